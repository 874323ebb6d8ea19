"""The model router's routes (``api_server/model_router.py`` runs them): each request
routed by its ``model`` to that model's service and its answer passed back byte for
byte; ``/v1/models``, ``/readyz``, ``/health``, ``/metrics`` and ``/stats`` over every
model; a cancel or a kept response asked of each loaded service in turn."""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, generate_latest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from api_server.audit_middleware import audit_of
from api_server.errors import (
    ANTHROPIC_ERRORS,
    OPENAI_ERRORS,
    ApiError,
    ErrorFormat,
    error_response,
)
from api_server.metrics_merge import merged_exposition
from api_server.model_slots import ModelService, ModelSlots, ModelUnavailable, SlotState

# Routed by the body's ``model``: generation, its prompt rendering, and tokenizing.
ROUTED_POSTS = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/messages",
    "/v1/responses",
    "/v1/completions/render",
    "/v1/chat/completions/render",
    "/tokenize",
    "/detokenize",
)
_HOP_BY_HOP = frozenset(
    {
        "host",
        "connection",
        "keep-alive",
        "transfer-encoding",
        "content-length",
        "upgrade",
        "te",
        "trailer",
        "proxy-authorization",
        "proxy-connection",
    }
)
# The answer's: its length stays (the body passes unchanged); date and server are ours.
_NOT_PASSED_BACK = (_HOP_BY_HOP - {"content-length", "host"}) | {"date", "server"}


# Each path's error body, where it is not OpenAI's.
FLAVOURS: dict[str, ErrorFormat] = {"/v1/messages": ANTHROPIC_ERRORS}


def errors_of(path: str) -> ErrorFormat:
    return FLAVOURS.get(path, OPENAI_ERRORS)


class _Passed(StreamingResponse):
    """A service's answer passed through; ``on_end`` runs once however it ends (done,
    the client gone, the service gone, or never sent: ``discard``), which frees the
    request's hold on the model."""

    def __init__(self, upstream: httpx.Response, on_end: Callable[[], Awaitable[None]]) -> None:
        super().__init__(upstream.aiter_raw(), upstream.status_code)
        # every header the service sent (a repeated one too), but the connection's own
        # and those the server writes itself
        self.raw_headers = [
            (k, v) for k, v in upstream.headers.raw if k.lower().decode() not in _NOT_PASSED_BACK
        ]
        self._upstream, self._on_end = upstream, on_end

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.discard()

    async def discard(self) -> None:
        try:
            await self._upstream.aclose()
        finally:
            await self._on_end()


