"""An OIDC issuer for the sign-in tests: signing keys made afresh by each run (RSA and
P-256, with ``cryptography``), tokens in every bad shape the server must refuse, and the
issuer's discovery document and JWKS, served either to an ``httpx.MockTransport`` (unit
tests) or over real HTTP on 127.0.0.1 from a thread (integration tests)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from jwt.algorithms import ECAlgorithm, RSAAlgorithm

AUDIENCE = "tandem-tests"
PrivateKey = rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey


@dataclass
class SigningKey:
    kid: str
    alg: str  # RS256 or ES256
    private: PrivateKey

    @staticmethod
    def make(kid: str, alg: str = "RS256") -> SigningKey:
        if alg == "RS256":
            return SigningKey(kid, alg, rsa.generate_private_key(65537, 2048))
        return SigningKey(kid, alg, ec.generate_private_key(ec.SECP256R1()))

    def jwk(self) -> dict[str, Any]:
        public = self.private.public_key()
        if isinstance(public, rsa.RSAPublicKey):
            data = RSAAlgorithm.to_jwk(public, as_dict=True)
        else:
            data = ECAlgorithm.to_jwk(public, as_dict=True)
        return {**data, "kid": self.kid, "use": "sig", "alg": self.alg}

    def public_pem(self) -> bytes:
        return self.private.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unsigned(header: dict[str, Any], claims: dict[str, Any]) -> str:
    return _b64(json.dumps(header).encode()) + "." + _b64(json.dumps(claims).encode())


@dataclass
class Issuer:
    """The issuer at ``url``: ``keys`` are published in its JWKS (change them to rotate);
    ``num_fetches`` counts JWKS fetches; ``down`` makes every answer a 503."""

    url: str = "http://issuer.test"
    keys: list[SigningKey] = field(default_factory=list)
    num_fetches: int = 0
    last_fetch: float = 0.0  # time.monotonic() of the last JWKS fetch
    down: bool = False

    def claims(self, **changes: Any) -> dict[str, Any]:
        """Claims of a good token for ``alice``; a change of None leaves a claim out."""
        now = int(time.time())
        claims = {"iss": self.url, "aud": AUDIENCE, "sub": "alice", "iat": now, "exp": now + 600}
        claims.update(changes)
        return {k: v for k, v in claims.items() if v is not None}

    def token(self, key: SigningKey | None = None, **changes: Any) -> str:
        key = key or self.keys[0]
        return jwt.encode(self.claims(**changes), key.private, key.alg, {"kid": key.kid})

    def bad_tokens(self) -> dict[str, str]:
        """Every kind of token a server must refuse, by what is wrong with it."""
        key = self.keys[0]
        stranger = SigningKey.make(key.kid)  # the kid of a published key, not its secret
        ghost = SigningKey.make("ghost")  # a kid the issuer never published
        hs_header = {"alg": "HS256", "typ": "JWT", "kid": key.kid}
        hs_body = _unsigned(hs_header, self.claims())
        # The classic confusion attack: the RSA public key used as an HMAC secret.
        hs_sig = hmac.new(key.public_pem(), hs_body.encode(), hashlib.sha256).digest()
        now = int(time.time())
        return {
            "expired": self.token(exp=now - 3600, iat=now - 7200),
            "not yet valid": self.token(nbf=now + 3600),
            "wrong audience": self.token(aud="someone-else"),
            "wrong issuer": self.token(iss="http://evil.test"),
            "no exp": self.token(exp=None),
            "alg none": _unsigned({"alg": "none", "kid": key.kid}, self.claims()) + ".",
            "hs256 with the public key": hs_body + "." + _b64(hs_sig),
            "forged signature": self.token(stranger),
            "unknown kid": self.token(ghost),
            "garbage": "not-a-jwt",
            "garbage in three parts": "aaa.bbb.ccc",
            "no tenant claim": self.token(sub=None),
        }

    def discovery(self) -> dict[str, Any]:
        return {"issuer": self.url, "jwks_uri": f"{self.url}/jwks.json"}

    def jwks(self) -> dict[str, Any]:
        self.num_fetches += 1
        self.last_fetch = time.monotonic()
        return {"keys": [k.jwk() for k in self.keys]}

    def answer(self, path: str) -> tuple[int, dict[str, Any]]:
        if self.down:
            return 503, {"error": "down"}
        if path == "/.well-known/openid-configuration":
            return 200, self.discovery()
        if path == "/jwks.json":
            return 200, self.jwks()
        return 404, {"error": "not found"}

    def transport(self) -> httpx.MockTransport:
        """The issuer as an httpx transport: no sockets."""

        def handle(request: httpx.Request) -> httpx.Response:
            status, body = self.answer(request.url.path)
            return httpx.Response(status, json=body)

        return httpx.MockTransport(handle)


@contextmanager
def serving(issuer: Issuer) -> Iterator[Issuer]:
    """``issuer`` over real HTTP on a free 127.0.0.1 port (its ``url`` set to it)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            status, body = issuer.answer(self.path)
            payload = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # the test's output stays readable

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    issuer.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield issuer
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
