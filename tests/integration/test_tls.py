"""HTTPS with mutual TLS (``--ssl-keyfile``, ``--ssl-certfile``, ``--ssl-ca-certs``,
``--ssl-cert-reqs 2``), checked with curl, as a user's client meets it: one server, with
certificates made for this run."""

from __future__ import annotations

import json
import ssl
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.stack import READY_TIMEOUT_S, TandemStack
from tests.tls_certs import Certs, make_certs

CURL = "/usr/bin/curl"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("tls"))


def _client_context(certs: Certs) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(certs.ca))
    context.load_cert_chain(str(certs.client_cert), str(certs.client_key))
    return context


@pytest.fixture(scope="module")
def mtls_server(certs: Certs, smollm2_dir: Path) -> Iterator[TandemStack]:
    stack = TandemStack(
        "--dtype",
        "float32",
        "--ssl-keyfile",
        str(certs.server_key),
        "--ssl-certfile",
        str(certs.server_cert),
        "--ssl-ca-certs",
        str(certs.ca),
        "--ssl-cert-reqs",
        "2",
    )
    stack.start(wait=False)
    try:
        _wait_healthy_over_https(stack, _client_context(certs))
        yield stack
    finally:
        stack.stop()


def _wait_healthy_over_https(stack: TandemStack, context: ssl.SSLContext) -> None:
    """TandemStack's own wait asks over plain HTTP, which this server refuses."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        assert stack.proc is not None and stack.proc.poll() is None, stack.log()
        try:
            health = httpx.get(f"https://127.0.0.1:{stack.port}/health", verify=context)
            if health.status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"not healthy over HTTPS:\n{stack.log()}"
        time.sleep(0.2)


def curl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [CURL, "--silent", "--show-error", "--max-time", "60", *args],
        capture_output=True,
        text=True,
        timeout=90,
    )


def completion_args(server: TandemStack) -> list[str]:
    body = {
        "model": "smollm2-135m-instruct",
        "prompt": "The capital of France is",
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
    }
    return [
        f"https://127.0.0.1:{server.port}/v1/completions",
        "-H",
        "Content-Type: application/json",
        "-d",
        json.dumps(body),
    ]


def test_curl_with_the_ca_and_a_client_certificate_completes(
    mtls_server: TandemStack, certs: Certs
) -> None:
    out = curl(
        "--cacert",
        str(certs.ca),
        "--cert",
        str(certs.client_cert),
        "--key",
        str(certs.client_key),
        "--write-out",
        "\n%{http_code} %{scheme}",
        *completion_args(mtls_server),
    )
    assert out.returncode == 0, out.stderr
    body, status = out.stdout.rsplit("\n", 1)
    assert status == "200 HTTPS"
    answer = json.loads(body)
    assert answer["usage"]["completion_tokens"] == 4 and answer["choices"][0]["text"]


def test_without_a_client_certificate_the_handshake_fails(
    mtls_server: TandemStack, certs: Certs
) -> None:
    # TLS 1.2: the server refuses the client's empty certificate within the handshake.
    out = curl("--tls-max", "1.2", "--cacert", str(certs.ca), *completion_args(mtls_server))
    assert out.returncode == 35, (out.returncode, out.stderr)  # SSL connect error
    assert out.stdout == ""
    # TLS 1.3 (curl's default): the client's part of the handshake ends before the server
    # reads its (empty) certificate, so curl sends its request into a connection the server
    # then closes without an HTTP answer.
    out = curl(
        "--cacert", str(certs.ca), "--write-out", "%{http_code}", *completion_args(mtls_server)
    )
    assert out.returncode in (52, 56) and out.stdout == "000", (out.returncode, out.stderr)


def test_the_server_certificate_is_checked_against_the_ca(
    mtls_server: TandemStack, certs: Certs
) -> None:
    client = ["--cert", str(certs.client_cert), "--key", str(certs.client_key)]
    out = curl("--cacert", str(certs.other_ca), *client, *completion_args(mtls_server))
    assert out.returncode == 60, (out.returncode, out.stderr)  # peer certificate not trusted


def test_plain_http_is_refused(mtls_server: TandemStack) -> None:
    out = curl("--write-out", "%{http_code}", f"http://127.0.0.1:{mtls_server.port}/health")
    assert out.returncode != 0 and out.stdout in ("", "000"), (out.returncode, out.stdout)
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{mtls_server.port}/health", timeout=10)
