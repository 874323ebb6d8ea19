"""OpenTelemetry traces end to end, received by a real OTLP/HTTP receiver in the test
(``ExportTraceServiceRequest`` protobufs POSTed to ``/v1/traces``).

One split-pool stack (``--kv-transfer shm``) starts with ``--otlp-traces-endpoint`` at a
port where nothing listens yet: requests still succeed and each exporting process logs
one warning, however many exports fail. Then the receiver opens on that port, and a
streamed chat request with a client ``traceparent`` makes one trace holding the API
server's request span, the engine's ``llm_request`` with its GenAI attributes (token
counts as the stream's usage says), its queue, prefill chunks, KV hand-off and decode.
A second, unified stack without the flag sends nothing, even with OpenTelemetry's own
endpoint variable pointing at the receiver."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from tests.stack import CPU_WORKERS, TandemStack, free_port

MODEL = "smollm2-135m-instruct"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
# Spans leave each process within 0.1 s; an export to nowhere gives up within 1 s.
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "100", "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "1"}
WARNING = "cannot export traces to"
# Long enough to be handed off (not prefilled in the decode pool), and in several chunks.
PROMPT = " ".join(f"Item {i} of the inventory is a lamp." for i in range(40))


@dataclass(frozen=True)
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    start: int
    end: int
    attributes: dict[str, Any]


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return tuple(_value(x) for x in v.array_value.values)
    return getattr(v, kind) if kind else None


class Receiver:
    """An OTLP/HTTP trace receiver on loopback, keeping every span it is sent."""

    def __init__(self, port: int) -> None:
        self.spans: list[Span] = []
        self.posts = 0
        lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = ExportTraceServiceRequest.FromString(body)
                with lock:
                    receiver.posts += 1
                    receiver.spans += list(_spans(request))
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if self.path == "/v1/traces" else 404)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: Any) -> None:
                return None

        self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def trace(self, trace_id: str, wanted: set[str], timeout_s: float = 15.0) -> list[Span]:
        """The spans of ``trace_id``, once every name in ``wanted`` is among them."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = [s for s in list(self.spans) if s.trace_id == trace_id]
            if wanted <= {s.name for s in spans} or time.monotonic() > deadline:
                return spans
            time.sleep(0.1)


def _spans(request: ExportTraceServiceRequest) -> Iterator[Span]:
    for resource_spans in request.resource_spans:
        resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for s in scope_spans.spans:
                yield Span(
                    resource.get("service.name", ""),
                    s.name,
                    s.trace_id.hex(),
                    s.span_id.hex(),
                    s.parent_span_id.hex(),
                    s.start_time_unix_nano,
                    s.end_time_unix_nano,
                    {a.key: _value(a.value) for a in s.attributes},
                )


def chat_stream(url: str, content: str, traceparent: str | None) -> dict[str, Any]:
    """A streamed chat completion; returns the usage its last chunk reports."""
    headers = {"traceparent": traceparent} if traceparent else {}
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 6,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    usage: dict[str, Any] | None = None
    with httpx.stream(
        "POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120
    ) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                usage = json.loads(line[6:]).get("usage") or usage
    assert usage is not None
    return usage


@pytest.fixture(scope="module")
def split_stack(smollm2_dir: Path) -> Iterator[tuple[TandemStack, int]]:
    port = free_port()  # the collector's, closed until a test opens it
    with TandemStack(
        "--prefill-workers",
        "1",
        "--decode-workers",
        "1",
        "--kv-transfer",
        "shm",
        "--max-num-batched-tokens",
        "128",  # the prompt's prefill runs in chunks
        "--otlp-traces-endpoint",
        f"http://127.0.0.1:{port}/v1/traces",
        env={**CPU_WORKERS, **FAST_EXPORT},
    ) as stack:
        yield stack, port


