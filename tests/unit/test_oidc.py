"""The sign-in token verifier (api_server/oidc.py) against an in-memory issuer, and the
Guard that uses it: bad tokens refused, good ones naming their tenant, key rotation, the
refresh rate limit, an issuer that is down, and API keys beside tokens."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

import httpx
import pytest
from starlette.types import Receive, Scope, Send

from api_server import oidc
from api_server.errors import ANTHROPIC_ERRORS
from api_server.guard import Guard
from api_server.oidc import TokenRejected, TokenVerifier, tenant_cache_salt, tenant_id
from common.cli_args import parse_config
from tests.oidc_issuer import AUDIENCE, Issuer, SigningKey

T = TypeVar("T")
RSA_KEY = SigningKey.make("rsa-1", "RS256")
EC_KEY = SigningKey.make("ec-1", "ES256")


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def verifier(issuer: Issuer, clock: Clock | None = None, **kw: Any) -> TokenVerifier:
    return TokenVerifier(
        issuer.url, AUDIENCE, transport=issuer.transport(), clock=clock or Clock(), **kw
    )


def test_good_rs256_and_es256_tokens_name_their_tenant() -> None:
    issuer = Issuer(keys=[RSA_KEY, EC_KEY])
    v = verifier(issuer)

    async def check() -> None:
        assert await v.tenant_of(issuer.token(RSA_KEY)) == tenant_id("alice")
        assert await v.tenant_of(issuer.token(EC_KEY, sub="bob")) == tenant_id("bob")

    run(check())
    assert issuer.num_fetches == 1  # keys are kept


def test_another_claim_may_name_the_tenant() -> None:
    issuer = Issuer(keys=[RSA_KEY])
    v = verifier(issuer, tenant_claim="org")
    assert run(v.tenant_of(issuer.token(org="acme"))) == tenant_id("acme")
    with pytest.raises(TokenRejected, match="'org' claim"):
        run(v.tenant_of(issuer.token()))


def test_a_small_clock_skew_is_allowed() -> None:
    issuer = Issuer(keys=[RSA_KEY])
    v = verifier(issuer)
    now = int(time.time())
    assert run(v.tenant_of(issuer.token(exp=now - 20, nbf=now + 20)))


# Each kind of bad token, and what its refusal says.
REFUSALS = {
    "expired": "has expired",
    "not yet valid": "not valid yet",
    "wrong audience": "not for audience",
    "wrong issuer": "not from issuer",
    "no exp": "lacks the 'exp' claim",
    "alg none": "'none' are not accepted",
    "hs256 with the public key": "'HS256' are not accepted",
    "forged signature": "signature does not verify",
    "unknown kid": "'ghost' is not among",
    "garbage": "not a valid JWT",
    "garbage in three parts": "not a valid JWT",
    "no tenant claim": "no 'sub' claim",
}


def test_every_bad_token_kind_is_checked() -> None:
    assert set(REFUSALS) == set(Issuer(keys=[RSA_KEY]).bad_tokens())


@pytest.mark.parametrize("kind", REFUSALS)
def test_bad_tokens_are_refused(kind: str) -> None:
    issuer = Issuer(keys=[RSA_KEY, EC_KEY])
    token = issuer.bad_tokens()[kind]
    with pytest.raises(TokenRejected, match=REFUSALS[kind]) as refused:
        run(verifier(issuer).tenant_of(token))
    assert refused.value.status == 401


def test_an_es256_header_on_an_rsa_key_is_refused() -> None:
    issuer = Issuer(keys=[RSA_KEY, EC_KEY])
    token = issuer.token(EC_KEY).split(".")
    header = {"alg": "ES256", "kid": RSA_KEY.kid}
    token[0] = base64.urlsafe_b64encode(json.dumps(header).encode()).rstrip(b"=").decode()
    with pytest.raises(TokenRejected, match="RS256 key"):
        run(verifier(issuer).tenant_of(".".join(token)))


def test_none_and_hmac_tokens_fetch_nothing() -> None:
    issuer = Issuer(keys=[RSA_KEY])
    v = verifier(issuer)
    bad = issuer.bad_tokens()
    for kind in ("alg none", "hs256 with the public key", "garbage"):
        with pytest.raises(TokenRejected):
            run(v.tenant_of(bad[kind]))
    assert issuer.num_fetches == 0


def test_a_rotated_key_is_picked_up_once_the_refresh_interval_is_up() -> None:
    issuer = Issuer(keys=[RSA_KEY])
    clock = Clock()
    v = verifier(issuer, clock, refresh_interval_s=10)
    new_key = SigningKey.make("rsa-2")

    async def check() -> None:
        assert await v.tenant_of(issuer.token(RSA_KEY))
        issuer.keys = [RSA_KEY, new_key]  # the issuer rotates in a new key
        clock.now += 1
        with pytest.raises(TokenRejected, match="not among"):  # too soon to fetch again
            await v.tenant_of(issuer.token(new_key))
        assert issuer.num_fetches == 1
        clock.now += 10
        assert await v.tenant_of(issuer.token(new_key)) == tenant_id("alice")
        assert await v.tenant_of(issuer.token(RSA_KEY)) == tenant_id("alice")
        assert issuer.num_fetches == 2

    run(check())


def test_made_up_key_ids_cannot_hammer_the_issuer() -> None:
    issuer = Issuer(keys=[RSA_KEY])
    clock = Clock()
    v = verifier(issuer, clock, refresh_interval_s=10)

    async def check() -> None:
        await v.tenant_of(issuer.token())
        for i in range(50):
            clock.now += 0.1
            with pytest.raises(TokenRejected, match="not among"):
                await v.tenant_of(issuer.token(SigningKey(f"junk-{i}", "RS256", RSA_KEY.private)))
        assert issuer.num_fetches == 1
        clock.now += 10  # once the interval is up, many at once still fetch once
        junk = SigningKey("junk", "RS256", RSA_KEY.private)
        results = await asyncio.gather(
            *(v.tenant_of(issuer.token(junk)) for _ in range(20)), return_exceptions=True
        )
        assert all(isinstance(r, TokenRejected) for r in results)
        assert issuer.num_fetches == 2

    run(check())


def test_kept_keys_are_fetched_again_when_old() -> None:
    issuer = Issuer(keys=[RSA_KEY, EC_KEY])
    clock = Clock()
    v = verifier(issuer, clock, max_age_s=100)

    async def check() -> None:
        assert await v.tenant_of(issuer.token(EC_KEY))
        issuer.keys = [RSA_KEY]  # the issuer withdraws its EC key
        clock.now += 101
        with pytest.raises(TokenRejected, match="not among"):
            await v.tenant_of(issuer.token(EC_KEY))

    run(check())


def test_an_issuer_that_is_down_is_a_503_and_keys_kept_still_work() -> None:
    issuer = Issuer(keys=[RSA_KEY], down=True)
    clock = Clock()
    v = verifier(issuer, clock, max_age_s=100, refresh_interval_s=10)

    async def check() -> None:
        with pytest.raises(TokenRejected, match="could not be fetched") as refused:
            await v.tenant_of(issuer.token())
        assert refused.value.status == 503
        issuer.down = False
        clock.now += 10
        assert await v.tenant_of(issuer.token())
        issuer.down = True
        clock.now += 200  # old keys, and the issuer down: the kept keys still serve
        assert await v.tenant_of(issuer.token())

    run(check())


def test_a_hanging_issuer_times_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(oidc, "FETCH_TIMEOUT_S", 0.2)

    async def hang(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(30)
        return httpx.Response(200)

    issuer = Issuer(keys=[RSA_KEY])
    v = TokenVerifier(issuer.url, AUDIENCE, transport=httpx.MockTransport(hang))
    with pytest.raises(TokenRejected) as refused:
        run(asyncio.wait_for(v.tenant_of(issuer.token()), 5))
    assert refused.value.status == 503


def test_a_discovery_document_of_another_issuer_is_refused() -> None:
    issuer = Issuer(keys=[RSA_KEY])
    v = TokenVerifier("http://other.test", AUDIENCE, transport=issuer.transport())
    with pytest.raises(TokenRejected, match="names issuer") as refused:
        run(v.tenant_of(issuer.token(iss="http://other.test")))
    assert refused.value.status == 503


def test_jwks_url_skips_discovery() -> None:
    issuer = Issuer(keys=[RSA_KEY])
    v = verifier(issuer, jwks_url=f"{issuer.url}/jwks.json")
    issuer.url = "http://issuer.test"
    assert run(v.tenant_of(issuer.token()))


def test_tenant_salts_cannot_be_posed_as() -> None:
    a, b = tenant_id("a"), tenant_id("b")
    salts = {
        tenant_cache_salt(a, None),
        tenant_cache_salt(b, None),
        tenant_cache_salt(a, "x"),
        tenant_cache_salt(None, "x"),
        tenant_cache_salt(None, tenant_cache_salt(a, None)),  # a caller posing as tenant a
    }
    assert len(salts) == 5
    assert tenant_cache_salt(None, None) is None and tenant_cache_salt(None, "x") == "x"


# The Guard with sign-in on.


async def echo_state(scope: Scope, receive: Receive, send: Send) -> None:
    state = {k: scope["state"][k] for k in ("caller", "key_id", "admin", "tenant")}
    body = json.dumps(state).encode()
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": body})


def ask(guard: Guard, path: str, auth: str | None) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=guard)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            headers = {"authorization": f"Bearer {auth}"} if auth else {}
            return await client.post(path, headers=headers, json={})

    return run(go())


def test_the_guard_signs_tenants_in_and_refuses_bad_tokens() -> None:
    issuer = Issuer(keys=[RSA_KEY])
    guard = Guard(
        echo_state,
        (),
        1 << 20,
        verifier=verifier(issuer),
        error_formats={"/v1/messages": ANTHROPIC_ERRORS},
    )
    ok = ask(guard, "/v1/completions", issuer.token())
    tenant = tenant_id("alice")
    assert ok.json() == {"caller": tenant, "key_id": tenant, "admin": False, "tenant": tenant}
    for path in ("/v1/completions", "/v1/messages"):
        for auth in (None, issuer.bad_tokens()["expired"]):
            r = ask(guard, path, auth)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
            body = r.json()
            assert body["error"]["type"] == "authentication_error"
            if path == "/v1/messages":  # Anthropic's dialect
                assert body["type"] == "error" and "code" not in body["error"]
            else:
                assert body["error"]["code"] in ("invalid_api_key", "invalid_token")
    assert ask(guard, "/health", None).json()["admin"] is False  # open, not an admin


def test_keys_and_tokens_both_sign_in() -> None:
    issuer = Issuer(keys=[RSA_KEY])
    guard = Guard(
        echo_state,
        ("user-key",),
        1 << 20,
        admin_keys=("admin-key",),
        verifier=verifier(issuer),
    )
    assert ask(guard, "/v1/completions", "admin-key").json()["admin"] is True
    user = ask(guard, "/v1/completions", "user-key").json()
    assert user["admin"] is False and user["key_id"].startswith("key:") and user["tenant"] is None
    assert ask(guard, "/v1/completions", issuer.token()).json()["tenant"] == tenant_id("alice")
    wrong = ask(guard, "/v1/completions", "wrong-key")
    assert wrong.status_code == 401 and "API key or sign-in token" in wrong.text
    assert ask(guard, "/v1/completions", issuer.bad_tokens()["wrong issuer"]).status_code == 401


def test_the_guard_answers_503_while_the_issuer_is_down() -> None:
    issuer = Issuer(keys=[RSA_KEY], down=True)
    guard = Guard(echo_state, (), 1 << 20, verifier=verifier(issuer))
    r = ask(guard, "/v1/completions", issuer.token())
    assert r.status_code == 503 and r.json()["error"]["code"] == "sign_in_unavailable"
    assert "retry-after" in r.headers


@pytest.mark.parametrize(
    ("flags", "refused"),
    [
        (("--oidc-issuer", "https://id.example.com", "--oidc-audience", "a"), None),
        (("--oidc-issuer", "http://127.0.0.1:9000", "--oidc-audience", "a"), None),
        (("--oidc-issuer", "http://id.example.com", "--oidc-audience", "a"), "plain HTTP"),
        (
            (
                *("--oidc-issuer", "https://id.example.com", "--oidc-audience", "a"),
                *("--oidc-jwks-url", "http://keys.example.com/jwks"),
            ),
            "plain HTTP",
        ),
        (("--oidc-issuer", "https://id.example.com"), "go together"),
        (("--oidc-jwks-url", "https://keys.example.com/jwks"), "give --oidc-issuer"),
    ],
)
def test_what_the_flags_refuse(
    flags: tuple[str, ...], refused: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    """Keys over plain HTTP off loopback could be anyone's: refused where the config is built."""
    if refused is None:
        assert parse_config(list(flags)).server.oidc_issuer == flags[1]
        return
    with pytest.raises(SystemExit):
        parse_config(list(flags))
    assert refused in capsys.readouterr().err
