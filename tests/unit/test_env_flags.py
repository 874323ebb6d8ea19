"""TANDEM_<FLAG> environment variables as defaults for every flag."""

from __future__ import annotations

import argparse

import pytest

from common.cli_args import parse_config
from common.env_flags import apply_env_defaults, env_name


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--pool", choices=["unified", "prefill"], default="unified")
    p.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--debug", action="store_true")
    p.add_argument("--api-key", action="append")
    return p


def test_env_name() -> None:
    assert env_name("--max-num-seqs") == "TANDEM_MAX_NUM_SEQS"


def test_env_sets_defaults_and_the_command_line_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_MAX_NUM_SEQS", "32")
    monkeypatch.setenv("TANDEM_POOL", "prefill")
    monkeypatch.setenv("TANDEM_PREFIX_CACHING", "off")
    monkeypatch.setenv("TANDEM_DEBUG", "0")
    monkeypatch.setenv("TANDEM_API_KEY", "a, b")
    p = parser()
    apply_env_defaults(p)
    args = p.parse_args([])
    assert (args.max_num_seqs, args.pool, args.prefix_caching) == (32, "prefill", False)
    assert args.debug is False and args.api_key == ["a", "b"]
    assert p.parse_args(["--max-num-seqs", "4", "--prefix-caching"]).max_num_seqs == 4
    assert p.parse_args(["--prefix-caching"]).prefix_caching is True


@pytest.mark.parametrize(
    ("name", "value"),
    [("TANDEM_MAX_NUM_SEQS", "many"), ("TANDEM_POOL", "decode"), ("TANDEM_DEBUG", "maybe")],
)
def test_bad_env_values_are_named(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], name: str, value: str
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exc:
        apply_env_defaults(parser())
    assert exc.value.code == 2
    assert name in capsys.readouterr().err


def test_tandem_serve_reads_port_and_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_PORT", "8016")
    monkeypatch.setenv("TANDEM_HOST", "0.0.0.0")
    monkeypatch.setenv("TANDEM_API_SERVER_COUNT", "2")
    config = parse_config(["--model", "/nonexistent"])
    assert (config.server.port, config.server.host) == (8016, "0.0.0.0")
    assert config.server.api_server_count == 2
