"""The content guard on the real stack (``--guard-blocklist``): prompts that hit are
refused in each flavour's error body, outputs that hit end right before the word with
finish reason ``content_filter`` (streams end cleanly), hits are counted, and nothing is
left behind in the engine. The same server writes a raw audit log (``--audit-log-raw``):
its lines hold the text, refusals have theirs."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.stack import TandemStack

MODEL = "smollm2-135m-instruct"
# Greedy SmolLM2 (float32) answers these with "Paris" early on. (Its chat template's own
# system prompt says "trained by Hugging Face": a template's text is not screened.)
PROMPT = "The capital of France is"
ASKED = "Q: What is the capital of France?\nA:"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
BLOCKLIST = """\
# the test's blocklist
paris
hugging face
re:\\bforbidden-\\d+\\b
"""
AUDIT_LOG = "audit.jsonl"
REFUSED = "the prompt contains text this server's content filter blocks; rephrase it"


@pytest.fixture(scope="module")
def guarded(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TandemStack]:
    path = tmp_path_factory.mktemp("guard") / "blocklist.txt"
    path.write_text(BLOCKLIST)
    audit = path.with_name(AUDIT_LOG)
    flags = ("--guard-blocklist", str(path), "--audit-log", str(audit), "--audit-log-raw")
    with TandemStack("--dtype", "float32", *flags) as stack:
        yield stack


def audit_lines(stack: TandemStack, request_id: str | None = None) -> list[dict[str, Any]]:
    """The audit log's lines (``request_id``: once it has that one; lines are written by
    a thread of their own, a moment after the answer)."""
    path = Path(stack.args[stack.args.index("--audit-log") + 1])
    deadline = time.monotonic() + 10
    while True:
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        if request_id is None or any(line["request_id"] == request_id for line in lines):
            return lines
        assert time.monotonic() < deadline, f"no audit line for {request_id}"
        time.sleep(0.05)


def post(stack: TandemStack, route: str, **body: Any) -> httpx.Response:
    return httpx.post(f"{stack.url}{route}", json={"model": MODEL, **body}, timeout=60)


def streamed(stack: TandemStack, route: str, **body: Any) -> list[str]:
    """The ``data:`` payloads of a streamed answer."""
    payload = {"model": MODEL, "stream": True, **body}
    with httpx.stream("POST", f"{stack.url}{route}", json=payload, timeout=60) as r:
        assert r.status_code == 200, r.read()
        return [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


def guard_hits(stack: TandemStack) -> dict[str, float]:
    prefix = f'tandem:guardrail_hits_total{{model_name="{MODEL}",where="'
    lines = httpx.get(f"{stack.url}/metrics", timeout=10).text.splitlines()
    return {
        line[len(prefix) :].split('"')[0]: float(line.rsplit(" ", 1)[1])
        for line in lines
        if line.startswith(prefix)
    }


def test_prompts_that_hit_are_refused_in_each_flavour(guarded: TandemStack) -> None:
    openai_refusal = {
        "error": {
            "message": REFUSED,
            "type": "invalid_request_error",
            "param": None,
            "code": "content_filter",
        }
    }
    ids = httpx.post(
        f"{guarded.url}/tokenize", json={"model": MODEL, "prompt": "Weekend in PARIS?"}
    ).json()["tokens"]
    for route, body in [
        ("/v1/completions", {"prompt": "I love Paris.", "max_tokens": 4}),
        ("/v1/completions", {"prompt": ["fine", "code forbidden-42 here"], "max_tokens": 4}),
        ("/v1/completions", {"prompt": ids, "max_tokens": 4}),  # token ids: read decoded
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Paris, hi"}]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hugging\n Face"}]}),
        ("/v1/responses", {"input": "tell me about paris"}),
    ]:
        r = post(guarded, route, **body)
        assert (r.status_code, r.json()) == (400, openai_refusal), (route, body)
    r = post(
        guarded,
        "/v1/messages",
        max_tokens=8,
        system="Answer in French.",
        messages=[{"role": "user", "content": [{"type": "text", "text": "Visit Paris?"}]}],
    )
    assert r.status_code == 400
    assert r.json() == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": REFUSED},
    }
    # A word inside a longer one is no hit; the chat template's own text is not read.
    r = post(guarded, "/v1/completions", prompt="Parisian cafes are", max_tokens=2)
    assert r.status_code == 200, r.text
    hi = [{"role": "user", "content": "Hi"}]
    r = post(guarded, "/v1/chat/completions", messages=hi, max_tokens=4)
    assert r.status_code == 200, r.text


def test_a_completion_that_hits_ends_right_before_the_word(guarded: TandemStack) -> None:
    greedy = {"prompt": PROMPT, "max_tokens": 32, "temperature": 0}
    # What the model writes before the word: the same request cut by a stop string.
    before = post(guarded, "/v1/completions", **greedy, stop=["Paris"]).json()
    expected = before["choices"][0]["text"]
    assert before["choices"][0]["finish_reason"] == "stop"

    plain = post(guarded, "/v1/completions", **greedy, ignore_eos=True).json()
    assert plain["choices"][0]["text"] == expected
    assert plain["choices"][0]["finish_reason"] == "content_filter"
    assert plain["usage"]["completion_tokens"] < 32  # aborted, not run to max_tokens

    events = streamed(guarded, "/v1/completions", **greedy, ignore_eos=True)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected
    reasons = [c["choices"][0]["finish_reason"] for c in chunks]
    assert reasons == [None] * (len(chunks) - 1) + ["content_filter"]
    assert chunks[-1]["usage"]["completion_tokens"] < 32


def test_token_ids_and_logprobs_end_where_the_text_does(guarded: TandemStack) -> None:
    # Greedy: PROMPT gets " Paris" at once (its space is sent, its token is not), ASKED
    # " The capital of France is Paris".
    for prompt in (PROMPT, ASKED):
        greedy = {"prompt": prompt, "max_tokens": 32, "temperature": 0, "return_token_ids": True}
        before = post(guarded, "/v1/completions", **greedy, stop=["Paris"]).json()["choices"][0]
        # A stop string's cut shows the token that wrote "Paris" (its last); the guard's not.
        plain = post(guarded, "/v1/completions", **greedy, logprobs=1).json()["choices"][0]
        assert plain["finish_reason"] == "content_filter"
        ids = plain["token_ids"]
        assert ids == before["token_ids"][:-1]
        logprobs = plain["logprobs"] or {"tokens": [], "token_logprobs": []}  # None: no token
        tokens = logprobs["tokens"]
        assert len(tokens) == len(logprobs["token_logprobs"]) == len(ids)
        assert plain["text"].startswith("".join(tokens))

        events = streamed(guarded, "/v1/completions", **greedy, logprobs=1)
        chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
        assert [t for c in chunks for t in c["token_ids"]] == ids
        assert [t for c in chunks if c["logprobs"] for t in c["logprobs"]["tokens"]] == tokens
    assert ids, "ASKED shows the tokens before the word"


def test_a_stop_string_kept_in_the_output_is_screened(guarded: TandemStack) -> None:
    greedy = {"prompt": PROMPT, "max_tokens": 32, "temperature": 0, "stop": ["Paris"]}
    expected = post(guarded, "/v1/completions", **greedy).json()["choices"][0]["text"]
    for events in (
        [post(guarded, "/v1/completions", **greedy, include_stop_str_in_output=True).text],
        streamed(guarded, "/v1/completions", **greedy, include_stop_str_in_output=True)[:-1],
    ):
        choices = [json.loads(e)["choices"][0] for e in events]
        assert "".join(c["text"] for c in choices) == expected
        assert choices[-1]["finish_reason"] == "content_filter"


def test_chat_messages_and_responses_end_with_their_own_reasons(guarded: TandemStack) -> None:
    greedy = {"messages": QUESTION, "max_tokens": 40, "temperature": 0}
    before = post(guarded, "/v1/chat/completions", **greedy, stop=["Paris"]).json()
    expected = before["choices"][0]["message"]["content"]
    assert expected  # the answer says something before the word

    events = streamed(
        guarded, "/v1/chat/completions", **greedy, stream_options={"include_usage": True}
    )
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    usage_chunk = chunks.pop()
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] > 0
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == expected
    assert chunks[-1]["choices"][0]["finish_reason"] == "content_filter"

    message = post(guarded, "/v1/messages", **greedy).json()
    assert message["content"] == [{"type": "text", "text": expected}]
    assert message["stop_reason"] == "refusal" and message["stop_sequence"] is None

    question = QUESTION[0]["content"]
    response = post(
        guarded, "/v1/responses", input=question, max_output_tokens=40, temperature=0
    ).json()
    assert response["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "content_filter"}
    assert response["output"][-1]["content"][0]["text"] == expected


def test_hits_are_counted_and_the_server_serves_on(guarded: TandemStack) -> None:
    start = guard_hits(guarded)
    assert set(start) == {"prompt", "completion"}
    assert post(guarded, "/v1/completions", prompt="Paris", max_tokens=2).status_code == 400
    hit = post(guarded, "/v1/completions", prompt=PROMPT, max_tokens=16, temperature=0)
    assert hit.json()["choices"][0]["finish_reason"] == "content_filter"
    assert guard_hits(guarded) == {
        "prompt": start["prompt"] + 1,
        "completion": start["completion"] + 1,
    }

    clean = post(guarded, "/v1/completions", prompt="One, two, three,", max_tokens=8, temperature=0)
    assert clean.status_code == 200
    assert clean.json()["choices"][0]["finish_reason"] in ("stop", "length")
    # Every request ended by the guard was aborted in the engine: its KV blocks are free.
    stats = guarded.stats_when(
        lambda s: s["num_kv_blocks_in_use"] == 0 and not s["active_requests"]
    )
    assert stats["num_kv_blocks_in_use"] == 0 and stats["active_requests"] == 0


def test_the_raw_audit_log_has_the_text_and_the_refusals(guarded: TandemStack) -> None:
    refused = post(
        guarded, "/v1/messages", max_tokens=4, messages=[{"role": "user", "content": "paris?"}]
    )
    assert refused.status_code == 400
    body = post(
        guarded, "/v1/completions", prompt="One, two, three,", max_tokens=4, temperature=0, n=2
    ).json()
    lines = audit_lines(guarded, body["id"])
    [line] = [line for line in lines if line["request_id"] == body["id"]]
    assert line["prompt"] == ["One, two, three,"]
    assert line["completion"] == [c["text"] for c in body["choices"]]
    assert line["finish_reasons"] == [c["finish_reason"] for c in body["choices"]]
    usage = body["usage"]
    assert (line["prompt_tokens"], line["completion_tokens"]) == (
        usage["prompt_tokens"],
        usage["completion_tokens"],
    )
    assert (line["status"], line["outcome"], line["model"]) == (200, "completed", MODEL)
    assert line["tenant"] == "host:127.0.0.1" and "prompt_sha256" not in line
    # The refusal's line: before any generation, so its status and route, no text.
    refusals = [line for line in lines if line["route"] == "/v1/messages" and line["status"] == 400]
    assert refusals and all(
        (no["outcome"], no["model"], no["prompt"]) == ("completed", MODEL, []) for no in refusals
    )
