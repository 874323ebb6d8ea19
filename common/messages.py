"""Every type that crosses a process boundary, in one place.

The life of a request, and the module that handles each step:

1. ``api_server/driver.py`` parses the HTTP body (the flavour's format object),
   ``api_server/generation.py`` validates and tokenizes the prompt and sends an
   ``EngineRequest`` over the engine's input socket (``api_server/client.py``).
2. ``engine_core/proc.py``'s input thread decodes it and queues it for the step loop;
   the ``Scheduler`` (``engine_core/scheduler.py``) admits it when the token budget,
   ``max_num_seqs`` and free KV blocks (``engine_core/kv_cache.py``) allow.
3. Each step the scheduler emits a ``SchedulerOutput``: a ``NewRequestData`` the first
   time a request is scheduled (or after it was preempted), then only a
   ``CachedRequestData`` diff (new block ids, tokens computed so far), plus the ids of
   finished requests so workers drop their state. ``engine_core/executor.py`` sends it
   to every worker of the pool.
4. ``worker/model_runner.py`` runs one batched forward over all scheduled tokens,
   samples, and answers with a ``ModelRunnerOutput``.
5. The scheduler appends sampled tokens, checks EOS / stop token ids / max_tokens /
   max model length, frees the blocks of finished requests, and the engine's output
   thread sends ``EngineOutputs`` (one ``RequestOutput`` per request that progressed)
   to the API server that owns each request.
6. ``api_server/detokenizer.py`` detokenizes incrementally and checks stop strings
   (sending an ``AbortRequests`` when one hits); ``api_server/app.py`` writes SSE
   chunks or the final JSON body.

Wire rules: every struct is MessagePack, ``array_like`` (field order is the wire
format), so fields are only ever appended, with defaults. A test pins the encoding.
"""

from __future__ import annotations

import enum

import msgspec


