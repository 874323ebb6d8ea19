"""The pieces of tracing: W3C context out of and back into a process
(``common/tracing.py``), one warning per collector outage, a bounded shutdown, tracing
off as no-ops, and the API server's request span (``api_server/request_tracing.py``)."""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
from collections.abc import Sequence

import httpx
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from api_server.request_tracing import TraceRequests, trace_requests
from common.tracing import (
    NoTracing,
    OtlpTracing,
    WarnOnceExporter,
    otlp_exporter,
    otlp_protocol,
    parent_context,
    start_tracing,
    trace_headers,
)

TRACE_ID = 0x4BF92F3577B34DA6A3CE929D0E0E4736
CLIENT_SPAN = 0x00F067AA0BA902B7
TRACEPARENT = f"00-{TRACE_ID:032x}-{CLIENT_SPAN:016x}-01"


def memory_tracer() -> tuple[trace.Tracer, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("test"), exporter


# ---------------------------------------------------------------- context across processes


def test_no_current_span_sends_no_headers() -> None:
    assert trace_headers() is None


def test_headers_carry_the_current_span_and_read_back_as_its_child() -> None:
    tracer, exporter = memory_tracer()
    with tracer.start_as_current_span("http", context=parent_context({"traceparent": TRACEPARENT})):
        headers = trace_headers()
        current = trace.get_current_span().get_span_context()
    assert headers is not None and headers["traceparent"].split("-")[1] == f"{TRACE_ID:032x}"
    assert headers["traceparent"].split("-")[2] == f"{current.span_id:016x}"
    child = tracer.start_span("engine", context=parent_context(headers))
    child.end()
    (http, engine) = exporter.get_finished_spans()
    assert http.parent is not None and http.parent.span_id == CLIENT_SPAN
    assert engine.context is not None and engine.context.trace_id == TRACE_ID
    assert engine.parent is not None and engine.parent.span_id == current.span_id


def test_missing_or_malformed_headers_start_a_new_trace() -> None:
    tracer, exporter = memory_tracer()
    for headers in (None, {}, {"traceparent": "garbage"}):
        tracer.start_span("x", context=parent_context(headers)).end()
    assert all(s.parent is None for s in exporter.get_finished_spans())


# ---------------------------------------------------------------- the exporter


class Flaky(SpanExporter):
    """Fails while ``down``; counts the batches it was given."""

    def __init__(self) -> None:
        self.down = True
        self.batches = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.batches += 1
        if self.down == "raise":
            raise ConnectionError("refused")
        return SpanExportResult.FAILURE if self.down else SpanExportResult.SUCCESS


def test_an_outage_is_one_warning_and_its_end_one_info(caplog: pytest.LogCaptureFixture) -> None:
    inner = Flaky()
    exporter = WarnOnceExporter(inner, "http://collector:4318/v1/traces")
    with caplog.at_level(logging.INFO, logger="common.tracing"):
        for _ in range(5):
            assert exporter.export([]) is SpanExportResult.FAILURE
        inner.down = False
        assert exporter.export([]) is SpanExportResult.SUCCESS
        assert exporter.export([]) is SpanExportResult.SUCCESS
        inner.down = "raise"  # type: ignore[assignment]
        assert exporter.export([]) is SpanExportResult.FAILURE  # raised: still a failure
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "common.tracing"]
    assert [level for level, _ in lines] == ["WARNING", "INFO", "WARNING"]
    assert "cannot export traces to http://collector:4318/v1/traces" in lines[0][1]
    assert inner.batches == 8


def test_spans_are_exported_off_the_calling_thread_and_flushed_at_shutdown() -> None:
    memory = InMemorySpanExporter()
    tracing = OtlpTracing("http://unused", "tandem-test", exporter=memory)
    assert tracing.exports
    tracing.tracer.start_span("a").end()
    assert not memory.get_finished_spans()  # batched: the exporter thread sends it later
    tracing.shutdown()
    (span,) = memory.get_finished_spans()
    assert span.resource.attributes["service.name"] == "tandem-test"


def test_shutdown_gives_up_on_a_collector_that_is_down() -> None:
    # A closed port: every export fails and the OTLP exporter retries with back-off.
    tracing = start_tracing("http://127.0.0.1:9/v1/traces", "tandem-test")
    assert isinstance(tracing, OtlpTracing)
    tracing.tracer.start_span("a").end()
    began = time.monotonic()
    tracing.shutdown()
    assert time.monotonic() - began < 6.0


def test_tracing_off_makes_nothing() -> None:
    tracing = start_tracing(None, "tandem-test")
    assert isinstance(tracing, NoTracing) and not tracing.exports
    threads = threading.active_count()
    with tracing.tracer.start_as_current_span("x"):
        assert trace_headers() is None  # a no-op span is no context to send
    assert threading.active_count() == threads
    tracing.shutdown()


