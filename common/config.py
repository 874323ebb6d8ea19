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

from common.audit_config import check_audit_flags
from common.config_checks import is_private_address, require
from common.kv_events_config import KVEventsConfig, parse_kv_events_config
from common.kv_transfer_config import KVRole
from common.lora_config import LoRAModule, check_lora_flags, parse_lora_module
from common.messages import PoolRole
from common.model_set_config import ModelSetConfig, check_model_set
from common.oidc_config import DEFAULT_TENANT_CLAIM, check_oidc_flags
from common.pool_config import DisaggConfig
from common.speculative_config import SpeculativeConfig, parse_speculative_config
from common.tls_config import CERT_NONE, check_tls_flags, uvicorn_tls_options

DType = Literal["auto", "float32", "bfloat16", "float16"]
DTYPES: tuple[str, ...] = ("auto", "float32", "bfloat16", "float16")
DEFAULT_MODEL = "smollm2-135m-instruct"
AttentionBackend = Literal["auto", "native", "torch"]
ATTENTION_BACKENDS: tuple[str, ...] = ("auto", "native", "torch")
# none: weights as the model's dtype (or as a W8A8 checkpoint holds them); gguf:
# projections kept in the GGUF's blocks; int8: W8A8, quantized at load (or the checkpoint's);
# compressed-tensors: a W8A8 checkpoint's int8 weights as they are (vLLM's spelling).
Quantization = Literal["none", "gguf", "int8", "compressed-tensors"]
QUANTIZATIONS: tuple[str, ...] = ("none", "gguf", "int8", "compressed-tensors")
# --quantization gguf's activations: q8 = quantized to 8 bits per block of 32 and dotted in
# integers (llama.cpp's arithmetic), float = as they are (exact), auto = chosen per CPU.
GgufActivations = Literal["auto", "q8", "float"]
GGUF_ACTIVATIONS: tuple[str, ...] = ("auto", "q8", "float")
# --tool-call-parser: the tool-call formats of api_server/tool_parsers.py (auto: the model's).
TOOL_CALL_PARSERS: tuple[str, ...] = ("auto", "hermes", "llama3_json", "pythonic", "gemma3")
# --reasoning-parser: the <think> section formats of api_server/reasoning.py.
REASONING_PARSERS: tuple[str, ...] = ("qwen3", "deepseek_r1")


