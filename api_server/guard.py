"""ASGI middleware in front of every route: API keys, per-caller request rate limits and
the request-body size limit.

Keys are kept only as SHA-256 digests and compared in constant time. With OIDC on
(``oidc.py``), a bearer JWT from the issuer signs a caller in too: a request passes with a
valid key or a valid token. The caller's identity (a key digest prefix, an OIDC tenant id,
or the client address when sign-in is off) is left in ``scope["state"]["caller"]`` for the
routes, which charge tokens to it; with sign-in on it is also ``scope["state"]["key_id"]``,
the owner of the requests it makes (who may cancel them), and for an OIDC caller
``scope["state"]["tenant"]``, whose prefix-cache entries are its own. Streaming responses
pass through untouched (pure ASGI, no response buffering).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api_server.errors import OPENAI_ERRORS, ApiError, ErrorFormat, error_body
from api_server.oidc import TokenRejected, TokenVerifier
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


@dataclass(frozen=True)
class Caller:
    """Who a request comes from, as the routes find it in ``scope["state"]``."""

    caller: str  # rate limits charge it
    key_id: str | None  # owns the requests (cancel); None with sign-in off
    admin: bool  # may change LoRA adapters
    tenant: str | None = None  # an OIDC tenant: its prefix-cache entries are its own


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
        verifier: TokenVerifier | None = None,
    ) -> None:
        """``admin_keys`` pass wherever ``api_keys`` do; ``scope["state"]["admin"]`` says
        whether the caller used one (always true with sign-in off). ``verifier`` turns
        OIDC sign-in on: a caller signed in with a token is never an admin, since a
        token's holder is any user of the issuer, not this server's operator."""
        self.app = app
        self.verifier = verifier
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
        try:
            who = await self.identify(scope, headers, is_open)
        except ApiError as refused:
            extra = (
                {"www-authenticate": "Bearer"}
                if refused.status == 401
                else {"retry-after": refused.retry_after}
            )
            await _reply(send, refused.status, self._body(path, refused), extra)
            return
        caller = who.caller
        state = scope.setdefault("state", {})
        state.update(caller=caller, key_id=who.key_id, admin=who.admin, tenant=who.tenant)
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

    async def identify(self, scope: Scope, headers: dict[str, str], is_open: bool) -> Caller:
        """The caller, by a valid API key or sign-in token; ApiError (401, or 503 when the
        issuer's keys cannot be fetched) for a route that is not open to anyone."""
        keys_on = bool(self._digests)
        if keys_on and self.authorized(headers):
            key_id = self.caller(scope, headers)
            return Caller(key_id, key_id, self.authorized(headers, self._admin_digests))
        token = _presented_key(headers)
        # With keys on too, a presented string that is no JWT was a mistyped key.
        if not is_open and token and (not keys_on or token.count(".") == 2):
            signed_in = await self._signed_in(token)
            if signed_in is not None:
                return signed_in
        if is_open or not (keys_on or self.verifier is not None):
            # Nobody needs to sign in here; with keys on, an open route still tells
            # callers apart by the key they present.
            caller = self.caller(scope, headers)
            admin = self.authorized(headers, self._admin_digests) and self.verifier is None
            return Caller(caller, caller if keys_on else None, admin)
        raise ApiError(
            401, self._sign_in_message(keys_on), "authentication_error", code="invalid_api_key"
        )

    async def _signed_in(self, token: str) -> Caller | None:
        """The tenant a sign-in token names; None with OIDC off."""
        if self.verifier is None:
            return None
        try:
            tenant = await self.verifier.tenant_of(token)
        except TokenRejected as e:
            if e.status != 401:
                error = ApiError(e.status, e.message, "server_error", code="sign_in_unavailable")
                raise error from None
            raise ApiError(401, e.message, "authentication_error", code="invalid_token") from None
        return Caller(tenant, tenant, admin=False, tenant=tenant)

    def _sign_in_message(self, keys_on: bool) -> str:
        if self.verifier is None:
            return "a valid API key is required (Authorization: Bearer KEY or x-api-key: KEY)"
        issuer = self.verifier.issuer
        either = "a valid API key or " if keys_on else "a valid "
        return f"{either}sign-in token from {issuer} is required (Authorization: Bearer TOKEN)"

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
