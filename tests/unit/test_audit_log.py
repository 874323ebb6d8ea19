"""The audit log: its line, digests or raw text, a sink that falls behind (lines dropped
and counted, the caller never waits), whole lines from several writers, rotation, and the
middleware's one line per request however the request ends."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import subprocess
import sys
import threading
import time
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Message

from api_server.audit_log import AuditEntry, AuditFileHandler, AuditLog
from api_server.audit_middleware import AuditMiddleware, audit_of
from api_server.driver import Choice, Generation, Prompt
from api_server.generation import Piece
from api_server.protocol import CompletionRequest
from common.audit_config import check_audit_sink
from common.tracing import trace_id_of

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


class Tally:
    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1) -> None:
        self.value += amount


class Lines(logging.Handler):
    """A sink that keeps its lines; with ``gate`` set, each waits for it (a slow sink)."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        super().__init__()
        self.lines: list[str] = []
        self.gate = gate

    def emit(self, record: logging.LogRecord) -> None:
        if self.gate is not None:
            self.gate.wait()
        self.lines.append(self.format(record))


def entry(**changes: Any) -> AuditEntry:
    fields: dict[str, Any] = {
        "time": 1_800_000_000.25,
        "route": "/v1/completions",
        "status": 200,
        "outcome": "completed",
        "latency_s": 0.1234,
        "request_id": "cmpl-1",
        "trace_id": TRACE_ID,
        "tenant": "key:0123456789abcdef",
        "key_id": "key:0123456789abcdef",
        "model": "m",
        "prompt_tokens": 5,
        "completion_tokens": 3,
        "finish_reasons": ["length"],
        "prompts": ["the secret prompt"],
        "completions": ["the secret answer"],
    }
    return AuditEntry(**(fields | changes))


def test_line_has_every_field_and_digests_not_text() -> None:
    line = entry().line(raw=False)
    body = json.loads(line)
    assert body == {
        "time": "2027-01-15T08:00:00.250Z",
        "request_id": "cmpl-1",
        "trace_id": TRACE_ID,
        "tenant": "key:0123456789abcdef",
        "key_id": "key:0123456789abcdef",
        "route": "/v1/completions",
        "model": "m",
        "status": 200,
        "outcome": "completed",
        "prompt_tokens": 5,
        "completion_tokens": 3,
        "latency_ms": 123.4,
        "finish_reasons": ["length"],
        "prompt_sha256": [hashlib.sha256(b"the secret prompt").hexdigest()],
        "completion_sha256": [hashlib.sha256(b"the secret answer").hexdigest()],
    }
    assert "secret" not in line


def test_raw_line_has_the_text_and_token_id_prompts_as_json() -> None:
    body = json.loads(entry(prompts=["caf\u00e9", [1, 2, 3]]).line(raw=True))
    assert body["prompt"] == ["caf\u00e9", "[1, 2, 3]"]
    assert body["completion"] == ["the secret answer"]
    assert "prompt_sha256" not in body and "completion_sha256" not in body


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        (TRACEPARENT, TRACE_ID),
        (f"01-{TRACE_ID}-00f067aa0ba902b7-01-later-fields", TRACE_ID),
        (None, None),
        ("", None),
        (f"ff-{TRACE_ID}-00f067aa0ba902b7-01", None),  # version ff is invalid
        (f"00-{'0' * 32}-00f067aa0ba902b7-01", None),  # all-zero trace id
        (f"00-{TRACE_ID}-{'0' * 16}-01", None),  # all-zero parent id
        (f"00-{TRACE_ID}-00f067aa0ba902b7-01-extra", None),  # version 00 has four fields
        (f"00-{TRACE_ID.upper()}-00f067aa0ba902b7-01", None),  # lowercase hex only
    ],
)
def test_trace_id_from_traceparent(header: str | None, expected: str | None) -> None:
    assert trace_id_of(header) == expected


def test_a_slow_sink_drops_and_counts_lines_and_never_blocks() -> None:
    gate = threading.Event()
    sink = Lines(gate)
    written, dropped = Tally(), Tally()
    log = AuditLog(sink, raw=False, written=written, dropped=dropped, max_queued=4)
    started = time.monotonic()
    for i in range(50):
        log.write(entry(request_id=f"r{i}"))
    took = time.monotonic() - started
    # The writer holds at most one line (blocked in the sink) and the queue four.
    assert took < 0.5 and 45 <= dropped.value <= 46
    gate.set()
    log.close()
    assert written.value == len(sink.lines) == 50 - dropped.value
    assert [json.loads(line)["request_id"] for line in sink.lines] == [
        f"r{i}" for i in range(len(sink.lines))
    ]