@dataclass(frozen=True)
class ModelConfig:
    """Which weights to serve and how."""

    model: str = DEFAULT_MODEL
    served_model_name: str | None = None
    dtype: DType = "auto"
    max_model_len: int | None = None  # None: the model's own context length
    chat_template: str | None = None  # a Jinja file overriding the tokenizer's template
    tool_call_parser: str = "auto"  # the format tool calls are written and read in
    reasoning_parser: str | None = None  # None: the output holds no reasoning section
    # On CPU: native kernels (attention, norms, ...; built once), PyTorch ops, or native if it builds.
    attention_backend: AttentionBackend = "auto"
    quantization: Quantization = "none"
    gguf_activations: GgufActivations = "auto"
    # Sampling defaults for fields a request leaves out: "auto" = the model's
    # generation_config.json, "vllm" = none (OpenAI's), or a directory with that file.
    generation_config: str = "auto"
    # LoRA adapters (common/lora_config.py), vLLM's flags and defaults.
    enable_lora: bool = False
    lora_modules: tuple[str, ...] = ()  # name=path or JSON, as given
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: --max-loras
    allow_runtime_lora_updating: bool = False

    @property
    def lora_adapters(self) -> list[LoRAModule]:
        """``--lora-modules``, parsed."""
        return [parse_lora_module(m) for m in self.lora_modules]

    @property
    def step_max_loras(self) -> int:
        """Distinct adapters a step may run; 0 with LoRA off."""
        return self.max_loras if self.enable_lora else 0

    @property
    def worker_lora_capacity(self) -> int:
        """Adapters a worker keeps loaded (``--max-cpu-loras``, at least ``--max-loras``)."""
        return self.max_cpu_loras or self.max_loras

    def __post_init__(self) -> None:
        require(bool(self.model), "--model must not be empty")
        check_lora_flags(
            self.enable_lora,
            self.lora_modules,
            self.max_loras,
            self.max_lora_rank,
            self.max_cpu_loras,
        )
        require(
            self.chat_template is None or os.path.isfile(self.chat_template),
            f"--chat-template {self.chat_template!r} is not a file",
        )
        require(
            self.tool_call_parser in TOOL_CALL_PARSERS,
            f"--tool-call-parser must be one of {', '.join(TOOL_CALL_PARSERS)}",
        )
        require(
            self.reasoning_parser in (None, *REASONING_PARSERS),
            f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)}",
        )
        require(self.dtype in DTYPES, f"--dtype must be one of {', '.join(DTYPES)}")
        require(
            self.attention_backend in ATTENTION_BACKENDS,
            f"--attention-backend must be one of {', '.join(ATTENTION_BACKENDS)}",
        )
        require(
            self.quantization in QUANTIZATIONS,
            f"--quantization must be one of {', '.join(QUANTIZATIONS)}",
        )
        require(
            self.gguf_activations in GGUF_ACTIVATIONS,
            f"--gguf-activations must be one of {', '.join(GGUF_ACTIVATIONS)}",
        )
        require(
            self.quantization == "none" or self.attention_backend != "torch",
            f"--quantization {self.quantization} runs on the native CPU kernels, "
            "not --attention-backend torch",
        )
        require(
            self.generation_config in ("auto", "vllm") or os.path.isdir(self.generation_config),
            f"--generation-config must be auto, vllm or a directory, got {self.generation_config!r}",
        )
        require(
            self.max_model_len is None or self.max_model_len > 0,
            f"--max-model-len must be positive, got {self.max_model_len}",
        )


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: block size in tokens and memory given to it."""

    block_size: int = 16
    kv_cache_gb: float = 1.0
    num_kv_blocks: int | None = None  # overrides kv_cache_gb (tests, benchmarks)
    kv_events_config: str | None = None  # vLLM's KVEventsConfig as JSON (a router's index)

    def __post_init__(self) -> None:
        parse_kv_events_config(self.kv_events_config)  # refused here, not at first use
        require(
            1 <= self.block_size <= 1024,
            f"--block-size must be in [1, 1024], got {self.block_size}",
        )
        require(self.kv_cache_gb > 0, f"--kv-cache-gb must be positive, got {self.kv_cache_gb}")
        require(
            self.num_kv_blocks is None or self.num_kv_blocks >= 1,
            f"--num-kv-blocks must be at least 1, got {self.num_kv_blocks}",
        )

    @property
    def kv_events(self) -> KVEventsConfig:
        return parse_kv_events_config(self.kv_events_config)


SchedulingPolicy = Literal["fcfs", "priority"]
Batching = Literal["continuous", "static"]


@dataclass(frozen=True)
class SchedulerConfig:
    """Batching limits per step and the policies of the scheduler."""

    max_num_seqs: int = 64
    # 512 rather than vLLM's 2048: on a CPU a step of 2,048 prompt tokens takes ~0.5 s,
    # and every stream decoding beside it waits that long; in 512-token steps the first
    # prompts of a burst start streaming sooner (32 chat prompts at once: TTFT p50 444-467
    # -> 308-316 ms, tok/s level, paired, docs/benchmarks.md). The price: where long
    # prompts keep arriving, more steps carry a chunk (mixed at 8 clients: ITL p95 20 -> 60
    # ms, p99 265 -> 168). A GPU may want more.
    max_num_batched_tokens: int = 512
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # 0 = a prompt may take the whole step budget
    enable_prefix_caching: bool = True
    scheduling_policy: SchedulingPolicy = "fcfs"
    priority_aging_s: float = 1.0
    batching: Batching = "continuous"
    batch_wait_timeout_s: float = 0.05
    max_waiting_requests: int = 1024
    # Schedule step N+1 while the workers run step N (vLLM's --async-scheduling), so a
    # worker finds its next step waiting when it finishes one. On by default: on the
    # 2-core AMD host it gave +3.5-9.6% at 1 client, +2% at 8 and +-1% at 32
    # (docs/benchmarks.md).
    async_scheduling: bool = True
    speculative_config: str | None = None  # vLLM's SpeculativeConfig as JSON

    @property
    def speculative(self) -> SpeculativeConfig:
        return parse_speculative_config(self.speculative_config)

    @property
    def max_steps_in_flight(self) -> int:
        """Steps a worker pool holds at once: the running one, and with async scheduling
        the next one, waiting at the workers."""
        return 2 if self.async_scheduling else 1

    def __post_init__(self) -> None:
        parse_speculative_config(self.speculative_config)  # refused here, not at first use
        require(
            self.long_prefill_token_threshold >= 0,
            f"--long-prefill-token-threshold must not be negative, got {self.long_prefill_token_threshold}",
        )
        require(
            self.scheduling_policy in ("fcfs", "priority"),
            "--scheduling-policy must be fcfs or priority",
        )
        require(
            self.priority_aging_s > 0,
            f"--priority-aging-s must be positive, got {self.priority_aging_s}",
        )
        require(
            self.batching in ("continuous", "static"), "--batching must be continuous or static"
        )
        require(self.batch_wait_timeout_s >= 0, "--batch-wait-timeout-s must not be negative")
        require(
            self.max_waiting_requests >= 1,
            f"--max-waiting-requests must be at least 1, got {self.max_waiting_requests}",
        )
        require(
            self.max_num_seqs >= 1, f"--max-num-seqs must be at least 1, got {self.max_num_seqs}"
        )
        require(
            self.max_num_batched_tokens >= 1,
            f"--max-num-batched-tokens must be at least 1, got {self.max_num_batched_tokens}",
        )


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP side and process supervision."""

    host: str = "127.0.0.1"
    port: int = 8000
    grace_period_s: float = 2.0
    api_server_count: int = 1  # processes sharing the HTTP port (SO_REUSEPORT)
    log_level: str = "info"
    max_body_bytes: int = 2 * 1024 * 1024
    max_n: int = 16  # most choices (n x prompts) in one completions request
    rate_limit_rpm: int = 0  # requests per minute per caller; 0 = unlimited
    rate_limit_tpm: int = 0  # prompt + completion tokens per minute per caller; 0 = unlimited
    log_requests: bool = False  # prompts and outputs in the log
    strict_request_fields: bool = False  # 422 for unknown request fields instead of ignoring
    request_read_timeout_s: float = 30.0  # a request's headers, then its body, must arrive in this
    shutdown_timeout_s: float = 30.0  # SIGTERM: in-flight requests may finish for this long
    allowed_origins: tuple[str, ...] = ()  # CORS; empty = no cross-origin access
    # HTTPS (common/tls_config.py): file paths, not secrets, so they travel on command lines.
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None  # the CAs client certificates must chain to
    ssl_cert_reqs: int = CERT_NONE  # ssl.VerifyMode: 2 = client certificate required
    # Words and patterns refused in prompts and outputs (api_server/blocklist.py); read
    # by the API servers alone, which refuse a file they cannot use at startup.
    guard_blocklist: str | None = None
    # OIDC sign-in (common/oidc_config.py): URLs and a claim name, not secrets.
    oidc_issuer: str | None = None
    oidc_audience: str | None = None
    oidc_jwks_url: str | None = None
    oidc_tenant_claim: str = DEFAULT_TENANT_CLAIM
    # The audit log (common/audit_config.py): a path, or "-" for stdout.
    audit_log: str | None = None
    audit_log_raw: bool = False
    # OTLP traces (vLLM's flag): off without an endpoint.
    otlp_traces_endpoint: str | None = None
    # Secrets: never put on a command line (``to_cli_args`` skips them); children get
    # them through the TANDEM_API_KEYS environment variable.
    api_keys: tuple[str, ...] = field(default=(), repr=False, metadata={"secret": True})

    def __post_init__(self) -> None:
        require(0 <= self.port <= 65535, f"--port must be in [0, 65535], got {self.port}")
        require(
            self.max_body_bytes >= 1024,
            f"--max-body-bytes must be at least 1024, got {self.max_body_bytes}",
        )
        require(
            all(k and "," not in k for k in self.api_keys),
            "API keys must be non-empty and contain no comma",
        )
        require(
            self.rate_limit_rpm >= 0 and self.rate_limit_tpm >= 0,
            "--rate-limit-rpm and --rate-limit-tpm must not be negative",
        )
        require(self.max_n >= 1, f"--max-n must be at least 1, got {self.max_n}")
        require(
            self.api_server_count >= 1,
            f"--api-server-count must be at least 1, got {self.api_server_count}",
        )
        require(self.grace_period_s >= 0, "--grace-period-s must not be negative")
        require(
            self.request_read_timeout_s > 0,
            f"--request-read-timeout-s must be positive, got {self.request_read_timeout_s}",
        )
        require(
            self.shutdown_timeout_s >= 0,
            f"--shutdown-timeout must not be negative, got {self.shutdown_timeout_s}",
        )
        require(
            all(o == "*" or o.startswith(("http://", "https://")) for o in self.allowed_origins),
            "--allowed-origins takes origins like https://example.com (or *)",
        )
        require(
            self.log_level in ("debug", "info", "warning", "error"),
            "--log-level must be debug, info, warning or error",
        )
        check_tls_flags(*self.tls_flags)
        check_oidc_flags(
            self.oidc_issuer, self.oidc_audience, self.oidc_jwks_url, self.oidc_tenant_claim
        )
        check_audit_flags(self.audit_log, self.audit_log_raw)
        require(
            not self.otlp_traces_endpoint
            or self.otlp_traces_endpoint.startswith(("http://", "https://")),
            f"--otlp-traces-endpoint takes an http(s) URL, got {self.otlp_traces_endpoint!r}",
        )

    @property
    def tls_flags(self) -> tuple[str | None, str | None, str | None, int]:
        """The TLS flags in ``common/tls_config.py``'s order: key, cert, CAs, cert reqs."""
        return self.ssl_keyfile, self.ssl_certfile, self.ssl_ca_certs, self.ssl_cert_reqs

    @property
    def scheme(self) -> str:
        """``https`` with a certificate, else ``http``."""
        return "https" if self.ssl_certfile else "http"

    def uvicorn_tls(self) -> dict[str, Any]:
        """``uvicorn.Config`` keywords for these flags (none: plain HTTP)."""
        return uvicorn_tls_options(*self.tls_flags)


