"""ASGI middleware in front of every route: API keys and the request-body size limit.

Keys are kept only as SHA-256 digests and compared in constant time. Streaming
responses pass through untouched (pure ASGI, no response buffering).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api_server.protocol import error_body

OPEN_PATHS = frozenset({"/health", "/livez", "/readyz", "/metrics", "/", "/favicon.ico"})


class BodyTooLarge(Exception):
    """Raised while reading a body that outgrows the limit (no Content-Length given)."""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class Guard:
    def __init__(self, app: ASGIApp, api_keys: tuple[str, ...], max_body_bytes: int) -> None:
        self.app = app
        self._digests = [_digest(k) for k in api_keys]
        self.max_body_bytes = max_body_bytes

    def authorized(self, headers: dict[str, str]) -> bool:
        if not self._digests:
            return True
        auth = headers.get("authorization", "")
        key = (
            auth[7:].strip() if auth.lower().startswith("bearer ") else headers.get("x-api-key", "")
        )
        given = _digest(key)
        # Compare against every key so the time taken says nothing about which matched.
        matches = [hmac.compare_digest(given, d) for d in self._digests]
        return bool(key) and any(matches)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if scope["path"] not in OPEN_PATHS and not self.authorized(headers):
            message = "a valid API key is required (Authorization: Bearer KEY or x-api-key: KEY)"
            await _reply(
                send,
                401,
                error_body(message, "authentication_error", code="invalid_api_key"),
                {"www-authenticate": "Bearer"},
            )
            return
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await _reply(send, 413, too_large_body(self.max_body_bytes))
            return
        await self.app(scope, self._limited(receive), send)

    def _limited(self, receive: Receive) -> Receive:
        seen = 0

        async def wrapped() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise BodyTooLarge()
            return message

        return wrapped


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
