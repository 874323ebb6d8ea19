"""Continuous batching: every step, running requests first, then waiting ones, under a
token budget and ``max_num_seqs``.

There are no prefill or decode phases: each request has ``num_computed_tokens`` and
the scheduler gives it up to ``num_tokens - num_computed_tokens`` of the step's budget,
so a long prompt is prefilled in chunks while other requests keep decoding. When KV
blocks run out, the most recently admitted running request is preempted (its blocks
freed, to be recomputed later) so older ones can continue.
"""

from __future__ import annotations

import logging
from collections import deque

from common.config import SchedulerConfig
from common.messages import (
    CachedRequestData,
    FinishReason,
    ModelInfo,
    ModelRunnerOutput,
    NewRequestData,
    RequestOutput,
    SchedulerOutput,
    SchedulerStats,
)
from engine_core.kv_cache import KVCacheManager
from engine_core.request import Request, RequestStatus

logger = logging.getLogger(__name__)

ClientOutputs = dict[bytes, list[RequestOutput]]


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, model: ModelInfo) -> None:
        self.config = config
        self.kv = kv
        self.model = model
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_for_workers: list[str] = []
        self._step_id = 0
        self.num_requests_total = 0
        self.num_generated_tokens_total = 0
        self.num_preemptions_total = 0
        self._last_num_scheduled = 0

    # ------------------------------------------------------------------ admission

    def add_request(self, request: Request) -> RequestOutput | None:
        """Queue a request; returns an error output instead if it can never run."""
        self.num_requests_total += 1
        error = self._admission_error(request)
        if error is not None:
            logger.warning("[%s] rejected: %s", request.request_id, error)
            return RequestOutput(request.request_id, [], FinishReason.ERROR, error)
        self.requests[request.request_id] = request
        self.waiting.append(request)
        return None

    def _admission_error(self, request: Request) -> str | None:
        if request.request_id in self.requests:
            return f"request id {request.request_id} is already in use"
        if request.num_prompt_tokens == 0:
            return "the prompt is empty"
        limit = self.model.max_model_len
        if request.num_prompt_tokens >= limit:
            return f"the prompt has {request.num_prompt_tokens} tokens; this model's context is {limit} tokens"
        if self.kv.num_blocks_for(min(limit, request.num_prompt_tokens + 1)) > self.kv.num_blocks:
            return (
                f"the prompt needs more KV blocks than the whole cache holds ({self.kv.num_blocks})"
            )
        return None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._finished_for_workers)

    # ------------------------------------------------------------------ schedule

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_data: list[NewRequestData] = []
        cached_data: list[CachedRequestData] = []
        preempted = False

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = min(request.num_tokens_to_compute, budget)
            while not self.kv.can_allocate(request.request_id, request.num_computed_tokens + n):
                victim = self.running[-1]  # the latest admitted; never one scheduled already
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            if request.status != RequestStatus.RUNNING:
                break  # the request itself was the only victim left
            new_blocks = self.kv.allocate(request.request_id, request.num_computed_tokens + n)
            cached_data.append(
                CachedRequestData(request.request_id, new_blocks, request.num_computed_tokens)
            )
            num_scheduled[request.request_id] = n
            budget -= n
            i += 1

        while (
            self.waiting
            and budget > 0
            and not preempted
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting[0]
            n = min(request.num_tokens_to_compute, budget)
            if not self.kv.can_allocate(request.request_id, request.num_computed_tokens + n):
                break
            self.waiting.popleft()
            self.kv.allocate(request.request_id, request.num_computed_tokens + n)
            request.status = RequestStatus.RUNNING
            request.sent_to_workers = True
            self.running.append(request)
            new_data.append(
                NewRequestData(
                    request.request_id,
                    list(request.token_ids),
                    request.sampling_params,
                    list(self.kv.blocks_of(request.request_id)),
                    request.num_computed_tokens,
                )
            )
            num_scheduled[request.request_id] = n
            budget -= n

        finished, self._finished_for_workers = self._finished_for_workers, []
        self._step_id += 1
        self._last_num_scheduled = sum(num_scheduled.values())
        return SchedulerOutput(self._step_id, new_data, cached_data, num_scheduled, finished)

    def _preempt(self, request: Request) -> None:
        """Free the request's blocks and send it back to the front of the queue."""
        self.running.remove(request)
        self.kv.free(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        self.waiting.appendleft(request)
        self._finished_for_workers.append(request.request_id)  # workers drop its state
        request.sent_to_workers = False
        self.num_preemptions_total += 1
        logger.info("[%s] preempted (KV cache full)", request.request_id)

    # ------------------------------------------------------------------ results

    def update_from_output(self, step: SchedulerOutput, result: ModelRunnerOutput) -> ClientOutputs:
        """Account computed tokens, append sampled ones, finish what should stop."""
        for request_id, n in step.num_scheduled_tokens.items():
            self.requests[request_id].num_computed_tokens += n
        outputs: ClientOutputs = {}
        for request_id, token in zip(result.request_ids, result.sampled_token_ids, strict=True):
            request = self.requests[request_id]
            request.token_ids.append(token)
            self.num_generated_tokens_total += 1
            reason = self._stop_reason(request, token)
            if reason is not None:
                self._finish(request, reason)
            out = RequestOutput(request_id, [token], reason)
            outputs.setdefault(request.client_id, []).append(out)
        return outputs

    def _stop_reason(self, request: Request, token: int) -> FinishReason | None:
        params = request.sampling_params
        if not params.ignore_eos and token in self.model.eos_token_ids:
            return FinishReason.STOP
        if token in params.stop_token_ids:
            return FinishReason.STOP
        # A request never outgrows the context or the whole KV cache (it could never
        # be scheduled again).
        limit = min(self.model.max_model_len, self.kv.num_blocks * self.kv.block_size)
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= limit:
            return FinishReason.LENGTH
        return None

    def abort_requests(self, request_ids: list[str]) -> ClientOutputs:
        """Finish these requests with ABORT; unknown or finished ids are ignored."""
        outputs: ClientOutputs = {}
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            self._finish(request, FinishReason.ABORT)
            outputs.setdefault(request.client_id, []).append(
                RequestOutput(request_id, [], FinishReason.ABORT)
            )
        return outputs

    def fail_all(self, error: str) -> ClientOutputs:
        """End every request with an error (the engine is going down)."""
        outputs: ClientOutputs = {}
        for request in list(self.requests.values()):
            self._finish(request, FinishReason.ERROR)
            outputs.setdefault(request.client_id, []).append(
                RequestOutput(request.request_id, [], FinishReason.ERROR, error)
            )
        return outputs

    def _finish(self, request: Request, reason: FinishReason) -> None:
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request.request_id)
        if request.sent_to_workers:
            self._finished_for_workers.append(request.request_id)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        del self.requests[request.request_id]
        logger.info(
            "[%s] finished (%s): %d prompt + %d output tokens",
            request.request_id,
            reason,
            request.num_prompt_tokens,
            request.num_output_tokens,
        )

    # ------------------------------------------------------------------ stats

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_kv_blocks_total=self.kv.num_blocks,
            num_kv_blocks_in_use=self.kv.num_used_blocks,
            num_tokens_scheduled=self._last_num_scheduled,
            num_requests_total=self.num_requests_total,
            num_generated_tokens_total=self.num_generated_tokens_total,
        )
