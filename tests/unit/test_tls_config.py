"""The TLS flags: how they go together, that they travel to children, that only the
process facing clients serves them (a model router's services do not; a fleet refuses
them), and that files which do not load are one clear line."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from api_server.model_router import service_config, service_env
from common.cli_args import parse_config
from common.fleet import plan_fleet
from common.tls_config import check_tls_files
from tests.tls_certs import make_certs

MTLS = [
    "--ssl-keyfile",
    "/tls/server.key",
    "--ssl-certfile",
    "/tls/server.pem",
    "--ssl-ca-certs",
    "/tls/ca.pem",
    "--ssl-cert-reqs",
    "2",
]


def test_the_flags_round_trip_and_name_the_scheme() -> None:
    config = parse_config(MTLS)
    assert config.server.tls_flags == ("/tls/server.key", "/tls/server.pem", "/tls/ca.pem", 2)
    assert config.server.scheme == "https" and parse_config([]).server.scheme == "http"
    assert parse_config(config.to_cli_args()) == config  # children get the same flags
    assert config.server.uvicorn_tls() == {
        "ssl_keyfile": "/tls/server.key",
        "ssl_certfile": "/tls/server.pem",
        "ssl_ca_certs": "/tls/ca.pem",
        "ssl_cert_reqs": 2,
    }
    assert parse_config([]).server.uvicorn_tls() == {}


def test_the_environment_gives_them_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_SSL_KEYFILE", "/k")
    monkeypatch.setenv("TANDEM_SSL_CERTFILE", "/c")
    assert parse_config([]).server.tls_flags == ("/k", "/c", None, 0)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--ssl-keyfile", "/k"], "--ssl-keyfile and --ssl-certfile go together"),
        (["--ssl-certfile", "/c"], "--ssl-keyfile and --ssl-certfile go together"),
        (["--ssl-ca-certs", "/ca"], "give --ssl-certfile and --ssl-keyfile too"),
        (["--ssl-cert-reqs", "2"], "give --ssl-certfile and --ssl-keyfile too"),
        (
            ["--ssl-keyfile", "/k", "--ssl-certfile", "/c", "--ssl-cert-reqs", "1"],
            "--ssl-cert-reqs 1 verifies client certificates: give --ssl-ca-certs",
        ),
        (["--ssl-cert-reqs", "3"], "invalid choice: 3"),
    ],
)
def test_what_the_flags_refuse(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse_config(argv)
    assert message in capsys.readouterr().err


def test_a_model_routers_services_serve_plain_http_on_loopback() -> None:
    config = parse_config(["--host", "0.0.0.0", "--model", "a", "--model", "b", *MTLS])
    child = service_config(config.for_model("b"), 9123, 1)
    assert (child.server.host, child.server.port, child.server.scheme) == (
        "127.0.0.1",
        9123,
        "http",
    )
    assert child.server.tls_flags == (None, None, None, 0)
    assert "--ssl-certfile" not in child.to_cli_args()
    assert child.server.api_keys == config.server.api_keys and child.model.model == "b"


def test_a_model_routers_services_get_no_tls_from_the_environment_either(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TANDEM_SSL_CERTFILE", "/c.pem")
    monkeypatch.setenv("TANDEM_SSL_KEYFILE", "/k.pem")
    monkeypatch.setenv("TANDEM_MAX_NUM_SEQS", "7")
    env = service_env()
    assert "TANDEM_SSL_CERTFILE" not in env and "TANDEM_SSL_KEYFILE" not in env
    assert env["TANDEM_MAX_NUM_SEQS"] == "7"  # every other setting reaches the services
    monkeypatch.setattr(os, "environ", env)
    assert parse_config(["--model", "b"]).server.scheme == "http"  # as a service parses it


def test_a_fleet_refuses_them() -> None:
    with pytest.raises(ValueError, match="tandem fleet serves no HTTPS"):
        plan_fleet(parse_config(MTLS), 2, "kv_aware", 9100, 6000)


def test_files_that_do_not_load_are_one_line(tmp_path: Path) -> None:
    certs = make_certs(tmp_path)
    check_tls_files(str(certs.server_key), str(certs.server_cert), str(certs.ca), 2)
    check_tls_files(None, None, None, 0)  # plain HTTP reads nothing
    with pytest.raises(ValueError, match=r"--ssl-certfile .* do not load"):
        check_tls_files(str(tmp_path / "missing.key"), str(certs.server_cert), None, 0)
    with pytest.raises(ValueError, match=r"--ssl-certfile .* do not load"):  # not its key
        check_tls_files(str(certs.client_key), str(certs.server_cert), None, 0)
    with pytest.raises(ValueError, match=r"--ssl-ca-certs .* does not load"):
        check_tls_files(str(certs.server_key), str(certs.server_cert), str(certs.server_key), 2)
