"""Each tool-call format on a tiny random checkpoint of its family, served through
Tandem's tool-aware template for it, as the parity tests serve the families.

A random model chooses nothing wisely, so the grammar alone makes its calls: asserted
are the format the raw tokens are written in (the parser's trigger), a valid call under
``required`` and a named function, streamed fragments equal to the non-streamed
arguments, and a conversation holding the call and its result rendering through the
family's template."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from tests.integration.tool_streams import read_stream
from tests.parity.families import build_servable
from tests.stack import TandemStack

MODEL = "tiny"
# Bounded so that a random model's call ends well within max_tokens.
ARGUMENTS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "exact": {"type": "boolean"},
        "city": {"type": "string", "maxLength": 8},
    },
    "required": ["unit", "exact", "city"],
    "additionalProperties": False,
}
WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": ARGUMENTS},
}
TIME: dict[str, Any] = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}
ASK: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
# (family, --tool-call-parser, how the raw answer of a call to get_weather begins)
FORMATS = [
    ("qwen2", "hermes", '<tool_call>\n{"name": "get_weather", "arguments": {'),
    ("qwen3", "hermes", '<tool_call>\n{"name": "get_weather", "arguments": {'),
    ("llama", "llama3_json", '{"name": "get_weather", "parameters": {'),
    ("llama", "pythonic", "[get_weather("),
    ("gemma3", "gemma3", "```tool_code\nget_weather("),
]


@pytest.fixture(scope="module", params=FORMATS, ids=[f"{f}-{p}" for f, p, _ in FORMATS])
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path
) -> Iterator[tuple[openai.OpenAI, Path, str]]:
    """A stack serving the family's checkpoint with the parser; its client, the
    checkpoint (for its tokenizer) and the expected start of a raw call."""
    family, parser, opening = request.param
    path = build_servable(family, tmp_path_factory.mktemp(f"tiny-{family}"), smollm2_dir)
    flags = ["--model", str(path), "--served-model-name", MODEL, "--dtype", "float32"]
    with TandemStack(*flags, "--tool-call-parser", parser) as stack:
        client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="none", max_retries=0)
        yield client, path, opening


def create(client: openai.OpenAI, **kwargs: Any) -> Any:
    defaults: dict[str, Any] = {"model": MODEL, "temperature": 0, "max_tokens": 200}
    return client.chat.completions.create(**defaults | kwargs)


def streamed(client: openai.OpenAI, **kwargs: Any) -> tuple[str, list[tuple[str, str]], str | None]:
    """Content, (name, arguments) per call, and the finish reason of a streamed answer."""
    return read_stream(create(client, stream=True, **kwargs))


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_the_family_format_carries_a_valid_call(
    served: tuple[openai.OpenAI, Path, str], choice: Any
) -> None:
    client, path, opening = served
    tools = [WEATHER] if choice == "required" else [TIME, WEATHER]
    kwargs = {"messages": ASK, "tools": tools, "tool_choice": choice, "parallel_tool_calls": False}
    answer = create(client, extra_body={"return_token_ids": True}, **kwargs)
    choice0 = answer.choices[0]
    raw = str(AutoTokenizer.from_pretrained(path).decode(choice0.model_extra["token_ids"]))
    assert raw.startswith(opening), raw
    assert choice0.finish_reason == "tool_calls" and choice0.message.content is None
    (call,) = choice0.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), ARGUMENTS)
    assert streamed(client, **kwargs) == (
        "",
        [("get_weather", call.function.arguments)],
        "tool_calls",
    )


def test_the_call_and_its_result_render_through_the_family_template(
    served: tuple[openai.OpenAI, Path, str],
) -> None:
    client, path, _ = served
    first = create(
        client, messages=ASK, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False
    )
    call = first.choices[0].message.tool_calls[0]
    result = '{"temperature": 21}'
    turns: list[Any] = [
        *ASK,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": result},
    ]
    second = create(
        client,
        messages=turns,
        tools=[WEATHER],
        tool_choice="none",
        max_tokens=4,
        extra_body={"return_token_ids": True},
    )
    assert second.choices[0].finish_reason == "length"
    assert second.choices[0].message.tool_calls is None
    prompt = AutoTokenizer.from_pretrained(path).decode(second.model_extra["prompt_token_ids"])
    arguments = json.loads(call.function.arguments)
    assert prompt.count("get_weather") == 2, prompt  # the tool listed, and the call
    assert all(json.dumps(v, ensure_ascii=False) in prompt for v in arguments.values()), prompt
    assert result in prompt and prompt.index("get_weather", prompt.index("What is")) < prompt.index(
        result
    )
