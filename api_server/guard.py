"""ASGI middleware in front of every route: API keys, per-caller request rate limits and
the request-body size limit.

Keys are kept only as SHA-256 digests and compared in constant time. The caller's
identity (a key digest prefix, or the client address when no keys are set) is left in
``scope["state"]["caller"]`` for the routes, which charge tokens to it; with keys on it
is also ``scope["state"]["key_id"]``, the owner of the requests made with that key. Streaming
responses pass through untouched (pure ASGI, no response buffering).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
from collections.abc import Mapping
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api_server.errors import OPENAI_ERRORS, ApiError, ErrorFormat, error_body
from api_server.rate_limit import RateLimited, RateLimiter

OPEN_PATHS = frozenset(
    {"/health", "/livez", "/readyz", "/metrics", "/", "/favicon.ico", "/openapi.json"}
)
OPEN_PREFIXES = ("/static/",)
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/messages"})


class BodyTooLarge(Exception):
    """Raised while reading a body that outgrows the limit (no Content-Length given)."""


class BodyTooSlow(Exception):
    """Raised while reading a body that has not arrived whole within the read timeout."""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class Guard:
    def __init__(
        self,
        app: ASGIApp,
        api_keys: tuple[str, ...],
        max_body_bytes: int,
        limiter: RateLimiter | None = None,
        error_formats: Mapping[str, ErrorFormat] | None = None,
        read_timeout_s: float = 30.0,
        admin_keys: tuple[str, ...] = (),
    ) -> None:
        """``admin_keys`` pass wherever ``api_keys`` do; ``scope["state"]["admin"]`` says
        whether the caller used one (always true with keys off)."""
        self.app = app
        self.read_timeout_s = read_timeout_s
        self.error_formats = error_formats or {}
        self._admin_digests = [_digest(k) for k in admin_keys]
        self._digests = [_digest(k) for k in api_keys] + self._admin_digests
        self.max_body_bytes = max_body_bytes
        self.limiter = limiter or RateLimiter()

    def caller(self, scope: Scope, headers: dict[str, str]) -> str:
        """Who is calling, for rate limits: a key's digest prefix, else the client host."""
        if self._digests:
            return "key:" + _digest(_presented_key(headers)).hex()[:16]
        client = scope.get("client")
        return "host:" + (client[0] if client else "unknown")

    def authorized(self, headers: dict[str, str], digests: list[bytes] | None = None) -> bool:
        """Whether the presented key is one of ``digests`` (default: any key)."""
        digests = self._digests if digests is None else digests
        if not self._digests:
            return True
        key = _presented_key(headers)
        given = _digest(key)
        # Compare against every key so the time taken says nothing about which matched.
        matches = [hmac.compare_digest(given, d) for d in digests]
        return bool(key) and any(matches)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        path: str = scope["path"]
        is_open = path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)
        if not is_open and not self.authorized(headers):
            message = "a valid API key is required (Authorization: Bearer KEY or x-api-key: KEY)"
            error = ApiError(401, message, "authentication_error", code="invalid_api_key")
            await _reply(send, 401, self._body(path, error), {"www-authenticate": "Bearer"})
            return
        caller = self.caller(scope, headers)
        state = scope.setdefault("state", {})
        state["caller"] = caller
        # With keys on, the key's identity owns the requests it makes (cancel checks it).
        state["key_id"] = caller if self._digests else None
        state["admin"] = self.authorized(headers, self._admin_digests)
        if path in GENERATION_PATHS and scope["method"] == "POST":
            try:
                self.limiter.admit(caller)
            except RateLimited as e:
                error = ApiError(429, str(e), "rate_limit_error", code="rate_limit_exceeded")
                await _reply(
                    send, 429, self._body(path, error), {"retry-after": e.retry_after_header}
                )
                return
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await _reply(send, 413, too_large_body(self.max_body_bytes))
            return
        await self.app(scope, self._limited(receive), send)

    def _body(self, path: str, error: ApiError) -> dict[str, Any]:
        """The error body in the dialect of the route asked for."""
        return self.error_formats.get(path, OPENAI_ERRORS).body(error)

    def _limited(self, receive: Receive) -> Receive:
        """``receive`` that refuses a body over the size limit or one still arriving when
        the read timeout is up (a client sending a byte a second); once the body is in,
        waiting for a disconnect has no deadline."""
        seen = 0
        body_done = False
        deadline = asyncio.get_running_loop().time() + self.read_timeout_s

        async def wrapped() -> Message:
            nonlocal seen, body_done
            if body_done:
                return await receive()
            remaining = deadline - asyncio.get_running_loop().time()
            try:
                message = await asyncio.wait_for(receive(), max(remaining, 0.0))
            except TimeoutError:
                raise BodyTooSlow() from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise BodyTooLarge()
                body_done = not message.get("more_body", False)
            return message

        return wrapped


def _presented_key(headers: dict[str, str]) -> str:
    auth = headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return headers.get("x-api-key", "")


def too_slow_body(timeout_s: float) -> dict[str, Any]:
    return error_body(
        f"the request body was not received within {timeout_s:g} s",
        "invalid_request_error",
        code="request_timeout",
    )


def too_large_body(limit: int) -> dict[str, Any]:
    return error_body(
        f"the request body exceeds {limit} bytes", "invalid_request_error", code="request_too_large"
    )


async def _reply(
    send: Send, status: int, body: dict[str, Any], extra: dict[str, str] | None = None
) -> None:
    payload = json.dumps(body).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(payload)).encode()),
    ]
    headers += [(k.encode(), v.encode()) for k, v in (extra or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