# ---------------------------------------------------------------- the API server's span


async def stream(request: Request) -> Response:
    headers = trace_headers()

    async def body():
        yield b"data: 1\n\n"
        yield f"data: {headers['traceparent'] if headers else None}\n\n".encode()

    return StreamingResponse(body(), media_type="text/event-stream")


async def fail(request: Request) -> Response:
    return JSONResponse({"error": "down"}, 503)


def app() -> Starlette:
    return Starlette(
        routes=[
            Route("/v1/chat/completions", stream, methods=["POST"]),
            Route("/v1/fail", fail, methods=["POST"]),
            Route("/health", fail, methods=["GET"]),
            Route("/v1/things/{id}", fail, methods=["POST"]),
        ]
    )


def post(asgi: object, path: str, method: str = "POST", **kwargs: object) -> httpx.Response:
    async def send() -> httpx.Response:
        transport = httpx.ASGITransport(app=asgi)  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.request(method, path, **kwargs)  # type: ignore[arg-type]

    return asyncio.run(send())


def test_a_request_span_continues_the_client_trace_and_is_current() -> None:
    tracer, exporter = memory_tracer()
    traced = TraceRequests(app(), tracer, frozenset({"/v1/chat/completions"}))
    r = post(traced, "/v1/chat/completions", headers={"traceparent": TRACEPARENT})
    assert r.status_code == 200
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert sorted(spans) == ["POST /v1/chat/completions", "response"]
    server, response = spans["POST /v1/chat/completions"], spans["response"]
    assert server.kind == SpanKind.SERVER
    assert server.parent is not None and server.parent.span_id == CLIENT_SPAN
    assert server.context is not None and server.context.trace_id == TRACE_ID
    assert dict(server.attributes or {}) == {
        "http.request.method": "POST",
        "url.path": "/v1/chat/completions",
        "http.route": "/v1/chat/completions",
        "http.response.status_code": 200,
    }
    assert response.parent is not None and response.parent.span_id == server.context.span_id
    # What the route would send the engine: the server span's own context.
    sent = r.text.split("data: ")[2].strip()
    assert sent == f"00-{TRACE_ID:032x}-{server.context.span_id:016x}-01"


def test_errors_gets_and_unknown_paths() -> None:
    tracer, exporter = memory_tracer()
    traced = TraceRequests(app(), tracer, frozenset({"/v1/fail"}))
    post(traced, "/v1/fail")
    post(traced, "/health", method="GET")  # probes are not traced
    post(traced, "/v1/things/123")  # a path with an id is not a span name
    names = [s.name for s in exporter.get_finished_spans() if s.name != "response"]
    assert names == ["POST /v1/fail", "POST"]
    failed = exporter.get_finished_spans()[1]
    assert not failed.status.is_ok


def test_tracing_off_serves_the_app_itself() -> None:
    inner = app()
    assert trace_requests(inner, NoTracing(), frozenset()) is inner


def test_the_request_span_names_its_trace_for_the_audit_log() -> None:
    """A trace this server starts (no traceparent) or continues: the audit line's id."""
    tracer, exporter = memory_tracer()

    async def trace_id(request: Request) -> Response:
        return PlainTextResponse(str(request.scope["state"]["trace_id"]))

    routes = [Route("/v1/completions", trace_id, methods=["POST"])]
    traced = TraceRequests(Starlette(routes=routes), tracer, frozenset({"/v1/completions"}))
    started = post(traced, "/v1/completions").text
    continued = post(traced, "/v1/completions", headers={"traceparent": TRACEPARENT}).text
    ids = [f"{s.context.trace_id:032x}" for s in exporter.get_finished_spans() if s.context]
    assert started in ids and started != f"{TRACE_ID:032x}"
    assert continued == f"{TRACE_ID:032x}"


def test_the_wire_is_http_protobuf_unless_opentelemetrys_variables_say_grpc() -> None:
    assert otlp_protocol({}) == "http/protobuf"
    assert otlp_protocol({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}) == "grpc"
    both = {
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
    }
    assert otlp_protocol(both) == "http/protobuf"  # the traces' own variable first
    grpc = otlp_exporter("http://127.0.0.1:4317", "grpc")
    assert type(grpc).__module__ == "opentelemetry.exporter.otlp.proto.grpc.trace_exporter"
    grpc.shutdown()
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/json: traces go"):
        otlp_protocol({"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"})


def test_grpc_without_its_exporter_names_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    # A None entry in sys.modules makes the import fail, as where it is not installed.
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.grpc.trace_exporter", None)
    with pytest.raises(ValueError, match="pip install opentelemetry-exporter-otlp-proto-grpc"):
        otlp_protocol({"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"})
