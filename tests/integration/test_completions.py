"""The real stack over HTTP: streaming and plain completions, models, stats."""

from __future__ import annotations

import asyncio
import json
import os
import time

import httpx
import pytest

from tests.stack import TandemStack, completion

MODEL = "smollm2-135m-instruct"


def sse_events(response: httpx.Response) -> list[str]:
    return [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]


def test_streaming_completion_names_paris(server: TandemStack) -> None:
    body = {
        "model": MODEL,
        "prompt": "The capital of France is",
        "max_tokens": 32,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-request-id"].startswith("cmpl-")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) > 2  # streamed, not one blob
    assert all(c["object"] == "text_completion" and c["model"] == MODEL for c in chunks)
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert "Paris" in text
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    last = chunks[-1]
    assert last["choices"][0]["finish_reason"] in ("stop", "length")
    assert last["usage"]["prompt_tokens"] == 5
    assert 0 < last["usage"]["completion_tokens"] <= 32


def test_plain_completion_and_stop_string(server: TandemStack) -> None:
    full = completion(
        server.url, "The capital of France is", max_tokens=12, temperature=0, return_token_ids=True
    )
    text = full["choices"][0]["text"]
    assert full["object"] == "text_completion"
    assert len(full["choices"][0]["token_ids"]) == full["usage"]["completion_tokens"]
    assert full["prompt_token_ids"] and full["usage"]["prompt_tokens"] == len(
        full["prompt_token_ids"]
    )
    cut = text.index(".")  # greedy SmolLM2: " Paris.\n\n..." -- stop at the first period
    stopped = completion(
        server.url, "The capital of France is", max_tokens=12, temperature=0, stop=["."]
    )
    assert stopped["choices"][0]["text"] == text[:cut]
    assert stopped["choices"][0]["finish_reason"] == "stop"


def test_max_tokens_gives_length(server: TandemStack) -> None:
    out = completion(server.url, "Once upon a time", max_tokens=5, temperature=0, ignore_eos=True)
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 5


def test_token_id_prompt_equals_text_prompt(server: TandemStack) -> None:
    by_text = completion(
        server.url, "Hello, my name is", max_tokens=8, temperature=0, return_token_ids=True
    )
    by_ids = completion(server.url, by_text["prompt_token_ids"], max_tokens=8, temperature=0)
    assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"]


def test_seeded_sampling_is_reproducible(server: TandemStack) -> None:
    params = {"max_tokens": 16, "temperature": 1.0, "top_p": 0.95, "top_k": 50, "ignore_eos": True}
    a = completion(server.url, "My favourite colour is", seed=1234, **params)["choices"][0]["text"]
    b = completion(server.url, "My favourite colour is", seed=1234, **params)["choices"][0]["text"]
    others = {
        completion(server.url, "My favourite colour is", seed=s, **params)["choices"][0]["text"]
        for s in range(5)
    }
    assert a == b
    assert len(others) > 1


def test_models_and_health(server: TandemStack) -> None:
    models = httpx.get(f"{server.url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == 8192
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok", "model_loaded": True}


def test_unknown_model_and_bad_json(server: TandemStack) -> None:
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "gpt-4", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(
        f"{server.url}/v1/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "x", "bogus": 1})
    assert r.status_code == 200 and r.headers["x-tandem-ignored-fields"] == "bogus"  # as vLLM
    r = httpx.post(
        f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 9000}
    )
    assert r.status_code == 400 and "8192" in r.json()["error"]["message"]
    assert completion(server.url, "still serving", max_tokens=2)["usage"]["completion_tokens"] >= 1


def wait_idle(url: str, timeout_s: float = 5.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        stats: dict[str, float] = httpx.get(f"{url}/stats").json()
        if (stats["active_requests"], stats["waiting_requests"], stats["num_kv_blocks_in_use"]) == (
            0,
            0,
            0,
        ):
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"engine not idle: {stats}")
        time.sleep(0.1)


def test_stats_return_to_zero_after_finishes_and_disconnects(server: TandemStack) -> None:
    """8 streams, 4 dropped mid-way: the other 4 complete; nothing is left running."""

    async def stream(client: httpx.AsyncClient, drop_after: int | None) -> list[str]:
        # A dropped stream asks for far more tokens than the test waits for: only an
        # abort in the engine lets the stats return to zero in time.
        max_tokens = 64 if drop_after is None else 3000
        body = {
            "model": MODEL,
            "prompt": "Tell me a long story about a dragon.",
            "max_tokens": max_tokens,
            "temperature": 0.8,
            "seed": 7,
            "ignore_eos": True,
            "stream": True,
        }
        events: list[str] = []
        async with client.stream("POST", f"{server.url}/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: ") :])
                    if drop_after is not None and len(events) >= drop_after:
                        return events  # leaving the block closes the connection mid-stream
        return events

    async def run() -> list[list[str]]:
        async with httpx.AsyncClient(timeout=120) as client:
            busy = asyncio.gather(*(stream(client, 3 if i % 2 else None) for i in range(8)))
            for _ in range(100):  # the streams are admitted within a step or two
                during = (await client.get(f"{server.url}/stats")).json()
                if during["num_kv_blocks_in_use"] > 0:
                    break
                await asyncio.sleep(0.1)
            assert during["active_requests"] > 0 and 0 < during["cache_usage"] < 1
            return list(await busy)

    results = asyncio.run(run())
    for events in results[0::2]:  # the streams that were read to the end
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        assert last["choices"][0]["finish_reason"] == "length"
        assert last["usage"]["completion_tokens"] == 64
    assert [len(events) for events in results[1::2]] == [3, 3, 3, 3]
    stats = wait_idle(server.url)
    assert stats["cache_usage"] == 0.0
    assert stats["num_kv_blocks_total"] > 0
    # What the worker's steps ran on: its cores, or fewer where the governor gave some up.
    assert 1 <= stats["worker_threads"] <= (os.cpu_count() or 1)


