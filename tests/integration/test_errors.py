"""One test per refused-request case: the status, an OpenAI error body naming the
field, and a server that still serves the next request. (401 and 413 are in
test_guard.py, 429 in test_rate_limits.py, 503 queue-full in test_admission.py, 503
not-ready and the in-stream error in test_lifecycle.py.)"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.stack import TandemStack, completion

MODEL = "smollm2-135m-instruct"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def prompt(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Hello", "max_tokens": 2, **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 2,
        **fields,
    }


@dataclass(frozen=True)
class Case:
    path: str
    body: bytes
    status: int
    param: str | None  # the field the error must name
    says: str  # words the message must contain

    @staticmethod
    def of(
        path: str, body: dict[str, Any] | list[Any], status: int, param: str | None, says: str
    ) -> Case:
        return Case(path, json.dumps(body).encode(), status, param, says)


CASES = {
    "malformed JSON": Case(COMPLETIONS, b'{"model": "x", ', 400, None, "not valid JSON"),
    "body not an object": Case.of(COMPLETIONS, [1, 2], 400, None, "JSON object"),
    "empty prompt": Case.of(COMPLETIONS, prompt(prompt=""), 400, "prompt", "empty"),
    "empty token list": Case.of(COMPLETIONS, prompt(prompt=[]), 422, "prompt", "prompt"),
    "out-of-vocabulary id": Case.of(
        COMPLETIONS, prompt(prompt=[1, 2, 10_000_000]), 400, "prompt", "outside the vocabulary"
    ),
    "prompt over the context": Case.of(
        COMPLETIONS, prompt(prompt=[42] * 9000), 400, "prompt", "9000"
    ),
    "tool_choice naming an unknown function": Case.of(
        CHAT,
        chat(
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice={"type": "function", "function": {"name": "g"}},
        ),
        400,
        "tool_choice",
        "not in tools",
    ),
    "tool_choice without tools": Case.of(
        CHAT, chat(tool_choice="required"), 400, "tool_choice", "needs 'tools'"
    ),
    "tools on completions": Case.of(
        COMPLETIONS,
        prompt(tools=[{"type": "function", "function": {"name": "f"}}]),
        400,
        "tools",
        "not supported",
    ),
    "beam search": Case.of(
        COMPLETIONS, prompt(use_beam_search=True), 400, "use_beam_search", "not supported"
    ),
    "logit_bias key not a token id": Case.of(
        CHAT, chat(logit_bias={"forty": 5}), 400, "logit_bias", "not a token id"
    ),
    "logit_bias id outside the vocabulary": Case.of(
        CHAT, chat(logit_bias={"10000000": 5}), 400, "logit_bias", "outside the vocabulary"
    ),
    "logit_bias out of range": Case.of(
        CHAT, chat(logit_bias={"42": 500}), 422, "logit_bias.42", "100"
    ),
    "allowed_token_ids outside the vocabulary": Case.of(
        COMPLETIONS, prompt(allowed_token_ids=[5, 60000]), 400, "allowed_token_ids", "outside"
    ),
    "schema that does not compile": Case.of(
        CHAT,
        chat(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "objec"}}}),
        400,
        "response_format",
        "objec",
    ),
    "regex that does not compile": Case.of(
        COMPLETIONS, prompt(guided_regex="a(b"), 400, "guided_regex", "unclosed group"
    ),
    "two output constraints": Case.of(
        COMPLETIONS,
        prompt(guided_regex="a+", guided_choice=["x"]),
        400,
        "guided_choice",
        "one output constraint",
    ),
    "chat_template_kwargs overriding a parameter": Case.of(
        CHAT, chat(chat_template_kwargs={"tokenize": True}), 400, "chat_template_kwargs", "tokenize"
    ),
    "wrong type": Case.of(COMPLETIONS, prompt(temperature="hot"), 422, "temperature", "number"),
    "wrong type in a message": Case.of(
        CHAT, chat(messages=[{"role": "user", "content": 5}]), 422, "messages.0.content", "content"
    ),
    "NaN": Case(
        COMPLETIONS,
        b'{"model": "%s", "prompt": "x", "temperature": NaN}' % MODEL.encode(),
        422,
        "temperature",
        "temperature",
    ),
    "Infinity": Case(
        COMPLETIONS,
        b'{"model": "%s", "prompt": "x", "top_p": Infinity}' % MODEL.encode(),
        422,
        "top_p",
        "top_p",
    ),
    "out of range": Case.of(COMPLETIONS, prompt(temperature=5), 422, "temperature", "2"),
    "negative max_tokens": Case.of(COMPLETIONS, prompt(max_tokens=-1), 422, "max_tokens", "0"),
    "max_tokens 0 without echo": Case.of(
        COMPLETIONS, prompt(max_tokens=0), 400, "max_tokens", "echo"
    ),
    "17 stop strings": Case.of(
        COMPLETIONS, prompt(stop=[f"s{i}" for i in range(17)]), 422, "stop", "16"
    ),
    "n above the limit": Case.of(COMPLETIONS, prompt(n=17), 422, "n", "16"),
    "unknown model": Case.of(COMPLETIONS, prompt(model="gpt-4"), 404, "model", "does not exist"),
    "chat to an unknown model": Case.of(CHAT, chat(model="gpt-4"), 404, "model", "does not exist"),
}


@pytest.mark.parametrize("case", CASES.values(), ids=list(CASES))
def test_refused_with_an_openai_error_body(server: TandemStack, case: Case) -> None:
    r = httpx.post(
        f"{server.url}{case.path}",
        content=case.body,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == case.status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == ("not_found_error" if case.status == 404 else "invalid_request_error")
    assert error["param"] == case.param
    assert case.says in error["message"]
    assert completion(server.url, "Still serving?", max_tokens=2)["usage"]["completion_tokens"] > 0


def test_refused_requests_leave_nothing_in_the_engine(server: TandemStack) -> None:
    for case in CASES.values():
        httpx.post(
            f"{server.url}{case.path}",
            content=case.body,
            headers={"content-type": "application/json"},
            timeout=30,
        )
    stats = httpx.get(f"{server.url}/stats").json()
    assert (stats["active_requests"], stats["waiting_requests"]) == (0, 0)
    assert stats["num_kv_blocks_in_use"] == 0
