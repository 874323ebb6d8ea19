"""Per-key rate limits (429 + Retry-After) and request logging, against the real stack."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.stack import TandemStack, completion

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def limited(smollm2_dir: Path) -> Iterator[TandemStack]:
    flags = ("--rate-limit-rpm", "3", "--rate-limit-tpm", "60", "--log-requests")
    keys = {"TANDEM_API_KEYS": "alpha,beta,gamma"}
    with TandemStack(*flags, env=keys) as stack:
        yield stack


def post(stack: TandemStack, key: str, path: str, body: dict[str, object]) -> httpx.Response:
    return httpx.post(
        f"{stack.url}{path}", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60
    )


def test_requests_per_minute_per_key(limited: TandemStack) -> None:
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
    for _ in range(3):
        assert post(limited, "alpha", "/v1/completions", body).status_code == 200
    r = post(limited, "alpha", "/v1/completions", body)
    assert r.status_code == 429
    assert 1 <= int(r.headers["retry-after"]) <= 60
    error = r.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
    assert "3 requests per minute" in error["message"]
    # The Anthropic route answers in its own dialect; the SDKs see their rate-limit errors.
    m = post(
        limited,
        "alpha",
        "/v1/messages",
        {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]},
    )
    assert m.status_code == 429 and m.json()["error"]["type"] == "rate_limit_error"
    sdk = openai.OpenAI(base_url=f"{limited.url}/v1", api_key="alpha", max_retries=0)
    with pytest.raises(openai.RateLimitError):
        sdk.completions.create(model=MODEL, prompt="Hi", max_tokens=1)
    # Other keys and the open routes are untouched.
    assert post(limited, "gamma", "/v1/completions", body).status_code == 200
    assert httpx.get(f"{limited.url}/health").status_code == 200


def test_tokens_per_minute_per_key(limited: TandemStack) -> None:
    body = {
        "model": MODEL,
        "prompt": "Write a long poem about the sea and its many moods:",
        "max_tokens": 50,
        "ignore_eos": True,
    }
    first = post(limited, "beta", "/v1/completions", body)
    assert first.status_code == 200
    assert first.json()["usage"]["total_tokens"] >= 60
    r = post(limited, "beta", "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 1})
    assert r.status_code == 429 and "60 tokens per minute" in r.json()["error"]["message"]
    assert int(r.headers["retry-after"]) >= 1


def test_logged_requests_carry_their_id(limited: TandemStack) -> None:
    marker = "zebra-umbrella-quartz"
    r = post(
        limited, "gamma", "/v1/completions", {"model": MODEL, "prompt": marker, "max_tokens": 3}
    )
    assert r.status_code == 200
    request_id = r.headers["x-request-id"]
    lines = [line for line in limited.log().splitlines() if request_id in line]
    assert any(marker in line and "prompt" in line for line in lines)
    assert any("output" in line for line in lines)
    # No line names the prompt without naming the request.
    assert all(request_id in line for line in limited.log().splitlines() if marker in line)


def test_prompts_are_not_logged_by_default(server: TandemStack) -> None:
    marker = "walrus-lantern-opal"
    completion(server.url, marker, max_tokens=2)
    assert marker not in server.log()
