"""Frozen, validated configuration and its command-line form.

Every process parses the same flags (``add_cli_args`` / ``TandemConfig.from_cli_args``),
so the launcher hands each child exactly the flags it was given (``to_cli_args``) and a
container can run any process by its own command with the same flags. Values found at
run time (the number of KV blocks, the model's context length) are never written back
here: they travel in the workers' ``WorkerReady`` handshake.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Literal

DType = Literal["auto", "float32", "bfloat16", "float16"]
DTYPES: tuple[str, ...] = ("auto", "float32", "bfloat16", "float16")
DEFAULT_MODEL = "smollm2-135m-instruct"


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


@dataclass(frozen=True)
class ModelConfig:
    """Which weights to serve and how."""

    model: str = DEFAULT_MODEL
    served_model_name: str | None = None
    dtype: DType = "auto"
    max_model_len: int | None = None  # None: the model's own context length
    chat_template: str | None = None  # a Jinja file overriding the tokenizer's template

    def __post_init__(self) -> None:
        _require(bool(self.model), "--model must not be empty")
        _require(
            self.chat_template is None or os.path.isfile(self.chat_template),
            f"--chat-template {self.chat_template!r} is not a file",
        )
        _require(self.dtype in DTYPES, f"--dtype must be one of {', '.join(DTYPES)}")
        _require(
            self.max_model_len is None or self.max_model_len > 0,
            f"--max-model-len must be positive, got {self.max_model_len}",
        )


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: block size in tokens and memory given to it."""

    block_size: int = 16
    kv_cache_gb: float = 1.0
    num_kv_blocks: int | None = None  # overrides kv_cache_gb (tests, benchmarks)

    def __post_init__(self) -> None:
        _require(
            1 <= self.block_size <= 1024,
            f"--block-size must be in [1, 1024], got {self.block_size}",
        )
        _require(self.kv_cache_gb > 0, f"--kv-cache-gb must be positive, got {self.kv_cache_gb}")
        _require(
            self.num_kv_blocks is None or self.num_kv_blocks >= 1,
            f"--num-kv-blocks must be at least 1, got {self.num_kv_blocks}",
        )


SchedulingPolicy = Literal["fcfs", "priority"]
Batching = Literal["continuous", "static"]


@dataclass(frozen=True)
class SchedulerConfig:
    """Batching limits per step and the policies of the scheduler."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # 0 = a prompt may take the whole step budget
    enable_prefix_caching: bool = True
    scheduling_policy: SchedulingPolicy = "fcfs"
    priority_aging_s: float = 1.0
    batching: Batching = "continuous"
    batch_wait_timeout_s: float = 0.05
    max_waiting_requests: int = 1024

    def __post_init__(self) -> None:
        _require(
            self.long_prefill_token_threshold >= 0,
            f"--long-prefill-token-threshold must not be negative, got {self.long_prefill_token_threshold}",
        )
        _require(
            self.scheduling_policy in ("fcfs", "priority"),
            "--scheduling-policy must be fcfs or priority",
        )
        _require(
            self.priority_aging_s > 0,
            f"--priority-aging-s must be positive, got {self.priority_aging_s}",
        )
        _require(
            self.batching in ("continuous", "static"), "--batching must be continuous or static"
        )
        _require(self.batch_wait_timeout_s >= 0, "--batch-wait-timeout-s must not be negative")
        _require(
            self.max_waiting_requests >= 1,
            f"--max-waiting-requests must be at least 1, got {self.max_waiting_requests}",
        )
        _require(
            self.max_num_seqs >= 1, f"--max-num-seqs must be at least 1, got {self.max_num_seqs}"
        )
        _require(
            self.max_num_batched_tokens >= 1,
            f"--max-num-batched-tokens must be at least 1, got {self.max_num_batched_tokens}",
        )


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP side and process supervision."""

    host: str = "127.0.0.1"
    port: int = 8000
    grace_period_s: float = 2.0
    log_level: str = "info"
    max_body_bytes: int = 2 * 1024 * 1024
    max_n: int = 16  # most choices (n x prompts) in one completions request
    # Secrets: never put on a command line (``to_cli_args`` skips them); children get
    # them through the TANDEM_API_KEYS environment variable.
    api_keys: tuple[str, ...] = field(default=(), repr=False, metadata={"secret": True})

    def __post_init__(self) -> None:
        _require(0 <= self.port <= 65535, f"--port must be in [0, 65535], got {self.port}")
        _require(
            self.max_body_bytes >= 1024,
            f"--max-body-bytes must be at least 1024, got {self.max_body_bytes}",
        )
        _require(
            all(k and "," not in k for k in self.api_keys),
            "API keys must be non-empty and contain no comma",
        )
        _require(self.grace_period_s >= 0, "--grace-period-s must not be negative")
        _require(
            self.log_level in ("debug", "info", "warning", "error"),
            "--log-level must be debug, info, warning or error",
        )


