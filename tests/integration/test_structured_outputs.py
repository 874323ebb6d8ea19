"""Structured outputs and chat ``n`` through the official SDKs: every sampled output
parses and validates against its schema, matches its regex, is one of its choices."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anthropic
import jsonschema
import openai
import pytest

from tests.stack import TandemStack

MODEL = "smollm2-135m-instruct"
# Nested objects, arrays, enums, required fields; strings and arrays bounded so that a
# sampled output always finishes within max_tokens.
PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "mood": {"type": "string", "enum": ["happy", "sad", "calm"]},
        "pets": {
            "type": "array",
            "maxItems": 2,
            "items": {
                "type": "object",
                "properties": {
                    "kind": {"type": "string", "enum": ["cat", "dog", "fish"]},
                    "name": {"type": "string", "maxLength": 12},
                },
                "required": ["kind", "name"],
                "additionalProperties": False,
            },
        },
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "mood", "pets", "address"],
    "additionalProperties": False,
}
PERSON_FORMAT: Any = {
    "type": "json_schema",
    "json_schema": {"name": "person", "schema": PERSON, "strict": True},
}
ASK: list[Any] = [
    {"role": "user", "content": "Describe a person, their pets and their address as JSON."}
]


@pytest.fixture(scope="module")
def client(server: TandemStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_chat_n_returns_every_choice_streamed_and_not(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL, messages=ASK, n=3, max_tokens=12, temperature=1.0, seed=7
    )
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert len({c.message.content for c in out.choices}) > 1  # sampled choices differ
    assert out.usage is not None
    assert out.usage.completion_tokens == 36  # 3 x 12, summed over the choices
    stream = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        n=3,
        max_tokens=12,
        temperature=1.0,
        seed=7,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    usage = None
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
        usage = chunk.usage or usage
    assert texts == {c.index: c.message.content for c in out.choices}  # same seeds, same texts
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert usage is not None and usage.completion_tokens == 36


def test_json_schema_holds_for_sampled_outputs(client: openai.OpenAI) -> None:
    def one(seed: int) -> tuple[str, str | None]:
        out = client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            temperature=1.0,
            seed=seed,
            max_tokens=400,
            response_format=PERSON_FORMAT,
        )
        return out.choices[0].message.content or "", out.choices[0].finish_reason

    with ThreadPoolExecutor(20) as pool:
        results = list(pool.map(one, range(20)))
    for text, finish in results:
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), PERSON)  # raises on any violation


def test_regex_and_choice_hold_for_sampled_outputs(client: openai.OpenAI) -> None:
    for seed in range(6):
        out = client.completions.create(
            model=MODEL,
            prompt="My phone number is",
            max_tokens=20,
            temperature=1.0,
            seed=seed,
            extra_body={"guided_regex": r"\(\d{3}\) \d{3}-\d{4}"},
        )
        assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", out.choices[0].text), out.choices[0].text
        chat = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Which planet is red?"}],
            max_tokens=10,
            temperature=1.0,
            seed=seed,
            extra_body={"structured_outputs": {"choice": ["Mars", "Venus", "Jupiter"]}},
        )
        assert chat.choices[0].message.content in ("Mars", "Venus", "Jupiter")


def test_json_object_on_completions_and_anthropic_output_format(
    client: openai.OpenAI, server: TandemStack
) -> None:
    out = client.completions.create(
        model=MODEL,
        prompt="A JSON object describing a cat:",
        max_tokens=120,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(out.choices[0].text), dict)
    else:  # ran out of tokens: what came is still a JSON object's prefix
        assert out.choices[0].text.lstrip().startswith("{")
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    msg = claude.messages.create(
        model=MODEL,
        max_tokens=40,
        messages=[{"role": "user", "content": "Is the sky blue?"}],
        extra_body={"temperature": 1.0, "output_format": {"type": "json_schema", "schema": schema}},
    )
    assert msg.content[0].type == "text"
    jsonschema.validate(json.loads(msg.content[0].text), schema)


BAD_FORMAT: Any = {
    "type": "json_schema",
    "json_schema": {"name": "bad", "schema": {"type": "object", "required": 5}},
}


def test_bad_schema_is_refused_with_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            response_format=BAD_FORMAT,
        )
    assert refused.value.status_code == 400
    body: Any = refused.value.body
    assert body["param"] == "response_format" and "compiled" in body["message"]