def test_tokenize_and_detokenize_round_trip(server: TandemStack) -> None:
    r = httpx.post(
        f"{server.url}/tokenize", json={"model": MODEL, "prompt": "The capital of France is"}
    )
    assert r.status_code == 200
    body = r.json()
    assert (
        body["tokens"] == [504, 3575, 282, 4649, 314]
        and body["count"] == 5
        and body["max_model_len"] == 8192
    )
    r = httpx.post(f"{server.url}/detokenize", json={"model": MODEL, "tokens": body["tokens"]})
    assert r.json() == {"prompt": "The capital of France is"}
    r = httpx.post(f"{server.url}/detokenize", json={"model": MODEL, "tokens": [10**6]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


def test_logprobs_plain_and_streamed(server: TandemStack) -> None:
    out = completion(
        server.url,
        "The capital of France is",
        max_tokens=5,
        temperature=0,
        logprobs=2,
        ignore_eos=True,
    )
    choice = out["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 5
    assert "".join(lp["tokens"]) == choice["text"]
    assert lp["text_offset"][0] == 0 and lp["text_offset"][1] == len(lp["tokens"][0])
    for token, value, top in zip(
        lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True
    ):
        assert value <= 0 and len(top) == 2
        assert (
            max(top.values()) == pytest.approx(value, abs=1e-5) and token in top
        )  # greedy = the top-1
    body = {
        "model": MODEL,
        "prompt": "The capital of France is",
        "max_tokens": 5,
        "temperature": 0,
        "logprobs": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        chunks = [json.loads(e) for e in sse_events(r)[:-1]]
    streamed = [v for c in chunks for v in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed == pytest.approx(lp["token_logprobs"], abs=1e-4)
    assert all(top == {} for c in chunks for top in c["choices"][0]["logprobs"]["top_logprobs"])


def test_penalties_change_greedy_continuations(server: TandemStack) -> None:
    """Penalties reach the sampler: each one changes a greedy continuation whose words
    repeat (presence and frequency count output tokens only, as in OpenAI's API)."""
    prompt = "Once upon a time there was a little"
    params = {"max_tokens": 32, "temperature": 0, "ignore_eos": True}
    plain = completion(server.url, prompt, **params)["choices"][0]["text"]
    for penalty in (
        {"repetition_penalty": 1.5},
        {"presence_penalty": 2.0},
        {"frequency_penalty": 2.0},
    ):
        text = completion(server.url, prompt, **params, **penalty)["choices"][0]["text"]
        assert text != plain, penalty


def test_seeded_request_is_the_same_alone_or_among_8(server: TandemStack) -> None:
    params = {"max_tokens": 12, "temperature": 1.0, "top_p": 0.9, "ignore_eos": True}
    alone = completion(server.url, "My favourite animal is", seed=99, **params)["choices"][0][
        "text"
    ]

    async def crowd() -> str:
        async with httpx.AsyncClient(timeout=120) as client:

            async def one(prompt: str, seed: int | None) -> str:
                body = {"model": MODEL, "prompt": prompt, "seed": seed, **params}
                r = await client.post(f"{server.url}/v1/completions", json=body)
                return str(r.json()["choices"][0]["text"])

            others = [one(f"Prompt number {i} says", None) for i in range(7)]
            results = await asyncio.gather(one("My favourite animal is", 99), *others)
            return results[0]

    assert asyncio.run(crowd()) == alone


def test_several_prompts_and_choices(server: TandemStack) -> None:
    out = completion(
        server.url,
        ["The capital of France is", "Two plus two is"],
        max_tokens=6,
        temperature=0,
        return_token_ids=True,
    )
    assert [c["index"] for c in out["choices"]] == [0, 1]
    alone = [
        completion(server.url, p, max_tokens=6, temperature=0)["choices"][0]["text"]
        for p in ("The capital of France is", "Two plus two is")
    ]
    assert [c["text"] for c in out["choices"]] == alone
    prompt_tokens = sum(len(c["prompt_token_ids"]) for c in out["choices"])
    assert out["usage"]["prompt_tokens"] == prompt_tokens
    assert out["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in out["choices"])

    sampled = completion(
        server.url,
        "My favourite food is",
        n=3,
        max_tokens=12,
        temperature=1.0,
        seed=5,
        ignore_eos=True,
    )
    texts = [c["text"] for c in sampled["choices"]]
    assert len(texts) == 3 and len(set(texts)) > 1  # choices differ
    again = completion(
        server.url,
        "My favourite food is",
        n=3,
        max_tokens=12,
        temperature=1.0,
        seed=5,
        ignore_eos=True,
    )
    assert [c["text"] for c in again["choices"]] == texts  # and a seed repeats them


def test_streamed_choices_are_merged_with_indexes(server: TandemStack) -> None:
    body = {
        "model": MODEL,
        "prompt": ["The capital of France is", "Two plus two is"],
        "n": 2,
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
        "echo": True,
    }
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    texts: dict[int, str] = {}
    for c in chunks:
        choice = c["choices"][0]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert sorted(texts) == [0, 1, 2, 3]
    assert texts[0] == texts[1] and texts[0].startswith("The capital of France is")  # greedy + echo
    assert texts[2].startswith("Two plus two is")
    assert "usage" in chunks[-1] and chunks[-1]["usage"]["completion_tokens"] > 0


def test_too_many_choices_is_refused(server: TandemStack) -> None:
    r = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "x", "n": 17})
    assert r.status_code == 422 and r.json()["error"]["param"] == "n"


def test_min_tokens_delays_eos(server: TandemStack) -> None:
    prompt = "<|im_start|>user\nSay only: yes<|im_end|>\n<|im_start|>assistant\n"
    short = completion(server.url, prompt, max_tokens=40, temperature=0)
    assert (
        short["choices"][0]["finish_reason"] == "stop" and short["usage"]["completion_tokens"] < 12
    )
    longer = completion(server.url, prompt, max_tokens=40, temperature=0, min_tokens=12)
    assert longer["usage"]["completion_tokens"] >= 12
    r = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": MODEL, "prompt": "x", "max_tokens": 2, "min_tokens": 3},
    )
    assert r.status_code == 422 and r.json()["error"]["param"] == "min_tokens"


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_non_streamed_request_is_aborted_when_its_client_leaves(
    server: TandemStack, route: str
) -> None:
    body: dict[str, object] = {"model": MODEL, "max_tokens": 3000, "ignore_eos": True}
    body |= (
        {"prompt": "Count:"}
        if route == "/v1/completions"
        else {"messages": [{"role": "user", "content": "Count"}]}
    )
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{server.url}{route}", json=body, timeout=1.5
        )  # gives up; the connection closes
    stats = wait_idle(
        server.url, timeout_s=5.0
    )  # 3,000 tokens would take minutes: only an abort frees it
    assert stats["num_kv_blocks_in_use"] == 0