@dataclass(frozen=True)
class EngineAddresses:
    """ZeroMQ addresses the engine binds and API servers connect to."""

    input_address: str = ""  # API servers PUSH requests here
    output_address: str = ""  # engine ROUTER sends outputs here

    @staticmethod
    def ipc_in(runtime_dir: str) -> EngineAddresses:
        return EngineAddresses(
            input_address=f"ipc://{os.path.join(runtime_dir, 'engine-input.sock')}",
            output_address=f"ipc://{os.path.join(runtime_dir, 'engine-output.sock')}",
        )

    def __post_init__(self) -> None:
        for name, address in (("input", self.input_address), ("output", self.output_address)):
            _require(
                address == "" or address.startswith(("ipc://", "tcp://")),
                f"--{name}-address must start with ipc:// or tcp://, got {address!r}",
            )


@dataclass(frozen=True)
class TandemConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    addresses: EngineAddresses = field(default_factory=EngineAddresses)

    @property
    def served_model_name(self) -> str:
        """The model id clients send: the flag, else the embedded name or dir basename."""
        if self.model.served_model_name:
            return self.model.served_model_name
        return os.path.basename(os.path.normpath(self.model.model))

    @staticmethod
    def from_cli_args(args: argparse.Namespace) -> TandemConfig:
        values = vars(args)

        def build(cls: Any) -> Any:
            return cls(
                **{f.name: values[f.name] for f in dataclasses.fields(cls) if f.name in values}
            )

        keys = [*(values.get("api_key") or []), *api_keys_from_env()]
        return TandemConfig(
            model=build(ModelConfig),
            cache=build(CacheConfig),
            scheduler=build(SchedulerConfig),
            server=dataclasses.replace(build(ServerConfig), api_keys=tuple(dict.fromkeys(keys))),
            addresses=build(EngineAddresses),
        )

    def with_addresses(self, addresses: EngineAddresses) -> TandemConfig:
        return dataclasses.replace(self, addresses=addresses)

    def with_model_path(self, path: str, served_model_name: str) -> TandemConfig:
        """A copy naming a resolved directory, keeping the served name."""
        model = dataclasses.replace(self.model, model=path, served_model_name=served_model_name)
        return dataclasses.replace(self, model=model)

    def to_cli_args(self) -> list[str]:
        """Flags that ``from_cli_args`` turns back into an equal config."""
        argv: list[str] = []
        for group in (self.model, self.cache, self.scheduler, self.server, self.addresses):
            for f in dataclasses.fields(group):
                if f.metadata.get("secret"):
                    continue
                value = getattr(group, f.name)
                flag = "--" + f.name.replace("_", "-")
                if isinstance(value, bool):
                    argv.append(flag if value else "--no-" + flag[2:])
                elif value is not None and value != "":
                    argv += [flag, str(value)]
        return argv


API_KEYS_ENV = "TANDEM_API_KEYS"


