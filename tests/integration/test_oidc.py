"""OIDC sign-in against the real stack: one server with ``--oidc-issuer`` and an API key,
and an issuer (discovery document and JWKS) served over HTTP by this test. Bad tokens are
401s in each route's dialect and never reach the engine, good ones get completions,
tenants' prefix-cache entries and requests are their own, and a key the issuer rotates
in is picked up while the server runs."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from api_server.oidc import REFRESH_INTERVAL_S, tenant_cache_salt, tenant_id
from tests.integration.test_tenants import request_id_of, start_stream
from tests.oidc_issuer import AUDIENCE, Issuer, SigningKey, serving
from tests.stack import TandemStack

MODEL = "smollm2-135m-instruct"
API_KEY = "sk-oidc-test-0123456789"
# Several full 16-token blocks, cheap to prefill.
PROMPT = " ".join(f"Fact {i}: the number {i} squared is {i * i}." for i in range(16))
RSA_KEY = SigningKey.make("rsa-1", "RS256")
EC_KEY = SigningKey.make("ec-1", "ES256")


@pytest.fixture(scope="module")
def issuer() -> Iterator[Issuer]:
    with serving(Issuer(keys=[RSA_KEY, EC_KEY])) as issuer:
        yield issuer


@pytest.fixture(scope="module")
def stack(issuer: Issuer, smollm2_dir: Path) -> Iterator[TandemStack]:
    flags = ("--dtype", "float32", "--num-kv-blocks", "256")
    oidc = ("--oidc-issuer", issuer.url, "--oidc-audience", AUDIENCE)
    with TandemStack(*flags, *oidc, env={"TANDEM_API_KEYS": API_KEY}) as stack:
        yield stack


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def complete(url: str, token: str, **fields: object) -> httpx.Response:
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 3, **fields}
    return httpx.post(f"{url}/v1/completions", json=body, headers=bearer(token), timeout=60)


def num_requests(url: str) -> int:
    stats = httpx.get(f"{url}/stats", headers=bearer(API_KEY)).json()
    return int(stats["total_requests"])


def test_bad_tokens_are_401s_in_each_dialect(stack: TandemStack, issuer: Issuer) -> None:
    before = num_requests(stack.url)
    messages = {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}]}
    for kind, token in [*issuer.bad_tokens().items(), ("none", "")]:
        headers = bearer(token) if token else {}
        r = httpx.post(
            f"{stack.url}/v1/completions", json={"model": MODEL, "prompt": "x"}, headers=headers
        )
        assert r.status_code == 401, (kind, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, kind
        assert error["type"] == "authentication_error", kind
        r = httpx.post(f"{stack.url}/v1/messages", json=messages, headers=headers)
        assert r.status_code == 401, (kind, r.text)
        assert r.json()["type"] == "error", kind
        assert r.json()["error"]["type"] == "authentication_error", kind
    assert num_requests(stack.url) == before  # none reached the engine


def test_good_tokens_get_completions(stack: TandemStack, issuer: Issuer) -> None:
    for key in (RSA_KEY, EC_KEY):
        r = complete(stack.url, issuer.token(key), temperature=0)
        assert r.status_code == 200, r.text
        assert "Paris" in r.json()["choices"][0]["text"]
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=issuer.token(), max_retries=0)
    assert client.models.list().data[0].id == MODEL


def test_an_api_key_signs_in_beside_tokens(stack: TandemStack) -> None:
    assert complete(stack.url, API_KEY).status_code == 200
    wrong = complete(stack.url, API_KEY + "x")
    assert wrong.status_code == 401 and "API key or sign-in token" in wrong.text
    assert API_KEY[3:] not in wrong.text


def cached_tokens(url: str, token: str, salt: str | None = None) -> int:
    r = complete(url, token, prompt=PROMPT, max_tokens=1, temperature=0, cache_salt=salt)
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_tenants_do_not_share_cached_prefixes(stack: TandemStack, issuer: Issuer) -> None:
    alice, bob = issuer.token(sub="alice"), issuer.token(EC_KEY, sub="bob")
    httpx.post(f"{stack.url}/reset_prefix_cache", headers=bearer(API_KEY))
    assert cached_tokens(stack.url, alice) == 0
    assert cached_tokens(stack.url, bob) == 0  # bob sees none of alice's
    assert cached_tokens(stack.url, API_KEY) == 0  # nor does an API key's caller
    # ... not even one sending alice's salt as its own
    assert cached_tokens(stack.url, API_KEY, tenant_cache_salt(tenant_id("alice"), None)) == 0
    assert cached_tokens(stack.url, alice) >= 128  # each tenant hits its own
    assert cached_tokens(stack.url, issuer.token(EC_KEY, sub="bob")) >= 128


def test_only_the_tenant_that_made_a_request_may_cancel_it(
    stack: TandemStack, issuer: Issuer
) -> None:
    alice, bob = issuer.token(sub="alice"), issuer.token(sub="bob")
    events: list[str] = []
    reader = threading.Thread(target=start_stream, args=(stack.url, alice, events))
    reader.start()
    request_id = request_id_of(events)
    cancel = f"{stack.url}/v1/requests/{request_id}/cancel"
    assert httpx.post(cancel, headers=bearer(bob)).status_code == 404
    assert httpx.post(cancel, headers=bearer(API_KEY)).status_code == 404
    mine = httpx.post(cancel, headers=bearer(alice))
    assert mine.status_code == 200 and mine.json()["cancelled"] is True
    reader.join(timeout=10)
    assert not reader.is_alive(), "the cancelled stream did not end"


def test_a_rotated_key_is_picked_up_while_serving(stack: TandemStack, issuer: Issuer) -> None:
    new_key = SigningKey.make("rsa-2", "RS256")
    issuer.keys = [*issuer.keys, new_key]
    # The server fetches the keys again for an unknown kid, at most once per interval.
    time.sleep(max(0.0, issuer.last_fetch + REFRESH_INTERVAL_S + 0.5 - time.monotonic()))
    r = complete(stack.url, issuer.token(new_key))
    assert r.status_code == 200, r.text
    issuer.keys = [new_key]  # the old keys withdrawn: the server's copy keeps them a while
    assert complete(stack.url, issuer.token(new_key)).status_code == 200