class ModelRouter:
    """The routes, over the services in ``slots``."""

    def __init__(self, slots: ModelSlots) -> None:
        self.slots = slots
        self.registry = CollectorRegistry()  # the router's own series (its audit log's)
        self.draining = False
        self.in_flight = 0
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=10.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
            trust_env=False,  # the services are on 127.0.0.1: never through HTTP_PROXY
        )

    async def route(self, request: Request) -> Response:
        """Find the body's model, hold its service (loading it if need be), pass the
        request on and the answer back."""
        errors = errors_of(request.url.path)
        if self.draining:
            return error_response(
                ApiError(503, "the server is shutting down", "server_error"), errors
            )
        body = await request.body()
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):  # refused here: no model is loaded for it
            return error_response(ApiError(400, "the body must be a JSON object"), errors)
        name = parsed.get("model", self._loaded_first())
        if not isinstance(name, str):
            return error_response(ApiError(400, "model must be a string", param="model"), errors)
        if name not in self.slots.services:
            served = ", ".join(f"'{n}'" for n in self.slots.services)
            error = ApiError(
                404,
                f"model '{name}' does not exist; this server serves {served}",
                "not_found_error",
                param="model",
                code="model_not_found",
            )
            return error_response(error, errors)
        self.in_flight += 1
        try:
            service = await self.slots.acquire(name)
        except ModelUnavailable as e:
            self.in_flight -= 1
            return error_response(ApiError(503, str(e), "server_error"), errors)
        except BaseException:
            self.in_flight -= 1
            raise
        return await self._pass(request, body, service)

    def _loaded_first(self) -> str:
        """Where a request naming no model goes (vLLM serves it with its model): a
        loaded model, so that it swaps none in."""
        return next(iter(self.slots.ready()), next(iter(self.slots.services)))

    async def _pass(self, request: Request, body: bytes, service: ModelService) -> Response:
        ended = False

        async def end() -> None:
            nonlocal ended
            if not ended:
                ended = True
                self.in_flight -= 1
                await self.slots.release(service)

        headers = _passed_headers(request)
        url = f"{service.url}{request.url.path}"
        if request.url.query:
            url += f"?{request.url.query}"
        # Handed on before the send: a client that leaves while the service works makes
        # the service write its line ("disconnected"), so the router must not write one too.
        audit = audit_of(request)
        audit.hand_on()
        try:
            upstream = await self.client.send(
                self.client.build_request(request.method, url, headers=headers, content=body),
                stream=True,
            )
        except httpx.HTTPError as e:
            if isinstance(e, httpx.ConnectError | httpx.ConnectTimeout):
                audit.take_back()  # the service never had it: this 503 is the router's line
            await end()
            message = f"model '{service.name}' did not answer: {type(e).__name__}"
            return error_response(
                ApiError(503, message, "server_error"), errors_of(request.url.path)
            )
        except BaseException:
            await end()
            raise
        return _Passed(upstream, end)

    async def fan_out(self, request: Request) -> Response:
        """A request about one request or response id (cancel, a kept response): asked of
        each loaded service until one knows it."""
        last: Response | None = None
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        for service in self.slots.services.values():
            reply = await self._ask(service, request.method, path, request)
            if reply is None:
                continue
            last = Response(
                reply.content, reply.status_code, media_type=reply.headers.get("content-type")
            )
            if reply.status_code != 404:
                return last
        return last or error_response(
            ApiError(404, f"nothing at {request.url.path} on this server", "not_found_error")
        )

    async def models(self, request: Request) -> Response:
        cards: list[dict[str, Any]] = []
        for service in self.slots.services.values():
            status = {"value": service.state.value}
            served: list[dict[str, Any]] = []
            reply = await self._ask(service, "GET", "/v1/models", request)
            if reply is not None and reply.status_code == 200:
                served = reply.json()["data"]
            if not served:
                served = [
                    {
                        "id": service.name,
                        "object": "model",
                        "created": int(time.time()),
                        "owned_by": "tandem",
                    }
                ]
            cards += [{**card, "status": status} for card in served]
        return JSONResponse({"object": "list", "data": cards})

    async def readyz(self, request: Request) -> Response:
        ready = self.slots.ready()
        body = {
            "role": "model_router",
            "models": {n: s.state.value for n, s in self.slots.services.items()},
        }
        if self.draining:
            return JSONResponse(
                {**body, "status": "not_ready", "reason": "draining: the server is shutting down"},
                503,
            )
        if not ready:
            return JSONResponse(
                {**body, "status": "not_ready", "reason": "no model is loaded yet"}, 503
            )
        return JSONResponse({**body, "status": "ready"})

    async def health(self, request: Request) -> Response:
        if self.draining:
            return JSONResponse(
                {"status": "draining", "model_loaded": bool(self.slots.ready())}, 503
            )
        if not self.slots.ready():
            return JSONResponse({"status": "loading", "model_loaded": False}, 503)
        return JSONResponse({"status": "ok", "model_loaded": True})

    async def metrics(self, request: Request) -> Response:
        texts = []
        for service in self.slots.services.values():
            reply = await self._ask(service, "GET", "/metrics", request)
            if reply is not None and reply.status_code == 200:
                texts.append((service.name, reply.text))
        texts.append(("model_router", generate_latest(self.registry).decode()))
        text, content_type = merged_exposition(texts, self.slots.services.values())
        return Response(text, media_type=content_type)

    async def stats(self, request: Request) -> Response:
        models: dict[str, Any] = {}
        for service in self.slots.services.values():
            entry: dict[str, Any] = {
                "status": service.state.value,
                "loads": service.loads,
                "unloads": service.unloads,
                "in_flight": service.in_flight,
            }
            reply = await self._ask(service, "GET", "/stats", request)
            if reply is not None and reply.status_code == 200:
                entry["stats"] = reply.json()
            models[service.name] = entry
        return JSONResponse({"models": models})

    async def _ask(
        self, service: ModelService, method: str, path: str, request: Request
    ) -> httpx.Response | None:
        """A loaded service's answer to a small request of the router's own (listing,
        metrics, a cancel); None when it is not loaded, or stops meanwhile."""
        if service.state is not SlotState.READY:
            return None
        try:
            return await self.client.request(
                method, f"{service.url}{path}", headers=_passed_headers(request), timeout=30.0
            )
        except httpx.HTTPError:
            return None


def _passed_headers(request: Request) -> list[tuple[str, str]]:
    return [(k, v) for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP]
