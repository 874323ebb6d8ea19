"""OpenAI's Responses API through the real openai SDK against a running stack (SmolLM2,
hermes tool calls): text input, a function call and its output on a second turn through
``previous_response_id``, typed stream events whose final response equals the one not
streamed, GET and DELETE of a kept response, and refusals (hosted tools, another key's or
an unknown response, an output answering no call). Shape and validity are asserted, not
that a 135M model chooses tools wisely."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.stack import TandemStack

MODEL = "smollm2-135m-instruct"
WEATHER: dict[str, Any] = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
    },
}
KEYS = ("key-one", "key-two")


@pytest.fixture(scope="module")
def client(server: TandemStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def keyed(smollm2_dir: Any) -> Iterator[TandemStack]:
    """A stack with two API keys: each key sees only its own kept responses."""
    with TandemStack("--api-key", KEYS[0], "--api-key", KEYS[1], "--max-num-seqs", "4") as stack:
        yield stack


def create(client: openai.OpenAI, **kwargs: Any) -> Any:
    """A response; its items and tools are plain dicts here, which the SDK's types do not name."""
    return client.responses.create(**kwargs)


def param_of(error: openai.APIStatusError) -> Any:
    body: Any = error.body  # the SDK hands the error object over, untyped
    return body["param"]


def test_text_input_answers_one_message(client: openai.OpenAI) -> None:
    response = create(client, model=MODEL, input="Say hello.", max_output_tokens=8, temperature=0)
    assert response.id.startswith("resp_") and response.object == "response"
    assert [item.type for item in response.output] == ["message"]
    assert response.output_text and response.output_text == response.output[0].content[0].text
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None and response.usage.output_tokens == 8


def test_a_function_call_then_its_output_through_previous_response_id(
    client: openai.OpenAI,
) -> None:
    first = create(
        client,
        model=MODEL,
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=80,
        temperature=0,
    )
    assert first.status == "completed", first.output
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert calls[0].call_id.startswith("call_") and calls[0].status == "completed"
    assert isinstance(json.loads(calls[0].arguments)["city"], str)
    output = {"type": "function_call_output", "call_id": calls[0].call_id, "output": "21 C"}
    second = create(
        client,
        model=MODEL,
        input=[output],
        previous_response_id=first.id,
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=12,
        temperature=0,
    )
    assert [item.type for item in second.output] == ["message"] and second.output_text
    assert second.previous_response_id == first.id
    # The second turn's prompt holds the first turn: more input tokens than the output alone.
    assert first.usage is not None and second.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens
    # The call id must answer a call of this conversation.
    stray = {**output, "call_id": "call_nobody"}
    with pytest.raises(openai.BadRequestError) as refused:
        create(client, model=MODEL, input=[stray], previous_response_id=first.id)
    assert param_of(refused.value) == "input.0.call_id"


def test_streamed_events_are_typed_in_order_and_end_with_the_unstreamed_response(
    client: openai.OpenAI,
) -> None:
    kwargs: dict[str, Any] = {"model": MODEL, "input": "Name a colour.", "temperature": 0}
    kwargs |= {"max_output_tokens": 10, "store": False}
    events = list(create(client, stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    plain = create(client, **kwargs)
    assert deltas == final.output_text == plain.output_text
    assert [i.type for i in final.output] == [i.type for i in plain.output]


def test_a_streamed_function_call_gives_argument_deltas(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"model": MODEL, "input": "Weather in Rome?", "temperature": 0}
    kwargs |= {"tools": [WEATHER], "tool_choice": "required", "max_output_tokens": 60}
    kwargs |= {"parallel_tool_calls": False}
    events = list(create(client, stream=True, **kwargs))
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].arguments == deltas and done[0].name == "get_weather"
    plain = create(client, **kwargs)
    call = plain.output[0]
    assert call.type == "function_call" and call.arguments == deltas


def test_kept_responses_are_read_and_deleted_by_their_key_only(keyed: TandemStack) -> None:
    one, two = (
        openai.OpenAI(base_url=f"{keyed.url}/v1", api_key=key, max_retries=0) for key in KEYS
    )
    made = create(one, model=MODEL, input="Hi", max_output_tokens=4, temperature=0)
    got = one.responses.retrieve(made.id)
    assert got.id == made.id and got.output_text == made.output_text
    with pytest.raises(openai.NotFoundError):
        two.responses.retrieve(made.id)  # another key's: as absent as one never made
    with pytest.raises(openai.BadRequestError) as refused:
        create(two, model=MODEL, input="and?", previous_response_id=made.id)
    assert param_of(refused.value) == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        two.responses.delete(made.id)
    one.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        one.responses.retrieve(made.id)
    unkept = create(one, model=MODEL, input="Hi", max_output_tokens=2, store=False, temperature=0)
    with pytest.raises(openai.NotFoundError):
        one.responses.retrieve(unkept.id)


@pytest.mark.parametrize(
    ("tool", "param"),
    [
        ({"type": "web_search"}, "tools.0.type"),
        ({"type": "function", "parameters": {"type": "object"}}, "tools.0.name"),
    ],
)
def test_tools_not_served_are_a_400_naming_the_field(
    server: TandemStack, tool: dict[str, Any], param: str
) -> None:
    body = {"model": MODEL, "input": "Search the web.", "tools": [tool]}
    r = httpx.post(f"{server.url}/v1/responses", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"


def test_an_unknown_response_is_a_404_in_the_openai_shape(server: TandemStack) -> None:
    r = httpx.get(f"{server.url}/v1/responses/resp_nothing", timeout=10)
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "response_not_found"
    r = httpx.delete(f"{server.url}/v1/responses/resp_nothing", timeout=10)
    assert r.status_code == 404