def test_a_failed_write_is_counted_as_dropped() -> None:
    class Broken(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            raise OSError("no space left on device")

    written, dropped = Tally(), Tally()
    log = AuditLog(Broken(), raw=False, written=written, dropped=dropped)
    log.write(entry())
    log.write(entry())
    log.close()
    assert (written.value, dropped.value) == (0, 2)


def test_every_line_is_written_or_counted_dropped_across_close() -> None:
    # A sink stuck (until the end of the test): close gives up on the queued lines and
    # counts them.
    gate = threading.Event()
    sink = Lines(gate)
    written, dropped = Tally(), Tally()
    log = AuditLog(sink, raw=False, written=written, dropped=dropped, max_queued=3)
    log.write(entry(request_id="held"))
    time.sleep(0.2)  # the writer takes it, and waits in the sink for good
    for i in range(3):  # the queue full
        log.write(entry(request_id=f"r{i}"))
    log.close(timeout_s=0.2)
    log.write(entry(request_id="late"))  # a request ending after the log closed
    # The three queued and the late one; the line the sink holds is neither yet.
    assert (written.value, dropped.value) == (0, 4)
    # Unstuck, the writer finishes its line and ends (a stuck handler would also hold
    # logging's lock at interpreter exit, and the test run would never end).
    gate.set()
    log.join_writer(timeout_s=2)
    assert written.value == 1 and not log.writer_alive


def test_writers_sharing_a_file_leave_whole_lines(tmp_path: Path) -> None:
    """Two logs on one path (as two API-server processes): every line whole. Long lines
    (raw text of 64 KiB) are where a buffered writer would tear them."""
    path = tmp_path / "audit.jsonl"
    logs = [AuditLog(AuditFileHandler(str(path)), True, Tally(), Tally()) for _ in range(2)]
    for i in range(200):
        for k, log in enumerate(logs):
            log.write(entry(request_id=f"{k}-{i}", prompts=[str(k) * 65536]))
    for log in logs:
        log.close()
    ids = sorted(json.loads(line)["request_id"] for line in path.read_text().splitlines())
    assert ids == sorted(f"{k}-{i}" for k in range(2) for i in range(200))


def test_a_rotated_file_is_reopened(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    log = AuditLog(AuditFileHandler(str(path)), False, Tally(), Tally())
    log.write(entry(request_id="before"))
    deadline = time.monotonic() + 5
    while not path.exists() or not path.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    path.rename(tmp_path / "audit.jsonl.1")  # what logrotate does before its signal
    log.write(entry(request_id="after"))
    log.close()
    assert json.loads((tmp_path / "audit.jsonl.1").read_text())["request_id"] == "before"
    assert json.loads(path.read_text())["request_id"] == "after"


# The middleware, on a small app of its own.


async def _nothing() -> AsyncGenerator[Piece, None]:
    yield Piece("", None, 0, [], 0, [])


def generation(n: int = 2) -> Generation:
    """A finished request: one text prompt, ``n`` choices."""
    req = CompletionRequest.model_validate({"model": "m", "prompt": "hello there", "n": n})
    prompt = Prompt([1, 2, 3], text="hello there")
    choices = []
    for k in range(n):
        piece = Piece(f"answer {k}", "length", 4, [7, 8, 9, 10], 0, [])
        choices.append(Choice(k, prompt, _nothing(), collected=[piece]))
    return Generation("cmpl-abc", "m", 0, req, choices)


async def completions(request: Request) -> Response:
    audit = audit_of(request)
    audit.model = "m"
    audit.generation = generation()
    mode = request.query_params.get("mode")
    if mode == "raise":
        raise RuntimeError("a bug")
    if mode == "stream":

        async def forever() -> AsyncGenerator[str, None]:
            while True:
                yield "data: {}\n\n"
                await asyncio.sleep(0.01)

        return StreamingResponse(forever(), media_type="text/event-stream")
    if mode == "handed-on":
        audit.hand_on()
    if mode == "taken-back":  # a router whose service could not be reached
        audit.hand_on()
        audit.take_back()
    return JSONResponse({"ok": True}, headers={"X-Request-Id": "cmpl-abc"})


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


def audited_app(log: AuditLog) -> Starlette:
    return Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
        ],
        middleware=[Middleware(AuditMiddleware, log=log)],
    )