def api_keys_from_env() -> list[str]:
    """Comma-separated keys from ``TANDEM_API_KEYS``."""
    return [k.strip() for k in os.environ.get(API_KEYS_ENV, "").split(",") if k.strip()]


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """The flags of ``tandem serve``; every process accepts all of them."""
    d = TandemConfig()
    m = parser.add_argument_group("model")
    m.add_argument(
        "--model",
        default=d.model.model,
        help="embedded model name (smollm2-135m-instruct) or a local Hugging Face "
        "directory with config.json and safetensors (default: %(default)s)",
    )
    m.add_argument(
        "--served-model-name",
        default=None,
        help="model id clients send; default: the embedded name or the directory's basename",
    )
    m.add_argument(
        "--dtype",
        default=d.model.dtype,
        choices=DTYPES,
        help="weights and activations dtype; auto = bfloat16 where the CPU has "
        "AVX512-BF16/AMX or on CUDA, else float32 (default: %(default)s)",
    )
    m.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="context length in tokens (prompt + output); default: the model's own",
    )
    m.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template file for /v1/chat/completions, replacing the model's own "
        "(needed for models without one, such as gemma-3-270m)",
    )
    c = parser.add_argument_group("KV cache")
    c.add_argument(
        "--block-size",
        type=int,
        default=d.cache.block_size,
        help="tokens per KV block (default: %(default)s)",
    )
    c.add_argument(
        "--kv-cache-gb",
        type=float,
        default=d.cache.kv_cache_gb,
        help="memory for KV blocks in GiB (default: %(default)s)",
    )
    c.add_argument(
        "--num-kv-blocks",
        type=int,
        default=None,
        help="exact number of KV blocks, overriding --kv-cache-gb",
    )
    s = parser.add_argument_group("scheduler")
    s.add_argument(
        "--max-num-seqs",
        type=int,
        default=d.scheduler.max_num_seqs,
        help="most requests in one step (default: %(default)s)",
    )
    s.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=d.scheduler.max_num_batched_tokens,
        help="token budget of one step; longer prompts are prefilled in chunks (default: %(default)s)",
    )
    s.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=d.scheduler.enable_chunked_prefill,
        help="split prompts longer than the step budget over several steps (default: on)",
    )
    s.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=d.scheduler.long_prefill_token_threshold,
        help="most tokens one prompt may take of a step, so decodes keep flowing; 0 = no cap (default: %(default)s)",
    )
    s.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=d.scheduler.enable_prefix_caching,
        help="reuse the KV blocks of identical prompt prefixes (default: on)",
    )
    s.add_argument(
        "--scheduling-policy",
        default=d.scheduler.scheduling_policy,
        choices=("fcfs", "priority"),
        help="waiting order: arrival, or request priority (lower first) with aging (default: %(default)s)",
    )
    s.add_argument(
        "--priority-aging-s",
        type=float,
        default=d.scheduler.priority_aging_s,
        help="with --scheduling-policy priority, a waiting request gains one priority level per this many seconds (default: %(default)s)",
    )
    s.add_argument(
        "--batching",
        default=d.scheduler.batching,
        choices=("continuous", "static"),
        help="static: a batch forms, runs to completion, nothing joins meanwhile; for comparison only (default: %(default)s)",
    )
    s.add_argument(
        "--batch-wait-timeout-s",
        type=float,
        default=d.scheduler.batch_wait_timeout_s,
        help="with --batching static, how long a batch waits to fill (default: %(default)s)",
    )
    s.add_argument(
        "--max-waiting-requests",
        type=int,
        default=d.scheduler.max_waiting_requests,
        help="queued requests beyond this are refused with 503 (default: %(default)s)",
    )
    h = parser.add_argument_group("server")
    h.add_argument(
        "--host", default=d.server.host, help="address the HTTP server binds (default: %(default)s)"
    )
    h.add_argument(
        "--port", type=int, default=d.server.port, help="HTTP port (default: %(default)s)"
    )
    h.add_argument(
        "--grace-period-s",
        type=float,
        default=d.server.grace_period_s,
        help="after a process dies, seconds to answer errors before the service exits (default: %(default)s)",
    )
    h.add_argument(
        "--log-level",
        default=d.server.log_level,
        help="debug, info, warning or error (default: %(default)s)",
    )
    h.add_argument(
        "--max-body-bytes",
        type=int,
        default=d.server.max_body_bytes,
        help="larger request bodies get 413 (default: %(default)s)",
    )
    h.add_argument(
        "--max-n",
        type=int,
        default=d.server.max_n,
        help="most choices (n times the number of prompts) in one completions request (default: %(default)s)",
    )
    h.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="require this key (Authorization: Bearer KEY or x-api-key: KEY) on all but the "
        f"health and metrics routes; repeatable; also read from {API_KEYS_ENV} (comma-separated)",
    )
    a = parser.add_argument_group("engine sockets (set by `tandem serve`; for containers)")
    a.add_argument(
        "--input-address", default="", help="ZeroMQ address of the engine's request socket"
    )
    a.add_argument(
        "--output-address", default="", help="ZeroMQ address of the engine's output socket"
    )


def parse_config(argv: list[str] | None = None, prog: str = "tandem serve") -> TandemConfig:
    parser = argparse.ArgumentParser(prog=prog)
    add_cli_args(parser)
    args = parser.parse_args(argv)
    try:
        return TandemConfig.from_cli_args(args)
    except ValueError as e:
        parser.error(str(e))
        raise  # unreachable: parser.error exits
