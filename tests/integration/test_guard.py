"""API keys, the body-size limit and explicit cancellation, against the real stack."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.stack import TandemStack

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def guarded(smollm2_dir: Path) -> Iterator[TandemStack]:
    flags = (
        "--api-key",
        "key-one",
        "--api-key",
        "key-two",
        "--max-body-bytes",
        "4096",
        "--num-kv-blocks",
        "256",
    )
    with TandemStack(*flags, env={"TANDEM_API_KEYS": "key-three"}) as stack:
        yield stack


def test_keys_are_required_except_on_open_routes(guarded: TandemStack) -> None:
    assert httpx.get(f"{guarded.url}/health").status_code == 200
    r = httpx.get(f"{guarded.url}/v1/models")
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert (
        httpx.get(f"{guarded.url}/v1/models", headers={"Authorization": "Bearer nope"}).status_code
        == 401
    )
    assert (
        httpx.get(
            f"{guarded.url}/v1/models", headers={"Authorization": "Bearer key-one"}
        ).status_code
        == 200
    )
    assert (
        httpx.get(f"{guarded.url}/v1/models", headers={"x-api-key": "key-three"}).status_code == 200
    )
    client = openai.OpenAI(base_url=f"{guarded.url}/v1", api_key="key-two", max_retries=0)
    out = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=3, temperature=0
    )
    assert "Paris" in out.choices[0].text
    bad = openai.OpenAI(base_url=f"{guarded.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="x", max_tokens=1)


def test_keys_never_appear_on_a_command_line(guarded: TandemStack) -> None:
    for process in [guarded.process_named(m) for m in ("api_server", "engine_core", "worker")]:
        assert not any("key-" in arg for arg in process.cmdline())


def test_oversized_bodies_get_413(guarded: TandemStack) -> None:
    headers = {"x-api-key": "key-one", "content-type": "application/json"}
    big = json.dumps({"model": MODEL, "prompt": "x" * 5000}).encode()
    r = httpx.post(f"{guarded.url}/v1/completions", content=big, headers=headers)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunked() -> Iterator[bytes]:  # no Content-Length: counted while read
        yield big[:3000]
        yield big[3000:]

    r = httpx.post(f"{guarded.url}/v1/completions", content=chunked(), headers=headers)
    assert r.status_code == 413
    ok = httpx.post(
        f"{guarded.url}/v1/completions",
        headers=headers,
        json={"model": MODEL, "prompt": "still fine", "max_tokens": 2},
    )
    assert ok.status_code == 200


def test_explicit_cancel_ends_the_stream_and_frees_blocks(guarded: TandemStack) -> None:
    headers = {"x-api-key": "key-one"}
    body = {
        "model": MODEL,
        "prompt": "Count to a thousand:",
        "max_tokens": 3000,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream(
        "POST", f"{guarded.url}/v1/completions", json=body, headers=headers, timeout=60
    ) as r:
        request_id = r.headers["x-request-id"]
        lines = r.iter_lines()
        events = [next(line for line in lines if line.startswith("data: ")) for _ in range(3)]
        cancelled = httpx.post(f"{guarded.url}/v1/requests/{request_id}/cancel", headers=headers)
        assert cancelled.status_code == 200 and cancelled.json() == {
            "id": request_id,
            "cancelled": True,
        }
        events += [line for line in lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "abort"
    assert len(events) < 500
    missing = httpx.post(f"{guarded.url}/v1/requests/{request_id}/cancel", headers=headers)
    assert missing.status_code == 404
    deadline = time.monotonic() + 5
    while httpx.get(f"{guarded.url}/stats", headers=headers).json()["num_kv_blocks_in_use"] != 0:
        assert time.monotonic() < deadline, "blocks not freed after cancel"
        time.sleep(0.1)
