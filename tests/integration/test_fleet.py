"""Tandem instances behind the real vLLM router (``vllm-router``), started as a user
starts them: ``tandem fleet``. The router's ``kv_aware`` policy knows what each instance
has cached only from the KV events the instances publish (vLLM's format)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.stack import TandemStack, free_port_range

MODEL = "smollm2-135m-instruct"
TOPICS = [
    "the history of tea in china",
    "how volcanoes form",
    "the rules of chess openings",
    "why the sky is blue",
    "growing tomatoes at home",
    "the life of honeybees",
    "building a wooden canoe",
    "how compilers optimise loops",
]


@pytest.fixture(scope="module")
def fleet() -> Iterator[tuple[TandemStack, list[str]]]:
    instances, events = free_port_range(2), free_port_range(4)
    stack = TandemStack(
        "--replicas",
        "2",
        "--policy",
        "kv_aware",
        "--instance-base-port",
        str(instances),
        "--kv-events-base-port",
        str(events),
        "--worker-threads",
        "1",
        "--kv-cache-gb",
        "0.1",
        command="fleet",
    )
    with stack:
        yield stack, [f"http://127.0.0.1:{instances + i}" for i in range(2)]


def chat(url: str, messages: list[dict[str, str]]) -> dict[str, object]:
    body = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    reply: dict[str, object] = r.json()
    return reply


def served(url: str) -> float:
    """Requests this instance has finished (its Prometheus counter)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("tandem:request_success_total{")
    )


def test_render_gives_the_prompt_tokens_the_request_is_served_with(
    fleet: tuple[TandemStack, list[str]],
) -> None:
    _, (url, _) = fleet
    messages = [{"role": "user", "content": "Name a colour."}]
    rendered = httpx.post(
        f"{url}/v1/chat/completions/render", json={"model": MODEL, "messages": messages}
    ).json()
    served_with = chat(url, messages)["usage"]
    assert isinstance(served_with, dict)
    assert rendered["num_tokens"] == len(rendered["token_ids"]) == served_with["prompt_tokens"]
    several = httpx.post(
        f"{url}/v1/completions/render", json={"model": MODEL, "prompt": ["a b", "c"]}
    ).json()
    assert [len(p["token_ids"]) for p in several] == [p["num_tokens"] for p in several]
    assert len(several) == 2
    wrong = httpx.post(f"{url}/v1/completions/render", json={"model": "nope", "prompt": "a"})
    assert wrong.status_code == 404 and wrong.json()["error"]["param"] == "model"


def test_kv_aware_sends_each_second_turn_where_the_first_was_cached(
    fleet: tuple[TandemStack, list[str]],
) -> None:
    """Turn 1 of conversation i goes straight to instance i % 2; turn 2 through the
    router lands on that same instance (8 of 8), and finds turn 1's blocks there."""
    router, instances = fleet
    landed = []
    for i, topic in enumerate(TOPICS):
        home = instances[i % 2]
        ask = f"Conversation {i}. Write a detailed essay about {topic}: its origins, key ideas and common mistakes. "
        messages = [{"role": "user", "content": ask * 3}]
        first = chat(home, messages)
        first_usage = first["usage"]
        assert isinstance(first_usage, dict)
        choices = first["choices"]
        assert isinstance(choices, list)
        messages += [
            {"role": "assistant", "content": choices[0]["message"]["content"]},
            {"role": "user", "content": "Now say it in one line."},
        ]
        before = [served(u) for u in instances]
        second = chat(router.url, messages)
        after = [served(u) for u in instances]
        went = [u for u, b, a in zip(instances, before, after, strict=True) if a > b]
        usage = second["usage"]
        assert isinstance(usage, dict)
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        landed.append((went == [home], cached))
        # every full block of turn 1's prompt is found again (16 tokens per block)
        assert went != [home] or cached >= first_usage["prompt_tokens"] // 16 * 16
    assert [ok for ok, _ in landed] == [True] * len(TOPICS), landed
