"""Anthropic's Messages API through the official anthropic SDK, against the real stack."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import pytest

from tests.stack import TandemStack

MODEL = "smollm2-135m-instruct"
QUESTION: list[Any] = [{"role": "user", "content": "What is the capital of France?"}]
# The current SDK no longer sends sampling parameters; the API still takes them.
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def client(server: TandemStack) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def test_message_plain(client: anthropic.Anthropic) -> None:
    msg = client.messages.create(
        model=MODEL,
        max_tokens=24,
        system="You are a terse assistant.",
        messages=QUESTION,
        extra_body=GREEDY,
    )
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert msg.content[0].type == "text" and "Paris" in msg.content[0].text
    assert msg.stop_reason in ("end_turn", "max_tokens")
    assert msg.usage.input_tokens > 10 and 0 < msg.usage.output_tokens <= 24


def test_stop_sequence_and_max_tokens(client: anthropic.Anthropic) -> None:
    msg = client.messages.create(model=MODEL, max_tokens=2, messages=QUESTION, extra_body=GREEDY)
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 2
    full = client.messages.create(model=MODEL, max_tokens=24, messages=QUESTION, extra_body=GREEDY)
    assert full.content[0].type == "text"
    text = full.content[0].text
    word = text.split()[1]
    cut = client.messages.create(
        model=MODEL,
        max_tokens=24,
        messages=QUESTION,
        extra_body=GREEDY,
        stop_sequences=[word],
    )
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == word
    assert cut.content[0].type == "text" and cut.content[0].text == text[: text.index(word)]


def test_stream_event_sequence(client: anthropic.Anthropic) -> None:
    plain = client.messages.create(model=MODEL, max_tokens=16, messages=QUESTION, extra_body=GREEDY)
    with client.messages.stream(
        model=MODEL, max_tokens=16, messages=QUESTION, extra_body=GREEDY
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[1] == "content_block_start"
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) <= {"content_block_delta", "text"}
    assert final.content[0].type == "text" and plain.content[0].type == "text"
    assert final.content[0].text == plain.content[0].text
    assert final.stop_reason == plain.stop_reason
    assert final.usage.output_tokens == plain.usage.output_tokens


def test_errors_use_anthropic_bodies(server: TandemStack) -> None:
    r = httpx.post(f"{server.url}/v1/messages", json={"model": MODEL, "messages": QUESTION})
    assert r.status_code == 400
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"]
    r = httpx.post(
        f"{server.url}/v1/messages",
        json={"model": "claude-9", "max_tokens": 4, "messages": QUESTION},
    )
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
