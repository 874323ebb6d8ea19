"""Hostile input at every door: each bad HTTP request gets the right 4xx with an error
body and a good request right after succeeds; slow and idle clients cannot hold the
server; bad frames on the engine's own socket are dropped and counted."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq

from common.messages import EngineRequest, SamplingParams
from tests.stack import TandemStack, free_port

MODEL = "smollm2-135m-instruct"
CONTEXT = 64


@pytest.fixture(scope="module")
def small(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TandemStack]:
    """A short context and a short read timeout; the engine on a known tcp address."""
    port = free_port()
    with TandemStack(
        "--max-model-len",
        str(CONTEXT),
        "--request-read-timeout-s",
        "2",
        "--input-address",
        f"tcp://127.0.0.1:{port}",
        "--output-address",
        f"tcp://127.0.0.1:{free_port()}",
    ) as stack:
        stack.engine_input = f"tcp://127.0.0.1:{port}"  # type: ignore[attr-defined]
        yield stack


def good(url: str) -> None:
    r = httpx.post(
        f"{url}/v1/completions",
        json={"model": MODEL, "prompt": "Hello", "max_tokens": 2},
        timeout=30,
    )
    assert r.status_code == 200, r.text


def post_raw(url: str, body: bytes) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/completions",
        content=body,
        headers={"content-type": "application/json"},
        timeout=30,
    )


def body(**fields: object) -> bytes:
    return json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 2, **fields}).encode()


CASES: dict[str, tuple[bytes, int, str]] = {
    "deeply nested JSON": (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, "nested"),
    "non-object body": (b'"just a string"', 400, "JSON object"),
    "invalid UTF-8": (b'{"model": "' + MODEL.encode() + b'", "prompt": "\xff\xfe"}', 400, "JSON"),
    "NaN": (b'{"model": "%s", "prompt": "x", "temperature": NaN}' % MODEL.encode(), 422, "temperature"),
    "max_tokens of a billion": (body(max_tokens=10**9), 400, str(CONTEXT)),
    "n over the limit": (body(n=10_000), 422, "16"),
    "10,000 stop strings": (body(stop=[f"s{i}" for i in range(10_000)]), 422, "16"),
    "token id out of range": (body(prompt=[1, 2, 99_999_999]), 400, "outside the vocabulary"),
    "negative token id": (body(prompt=[1, -5]), 422, "prompt"),
    "prompt at the context limit": (body(prompt=[42] * CONTEXT, max_tokens=1), 400, str(CONTEXT)),
    "one token over with max_tokens": (body(prompt=[42] * (CONTEXT - 1), max_tokens=2), 400, "65"),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_hostile_body_gets_its_4xx_and_the_server_serves_on(small: TandemStack, case: str) -> None:
    raw, status, says = CASES[case]
    r = post_raw(small.url, raw)
    assert r.status_code == status, r.text
    assert says in r.json()["error"]["message"], r.text
    good(small.url)


def test_prompts_that_exactly_fit_the_context_are_served(small: TandemStack) -> None:
    r = post_raw(small.url, body(prompt=[42] * (CONTEXT - 1), max_tokens=1))
    assert r.status_code == 200 and r.json()["usage"]["total_tokens"] == CONTEXT


def test_body_over_the_limit_with_and_without_content_length(small: TandemStack) -> None:
    big = b'{"model": "x", "prompt": "' + b"a" * (3 * 1024 * 1024) + b'"}'
    assert post_raw(small.url, big).status_code == 413

    def chunks() -> Iterator[bytes]:  # chunked: no Content-Length to judge by
        for i in range(0, len(big), 65536):
            yield big[i : i + 65536]

    r = httpx.post(f"{small.url}/v1/completions", content=chunks(), timeout=30)
    assert r.status_code == 413
    good(small.url)


def trickle(port: int, first: bytes, then: bytes, per_byte_s: float) -> tuple[bytes, float]:
    """Send ``first`` at once, then ``then`` a byte every ``per_byte_s`` until the server
    answers or closes; returns its answer and the seconds it took."""
    start = time.monotonic()
    answer = b""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(first)
        s.settimeout(per_byte_s)
        for byte in then:
            try:
                s.sendall(bytes([byte]))
                answer += s.recv(65536)
            except TimeoutError:
                continue  # nothing yet: the next byte
            except OSError:
                break  # the server closed the connection
            if answer:
                break
        s.settimeout(2)
        try:
            while chunk := s.recv(65536):
                answer += chunk
        except OSError:
            pass
    return answer, time.monotonic() - start


def test_slow_clients_are_cut_off_by_the_read_timeout(small: TandemStack) -> None:
    payload = body()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    ).encode()
    # The headers a byte every 0.25 s (slowloris): 408 when the 2 s are up.
    answer, took = trickle(small.port, b"", head, 0.25)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"request_timeout" in answer and took < 5
    # The headers at once, then the body a byte every 0.25 s.
    answer, took = trickle(small.port, head, payload, 0.25)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"request_timeout" in answer and took < 5
    good(small.url)


def test_a_thousand_idle_connections_do_not_stop_the_others(small: TandemStack) -> None:
    idle = [socket.create_connection(("127.0.0.1", small.port), timeout=10) for _ in range(1000)]
    try:
        start = time.monotonic()
        good(small.url)
        assert time.monotonic() - start < 10
        health = httpx.get(f"{small.url}/health", timeout=10)
        assert health.status_code == 200
    finally:
        for s in idle:
            s.close()


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(f"tandem:{name}{{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no tandem:{name}")


def test_bad_frames_on_the_engine_socket_are_dropped_and_counted(small: TandemStack) -> None:
    url = small.url
    malformed_before = metric(url, "malformed_frames_total")
    dropped_before = metric(url, "engine_input_dropped_connections_total")
    valid = EngineRequest("rogue-1", b"nobody", [1, 2, 3], SamplingParams(max_tokens=2), 0.0)
    encoded = msgspec.msgpack.encode(valid)
    wrong_type = msgspec.msgpack.encode(["EngineRequest", 5, "x", "not ids", {}, "later"])
    nonsense = msgspec.msgpack.encode(  # right types, impossible values: refused, not run
        EngineRequest(
            "rogue-2",
            b"nobody",
            [10**8],
            SamplingParams(max_tokens=2, temperature=float("nan")),
            0.0,
        )
    )
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 15000)  # delivered even on a loaded host
    push.connect(small.engine_input)  # type: ignore[attr-defined]
    for frame in (b"\x00garbage\xff", encoded[: len(encoded) // 2], wrong_type, nonsense):
        push.send(frame)
    push.close()
    oversized = ctx.socket(zmq.PUSH)
    oversized.setsockopt(zmq.LINGER, 15000)
    oversized.connect(small.engine_input)  # type: ignore[attr-defined]
    oversized.send(b"\x93" + b"x" * (40 * 1024 * 1024))  # over the 33 MiB frame limit
    oversized.close()
    ctx.term()
    deadline = time.monotonic() + 15
    while (
        metric(url, "malformed_frames_total") < malformed_before + 3
        or metric(url, "engine_input_dropped_connections_total") < dropped_before + 1
    ):
        assert time.monotonic() < deadline, "frames were not counted"
        time.sleep(0.2)
    assert metric(url, "malformed_frames_total") == malformed_before + 3
    assert "rogue-2] refused" in small.log()  # decoded, then refused on its values
    good(url)
    stats = httpx.get(f"{url}/stats").json()
    assert (stats["active_requests"], stats["waiting_requests"]) == (0, 0)