def test_a_collector_that_is_down_costs_one_warning_per_process(
    split_stack: tuple[TandemStack, int],
) -> None:
    stack, _ = split_stack
    for i in range(3):
        usage = chat_stream(stack.url, f"Say {i}.", f"00-{TRACE_ID[:-1]}{i}-{CLIENT_SPAN}-01")
        assert usage["completion_tokens"] > 0
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        warnings = [line for line in stack.log().splitlines() if WARNING in line]
        if {"api_server", "engine_core"} <= {line.split()[2] for line in warnings}:
            break
        time.sleep(0.2)
    for _ in range(3):  # more failed exports: no more warnings
        chat_stream(stack.url, "Say more.", None)
    time.sleep(2.5)
    warnings = [line for line in stack.log().splitlines() if WARNING in line]
    assert sorted(line.split()[2] for line in warnings) == ["api_server", "engine_core"], warnings
    assert "Failed to export" not in stack.log()  # the exporter's own lines are DEBUG


def test_one_trace_holds_the_request_from_http_to_decode(
    split_stack: tuple[TandemStack, int],
) -> None:
    stack, port = split_stack
    receiver = Receiver(port)
    try:
        traceparent = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"
        usage = chat_stream(stack.url, PROMPT, traceparent)
        names = {"POST /v1/chat/completions", "response", "llm_request", "queue", "prefill_chunk"}
        names |= {"kv_handoff", "decode_steps"}
        spans = receiver.trace(TRACE_ID, names)
    finally:
        receiver.close()
    by_name: dict[str, list[Span]] = {}
    for s in spans:
        by_name.setdefault(s.name, []).append(s)
    assert names <= set(by_name), sorted(by_name)
    (http,) = by_name["POST /v1/chat/completions"]
    (root,) = by_name["llm_request"]
    assert http.parent_id == CLIENT_SPAN and http.service == "tandem-api-server"
    assert http.attributes["http.response.status_code"] == 200
    assert by_name["response"][0].parent_id == http.span_id
    assert root.parent_id == http.span_id and root.service == "tandem-engine-core"
    for name in ("queue", "prefill_chunk", "kv_handoff", "decode_steps"):
        assert all(s.parent_id == root.span_id for s in by_name[name]), name
    a = root.attributes
    assert a["gen_ai.request.model"] == MODEL
    assert a["gen_ai.request.max_tokens"] == 6 and a["gen_ai.request.temperature"] == 0.0
    assert a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert 0 < a["gen_ai.server.time_to_first_token"] < a["gen_ai.latency.e2e"]
    chunks = sorted(by_name["prefill_chunk"], key=lambda s: s.start)
    assert len(chunks) >= 2 and {c.attributes["tandem.pool"] for c in chunks} == {"prefill"}
    computed = sum(c.attributes["tandem.prefill.num_tokens"] for c in chunks)
    assert computed + a["tandem.num_cached_tokens"] == usage["prompt_tokens"]
    (handoff,), (decode,) = by_name["kv_handoff"], by_name["decode_steps"]
    assert decode.attributes["tandem.pool"] == "decode"
    # In the order the request lived them, all within the HTTP request.
    (queue,) = by_name["queue"]
    assert http.start <= root.start <= queue.start <= queue.end <= chunks[0].start
    assert chunks[-1].end <= handoff.start <= handoff.end <= decode.start <= decode.end
    assert decode.end <= root.end <= http.end
    assert "exporting traces to" in stack.log()  # each process says it recovered


def test_tracing_off_sends_nothing(smollm2_dir: Path) -> None:
    port = free_port()
    receiver = Receiver(port)
    # OpenTelemetry's own variable would make an exporter send here: none is made.
    env = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{port}/v1/traces"}
    try:
        with TandemStack("--max-num-seqs", "4", env={**env, **FAST_EXPORT}) as stack:
            chat_stream(stack.url, "Say hi.", f"00-{TRACE_ID}-{CLIENT_SPAN}-01")
            time.sleep(1.0)  # ten export periods, had there been an exporter
            assert receiver.posts == 0
            assert WARNING not in stack.log()
    finally:
        receiver.close()
