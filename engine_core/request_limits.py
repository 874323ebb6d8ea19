"""What a request may be and when it must end: the checks at admission (a prompt this
model and this KV cache can hold, room in the queue) and the stop conditions applied to
every sampled token (EOS, stop tokens, ``max_tokens``, the context)."""

from __future__ import annotations

from common.messages import ErrorKind, FinishReason, ModelInfo
from engine_core.kv_cache import KVCacheManager
from engine_core.request import Request


class RequestLimits:
    def __init__(self, model: ModelInfo, kv: KVCacheManager, max_waiting_requests: int) -> None:
        self.model = model
        self.kv = kv
        self.max_waiting_requests = max_waiting_requests

    @property
    def length_limit(self) -> int:
        """The most tokens a request may hold: it never outgrows the context or the whole
        KV cache (it could never be scheduled again)."""
        return min(self.model.max_model_len, self.kv.num_blocks * self.kv.block_size)

    def admission_error(
        self, request: Request, id_in_use: bool, num_waiting: int
    ) -> tuple[ErrorKind, str] | None:
        """Why ``request`` cannot be queued, or None."""
        if id_in_use:
            return ErrorKind.INVALID, f"request id {request.request_id} is already in use"
        if request.num_prompt_tokens == 0:
            return ErrorKind.INVALID, "the prompt is empty"
        limit = self.model.max_model_len
        if request.num_prompt_tokens >= limit:
            return ErrorKind.INVALID, (
                f"the prompt has {request.num_prompt_tokens} tokens; this model's context length is {limit} tokens"
            )
        if self.kv.num_blocks_for(request.num_prompt_tokens + 1) > self.kv.num_blocks:
            return (
                ErrorKind.INVALID,
                f"the prompt needs more KV blocks than the whole cache holds ({self.kv.num_blocks})",
            )
        if num_waiting >= self.max_waiting_requests:
            return ErrorKind.OVERLOADED, (
                f"the queue is full ({self.max_waiting_requests} waiting requests); retry later"
            )
        return None

    def stop_reason(self, request: Request, token: int) -> FinishReason | None:
        """Why ``request`` ends with ``token`` (already appended), or None."""
        params = request.sampling_params
        if not params.ignore_eos and token in self.model.eos_token_ids:
            return FinishReason.STOP
        if token in params.stop_token_ids:
            return FinishReason.STOP
        if (
            request.num_output_tokens >= params.max_tokens
            or request.num_tokens >= self.length_limit
        ):
            return FinishReason.LENGTH
        return None
