"""A request as the engine core tracks it."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from common.messages import (
    EngineRequest,
    FinishReason,
    KVTransferParams,
    LoRARequest,
    SamplingParams,
    TokenLogprobs,
)


def lora_cache_key(lora: LoRARequest | None) -> bytes:
    """What an adapter adds to a request's block keys: its name and folder, as on every
    instance of a fleet (not the engine-local id), so two adapters never share KV and an
    adapter's prompts match across instances."""
    if lora is None:
        return b""
    return b"\x00lora\x00" + lora.name.encode() + b"\x00" + lora.path.encode()


@dataclass(frozen=True)
class KVPullRecord:
    """How a fleet decode instance's pull of this request's KV ended (for its trace)."""

    started: float  # engine clock: blocks allocated, the pull sent
    ended: float
    outcome: str  # done, refused, failed, expired (kv_transfers_total's outcomes)
    num_blocks: int
    num_bytes: int
    source_engine_id: str  # the prefill instance's


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED = 3
    HANDED_OFF = 4  # between pools: its prompt done in one, not yet decoding in the other


class Request:
    """Token ids (prompt, then outputs) and how many of them the KV cache holds."""

    def __init__(
        self,
        request_id: str,
        client_id: bytes,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: float,
        priority: int = 0,
        cache_salt: str | None = None,
        owner: str | None = None,
        kv_transfer: KVTransferParams | None = None,
        lora: LoRARequest | None = None,
    ) -> None:
        self.request_id = request_id
        self.client_id = client_id
        self.num_prompt_tokens = len(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.arrival_time = arrival_time
        self.priority = priority
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        # Async scheduling: tokens scheduled in steps the workers are still running, and
        # the tokens those steps will sample (the workers hold them; they come here with
        # the step's output).
        self.num_scheduled_ahead = 0
        self.num_output_placeholders = 0
        self.finish_reason: FinishReason | None = None
        self.sent_to_workers = False  # the workers hold state for it
        # Hashed into every block key: the salt, and the adapter (its KV is its own).
        self.cache_salt = (cache_salt or "").encode() + lora_cache_key(lora)
        self.lora = lora
        self.owner = owner
        self.block_hashes: list[bytes] = []  # chained hashes of its full blocks
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache
        self.first_output_sent = False
        # Engine clock times for RequestTimings: received, first scheduled, first token.
        self.received_time: float | None = None
        self.scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.handoff_started: float | None = None  # split pools: when the prompt was done
        self.kv_pull: KVPullRecord | None = None  # a fleet's decode: its KV pull, once ended
        # A fleet's prefill/decode split: asks a remote decode, or brings remote KV.
        self.kv_transfer = kv_transfer
        # Asked for prompt logprobs: they gather here chunk by chunk, for its first output.
        self.prompt_logprobs: list[TokenLogprobs] = []

    @staticmethod
    def from_engine_request(r: EngineRequest) -> Request:
        return Request(
            r.request_id,
            r.client_id,
            r.prompt_token_ids,
            r.sampling_params,
            r.arrival_time,
            r.priority,
            r.cache_salt,
            r.owner,
            r.kv_transfer,
            r.lora,
        )

    @property
    def takes_cached_prefix(self) -> bool:
        """Whether its prefill may skip cached blocks: not when it asked for prompt
        logprobs, which come from the prefill's own hidden states."""
        return self.sampling_params.prompt_logprobs is None

    def gather_prompt_logprobs(self, entries: list[TokenLogprobs]) -> None:
        """A step's prompt logprobs (a prefill recomputed after its first output has
        sent them already)."""
        if not self.first_output_sent:
            self.prompt_logprobs += entries

    def take_prompt_logprobs(self) -> list[TokenLogprobs] | None:
        """For its first output: the gathered prompt logprobs, if it asked."""
        if self.sampling_params.prompt_logprobs is None:
            return None
        taken, self.prompt_logprobs = self.prompt_logprobs, []
        return taken

    def restart_prefill(self) -> None:
        """Preempted: its prompt is prefilled again, its prompt logprobs with it."""
        if not self.first_output_sent:
            self.prompt_logprobs = []

    @property
    def remote_decode(self) -> bool:
        """Its blocks are to be lent to a decode instance once it finishes."""
        return self.kv_transfer is not None and self.kv_transfer.do_remote_decode

    @property
    def remote_prefill(self) -> bool:
        """Its prompt's KV is to be pulled from a prefill instance."""
        return self.kv_transfer is not None and self.kv_transfer.do_remote_prefill

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_tokens_to_compute(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def num_tokens_unscheduled(self) -> int:
        """Tokens no step has been given yet, counting those in-flight steps will sample."""
        return (
            len(self.token_ids)
            + self.num_output_placeholders
            - self.num_computed_tokens
            - self.num_scheduled_ahead
        )

    def __repr__(self) -> str:
        return f"Request({self.request_id}, {self.status.name}, computed={self.num_computed_tokens}/{self.num_tokens})"
