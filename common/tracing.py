"""OpenTelemetry traces: one exporter per process, chosen once at start, and the W3C
trace context that rides across the ZeroMQ hops.

``start_tracing(endpoint, service)`` gives ``NoTracing`` without ``--otlp-traces-endpoint``
(no provider, no exporter thread, a tracer that makes no spans) or ``OtlpTracing``: a
``TracerProvider`` of this process's own (not installed as OpenTelemetry's global one;
the tracer is handed to whoever makes spans) whose ``BatchSpanProcessor`` exports over
OTLP on its own thread, so a span costs the serving thread only its creation. The wire
is OTLP/HTTP (protobuf) unless OpenTelemetry's own ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``
(or ``OTEL_EXPORTER_OTLP_PROTOCOL``) says ``grpc``, which takes the gRPC exporter package
where it is installed (``pip install opentelemetry-exporter-otlp-proto-grpc``). A
collector that does not answer costs dropped spans and one warning per outage
(``WarnOnceExporter``); the exporter's own line per failed export is turned into DEBUG.

Context crosses processes as W3C ``traceparent``/``tracestate`` headers:
``trace_headers()`` writes the current span's (the API server's request span) into the
dict ``EngineRequest.trace_headers`` carries, ``parent_context(headers)`` reads it back
in the engine core so that the spans made there join the client's trace.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Protocol
from urllib.parse import urlparse

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

logger = logging.getLogger(__name__)

TRACER_NAME = "tandem"
# The exporter logs each failed export (and each retry); WarnOnceExporter speaks for it.
_EXPORTER_LOGGERS = (
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "opentelemetry.exporter.otlp.common.http",
    "opentelemetry.exporter.otlp.proto.grpc.exporter",
)
# OpenTelemetry's variables for the wire, the traces' own first (as its SDK reads them).
PROTOCOL_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
HTTP_PROTOBUF, GRPC = "http/protobuf", "grpc"
# At exit, the final export may take this long; one to a collector that is down gives up.
SHUTDOWN_TIMEOUT_S = 2.0

_PROPAGATOR = TraceContextTextMapPropagator()  # stateless: W3C traceparent/tracestate


class Tracing(Protocol):
    """A process's tracing, chosen once at start."""

    tracer: trace.Tracer

    @property
    def exports(self) -> bool:
        """Whether spans go anywhere (callers choose their span-making objects by it)."""
        ...

    def shutdown(self) -> None:
        """Export what is queued (bounded in time) and stop the exporter thread."""
        ...


class NoTracing:
    """No endpoint: no provider, no thread; the tracer's spans are no-ops."""

    def __init__(self) -> None:
        self.tracer: trace.Tracer = trace.NoOpTracer()

    @property
    def exports(self) -> bool:
        return False

    def shutdown(self) -> None:
        return None


class WarnOnceExporter(SpanExporter):
    """Exports through ``inner``. The first failed export of an outage logs one warning,
    the first success after it one info line, and nothing in between: a collector that
    is down must not fill the log (serving goes on; the batch is dropped)."""

    def __init__(self, inner: SpanExporter, endpoint: str) -> None:
        self._inner = inner
        self._endpoint = endpoint
        self._failing = False  # only the exporter thread reads and writes it
        self._stopped = threading.Event()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            result = self._inner.export(spans)
        except Exception:  # a bug in the exporter must not kill its thread either
            logger.debug("trace export raised", exc_info=True)
            result = SpanExportResult.FAILURE
        failing = result is not SpanExportResult.SUCCESS
        if failing and not self._failing:
            logger.warning(
                "cannot export traces to %s: spans are dropped until it answers "
                "(serving goes on; further failures are not logged)",
                self._endpoint,
            )
        elif self._failing and not failing:
            logger.info("exporting traces to %s again", self._endpoint)
        self._failing = failing
        return result

    def shutdown(self) -> None:
        """Stop, ending an export that waits to retry (once, whoever asks first)."""
        if not self._stopped.is_set():
            self._stopped.set()
            self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._inner.force_flush(timeout_millis)