class _Wire(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Base of every wire struct: positional MessagePack arrays, defaults omitted."""


class FinishReason(enum.IntEnum):
    """Why a request ended. ``str()`` gives the OpenAI ``finish_reason`` word."""

    STOP = 0  # EOS, a stop token id or a stop string
    LENGTH = 1  # max_tokens or the model's context length
    ABORT = 2  # cancelled by the client or the API server
    ERROR = 3  # the engine or a worker failed

    def __str__(self) -> str:
        return ("stop", "length", "abort", "error")[self.value]


class ErrorKind(enum.IntEnum):
    """Why the engine refused or failed a request, so the API can answer with the right status."""

    INVALID = 1  # can never run as asked (400)
    OVERLOADED = 2  # queue full; retry later (503)
    INTERNAL = 3  # the engine or a worker failed (500/503)


class StructuredOutputKind(enum.IntEnum):
    """What constrains a request's output (``StructuredOutput.spec`` says how)."""

    JSON_SCHEMA = 0  # spec: a JSON schema, as JSON text
    JSON_OBJECT = 1  # any JSON object; spec unused
    REGEX = 2  # spec: a regular expression the whole output matches
    CHOICE = 3  # spec: a JSON list of strings, the output is one of them
    GRAMMAR = 4  # spec: an EBNF (GBNF) grammar whose root rule the output matches
    LLGUIDANCE = 5  # spec: llguidance's JSON grammar (several, referring to one another)


class StructuredOutput(_Wire):
    """A constraint on the output, compiled into a token mask by the worker's sampler."""

    kind: StructuredOutputKind
    spec: str = ""


class SamplingParams(_Wire):
    """How to pick tokens for one request. ``temperature == 0`` means greedy."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off; over prompt and output tokens
    presence_penalty: float = 0.0  # over output tokens
    frequency_penalty: float = 0.0  # over output tokens
    logprobs: int | None = None  # top-k logprobs per sampled token; 0 = only its own
    min_tokens: int = 0  # EOS and stop_token_ids cannot be sampled before this many tokens
    logit_bias: dict[int, float] | None = None  # added to these tokens' logits
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    structured: StructuredOutput | None = None  # JSON schema, regex, choice or grammar
    # Logprobs of the prompt's tokens after the first, with the top-k at each (vLLM's
    # prompt_logprobs); such a request is never served from the prefix cache.
    prompt_logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class TokenLogprobs(_Wire):
    """Log-probability of a sampled token under the model's raw distribution, and the
    ``k`` most likely tokens with theirs."""

    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]
    rank: int = 0  # its place among the vocabulary by logprob, from 1 (0: not computed)


# ---------------------------------------------------------------- between instances
# A fleet's prefill/decode split (``docs/fleet.md``). ``KVTransferParams`` is the
# NixlConnector's contract, the ``kv_transfer_params`` a router copies from a prefill
# instance's answer into the request it sends a decode instance; it also rides inside
# ``EngineRequest`` and ``RequestOutput``. A decode instance's engine sends ``KVPull`` to
# the prefill instance's side channel (``kv_ip:kv_port``), which answers ``KVPullAck``
# at once (it is alive and has the pull) and ``KVPullAnswer`` once its engine has checked
# the pull against the lease. The KV itself travels on the TCP KV stream
# (``worker/kv_transfer.py``), each transfer behind a ``KVStreamHeader``.


class KVTransferParams(msgspec.Struct):
    """vLLM's NixlConnector ``kv_transfer_params``, as JSON objects spell them.

    A prefill request asks ``do_remote_decode``; its answer names the lease
    (``remote_request_id``), the prompt's full blocks on the prefill instance
    (``remote_block_ids``), the instance (``remote_engine_id``) and its side channel
    (``remote_host``/``remote_port``). A decode request carries those with
    ``do_remote_prefill``."""

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    remote_block_ids: list[int] | None = None
    remote_request_id: str | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    tp_size: int = 1
    block_size: int | None = None  # Tandem: the prefill instance's tokens per block

    @property
    def side_channel(self) -> str:
        host = self.remote_host or ""
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"  # an IPv6 address, as ZeroMQ spells it
        return f"tcp://{host}:{self.remote_port}"


class KVPull(msgspec.Struct, array_like=True, tag=True):
    """Decode engine -> prefill side channel: send lease ``lease_id``'s blocks
    ``block_ids`` (positions ``first_block`` on of its prompt, whose chained hashes are
    ``block_hashes``) to ``destinations`` as transfer ``transfer_id``, for a request made
    with ``owner``'s key (it must be the prefill request's). No blocks: the
    decode side needs none (it holds them, or gave up); the lease can go."""

    lease_id: str
    engine_id: str
    transfer_id: str
    first_block: int
    block_ids: list[int]
    block_hashes: list[bytes]
    destinations: list[str]
    block_size: int
    owner: str | None = None  # the API key (by digest) of the decode request


class KVPullAck(msgspec.Struct, array_like=True, tag=True):
    """Prefill side channel -> decode engine: the pull reached a live instance."""

    transfer_id: str


class KVPullAnswer(msgspec.Struct, array_like=True, tag=True):
    """Prefill engine -> decode engine: the pull is being sent (``ok``), or why not.
    ``param``: the ``kv_transfer_params`` field found not to match the lease (a forged or
    mistaken request, refused with 400); None for any other failure."""

    transfer_id: str
    ok: bool
    error: str | None = None
    param: str | None = None


PeerMessage = KVPull | KVPullAck | KVPullAnswer


class KVStreamHeader(msgspec.Struct, array_like=True):
    """Prefill worker -> decode worker, before a transfer's bytes on the TCP KV stream."""

    transfer_id: str
    num_blocks: int
    num_bytes: int
    checksum: int  # XXH3-64 of the frames


# ---------------------------------------------------------------- api_server -> engine


class LoRARequest(_Wire):
    """A LoRA adapter a request runs with (vLLM's ``LoRARequest``): ``name`` is what
    clients pass as ``model``, ``int_id`` the engine's id for this load of it (unique for
    the engine's life: a name loaded again gets a new id, so no KV or weights of the old
    files are reused), ``path`` the PEFT folder every worker reads it from."""

    name: str
    int_id: int
    path: str


