from __future__ import annotations

import os

import pytest

from common.cli_args import parse_config
from common.config import CacheConfig, EngineAddresses, ModelConfig, SchedulerConfig
from common.messages import PoolRole


def test_cli_round_trip() -> None:
    argv = [
        "--model",
        "/m/x",
        "--dtype",
        "float32",
        "--max-num-seqs",
        "4",
        "--kv-cache-gb",
        "0.5",
        "--input-address",
        "ipc:///tmp/a",
        "--output-address",
        "tcp://127.0.0.1:5555",
        "--quantization",
        "gguf",
        "--gguf-activations",
        "float",
    ]
    config = parse_config(argv)
    assert config.model.dtype == "float32" and config.scheduler.max_num_seqs == 4
    assert config.model.quantization == "gguf" and config.model.gguf_activations == "float"
    assert config.served_model_name == "x"
    assert parse_config(config.to_cli_args()) == config


def test_defaults() -> None:
    config = parse_config([])
    assert (config.server.host, config.server.port) == ("127.0.0.1", 8000)
    assert config.model.model == "smollm2-135m-instruct" == config.served_model_name
    assert config.cache.block_size == 16


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: ModelConfig(dtype="int4"), "--dtype must be one of"),  # type: ignore[arg-type]
        (lambda: SchedulerConfig(max_num_seqs=0), "--max-num-seqs must be at least 1"),
        (lambda: CacheConfig(kv_cache_gb=0), "--kv-cache-gb must be positive"),
        (lambda: EngineAddresses(input_address="http://x"), "--input-address must start with"),
        (lambda: ModelConfig(quantization="awq"), "--quantization must be one of none, gguf, int8"),  # type: ignore[arg-type]
        (
            lambda: ModelConfig(gguf_activations="q4"),  # type: ignore[arg-type]
            "--gguf-activations must be one of auto, q8, float",
        ),
        (
            lambda: ModelConfig(quantization="gguf", attention_backend="torch"),
            "--quantization gguf runs on the native CPU kernels",
        ),
        (
            lambda: ModelConfig(quantization="int8", attention_backend="torch"),
            "--quantization int8 runs on the native CPU kernels",
        ),
    ],
)
def test_invalid_values_raise_clear_errors(build: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()  # type: ignore[operator]


def test_configs_are_frozen() -> None:
    config = parse_config([])
    with pytest.raises(AttributeError):
        config.scheduler.max_num_seqs = 3  # type: ignore[misc]


def test_one_thread_flag_for_every_worker(capsys: pytest.CaptureFixture[str]) -> None:
    split = ["--model", "m", "--prefill-workers", "1", "--decode-workers", "1"]
    assert parse_config([*split, "--worker-threads", "3"]).disagg.threads_per_worker() == 3
    # Split pools divide the cores among their worker processes by default.
    assert parse_config(split).disagg.threads_per_worker() == max(1, (os.cpu_count() or 1) // 2)
    with pytest.raises(SystemExit):
        parse_config([*split, "--worker-threads", "0"])
    assert "--worker-threads must be at least 1" in capsys.readouterr().err
    for per_pool in ("--prefill-threads", "--decode-threads"):  # one flag family (WAVE2)
        with pytest.raises(SystemExit):
            parse_config([*split, per_pool, "1"])


def test_tensor_parallel_size_makes_the_unified_pool_that_many_ranks() -> None:
    config = parse_config(["--model", "m", "--tensor-parallel-size", "2"]).disagg
    assert config.num_workers(PoolRole.UNIFIED) == 2
    assert config.threads_per_worker() == max(1, (os.cpu_count() or 1) // 2)
    assert (
        parse_config(
            ["--model", "m", "-tp", "2", "--threads-per-rank", "3"]
        ).disagg.threads_per_worker()
        == 3
    )
    for bad in (["-tp", "0"], ["-tp", "2", "--prefill-workers", "1", "--decode-workers", "1"]):
        with pytest.raises(SystemExit):
            parse_config(["--model", "m", *bad])


def test_split_pools_take_a_width_each(capsys: pytest.CaptureFixture[str]) -> None:
    split = ["--model", "m", "--prefill-workers", "1", "--decode-workers", "1"]
    config = parse_config([*split, "--prefill-tp", "2"]).disagg
    assert (config.tp_size(PoolRole.PREFILL), config.tp_size(PoolRole.DECODE)) == (2, 1)
    assert (config.num_workers(PoolRole.PREFILL), config.num_workers(PoolRole.DECODE)) == (2, 1)
    assert config.reshards
    assert config.threads_per_worker() == max(1, (os.cpu_count() or 1) // 3)
    same = parse_config([*split, "--prefill-tp", "2", "--decode-tp", "2"]).disagg
    assert not same.reshards and same.num_workers(PoolRole.DECODE) == 2
    assert parse_config([*split, "--prefill-tp", "2"]).to_cli_args().count("--prefill-tp") == 1
    for bad, why in (
        (["--prefill-tp", "2"], "--prefill-tp needs split pools"),
        ([*split[2:], "--decode-tp", "0"], "--decode-tp must be at least 1"),
        (["--prefill-workers", "2", "--decode-workers", "1", "--prefill-tp", "2"], "workers 1"),
        ([*split[2:], "-tp", "2"], "give split pools --prefill-tp and --decode-tp"),
    ):
        with pytest.raises(SystemExit):
            parse_config(["--model", "m", *bad])
        assert why in capsys.readouterr().err


def test_several_models_parse_round_trip_and_each_serves_alone() -> None:
    config = parse_config(["--model", "/m/a", "--model", "b", "--models-max", "1"])
    assert config.model_names == ("/m/a", "b") and config.model_set.models_max == 1
    assert parse_config(config.to_cli_args()) == config
    alone = config.for_model("b")
    assert alone.model_names == ("b",) and alone.served_model_name == "b"
    assert alone.model_set.models_max == 1 and alone.scheduler == config.scheduler


def test_the_command_lines_models_replace_the_environments(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TANDEM_MODEL", "a,b")
    assert parse_config([]).model_names == ("a", "b")
    assert parse_config(["--model", "c"]).model_names == ("c",)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "/x/m", "--model", "/y/m"], "--model names m more than once"),
        (["--model", "a", "--model", "b", "--served-model-name", "c"], "--served-model-name"),
        (["--model", "a", "--model", "b", "--enable-lora"], "--enable-lora serves adapters"),
        (["--model", "a", "--model", "b", "--models-max", "-1"], "--models-max must not be"),
        (
            ["--model", "a", "--model", "b", "--kv-transfer-config", '{"kv_role": "kv_both"}'],
            "--kv-transfer-config serves one model",
        ),
    ],
)
def test_what_several_models_refuse(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse_config(argv)
    assert message in capsys.readouterr().err