class _DemoteToDebug(logging.Filter):
    """The exporter's per-failure lines, as DEBUG (shown only at ``--log-level debug``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger().isEnabledFor(logging.DEBUG)


def otlp_protocol(environ: Mapping[str, str] = os.environ) -> str:
    """``http/protobuf`` (the default) or ``grpc``, as OpenTelemetry's variables say; any
    other value, or ``grpc`` without its exporter installed, is a ``ValueError`` naming
    the fix (raised before anything starts: ``common/launcher.serve``)."""
    for variable in PROTOCOL_VARIABLES:
        protocol = environ.get(variable, "").strip().lower()
        if not protocol:
            continue
        if protocol not in (HTTP_PROTOBUF, GRPC):
            raise ValueError(
                f"{variable}={protocol}: traces go over {HTTP_PROTOBUF!r} (the default) or {GRPC!r}"
            )
        if protocol == GRPC:
            try:
                import opentelemetry.exporter.otlp.proto.grpc.trace_exporter  # noqa: F401
            except ImportError:
                raise ValueError(
                    f"{variable}=grpc needs OpenTelemetry's gRPC exporter: "
                    "pip install opentelemetry-exporter-otlp-proto-grpc"
                ) from None
        return protocol
    return HTTP_PROTOBUF


def otlp_exporter(endpoint: str, protocol: str) -> SpanExporter:
    """The OTLP span exporter for ``protocol`` (``otlp_protocol``), sending to
    ``endpoint`` (gRPC: ``http://host:4317`` in plain text, ``https://`` over TLS)."""
    if protocol == GRPC:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcSpanExporter,
        )

        return GrpcSpanExporter(endpoint=endpoint, insecure=urlparse(endpoint).scheme == "http")
    return OTLPSpanExporter(endpoint=endpoint)


class OtlpTracing:
    """Spans of this process, batched and exported over OTLP (HTTP/protobuf or gRPC) to
    ``endpoint`` on the processor's own thread."""

    def __init__(
        self, endpoint: str, service_name: str, exporter: SpanExporter | None = None
    ) -> None:
        self.endpoint = endpoint
        self.protocol = otlp_protocol()
        chosen = exporter or otlp_exporter(endpoint, self.protocol)
        self._exporter = WarnOnceExporter(chosen, endpoint)
        self._processor = BatchSpanProcessor(self._exporter)
        # No atexit hook: shutdown() bounds the final export; the SDK's would wait 30 s
        # on a collector that is down.
        self._provider = TracerProvider(
            resource=Resource.create({"service.name": service_name}), shutdown_on_exit=False
        )
        self._provider.add_span_processor(self._processor)
        self.tracer: trace.Tracer = self._provider.get_tracer(TRACER_NAME)
        demote = _DemoteToDebug()
        for name in _EXPORTER_LOGGERS:
            logging.getLogger(name).addFilter(demote)

    @property
    def exports(self) -> bool:
        return True

    def shutdown(self) -> None:
        # The processor's own shutdown waits for its final export, which retries for up
        # to the exporter's timeout (10 s) while the collector is down: past our bound
        # the exporter is stopped, which ends its retries.
        stopping = threading.Thread(target=self._processor.shutdown, daemon=True)
        stopping.start()
        stopping.join(SHUTDOWN_TIMEOUT_S)
        if stopping.is_alive():
            self._exporter.shutdown()
            stopping.join(SHUTDOWN_TIMEOUT_S)


def start_tracing(endpoint: str | None, service_name: str) -> NoTracing | OtlpTracing:
    """This process's tracing: OTLP to ``endpoint``, or none."""
    if not endpoint:
        return NoTracing()
    tracing = OtlpTracing(endpoint, service_name)
    logger.info("exporting traces to %s as %s (%s)", endpoint, service_name, tracing.protocol)
    return tracing


def trace_headers() -> dict[str, str] | None:
    """The current span's context as W3C headers, for a request that leaves this process;
    None when no span is current (tracing off), so the wire carries nothing."""
    if not trace.get_current_span().get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return carrier


def trace_id_of(traceparent: str | None) -> str | None:
    """The trace id (32 hex digits) a W3C ``traceparent`` header names; None without one
    or for one the W3C rules make invalid (the propagator's checks)."""
    if traceparent is None:
        return None
    context = trace.get_current_span(parent_context({"traceparent": traceparent}))
    ids = context.get_span_context()
    return format(ids.trace_id, "032x") if ids.is_valid else None


def parent_context(headers: Mapping[str, str] | None) -> Context:
    """The context W3C ``headers`` name (an empty one when they name none): spans
    started in it are children of the span that sent them."""
    return _PROPAGATOR.extract(headers or {}, context=Context())