class EngineRequest(_Wire, tag=True):
    """A tokenized request, sent once by the API server that owns it."""

    request_id: str
    client_id: bytes
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None  # isolates this request's prefix-cache entries
    owner: str | None = None  # the API key (by digest) that made it: it alone may cancel it
    # A fleet's prefill/decode split: prefill it for a remote decode, or pull its KV.
    kv_transfer: KVTransferParams | None = None
    lora: LoRARequest | None = None  # the adapter it runs with; None: the base model
    # W3C traceparent/tracestate of the API server's request span, when tracing is on
    # (``common/tracing.py``): the engine's spans of this request join that trace.
    trace_headers: dict[str, str] | None = None


class AbortRequests(_Wire, tag=True):
    """Stop these requests and free their blocks. Unknown ids are ignored."""

    request_ids: list[str]


class CancelRequests(_Wire, tag=True):
    """Cancel by id from any API-server process (``--api-server-count``): the request
    ``request_id`` and its other choices (``<id>-<k>``), if ``owner`` made them (or they
    were made without keys)."""

    request_id: str
    owner: str | None = None


class ResetPrefixCache(_Wire, tag=True):
    """Forget every cached prefix block (e.g. after changing weights)."""


class LoadLoRAAdapter(_Wire, tag=True):
    """Serve the PEFT adapter at ``path`` as model ``name`` from now on (the API server
    checked the files); every API server learns it from the next heartbeat."""

    name: str
    path: str


class UnloadLoRAAdapter(_Wire, tag=True):
    """Stop serving adapter ``name`` to new requests; those running finish on it."""

    name: str


EngineInput = (
    EngineRequest
    | AbortRequests
    | ResetPrefixCache
    | CancelRequests
    | LoadLoRAAdapter
    | UnloadLoRAAdapter
)


# ---------------------------------------------------------------- engine -> api_server


class RequestTimings(_Wire):
    """Where a finished request spent its time in the engine, in seconds: waiting to be
    first scheduled, from then to its first token (prefill), and after (decode)."""

    queued_s: float
    prefill_s: float
    decode_s: float


class RequestOutput(_Wire):
    """New tokens of one request since its last output; ``finish_reason`` on the last."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    error: str | None = None
    error_kind: ErrorKind | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    logprobs: list[TokenLogprobs] | None = None  # one per new token, when asked
    timings: RequestTimings | None = None  # on the last output of a finished request
    # On the last output of a request prefilled for a remote decode: where its KV waits.
    kv_transfer_params: KVTransferParams | None = None
    error_param: str | None = None  # the request field an INVALID error is about
    # On the first output of a request that asked: one per prompt token after the first.
    prompt_logprobs: list[TokenLogprobs] | None = None


class SchedulerStats(_Wire):
    """A snapshot of the scheduler, taken after a step."""

    num_running: int = 0
    num_waiting: int = 0
    num_kv_blocks_total: int = 0
    num_kv_blocks_in_use: int = 0
    num_tokens_scheduled: int = 0
    num_requests_total: int = 0
    num_generated_tokens_total: int = 0
    num_preemptions_total: int = 0
    prefix_cache_queries_total: int = 0  # prompt tokens looked up
    prefix_cache_hits_total: int = 0  # of which found in the cache
    num_prompt_tokens_total: int = 0  # prompt tokens of admitted requests
    # Tokens per step as a cumulative histogram: counts of steps with at most
    # ITERATION_TOKEN_BUCKETS[i] tokens (the last entry counts every step), and their sum.
    iteration_tokens_buckets: list[int] = []
    iteration_tokens_sum: int = 0
    # Frames the engine's input socket dropped: undecodable ones, and connections cut
    # for a frame over the size limit (or lost by a peer that went away).
    num_malformed_frames_total: int = 0
    num_dropped_connections_total: int = 0
    # CPU threads the pool's workers ran their latest steps on, summed over workers (the
    # thread governor lowers a worker's while other processes hold its cores); 0 before
    # any step.
    num_worker_threads: int = 0
    # Prompt tokens still to prefill, of waiting and running requests (a prefill
    # instance's autoscaling signal).
    num_prompt_tokens_waiting: int = 0
    # Speculative decoding (vLLM's spec_decode_* counters): steps that verified drafts
    # per request, drafted tokens, accepted ones, and accepted ones by draft position.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = []
    # LoRA: running and waiting requests per adapter name, adapters swapped into a slot.
    lora_running: dict[str, int] = {}
    lora_waiting: dict[str, int] = {}
    lora_swaps_total: int = 0
    max_loras: int = 0  # --max-loras; 0: LoRA off


ITERATION_TOKEN_BUCKETS: tuple[int, ...] = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class ModelInfo(_Wire):
    """What a worker learned from the model files, for the engine and API servers."""

    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    num_layers: int = 0
    # Each projection a LoRA adapter may target (q_proj ... down_proj): its whole
    # (in_features, out_features), what an adapter's A and B must agree with.
    lora_module_shapes: dict[str, tuple[int, int]] = {}


class EngineOutputs(_Wire, tag=True):
    """Outputs of one step for one API server, with the step's stats."""

    outputs: list[RequestOutput]
    stats: SchedulerStats | None = None


