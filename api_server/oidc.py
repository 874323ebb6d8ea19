"""The sign-in token verifier (``--oidc-issuer``, ``--oidc-audience``): a bearer JWT is
accepted when one of the issuer's published keys signed it (RS256 or ES256 only), it is
from that issuer, for that audience, and in date; its tenant claim names the caller.

The keys (a JWKS) are fetched on the first token, from ``--oidc-jwks-url`` or the
``jwks_uri`` of the issuer's ``/.well-known/openid-configuration``, and kept. A token
signed with a key id (``kid``) not among them fetches them again (the issuer rotated its
keys), but at most once per ``refresh_interval_s``: tokens with made-up key ids cannot
make this server hammer the issuer. Kept keys are fetched again after ``max_age_s`` so a
key the issuer withdrew stops working. Fetches are async with a deadline: an issuer that
is down turns into a 503 that says so, never a request that hangs.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable
from typing import Any

import httpx
import jwt

from common.config import ServerConfig

logger = logging.getLogger(__name__)

ALGORITHMS = ("RS256", "ES256")
# Clocks of this server and the issuer may differ by this much (exp, nbf, iat).
LEEWAY_S = 60.0
FETCH_TIMEOUT_S = 5.0
REFRESH_INTERVAL_S = 10.0
MAX_AGE_S = 3600.0
DISCOVERY_PATH = "/.well-known/openid-configuration"


class TokenRejected(Exception):
    """A token that does not sign anyone in (401), or keys that could not be fetched to
    check it (503); the message says which and why."""

    def __init__(self, message: str, status: int = 401) -> None:
        super().__init__(message)
        self.message, self.status = message, status


def tenant_id(value: str) -> str:
    """The caller id of a tenant: a digest, so a claim such as an email address shows
    nowhere (logs, rate-limit keys, the engine) and its length is bounded."""
    return "oidc:" + hashlib.sha256(value.encode()).hexdigest()[:32]


def tenant_cache_salt(tenant: str | None, salt: str | None) -> str | None:
    """The prefix-cache salt of a request: a tenant's requests hash their blocks under
    the tenant (plus any ``cache_salt`` of their own), so no other caller can find them.
    The mapping is one-to-one: a salt sent without a tenant that starts like a tenant's
    is escaped, so nobody can pose as a tenant by sending its salt."""
    if tenant is None:
        return "\x00" + salt if salt is not None and salt.startswith("\x00") else salt
    return f"\x00tenant\x00{tenant}\x00{salt or ''}"


class TokenVerifier:
    """Checks bearer JWTs against one issuer's published keys; ``tenant_of`` gives the
    signed-in caller's id. The kept keys are this object's alone: one per process."""

    def __init__(
        self,
        issuer: str,
        audience: str,
        jwks_url: str | None = None,
        tenant_claim: str = "sub",
        refresh_interval_s: float = REFRESH_INTERVAL_S,
        max_age_s: float = MAX_AGE_S,
        transport: httpx.AsyncBaseTransport | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``transport`` and ``clock`` replace the network and the time (tests)."""
        self.issuer, self.audience, self.tenant_claim = issuer, audience, tenant_claim
        self.refresh_interval_s, self.max_age_s = refresh_interval_s, max_age_s
        self._jwks_url = jwks_url
        self._transport, self._clock = transport, clock
        self._keys: dict[str | None, jwt.PyJWK] = {}
        self._fetched_at = -float("inf")  # monotonic time of the last fetch, failed or not
        self._loaded_at = -float("inf")  # ... of the last one that brought keys
        self._fetch_error: str | None = None
        self._lock = asyncio.Lock()
        self.num_fetches = 0

    async def tenant_of(self, token: str) -> str:
        """The tenant id (``tenant_id``) of a valid token; ``TokenRejected`` otherwise."""
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError:
            raise TokenRejected("the bearer token is not a valid JWT") from None
        alg = header.get("alg")
        if alg not in ALGORITHMS:
            # Before any key lookup: `none` and HMAC tokens never cause a fetch.
            raise TokenRejected(
                f"tokens signed with {alg!r} are not accepted (only {', '.join(ALGORITHMS)})"
            )
        key = await self._key(header.get("kid"))
        if key.algorithm_name != alg:
            raise TokenRejected(f"the token says {alg} but its key is a {key.algorithm_name} key")
        claims = self._decode(token, key)
        value = claims.get(self.tenant_claim)
        if not isinstance(value, str | int) or isinstance(value, bool) or value == "":
            raise TokenRejected(
                f"the token has no {self.tenant_claim!r} claim naming the caller "
                "(--oidc-tenant-claim)"
            )
        return tenant_id(str(value))

    def _decode(self, token: str, key: jwt.PyJWK) -> dict[str, Any]:
        try:
            claims: dict[str, Any] = jwt.decode(
                token,
                key.key,
                algorithms=[key.algorithm_name],
                audience=self.audience,
                issuer=self.issuer,
                leeway=LEEWAY_S,
                options={"require": ["exp", "iss", "aud"]},
            )
        except jwt.ExpiredSignatureError:
            raise TokenRejected("the token has expired") from None
        except jwt.ImmatureSignatureError:
            raise TokenRejected("the token is not valid yet (nbf, iat)") from None
        except jwt.InvalidAudienceError:
            raise TokenRejected(f"the token is not for audience {self.audience!r}") from None
        except jwt.InvalidIssuerError:
            raise TokenRejected(f"the token is not from issuer {self.issuer!r}") from None
        except jwt.MissingRequiredClaimError as e:
            raise TokenRejected(f"the token lacks the {e.claim!r} claim") from None
        except jwt.InvalidSignatureError:
            raise TokenRejected("the token's signature does not verify") from None
        except jwt.PyJWTError as e:
            raise TokenRejected(f"the token is not valid: {e}") from None
        return claims

    async def _key(self, kid: Any) -> jwt.PyJWK:
        """The key of ``kid``, fetching the issuer's keys when they are unknown or old."""
        now = self._clock()
        stale = now - self._loaded_at > self.max_age_s
        if (stale or self._find(kid) is None) and self._may_fetch(now):
            async with self._lock:
                # Another request may have fetched them while this one waited.
                if self._may_fetch(self._clock()):
                    await self._fetch()
        key = self._find(kid)
        if key is not None:
            return key
        if not self._keys:
            raise TokenRejected(
                f"the signing keys of {self.issuer} could not be fetched ({self._fetch_error}); "
                "try again shortly",
                status=503,
            )
        if kid is None:
            raise TokenRejected("the token names no key id (kid) and the issuer has several keys")
        raise TokenRejected(f"the token's key id {str(kid)[:64]!r} is not among the issuer's keys")

    def _find(self, kid: Any) -> jwt.PyJWK | None:
        if kid is None and len(self._keys) == 1:  # one key: a token need not name it
            return next(iter(self._keys.values()))
        return self._keys.get(kid) if isinstance(kid, str) else None

    def _may_fetch(self, now: float) -> bool:
        return now - self._fetched_at >= self.refresh_interval_s

    async def _fetch(self) -> None:
        """Fetch the issuer's keys; on failure the kept keys stay and the error is kept
        for the message."""
        self._fetched_at = self._clock()
        self.num_fetches += 1
        try:
            async with httpx.AsyncClient(
                timeout=FETCH_TIMEOUT_S, transport=self._transport
            ) as http:
                keys = await asyncio.wait_for(self._fetch_keys(http), FETCH_TIMEOUT_S)
        except (httpx.HTTPError, TimeoutError, ValueError) as e:
            self._fetch_error = str(e) or type(e).__name__
            logger.warning("cannot fetch the signing keys of %s: %s", self.issuer, e)
            return
        self._keys, self._loaded_at, self._fetch_error = keys, self._clock(), None
        logger.info("signing keys of %s: %s", self.issuer, ", ".join(map(str, keys)))

    async def _fetch_keys(self, http: httpx.AsyncClient) -> dict[str | None, jwt.PyJWK]:
        if self._jwks_url is None:
            discovery = await _get_json(http, self.issuer.rstrip("/") + DISCOVERY_PATH)
            issuer, url = discovery.get("issuer"), discovery.get("jwks_uri")
            if not isinstance(issuer, str) or issuer.rstrip("/") != self.issuer.rstrip("/"):
                raise ValueError(f"the discovery document names issuer {issuer!r}")
            if not isinstance(url, str):
                raise ValueError("the discovery document has no jwks_uri")
            self._jwks_url = url  # kept: where the keys are does not change with them
        jwks = await _get_json(http, self._jwks_url)
        keys = _signing_keys(jwks.get("keys"))
        if not keys:
            raise ValueError(f"{self._jwks_url} has no {' or '.join(ALGORITHMS)} signing keys")
        return keys