@dataclass(frozen=True)
class EngineAddresses:
    """ZeroMQ addresses the engine binds and API servers connect to, and how they are
    protected: beyond the loopback interface only with ``expose_engine`` and CurveZMQ keys
    (``curve_keys``: a directory made by ``tandem keys``; files, never key text on a
    command line)."""

    input_address: str = ""  # API servers PUSH requests here
    output_address: str = ""  # engine ROUTER sends outputs here
    expose_engine: bool = False
    curve_keys: str | None = None

    @staticmethod
    def ipc_in(runtime_dir: str) -> EngineAddresses:
        return EngineAddresses(
            input_address=f"ipc://{os.path.join(runtime_dir, 'engine-input.sock')}",
            output_address=f"ipc://{os.path.join(runtime_dir, 'engine-output.sock')}",
        )

    def __post_init__(self) -> None:
        for name, address in (("input", self.input_address), ("output", self.output_address)):
            require(
                address == "" or address.startswith(("ipc://", "tcp://")),
                f"--{name}-address must start with ipc:// or tcp://, got {address!r}",
            )
            require(
                is_private_address(address) or self.expose_engine,
                f"--{name}-address {address} listens beyond 127.0.0.1; pass --expose-engine "
                "(with --curve-keys) to mean it",
            )
        require(
            not self.expose_engine or self.curve_keys is not None,
            "--expose-engine needs --curve-keys DIR (CurveZMQ keys made by `tandem keys DIR`): "
            "the engine's sockets are never open unencrypted beyond this host",
        )
        require(
            self.curve_keys is None or os.path.isdir(self.curve_keys),
            f"--curve-keys {self.curve_keys!r} is not a directory (make one with `tandem keys DIR`)",
        )


