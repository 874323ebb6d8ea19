"""The command-line form of ``TandemConfig``: the flags of ``tandem serve``, which every
process accepts, with their help texts and defaults."""

from __future__ import annotations

import argparse

from common.audit_config import add_audit_args
from common.config import (
    API_KEYS_ENV,
    ATTENTION_BACKENDS,
    DTYPES,
    GGUF_ACTIVATIONS,
    QUANTIZATIONS,
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
    TandemConfig,
)
from common.env_flags import apply_env_defaults
from common.lora_config import add_lora_args
from common.model_set_config import ModelsAction, add_model_set_args
from common.oidc_config import add_oidc_args
from common.tls_config import add_tls_args


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """The flags of ``tandem serve``; every process accepts all of them."""
    d = TandemConfig()
    m = parser.add_argument_group("model")
    m.add_argument(
        "--model",
        action=ModelsAction,
        default=[d.model.model],
        help="embedded model name (smollm2-135m-instruct) or a local Hugging Face "
        f"directory with config.json and safetensors (default: {d.model.model}); give it "
        "again to serve several models, each routed to by its name (--models-max)",
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
    m.add_argument(
        "--tool-call-parser",
        default=d.model.tool_call_parser,
        choices=TOOL_CALL_PARSERS,
        help="the format of tool calls on /v1/chat/completions (auto: the one the model's chat "
        "template writes, else its family's); a model whose template knows no tools gets "
        "Tandem's template for the format",
    )
    m.add_argument(
        "--reasoning-parser",
        default=None,
        choices=REASONING_PARSERS,
        help="read the model's <think> section into message.reasoning_content (qwen3: the "
        "model opens it; deepseek_r1: the template does); enables thinking_token_budget",
    )
    m.add_argument(
        "--attention-backend",
        default=d.model.attention_backend,
        choices=ATTENTION_BACKENDS,
        help="on CPU: native = Tandem's C++ kernels for decode attention, KV writes, RoPE, "
        "RMSNorm and SwiGLU (built once with gcc, cached), torch = PyTorch ops only, "
        "auto = native when it builds (default: %(default)s)",
    )
    m.add_argument(
        "--quantization",
        default=d.model.quantization,
        choices=QUANTIZATIONS,
        help="gguf = keep the projections of a GGUF model (an embedded one or a *.gguf "
        "--model) in the file's quantized blocks (Q4_0/1, Q5_0/1, Q8_0, Q4_K, Q5_K, Q6_K) "
        "and compute with fused dequantize-and-dot kernels: ~3x fewer bytes per decode "
        "step; native CPU kernels only (default: %(default)s)",
    )
    m.add_argument(
        "--gguf-activations",
        default=d.model.gguf_activations,
        choices=GGUF_ACTIVATIONS,
        help="with --quantization gguf: q8 = quantize each projection's input to 8 bits per "
        "block of 32 and multiply in integers, as llama.cpp does (faster where the CPU has no "
        "bfloat16 dot; perplexity in docs/benchmarks.md), float = multiply the input as it is "
        "(exact: greedy parity with transformers), auto = q8 on CPUs without AVX512-BF16, "
        "float on those with it (default: %(default)s)",
    )
    m.add_argument(
        "--generation-config",
        default=d.model.generation_config,
        help="sampling defaults for fields a request leaves out: auto = the model's "
        "generation_config.json (as vLLM), vllm = none (OpenAI's defaults), or a directory "
        "holding a generation_config.json (default: %(default)s)",
    )
    add_lora_args(parser, d.model.max_loras, d.model.max_lora_rank)
    add_model_set_args(parser)
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
    c.add_argument(
        "--kv-events-config",
        default=d.cache.kv_events_config,
        help="publish KV cache events for a router's prefix index, as vLLM: JSON with "
        'enable_kv_cache_events, publisher ("zmq"), endpoint, replay_endpoint, '
        "buffer_steps, hwm, max_queue_size, topic (docs/fleet.md)",
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
    s.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=d.scheduler.async_scheduling,
        help="schedule the next step while the worker runs this one, so it never waits for "
        "the engine (default: on)",
    )
    s.add_argument(
        "--speculative-config",
        default=d.scheduler.speculative_config,
        help="speculative decoding, as vLLM: JSON with method (ngram), "
        "num_speculative_tokens, prompt_lookup_min, prompt_lookup_max, "
        "disable_by_batch_size (docs/speculative.md)",
    )
    h = parser.add_argument_group("server")
    h.add_argument(
        "--host", default=d.server.host, help="address the HTTP server binds (default: %(default)s)"
    )
    h.add_argument(
        "--port", type=int, default=d.server.port, help="HTTP port (default: %(default)s)"
    )
    h.add_argument(
        "--api-server-count",
        type=int,
        default=d.server.api_server_count,
        help="API-server processes sharing the port (SO_REUSEPORT) in front of one engine "
        "(default: %(default)s)",
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
    h.add_argument(
        "--rate-limit-rpm",
        type=int,
        default=d.server.rate_limit_rpm,
        help="requests per minute per API key (per client address without keys), sliding "
        "window, answered 429 + Retry-After beyond it; 0 = unlimited (default: %(default)s)",
    )
    h.add_argument(
        "--rate-limit-tpm",
        type=int,
        default=d.server.rate_limit_tpm,
        help="prompt + completion tokens per minute per API key, sliding window; 0 = "
        "unlimited (default: %(default)s)",
    )
    h.add_argument(
        "--log-requests",
        action=argparse.BooleanOptionalAction,
        default=d.server.log_requests,
        help="log prompts and outputs (with the request id); off by default for privacy",
    )
    h.add_argument(
        "--request-read-timeout-s",
        type=float,
        default=d.server.request_read_timeout_s,
        help="a request's headers, then its body, must arrive within this many seconds "
        "(else 408), so slow clients cannot hold connections (default: %(default)s)",
    )
    h.add_argument(
        "--shutdown-timeout",
        "--shutdown-timeout-s",
        dest="shutdown_timeout_s",
        type=float,
        default=d.server.shutdown_timeout_s,
        help="on SIGTERM, readiness turns 503 and new requests get 503 at once; in-flight "
        "requests may run this many seconds before they end with an error; a second "
        "SIGTERM/SIGINT stops at once (default: %(default)s)",
    )
    h.add_argument(
        "--allowed-origins",
        action="append",
        default=None,
        help="origins allowed to call the API from a browser (CORS), e.g. "
        "https://app.example.com; repeatable or comma-separated; default: none",
    )
    h.add_argument(
        "--strict-request-fields",
        action=argparse.BooleanOptionalAction,
        default=d.server.strict_request_fields,
        help="refuse unknown request fields with 422; by default they are ignored, logged "
        "and named in the X-Tandem-Ignored-Fields response header (as vLLM)",
    )
    h.add_argument(
        "--guard-blocklist",
        default=d.server.guard_blocklist,
        metavar="FILE",
        help="refuse prompts (400, code content_filter) and end outputs (finish_reason "
        "content_filter) that contain a word of FILE: one a line, case-insensitive whole "
        "words, re:PATTERN for a regular expression, # comments (docs/guardrails.md)",
    )
    h.add_argument(
        "--otlp-traces-endpoint",
        default=d.server.otlp_traces_endpoint,
        metavar="URL",
        help="export OpenTelemetry traces (OTLP over HTTP/protobuf) to URL, e.g. "
        "http://localhost:4318/v1/traces; W3C traceparent is taken from requests "
        "(default: no tracing)",
    )
    add_tls_args(parser)
    add_oidc_args(parser)
    add_audit_args(parser)
    p = parser.add_argument_group("worker pools (prefill/decode disaggregation)")
    p.add_argument(
        "--prefill-workers",
        type=int,
        default=d.disagg.prefill_workers,
        help="worker processes of a prefill pool; with --decode-workers, prompts are "
        "prefilled in one pool and decoded in another (default: one unified pool)",
    )
    p.add_argument(
        "--decode-workers",
        type=int,
        default=d.disagg.decode_workers,
        help="worker processes of the decode pool (with --prefill-workers)",
    )
    p.add_argument(
        "--kv-transfer",
        default=d.disagg.kv_transfer,
        choices=("shm", "tcp"),
        help="how a prompt's KV reaches the decode pool: shm = one shared-memory KV pool, "
        "handed over by block ids, zero bytes copied (one host); tcp = streamed from the "
        "prefill worker to the decode worker, checksummed (across hosts) (default: %(default)s)",
    )
    p.add_argument(
        "--kv-transfer-lease-s",
        type=float,
        default=d.disagg.kv_transfer_lease_s,
        help="tcp: a hand-off that has not landed within this many seconds expires "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--kv-load-failure-policy",
        default=d.disagg.kv_load_failure_policy,
        choices=("fail", "recompute"),
        help="a failed or expired hand-off: fail = end the request with an error; "
        "recompute = prefill it again in the decode pool (default: %(default)s)",
    )
    p.add_argument(
        "--disagg-min-prompt-tokens",
        type=int,
        default=d.disagg.disagg_min_prompt_tokens,
        help="prompts whose uncached part is shorter are prefilled in the decode pool: "
        "always with tcp, only while the prefill pool is busy with shm; 0 = always hand "
        "off (default: %(default)s)",
    )
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="worker processes of the (unified) pool, each holding a shard of every layer "
        "(torch.distributed: gloo on CPU, NCCL on CUDA) (default: %(default)s)",
    )
    for pool in ("prefill", "decode"):
        p.add_argument(
            f"--{pool}-tp",
            type=int,
            default=1,
            help=f"tensor-parallel ranks of the {pool} pool (split pools, with "
            f"--{pool}-workers 1); the two pools may differ: the KV hand-off re-shards "
            "(default: %(default)s)",
        )
    p.add_argument(
        "--worker-threads",
        "--threads-per-rank",
        type=int,
        default=None,
        help="compute threads per worker process / tensor-parallel rank (default: this "
        "machine's cores divided among the worker processes)",
    )
    p.add_argument(
        "--adaptive-worker-threads",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run a worker on one core fewer while another process keeps its threads "
        "waiting for a core, trying them all again every few seconds (default: on)",
    )
    p.add_argument(
        "--external-workers",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="the engine starts no workers: they run by their own command (python -m "
        "worker --pool ...) and connect to the pool addresses; their death is noticed by "
        "heartbeat",
    )
    for pool in ("unified", "prefill", "decode"):
        p.add_argument(
            f"--{pool}-pool-address",
            default="",
            help=f"ZeroMQ address the engine binds for its {pool} pool's workers "
            "(default: ipc:// in its private runtime directory)",
        )
    p.add_argument(
        "--kv-transfer-address",
        default=d.disagg.kv_transfer_address,
        help="tcp: where a decode worker listens for KV (port 0: any free one) "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--kv-transfer-config",
        default=None,
        help="this instance's part in a fleet's prefill/decode split, as vLLM: JSON with "
        "kv_role (kv_producer, kv_consumer, kv_both), kv_ip, kv_port, engine_id, "
        "kv_load_failure_policy, kv_connector_extra_config (docs/fleet.md)",
    )
    p.add_argument(
        "--kv-transfer-host",
        default="",
        help="tcp: the host prefill workers use to reach this decode worker (default: the "
        "bind host); set it when binding 0.0.0.0 in a container",
    )
    p.add_argument(
        "--service-id",
        default="",
        help="names this service's shared-memory segments (set by tandem serve; give the "
        "same one to every process of a deployment started apart)",
    )
    a = parser.add_argument_group("engine sockets (set by `tandem serve`; for containers)")
    a.add_argument(
        "--input-address", default="", help="ZeroMQ address of the engine's request socket"
    )
    a.add_argument(
        "--output-address", default="", help="ZeroMQ address of the engine's output socket"
    )
    a.add_argument(
        "--expose-engine",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="allow tcp:// engine addresses beyond 127.0.0.1 (requires --curve-keys)",
    )
    a.add_argument(
        "--curve-keys",
        default=None,
        help="a directory of CurveZMQ keys made by `tandem keys DIR`: encrypts and "
        "authenticates every engine socket (needed between hosts)",
    )
    apply_env_defaults(parser)  # TANDEM_<FLAG> for every flag above


def parse_config(argv: list[str] | None = None, prog: str = "tandem serve") -> TandemConfig:
    """The config from these flags, over ``TANDEM_<FLAG>`` variables, over defaults."""
    parser = argparse.ArgumentParser(prog=prog)
    add_cli_args(parser)
    args = parser.parse_args(argv)
    try:
        return TandemConfig.from_cli_args(args)
    except ValueError as e:
        parser.error(str(e))
        raise  # unreachable: parser.error exits
