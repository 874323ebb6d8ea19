"""Anthropic tool use through the real anthropic SDK against a running stack (SmolLM2,
the hermes format): ``tool_use`` blocks whose ``input`` satisfies the tool's schema,
``stop_reason: "tool_use"``, the streamed ``tool_use`` block and its ``input_json_delta``
events agreeing with the plain answer, a ``tool_result`` turn, and refusals naming the
Anthropic field."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest

from tests.stack import TandemStack

MODEL = "smollm2-135m-instruct"
WEATHER: dict[str, Any] = {
    "name": "get_weather",
    "description": "The current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
    },
}
TIME: dict[str, Any] = {"name": "get_time", "input_schema": {"type": "object", "properties": {}}}
ASK: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def client(server: TandemStack) -> Any:
    """The SDK's messages resource; the tools are plain dicts here, which its types do
    not name."""
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0).messages


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_any_and_named_tool_choice_answer_with_valid_tool_use(client: Any, choice: Any) -> None:
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 200,
        "messages": ASK,
        "tools": [WEATHER, TIME],
        "tool_choice": {**choice, "disable_parallel_tool_use": True},
        "extra_body": GREEDY,
    }
    msg = client.create(**kwargs)
    assert msg.stop_reason == "tool_use"
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].id.startswith("toolu_")
    use = uses[0]
    if choice["type"] == "tool":
        assert use.name == "get_weather"
    schema = {t["name"]: t["input_schema"] for t in (WEATHER, TIME)}[use.name]
    jsonschema.validate(use.input, schema)

    with client.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    starts = [e for e in events if e.type == "content_block_start"]
    assert [s.content_block.type for s in starts] == ["tool_use"]
    assert starts[0].content_block.name == use.name
    partial = "".join(
        e.delta.partial_json
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    )
    assert json.loads(partial) == use.input
    assert final.stop_reason == "tool_use"
    assert [(b.type, getattr(b, "input", None)) for b in final.content] == [("tool_use", use.input)]


def test_a_tool_result_turn_answers_in_text(client: Any) -> None:
    first = client.create(
        model=MODEL,
        max_tokens=200,
        messages=ASK,
        tools=[WEATHER],
        tool_choice={"type": "any"},
        extra_body=GREEDY,
    )
    use = next(b for b in first.content if b.type == "tool_use")
    messages: list[Any] = [
        *ASK,
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": use.id, "content": "21 degrees"},
                {"type": "text", "text": "Thanks. Say it in words."},
            ],
        },
    ]
    second = client.create(
        model=MODEL,
        max_tokens=12,
        messages=messages,
        tools=[WEATHER],
        tool_choice={"type": "none"},
        extra_body=GREEDY,
    )
    assert second.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in second.content] == ["text"]
    assert "<tool_call>" not in second.content[0].text
    forged = [*messages[:2], {**messages[2], "content": [{**messages[2]["content"][0]}]}]
    forged[2]["content"][0]["tool_use_id"] = "toolu_nobody"
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.create(model=MODEL, max_tokens=8, messages=forged, tools=[WEATHER])
    assert "messages.2.content.0.tool_use_id" in str(refused.value)


def test_auto_answers_text_or_valid_tool_use(client: Any) -> None:
    msg = client.create(
        model=MODEL, max_tokens=40, messages=ASK, tools=[WEATHER], extra_body=GREEDY
    )
    for block in msg.content:
        if block.type == "tool_use":
            jsonschema.validate(block.input, WEATHER["input_schema"])
        else:
            assert block.type == "text" and "<tool_call>" not in block.text
    called = any(b.type == "tool_use" for b in msg.content)
    assert msg.stop_reason == ("tool_use" if called else msg.stop_reason)
    assert msg.stop_reason in ("tool_use", "end_turn", "max_tokens")


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
        ({"tools": [{"name": "bad name!", "input_schema": {}}]}, "tools.0.name"),
        ({"tools": [{"name": "f", "input_schema": {"type": "array"}}]}, "tools.0.input_schema"),
        ({"tools": [{"name": "f"}]}, "tools.0.input_schema"),
    ],
)
def test_bad_tools_are_400s_naming_the_field(
    server: TandemStack, change: dict[str, Any], named: str
) -> None:
    body = {"model": MODEL, "max_tokens": 8, "messages": ASK, "tools": [WEATHER], **change}
    r = httpx.post(f"{server.url}/v1/messages", json=body)
    assert r.status_code == 400
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert named in error["error"]["message"]