@dataclass(frozen=True)
class TandemConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    addresses: EngineAddresses = field(default_factory=EngineAddresses)
    disagg: DisaggConfig = field(default_factory=DisaggConfig)
    model_set: ModelSetConfig = field(default_factory=ModelSetConfig)

    def __post_init__(self) -> None:
        check_model_set(self.model_names, self.model.served_model_name, self.model.enable_lora)
        require(
            len(self.model_names) == 1 or self.disagg.instance_kv.role is KVRole.NONE,
            "--kv-transfer-config serves one model: give one --model",
        )
        # The pools' and the KV hand-off's sockets carry prompts and KV: the same rule as
        # the engine's own sockets (and the same keys encrypt them).
        d = self.disagg
        for flag, address in (
            ("--unified-pool-address", d.unified_pool_address),
            ("--prefill-pool-address", d.prefill_pool_address),
            ("--decode-pool-address", d.decode_pool_address),
            ("--kv-transfer-address", d.kv_transfer_address),
            ("--kv-transfer-config kv_ip", d.instance_kv.side_channel_address),
        ):
            require(
                is_private_address(address) or self.addresses.expose_engine,
                f"{flag} {address} listens beyond 127.0.0.1; pass --expose-engine "
                "(with --curve-keys) to mean it",
            )

        require(
            not d.instance_kv.role.consumes or self.scheduler.enable_prefix_caching,
            "--kv-transfer-config kv_role kv_consumer lands pulled KV as prefix-cache blocks: "
            "it needs --enable-prefix-caching",
        )
        require(
            not self.scheduler.speculative.enabled
            or all(s.tp == 1 for s in d.pool_specs() if s.role is not PoolRole.PREFILL),
            "--speculative-config with tensor parallelism is not served yet: "
            "run the pool that decodes with one rank",
        )

    @property
    def served_model_name(self) -> str:
        """The model id clients send: the flag, else the embedded name or dir basename."""
        if self.model.served_model_name:
            return self.model.served_model_name
        return os.path.basename(os.path.normpath(self.model.model))

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every ``--model``, in order (several: ``common/model_set_config.py``)."""
        return (self.model.model, *self.model_set.more_models)

    def for_model(self, model: str) -> TandemConfig:
        """This config serving ``model`` alone (a model router's service for it)."""
        return dataclasses.replace(
            self,
            model=dataclasses.replace(self.model, model=model),
            model_set=dataclasses.replace(self.model_set, more_models=()),
        )

    @staticmethod
    def from_cli_args(args: argparse.Namespace) -> TandemConfig:
        # --model is repeatable: the first is the model, the rest the model set's.
        models = list(getattr(args, "model", None) or [DEFAULT_MODEL])
        values = {**vars(args), "model": models[0], "more_models": models[1:]}

        def build(cls: Any) -> Any:
            # argparse gives repeatable flags as lists; the config holds tuples (frozen).
            return cls(
                **{
                    f.name: tuple(v) if isinstance(v := values[f.name], list) else v
                    for f in dataclasses.fields(cls)
                    if f.name in values
                }
            )

        keys = [*(values.get("api_key") or []), *api_keys_from_env()]
        origins = [o.strip() for arg in values.get("allowed_origins") or [] for o in arg.split(",")]
        server = {
            f.name: values[f.name] for f in dataclasses.fields(ServerConfig) if f.name in values
        }
        server.update(
            api_keys=tuple(dict.fromkeys(keys)), allowed_origins=tuple(o for o in origins if o)
        )
        return TandemConfig(
            model=build(ModelConfig),
            cache=build(CacheConfig),
            scheduler=build(SchedulerConfig),
            server=ServerConfig(**server),
            addresses=build(EngineAddresses),
            disagg=build(DisaggConfig),
            model_set=build(ModelSetConfig),
        )

    def with_disagg(self, **changes: Any) -> TandemConfig:
        return dataclasses.replace(self, disagg=dataclasses.replace(self.disagg, **changes))

    def with_addresses(self, addresses: EngineAddresses) -> TandemConfig:
        return dataclasses.replace(self, addresses=addresses)

    def with_model_path(self, path: str, served_model_name: str) -> TandemConfig:
        """A copy naming a resolved directory, keeping the served name."""
        model = dataclasses.replace(self.model, model=path, served_model_name=served_model_name)
        return dataclasses.replace(self, model=model)

    def to_cli_args(self) -> list[str]:
        """Flags that ``from_cli_args`` turns back into an equal config."""
        argv: list[str] = []
        groups = (
            self.model,
            self.cache,
            self.scheduler,
            self.server,
            self.addresses,
            self.disagg,
            self.model_set,
        )
        for group in groups:
            for f in dataclasses.fields(group):
                if f.metadata.get("secret"):
                    continue
                value = getattr(group, f.name)
                flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
                if isinstance(value, tuple):  # repeatable flags
                    for item in value:
                        argv += [flag, str(item)]
                elif isinstance(value, bool):
                    argv.append(flag if value else "--no-" + flag[2:])
                elif value is not None and value != "":
                    argv += [flag, str(value)]
        return argv


API_KEYS_ENV = "TANDEM_API_KEYS"


def api_keys_from_env() -> list[str]:
    """Comma-separated keys from ``TANDEM_API_KEYS``."""
    return [k.strip() for k in os.environ.get(API_KEYS_ENV, "").split(",") if k.strip()]