class KVTransferStats(_Wire):
    """Hand-offs between the prefill and decode pools, cumulative (split pools only).

    ``outcomes`` counts each hand-off once by how it ended: done, failed, aborted, refused,
    expired, worker_died; ``local_prefill`` counts requests the router prefilled in the
    decode pool instead. Durations (start to decode-ready) as a cumulative histogram over
    ``KV_TRANSFER_BUCKETS_S`` (last entry: every hand-off), with their sum."""

    outcomes: dict[str, int] = {}
    num_bytes_total: int = 0
    duration_buckets: list[int] = []
    duration_sum_s: float = 0.0


KV_TRANSFER_BUCKETS_S: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip


class EngineHeartbeat(_Wire, tag=True):
    """Sent to every known client a few times a second: proves the engine alive.

    ``ready`` turns true once every worker of every pool has loaded the model and warmed
    up; ``model`` carries what the workers found (context length, EOS ids, vocabulary);
    ``role`` is this engine's part in the service: ``unified`` (prefill and decode in one
    pool) or ``split`` (a prefill and a decode pool); ``pools`` has each pool's figures
    when split (``stats`` are then the totals), ``kv_transfers`` the hand-offs.
    """

    ready: bool
    stats: SchedulerStats
    model: ModelInfo | None = None
    role: str = "unified"
    pools: dict[str, SchedulerStats] = {}
    kv_transfers: KVTransferStats | None = None
    lora_adapters: list[LoRARequest] = []  # the adapters served now, by load order


class EngineDead(_Wire, tag=True):
    """The engine is going down; ``reason`` names the process that died."""

    reason: str


class ClientHello(_Wire, tag=True):
    """First frame a client sends on the output socket so the engine can route to it."""

    client_id: bytes


EngineOutput = EngineOutputs | EngineHeartbeat | EngineDead


# ---------------------------------------------------------------- engine <-> workers


class PoolRole(enum.IntEnum):
    """What a worker pool does: everything, or one side of a prefill/decode split."""

    UNIFIED = 0
    PREFILL = 1
    DECODE = 2

    def __str__(self) -> str:
        return ("unified", "prefill", "decode")[self.value]


class WorkerReady(_Wire, tag=True):
    """A worker's handshake: values found at run time, never written into configs.
    ``kv_address`` is where a decode worker takes KV over TCP (``--kv-transfer tcp``)."""

    rank: int
    num_kv_blocks: int
    block_size: int
    model: ModelInfo
    pool: PoolRole = PoolRole.UNIFIED
    kv_address: str = ""
    num_kv_bytes_per_block: int = 0  # all layers, K and V


class KVSend(_Wire):
    """Engine -> prefill worker: copy these blocks out (before this step's forward) and
    stream them to the decode pool as transfer ``transfer_id``: to each address of
    ``destinations``, one per decode rank, that rank's KV heads (one address unless the
    decode pool is tensor-parallel)."""

    transfer_id: str
    block_ids: list[int]
    destinations: list[str]


