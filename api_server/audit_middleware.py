"""The audit log's ASGI middleware: one ``AuditEntry`` per request to a generation route,
handed to the ``AuditLog`` exactly once, when the request ends however it ends (the body
sent whole, the client gone, an exception).

Pure ASGI, like the guard: a stream passes through untouched, only the response's start
(status, ``X-Request-Id``) and whether its last body message went out are noted. It sits
outside the guard, so a refusal there (401, 429, 413) has its line too. The request's
``AuditRecord`` lies in ``scope["state"]["audit"]`` while it runs; the generation driver
puts the requested model and then the ``Generation`` in it, which is read when the line is
taken: the usage the response reported, each choice's finish reason and text so far.

Routes audited: the four generation routes. Others (health, metrics, tokenize, render,
cancel, kept responses) generate nothing for a tenant and have no line.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api_server.audit_log import AuditEntry, AuditLog
from api_server.protocol import CompletionRequest
from common.tracing import trace_id_of

if TYPE_CHECKING:
    from api_server.generation_state import Generation

logger = logging.getLogger(__name__)

GENERATION_ROUTES = frozenset(
    {"/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses"}
)
AUDIT_STATE = "audit"  # the record's key in scope["state"]
CLIENT_GONE = 499  # what cancel_on_disconnect answers a client that left


@dataclass
class AuditRecord:
    """One request's audit facts as they become known: the middleware's (route, arrival,
    status, ids) and the handler's (``model``, ``generation``)."""

    route: str
    arrival: float  # wall clock, for the line's time
    started: float  # monotonic, for its latency
    traceparent: str | None = None
    client_request_id: str | None = None  # the request's X-Request-Id header
    status: int | None = None
    response_request_id: str | None = None  # the response's X-Request-Id header
    model: str | None = None  # as the request named it, until there is a generation
    generation: Generation | None = None
    handed_on: bool = False

    @classmethod
    def begin(cls, scope: Scope) -> AuditRecord:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        return cls(
            scope["path"],
            time.time(),
            time.monotonic(),
            headers.get("traceparent"),
            headers.get("x-request-id"),
        )

    def hand_on(self) -> None:
        """A model router is passing the request to a model's service, whose audit log
        writes its line once it has the request; the router writes none."""
        self.handed_on = True

    def take_back(self) -> None:
        """The service never had the request (no connection): the router's line."""
        self.handed_on = False

    def response_started(self, message: Message) -> None:
        self.status = int(message["status"])
        for key, value in message.get("headers", []):
            if key.lower() == b"x-request-id":
                self.response_request_id = value.decode("latin-1")

    def entry(self, state: Mapping[str, Any], outcome: str, status: int) -> AuditEntry:
        """The line's snapshot, taken on the event loop (the writer thread only formats).
        The trace id is a tracer's (``state["trace_id"]``) when one set it, else the
        incoming ``traceparent``'s; the request id the response's, else the one the driver
        gave the generation, else the client's."""
        entry = AuditEntry(
            time=self.arrival,
            route=self.route,
            status=status,
            outcome=outcome,
            latency_s=time.monotonic() - self.started,
            request_id=self.response_request_id
            or (self.generation.request_id if self.generation else self.client_request_id),
            trace_id=state.get("trace_id") or trace_id_of(self.traceparent),
            tenant=state.get("caller"),
            key_id=state.get("key_id"),
            model=self.model,
        )
        gen = self.generation
        if gen is None:
            return entry
        usage = gen.usage()
        # A scored prompt (completions' max_tokens 0) reports no completion, as its answer.
        scored = isinstance(gen.request, CompletionRequest) and gen.request.scores_only
        return dataclasses.replace(
            entry,
            model=gen.model,
            prompt_tokens=usage["prompt_tokens"],
            completion_tokens=0 if scored else usage["completion_tokens"],
            finish_reasons=[c.last.finish_reason if c.last else None for c in gen.choices],
            # each prompt once, however many choices it has
            prompts=[
                c.prompt.text or c.prompt.ids for c in gen.choices if c.index % gen.request.n == 0
            ],
            completions=["" if scored else c.text for c in gen.choices],
        )


def audit_of(request: Request) -> AuditRecord:
    """The request's audit record; with the audit log off, one nobody reads."""
    record = request.scope.get("state", {}).get(AUDIT_STATE)
    if isinstance(record, AuditRecord):
        return record
    return AuditRecord(request.url.path, 0.0, 0.0)


class AuditMiddleware:
    """Hands the ``AuditLog`` one entry per request to ``routes``."""

    def __init__(self, app: ASGIApp, log: AuditLog, routes: frozenset[str] = GENERATION_ROUTES):
        self.app = app
        self.log = log
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in self.routes:
            await self.app(scope, receive, send)
            return
        record = AuditRecord.begin(scope)
        state = scope.setdefault("state", {})
        state[AUDIT_STATE] = record
        body_sent = False

        async def send_noting(message: Message) -> None:
            nonlocal body_sent
            if message["type"] == "http.response.start":
                record.response_started(message)
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                body_sent = True

        # The outcome if the app raises: an error (500 when nothing was sent yet, which
        # Starlette's outermost middleware then answers).
        outcome = "error"
        try:
            await self.app(scope, receive, send_noting)
            # A stream the client left ends without its last body message (Starlette
            # cancels it); a non-streamed answer it left is cancel_on_disconnect's 499.
            done = body_sent and record.status != CLIENT_GONE
            outcome = "completed" if done else "disconnected"
        except (ClientDisconnect, OSError):
            outcome = "disconnected"
            raise
        finally:
            if not record.handed_on:
                self._write(record, state, outcome)

    def _write(self, record: AuditRecord, state: Mapping[str, Any], outcome: str) -> None:
        status = record.status if record.status is not None else 500
        try:
            self.log.write(record.entry(state, outcome, status))
        except Exception:  # a bug here must not turn a served request into an error
            logger.exception("audit log: no line for a request to %s", record.route)


def audited(log: AuditLog | None) -> list[Middleware]:
    """The audit middleware where ``--audit-log`` is given; none otherwise."""
    return [] if log is None else [Middleware(AuditMiddleware, log=log)]