def call(
    app: Starlette, path: str, query: str = "", leave_after_s: float | None = None
) -> list[Message]:
    """One request straight through the ASGI interface; the client leaves after
    ``leave_after_s`` (None: it stays until the response ends)."""
    sent: list[Message] = []
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST" if path.startswith("/v1/") else "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query.encode(),
        "headers": [(b"traceparent", TRACEPARENT.encode()), (b"host", b"test")],
        "client": ("127.0.0.1", 1234),
        "server": ("test", 80),
    }

    async def run() -> None:
        messages = [{"type": "http.request", "body": b"{}", "more_body": False}]

        async def receive() -> Message:
            if messages:
                return messages.pop()
            if leave_after_s is None:
                await asyncio.Event().wait()  # until cancelled
            await asyncio.sleep(leave_after_s or 0.0)
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            sent.append(message)

        await app(scope, receive, send)

    asyncio.run(run())
    return sent


def lines_of(run: Any, raw: bool = False) -> list[dict[str, Any]]:
    sink = Lines()
    log = AuditLog(sink, raw=raw, written=Tally(), dropped=Tally())
    try:
        run(audited_app(log))
    finally:
        log.close()
    return [json.loads(line) for line in sink.lines]


def test_a_completed_request_has_one_line_with_the_handlers_facts() -> None:
    [line] = lines_of(lambda app: call(app, "/v1/completions"))
    assert line["request_id"] == "cmpl-abc" and line["trace_id"] == TRACE_ID
    assert (line["status"], line["outcome"], line["route"]) == (200, "completed", "/v1/completions")
    assert line["tenant"] is None  # no guard in this app
    # Two choices of one prompt: the prompt once, its tokens once; completions summed.
    assert (line["prompt_tokens"], line["completion_tokens"]) == (3, 8)
    assert line["finish_reasons"] == ["length", "length"]
    assert line["prompt_sha256"] == [hashlib.sha256(b"hello there").hexdigest()]
    assert line["completion_sha256"] == [
        hashlib.sha256(f"answer {k}".encode()).hexdigest() for k in range(2)
    ]


def test_raw_lines_have_the_text() -> None:
    [line] = lines_of(lambda app: call(app, "/v1/completions"), raw=True)
    assert line["prompt"] == ["hello there"] and line["completion"] == ["answer 0", "answer 1"]


def test_a_client_leaving_a_stream_has_one_line() -> None:
    [line] = lines_of(lambda app: call(app, "/v1/completions", "mode=stream", leave_after_s=0.05))
    assert (line["status"], line["outcome"]) == (200, "disconnected")


def test_an_exception_has_one_line() -> None:
    def run(app: Starlette) -> None:
        with pytest.raises(RuntimeError, match="a bug"):
            call(app, "/v1/completions", "mode=raise")

    [line] = lines_of(run)
    assert (line["status"], line["outcome"], line["model"]) == (500, "error", "m")


def test_other_routes_and_requests_handed_on_have_no_line() -> None:
    def run(app: Starlette) -> None:
        call(app, "/health")
        call(app, "/v1/completions", "mode=handed-on")

    assert lines_of(run) == []


def test_a_request_taken_back_from_a_service_has_the_routers_line() -> None:
    def run(app: Starlette) -> None:
        call(app, "/v1/completions", "mode=taken-back")

    [line] = lines_of(run)
    assert (line["status"], line["outcome"], line["request_id"]) == (200, "completed", "cmpl-abc")


def test_a_path_that_cannot_be_appended_to_is_one_line_before_anything_starts(
    tmp_path: Path,
) -> None:
    check_audit_sink(str(tmp_path / "audit.jsonl"))  # made, appendable
    check_audit_sink("-")  # stdout
    with pytest.raises(ValueError, match=r"--audit-log .* cannot be opened for appending"):
        check_audit_sink(str(tmp_path))  # a directory
    # `tandem serve` refuses it before it starts any process (its exit code, its message).
    out = subprocess.run(
        [sys.executable, "-m", "common.cli", "serve", "--audit-log", str(tmp_path / "no" / "x")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0
    assert "cannot be opened for appending" in out.stderr and "Traceback" not in out.stderr
