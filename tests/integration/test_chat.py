"""Chat completions through the official openai SDK, against the real stack."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.stack import TandemStack

MODEL = "smollm2-135m-instruct"
MESSAGES: list[Any] = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]


@pytest.fixture(scope="module")
def client(server: TandemStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def templated_ids(model_dir: Path) -> list[int]:
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return list(
        tok.apply_chat_template(
            MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )


def test_chat_plain(client: openai.OpenAI, smollm2_dir: Path) -> None:
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0
    )
    choice = out.choices[0]
    assert out.object == "chat.completion" and choice.message.role == "assistant"
    assert "Paris" in (choice.message.content or "")
    assert choice.finish_reason in ("stop", "length")
    assert out.usage is not None and out.usage.prompt_tokens == len(templated_ids(smollm2_dir))
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_chat_stream_with_usage_matches_plain(client: openai.OpenAI) -> None:
    plain = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0
    )
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == [plain.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and plain.usage is not None
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_chat_logprobs(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    assert out.choices[0].logprobs is not None and out.usage is not None
    content = out.choices[0].logprobs.content
    assert content is not None and len(content) == out.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)  # greedy


def test_unsupported_field_is_refused(client: openai.OpenAI, server: TandemStack) -> None:
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "use_beam_search": True,
    }
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body)
    assert (
        r.status_code == 400
        and r.json()["error"]["message"] == "'use_beam_search' is not supported"
    )
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert r.status_code == 422 and r.json()["error"]["param"] == "messages"


@pytest.fixture(scope="module")
def templateless_model(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2's files without its chat template, like a base model."""
    path = tmp_path_factory.mktemp("no-template")
    for name in os.listdir(smollm2_dir):
        if name != "chat_template.jinja" and not name.startswith("."):
            (path / name).symlink_to(smollm2_dir / name)
    return path


@pytest.mark.parametrize("with_template_file", [False, True])
def test_model_without_template(
    templateless_model: Path, smollm2_dir: Path, with_template_file: bool
) -> None:
    flags = [
        "--model",
        str(templateless_model),
        "--served-model-name",
        MODEL,
        "--num-kv-blocks",
        "64",
    ]
    if with_template_file:
        flags += ["--chat-template", str(smollm2_dir / "chat_template.jinja")]
    with TandemStack(*flags) as stack:
        r = httpx.post(
            f"{stack.url}/v1/chat/completions",
            timeout=60,
            json={"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "temperature": 0},
        )
    if with_template_file:
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    else:
        assert r.status_code == 400 and "no chat template" in r.json()["error"]["message"]
