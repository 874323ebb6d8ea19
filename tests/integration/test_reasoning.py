"""Reasoning sections on a tiny random Qwen3 served with ``--reasoning-parser qwen3``.

The output is scripted by the template and the budget: the template opens ``<think>``
(as Qwen3's thinking templates do), and ``thinking_token_budget`` forces ``</think>``
after that many tokens, so the reasoning is exactly the first tokens' text. Asserted:
the split (non-streamed and streamed, both vLLM names), the budget, ``enable_thinking:
false`` passing through to the template, a JSON schema applying after the section, and
Anthropic's ``thinking`` blocks."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from tests.parity.families import build_servable
from tests.stack import TandemStack

MODEL = "tiny-qwen3"
BUDGET = 6
# chatml whose generation prompt opens the section, or writes it empty when thinking is off.
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)
ASK: list[Any] = [{"role": "user", "content": "Why is the sky blue?"}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    return build_servable("qwen3", tmp_path_factory.mktemp("tiny-qwen3"), smollm2_dir)


@pytest.fixture(scope="module")
def stack(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TandemStack]:
    template = tmp_path_factory.mktemp("template") / "thinking.jinja"
    template.write_text(TEMPLATE)
    flags = ["--model", str(checkpoint), "--served-model-name", MODEL, "--dtype", "float32"]
    flags += ["--reasoning-parser", "qwen3", "--chat-template", str(template)]
    with TandemStack(*flags) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack: TandemStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="none", max_retries=0)


def chat(client: openai.OpenAI, **kwargs: Any) -> Any:
    return client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, **kwargs)


def test_the_budget_ends_the_section_and_the_split_is_exact(
    client: openai.OpenAI, checkpoint: Path
) -> None:
    answer = chat(
        client,
        max_tokens=20,
        extra_body={"thinking_token_budget": BUDGET, "return_token_ids": True},
    )
    choice = answer.choices[0]
    message: Any = choice.message
    ids = choice.model_extra["token_ids"]
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    assert message.reasoning_content == message.reasoning == tokenizer.decode(ids[:BUDGET])
    assert tokenizer.decode(ids) == message.reasoning + "</think>" + message.content
    assert "<think>" not in message.content and "</think>" not in message.content

    reasoning, content, finish = "", "", None
    stream = chat(client, max_tokens=20, stream=True, extra_body={"thinking_token_budget": BUDGET})
    for chunk in stream:
        delta: Any = chunk.choices[0].delta
        extra = delta.model_extra or {}
        assert extra.get("reasoning_content") == extra.get("reasoning")
        reasoning += extra.get("reasoning_content") or ""
        content += delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
    assert (reasoning, content, finish) == (
        message.reasoning,
        message.content,
        choice.finish_reason,
    )


def test_thinking_off_passes_to_the_template_and_all_is_answer(client: openai.OpenAI) -> None:
    answer = chat(
        client, max_tokens=8, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    message: Any = answer.choices[0].message
    assert message.reasoning_content is None and message.content
    hidden = chat(
        client, max_tokens=12, extra_body={"thinking_token_budget": 2, "include_reasoning": False}
    )
    assert hidden.choices[0].message.model_extra["reasoning_content"] is None


def test_a_json_schema_applies_after_the_section(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"sky": {"type": "string", "maxLength": 8}},
        "required": ["sky"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    answer = chat(
        client, max_tokens=60, response_format=fmt, extra_body={"thinking_token_budget": BUDGET}
    )
    message: Any = answer.choices[0].message
    assert message.reasoning_content and answer.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(message.content), schema)


def test_anthropic_thinking_blocks(stack: TandemStack) -> None:
    client: Any = anthropic.Anthropic(base_url=stack.url, api_key="unused", max_retries=0)
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 16,
        "messages": ASK,
        "thinking": {"type": "enabled", "budget_tokens": BUDGET},
        "extra_body": {"temperature": 0},
    }
    msg = client.messages.create(**kwargs)
    assert [b.type for b in msg.content][:1] == ["thinking"] and msg.content[0].thinking
    with client.messages.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts[0] == "thinking"
    thought = "".join(
        e.delta.thinking
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "thinking_delta"
    )
    assert thought == msg.content[0].thinking == final.content[0].thinking


def test_a_budget_without_a_reasoning_parser_is_a_400(server: TandemStack) -> None:
    body = {"model": "smollm2-135m-instruct", "messages": ASK, "thinking_token_budget": 4}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "thinking_token_budget"