async def _get_json(http: httpx.AsyncClient, url: str) -> dict[str, Any]:
    reply = await http.get(url)
    reply.raise_for_status()
    body = reply.json()
    if not isinstance(body, dict):
        raise ValueError(f"{url} did not answer with a JSON object")
    return body


def _signing_keys(entries: Any) -> dict[str | None, jwt.PyJWK]:
    """The RS256 and ES256 signature keys of a JWKS ``keys`` list, by kid; others (HMAC
    secrets, encryption keys, other curves) are left out, never trusted."""
    keys: dict[str | None, jwt.PyJWK] = {}
    for entry in entries if isinstance(entries, list) else []:
        if not isinstance(entry, dict) or entry.get("use", "sig") != "sig":
            continue
        try:
            key = jwt.PyJWK(entry)
        except jwt.PyJWTError:
            continue
        if key.algorithm_name in ALGORITHMS:
            keys[key.key_id] = key
    return keys


def verifier_from(server: ServerConfig) -> TokenVerifier | None:
    """The verifier of ``--oidc-issuer``/``--oidc-audience``; None with OIDC off."""
    if not (server.oidc_issuer and server.oidc_audience):
        return None
    return TokenVerifier(
        server.oidc_issuer, server.oidc_audience, server.oidc_jwks_url, server.oidc_tenant_claim
    )