class KVReceive(_Wire):
    """Engine -> decode worker: transfer ``transfer_id`` lands in ``block_ids``, each
    valid only at its ``generations`` entry (a block reallocated since is never written).
    ``src_block_ids``: ``shm`` between pools of different widths, where the decode worker
    copies the blocks itself out of the prefill ranks' shared memory (``tcp``: empty)."""

    transfer_id: str
    block_ids: list[int]
    generations: list[int]
    src_block_ids: list[int] = []


class KVTransferResult(_Wire):
    """Worker -> engine: how a transfer ended on this side (the decode side reports
    landing, the prefill side a failed send)."""

    transfer_id: str
    ok: bool
    error: str | None = None
    num_bytes: int = 0


class NewRequestData(_Wire):
    """Everything a worker needs the first time it sees a request (or after preemption).

    ``token_ids`` holds the prompt and any tokens generated before a preemption.
    """

    request_id: str
    token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    num_prompt_tokens: int = 0  # of token_ids; the rest were generated before a preemption
    lora: LoRARequest | None = None  # the adapter its rows run with


class CachedRequestData(_Wire):
    """The diff for a request the worker already holds."""

    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    # The worker keeps this many of the request's blocks before appending new_block_ids:
    # a speculative step's rejected drafts gave the rest back. None keeps them all.
    num_kept_blocks: int | None = None


class SchedulerOutput(_Wire, tag=True):
    """One step's work. ``num_scheduled_tokens`` keeps the batch order. The KV transfer
    orders of split pools ride along (``--kv-transfer tcp``)."""

    step_id: int
    new_requests: list[NewRequestData]
    cached_requests: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    finished_request_ids: list[str]
    kv_sends: list[KVSend] = []
    kv_receives: list[KVReceive] = []
    kv_cancels: list[str] = []  # transfer ids: drop whatever arrives for them
    # Tensor parallelism: what rank 0 sampled in the pool's previous step, for the other
    # ranks (which do not sample) to append to their requests before this step.
    prev_sampled: dict[str, int] = {}
    # Speculative decoding: the proposed tokens per request, counted in its
    # num_scheduled_tokens after its real ones; the workers verify them this step.
    draft_token_ids: dict[str, list[int]] = {}

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


class ModelRunnerOutput(_Wire, tag=True):
    """Sampled tokens for the requests whose scheduled tokens reached their end."""

    step_id: int
    request_ids: list[str]
    sampled_token_ids: list[int]
    logprobs: list[TokenLogprobs | None] = []  # aligned with request_ids, when any asked
    kv_copied: list[str] = []  # transfers whose blocks were copied out: free to reuse
    kv_results: list[KVTransferResult] = []
    num_threads: int = 0  # the CPU threads this worker ran the step on (0: not said)
    # Per request that asked: the logprobs of the prompt tokens this step's positions
    # predict (worker/prompt_logprobs.py), in order.
    prompt_logprobs: dict[str, list[TokenLogprobs]] = {}
    # Per request that verified drafts: how many of them were accepted. Its new tokens
    # are those drafts, then its sampled token (the target's own at the first mismatch).
    num_accepted_drafts: dict[str, int] = {}


class KVTransferStatus(_Wire, tag=True):
    """Worker -> engine between steps: transfers that ended while the worker was idle."""

    rank: int
    results: list[KVTransferResult]


class WorkerHeartbeat(_Wire, tag=True):
    """A worker started by its own command proves itself alive to an engine that did
    not start it (``--external-workers``), from a thread beside its step loop."""

    rank: int


class WorkerFailed(_Wire, tag=True):
    """A worker could not run a step (or load); it exits after sending this."""

    rank: int
    error: str


class Shutdown(_Wire, tag=True):
    """Engine -> worker: exit cleanly."""


WorkerInput = SchedulerOutput | Shutdown
WorkerMessage = WorkerReady | ModelRunnerOutput | WorkerFailed | KVTransferStatus | WorkerHeartbeat
