"""The API server's span of each HTTP request: a pure-ASGI middleware, outermost.

``TraceRequests`` continues the client's trace (its W3C ``traceparent``/``tracestate``
headers) or starts one, opens a SERVER span named as OpenTelemetry's HTTP conventions
name it (``POST /v1/chat/completions``) and makes it current in the request's task, so
that ``generation.py`` puts its context into the ``EngineRequest`` it sends
(``common/tracing.py``'s ``trace_headers``) and the engine's spans join the trace. A
child span ``response`` runs from the response's status line to its last body chunk: for
a stream, the time its tokens flowed to the client. Both end with the last body chunk
(or when the app fails, or the client leaves).

Only POSTs are traced: probes and scrapes (``/health``, ``/metrics``) would bury the
requests that do work. ``trace_requests`` wraps the app only when this process exports
traces; otherwise the app is served as it is.
"""

from __future__ import annotations

from opentelemetry import context, trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from common.tracing import Tracing, parent_context

_TRACE_HEADERS = (b"traceparent", b"tracestate")


class _Exchange:
    """One request's spans, ended once."""

    def __init__(self, tracer: trace.Tracer, span: Span, send: Send) -> None:
        self._tracer = tracer
        self._span = span
        self._send = send
        self._response: Span | None = None
        self._ended = False

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            status = int(message["status"])
            self._span.set_attribute("http.response.status_code", status)
            if status >= 500:  # a 4xx is the client's doing (HTTP conventions for servers)
                self._span.set_status(Status(StatusCode.ERROR))
            inside = trace.set_span_in_context(self._span)
            self._response = self._tracer.start_span("response", context=inside)
        await self._send(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            self.end()

    def failed(self, error: BaseException) -> None:
        self._span.record_exception(error)
        self._span.set_status(Status(StatusCode.ERROR, type(error).__name__))

    def end(self) -> None:
        if self._ended:
            return
        self._ended = True
        if self._response is not None:
            self._response.end()
        self._span.end()


class TraceRequests:
    """A SERVER span per POST request, current while the app handles it."""

    def __init__(self, app: ASGIApp, tracer: trace.Tracer, routes: frozenset[str]) -> None:
        self.app = app
        self.tracer = tracer
        self.routes = routes  # span names carry a known route, never an id-bearing path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        carrier = {
            name.decode("latin-1"): value.decode("latin-1")
            for name, value in scope["headers"]
            if name in _TRACE_HEADERS
        }
        attributes: dict[str, str] = {"http.request.method": "POST", "url.path": path}
        name = "POST"
        if path in self.routes:
            attributes["http.route"] = path
            name = f"POST {path}"
        span = self.tracer.start_span(
            name, context=parent_context(carrier), kind=SpanKind.SERVER, attributes=attributes
        )
        # The audit log's trace id (audit_middleware.py): this trace's, started here or not.
        scope.setdefault("state", {})["trace_id"] = format(span.get_span_context().trace_id, "032x")
        exchange = _Exchange(self.tracer, span, send)
        token = context.attach(trace.set_span_in_context(span))
        try:
            await self.app(scope, receive, exchange.send)
        except BaseException as e:
            exchange.failed(e)
            raise
        finally:
            context.detach(token)
            exchange.end()


def trace_requests(app: ASGIApp, tracing: Tracing, routes: frozenset[str]) -> ASGIApp:
    """``app`` with a span per request when this process exports traces, else ``app``."""
    return TraceRequests(app, tracing.tracer, routes) if tracing.exports else app
