"""Continuous batching: every step, running requests first, then waiting ones, under a
token budget and ``max_num_seqs``.

There are no prefill or decode phases: each request has ``num_computed_tokens`` and
the scheduler gives it up to ``num_tokens - num_computed_tokens`` of the step's budget
(capped by ``long_prefill_token_threshold``), so a long prompt is prefilled in chunks
while other requests keep decoding. On admission, the prompt's cached prefix blocks are
reused. When KV blocks run out, the least urgent running request (largest priority
value, then latest arrival) is preempted: its blocks are freed and it is recomputed
later. ``--batching static`` keeps the old way for comparison: a batch forms, runs to
completion, and nothing joins it meanwhile.

Split pools use two schedulers. The prefill pool's (``hands_off``) lets a request go
once its prompt is computed and its first token sampled: ``take_handoffs`` hands it to
the engine with its KV blocks still allocated. The decode pool's takes such a request
with ``accept`` (its KV already in place) and decodes it; it also prefills the short
prompts the router sends it directly, and recomputes what it preempts.

Async scheduling (``--async-scheduling``): ``schedule`` may run again while the workers
still run its last step. A request's tokens in such steps count as scheduled ahead, and
the token such a step will sample as a placeholder, so the next step computes the
position after it (the worker appended the sampled token itself). A request that its
in-flight tokens will end by length is not scheduled again. Scheduling ahead never
preempts: when KV blocks run short it stops (``can_schedule_ahead`` turns false) until
the steps in flight are done, and preempts then.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

from common.config import SchedulerConfig
from common.messages import (
    CachedRequestData,
    ErrorKind,
    FinishReason,
    KVTransferParams,
    ModelInfo,
    ModelRunnerOutput,
    NewRequestData,
    RequestOutput,
    RequestTimings,
    SchedulerOutput,
    SchedulerStats,
)
from engine_core.batching import make_batching
from engine_core.iteration_tokens import IterationTokens
from engine_core.kv_cache import KVCacheManager, extend_block_hashes
from engine_core.lora_slots import LoRASlots, adapter_counts
from engine_core.request import Request, RequestStatus
from engine_core.request_limits import RequestLimits
from engine_core.request_queue import RequestQueue, make_queue
from engine_core.speculation import NoSpeculation, Speculation, make_speculation
from engine_core.steps_in_flight import StepsInFlight

logger = logging.getLogger(__name__)

ClientOutputs = dict[bytes, list[RequestOutput]]


class Lender(Protocol):
    """Keeps a finished request's prompt blocks for a remote decode (``kv_leases.py``)."""

    def hold(self, request: Request) -> KVTransferParams: ...


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        model: ModelInfo,
        clock: Callable[[], float] = time.monotonic,
        hands_off: bool = False,
        lender: Lender | None = None,  # a prefill instance of a fleet's split
        max_loras: int = 0,  # distinct LoRA adapters a step may run (0: LoRA off)
    ) -> None:
        self.config = config
        self.lora_slots = LoRASlots(max_loras)
        self.lender = lender
        self.kv = kv
        self.model = model
        self._clock = clock
        self.hands_off = hands_off
        self.requests: dict[str, Request] = {}
        self.incoming: deque[Request] = deque()  # accepted hand-offs, KV in place
        self._handoffs: list[Request] = []
        self._in_flight = StepsInFlight()
        self._stalled = False  # scheduling ahead found too few KV blocks
        self._drafting_steps: set[int] = set()  # steps in flight that verify drafts
        self.limits = RequestLimits(model, kv, config.max_waiting_requests)
        self.waiting: RequestQueue = make_queue(config)
        self.running: list[Request] = []
        # Without chunking a prompt runs whole in one step, whatever the budget says.
        self._step_budget = config.max_num_batched_tokens
        if not config.enable_chunked_prefill:
            self._step_budget = max(self._step_budget, model.max_model_len)
        self._prefill_cap = config.long_prefill_token_threshold or self._step_budget
        self._finished_for_workers: list[str] = []
        self._step_id = 0
        self.batching = make_batching(config, clock)
        self.num_requests_total = 0
        self.num_generated_tokens_total = 0
        self.num_preemptions_total = 0
        self.num_prompt_tokens_total = 0
        self._last_num_scheduled = 0
        self.iteration_tokens = IterationTokens()
        # A prefill pool's requests leave after one token: nothing to speculate on.
        self.speculation: Speculation = (
            NoSpeculation() if hands_off else make_speculation(config.speculative)
        )

    # ------------------------------------------------------------------ admission

    def add_request(self, request: Request) -> RequestOutput | None:
        """Queue a request; returns an error output instead if it cannot be queued."""
        self.num_requests_total += 1
        error = self.limits.admission_error(
            request, request.request_id in self.requests, len(self.waiting)
        )
        if error is not None:
            kind, message = error
            logger.warning("[%s] refused: %s", request.request_id, message)
            return RequestOutput(request.request_id, [], FinishReason.ERROR, message, kind)
        self.requests[request.request_id] = request
        self.num_prompt_tokens_total += request.num_prompt_tokens
        request.received_time = self._clock()
        self.waiting.add(request)
        self.batching.arrived()
        return None

    def accept(self, request: Request) -> None:
        """Take over a request whose prompt another pool computed: its KV blocks are
        allocated here under its id and hold ``request.num_computed_tokens`` tokens. It
        runs once ``max_num_seqs`` allows, ahead of new prompts."""
        request.status = RequestStatus.WAITING
        request.sent_to_workers = False
        self.requests[request.request_id] = request
        self.incoming.append(request)

    def recompute(self, request: Request) -> None:
        """Take over a request whose KV never arrived: prefill it (prompt and the tokens
        generated so far) again here, as after a preemption."""
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.sent_to_workers = False
        self.requests[request.request_id] = request
        self.waiting.readd_preempted(request)

    def take_handoffs(self) -> list[Request]:
        """Requests whose prompt is done in this (prefill) pool, to hand over; they have
        left this scheduler but keep their KV blocks."""
        handoffs, self._handoffs = self._handoffs, []
        return handoffs

    @property
    def step_budget(self) -> int:
        return self._step_budget

    def num_pending_prompt_tokens(self) -> int:
        """Tokens still to compute for requests waiting or running here."""
        return sum(r.num_tokens_to_compute for r in (*self.waiting, *self.running))

    @property
    def can_schedule_ahead(self) -> bool:
        """Whether another step may be scheduled before the running ones are done."""
        if self._stalled or self._drafting_steps:  # drafts decide where the next step starts
            return False
        return not self.speculation.wants_sync(len(self.running))

    def has_work(self) -> bool:
        return bool(
            len(self.waiting) or self.running or self.incoming or self._finished_for_workers
        )

    # ------------------------------------------------------------------ schedule

    def schedule(self) -> SchedulerOutput:
        ahead = bool(self._in_flight)  # the workers are still running earlier steps
        if not ahead:
            self._stalled = False
        budget = self._step_budget
        num_scheduled: dict[str, int] = {}
        drafts: dict[str, list[int]] = {}
        may_draft = not ahead and self.speculation.step_allows(len(self.running))
        cached_data: list[CachedRequestData] = []
        new_data: list[NewRequestData] = []
        preempted = False
        while (
            self.incoming
            and len(self.running) < self.config.max_num_seqs
            and self._lora_fits(self.incoming[0])
        ):
            request = self.incoming.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)

        # Most urgent first, so preemption victims (taken from the end) are never
        # requests already scheduled in this step.
        self.running.sort(key=self.waiting.urgency)
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = self._num_new_tokens(request, budget)
            if n == 0:  # every token it has is in flight, or they end it
                i += 1
                continue
            start = request.num_computed_tokens + request.num_scheduled_ahead
            draft = self._drafts(request, n, budget) if may_draft else []
            if draft and not self.kv.can_allocate(request.request_id, start + n + len(draft)):
                draft = []  # drafts never preempt anyone
            n += len(draft)
            if ahead and not self.kv.can_allocate(request.request_id, start + n):
                self._stalled = True  # preempt once the steps in flight are done
                break
            while not self.kv.can_allocate(request.request_id, start + n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            if request.status != RequestStatus.RUNNING:
                break  # the request itself was the least urgent one left
            kept = len(self.kv.blocks_of(request.request_id))
            new_blocks = self.kv.allocate(request.request_id, start + n)
            if request.sent_to_workers:
                cached = CachedRequestData(request.request_id, new_blocks, start, kept)
                cached_data.append(cached)
            else:  # accepted from another pool: this pool's workers see it first now
                new_data.append(self._new_request_data(request))
                request.sent_to_workers = True
            num_scheduled[request.request_id] = n
            if draft:
                drafts[request.request_id] = draft
            budget -= n
            i += 1

        if not preempted and not self._stalled:
            budget = self._admit_waiting(budget, num_scheduled, new_data)

        finished, self._finished_for_workers = self._finished_for_workers, []
        self._step_id += 1
        self.speculation.planned(ahead, bool(drafts))
        if num_scheduled:
            real = {r: n - len(drafts.get(r, ())) for r, n in num_scheduled.items()}
            self._in_flight.add(self._step_id, real, self.requests)
        if drafts:
            self._drafting_steps.add(self._step_id)
        self._last_num_scheduled = self._step_budget - budget
        if self._last_num_scheduled:
            self.iteration_tokens.observe(self._last_num_scheduled)
        return SchedulerOutput(
            self._step_id, new_data, cached_data, num_scheduled, finished, draft_token_ids=drafts
        )

    def _admit_waiting(
        self, budget: int, num_scheduled: dict[str, int], new_data: list[NewRequestData]
    ) -> int:
        quota = self.batching.quota(len(self.waiting), len(self.running))
        skipped: list[Request] = []
        while (
            quota > 0
            and len(self.waiting)
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting.peek()
            extend_block_hashes(
                request.block_hashes, request.token_ids, self.kv.block_size, request.cache_salt
            )
            hits = (
                self.kv.find_cached_prefix(request.block_hashes, request.num_tokens)
                if request.takes_cached_prefix
                else []
            )
            num_computed = len(hits) * self.kv.block_size
            remaining = request.num_tokens - num_computed
            n = min(remaining, budget, self._prefill_cap)
            if n < remaining and not self.config.enable_chunked_prefill:
                break  # the whole prompt must fit in this step
            if not self.kv.can_allocate(request.request_id, num_computed + n, hits):
                break
            if not self._lora_fits(request):
                # Its adapter has no slot while the running requests hold them all: the
                # requests behind it go first (as vLLM); it keeps its place in the queue.
                skipped.append(self.waiting.pop())
                continue
            self.waiting.pop()
            self.kv.allocate(request.request_id, num_computed + n, hits)
            self.kv.record_lookup(request.num_tokens, num_computed)
            request.num_computed_tokens = num_computed
            if not request.first_output_sent:
                request.num_cached_tokens = request.num_computed_tokens
            request.status = RequestStatus.RUNNING
            request.sent_to_workers = True
            if request.scheduled_time is None:
                request.scheduled_time = self._clock()
            self.running.append(request)
            self.batching.admitted()
            quota -= 1
            new_data.append(self._new_request_data(request))
            num_scheduled[request.request_id] = n
            budget -= n
        for request in reversed(skipped):
            self.waiting.readd_preempted(request)  # back where each was, in order
        return budget

    def _new_request_data(self, request: Request) -> NewRequestData:
        return NewRequestData(
            request.request_id,
            list(request.token_ids),
            request.sampling_params,
            list(self.kv.blocks_of(request.request_id)),
            request.num_computed_tokens,
            request.num_prompt_tokens,
            request.lora,
        )

    def _lora_fits(self, request: Request) -> bool:
        """Whether its adapter may run beside the running ones (``lora_slots.py``)."""
        return self.lora_slots.admit(request.lora, (r.lora for r in self.running))

    def _drafts(self, request: Request, n: int, budget: int) -> list[int]:
        """Tokens to verify after the one real token of a decoding request, within the
        budget left and short of its end (a draft past it could never be kept)."""
        if n != 1 or request.num_tokens_to_compute != 1 or not request.first_output_sent:
            return []  # a prefill (or its last chunk) samples its first token plainly
        room = min(
            budget - n,
            request.sampling_params.max_tokens - request.num_output_tokens - 1,
            self.limits.length_limit - request.num_tokens - 1,
        )
        return self.speculation.drafts_for(request, room) if room > 0 else []

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        placeholders = request.num_output_placeholders
        if placeholders and (
            self.hands_off  # its prompt is done: it leaves this pool with that token
            or request.num_output_tokens + placeholders >= request.sampling_params.max_tokens
            or request.num_tokens + placeholders >= self.limits.length_limit
        ):
            return 0  # the steps in flight end it
        return min(request.num_tokens_unscheduled, budget, self._prefill_cap)

    def _preempt(self, request: Request) -> None:
        """Free the request's blocks and send it back to the waiting queue."""
        self.running.remove(request)
        self.kv.free(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_scheduled_ahead = request.num_output_placeholders = 0
        request.restart_prefill()
        self.waiting.readd_preempted(request)
        self._finished_for_workers.append(request.request_id)  # workers drop its state
        request.sent_to_workers = False
        self.num_preemptions_total += 1
        logger.info("[%s] preempted (KV cache full)", request.request_id)

    # ------------------------------------------------------------------ results

    def update_from_output(self, step: SchedulerOutput, result: ModelRunnerOutput) -> ClientOutputs:
        """Account computed tokens, append sampled ones, finish what should stop. A request
        that ended while the step ran (aborted) is skipped; the blocks it held are freed
        only now that its workers are done writing them."""
        in_step, to_free = self._in_flight.done(step.step_id)
        self._drafting_steps.discard(step.step_id)
        for request_id, request in in_step.items():
            if self.requests.get(request_id) is not request:
                continue  # ended mid-step
            num_drafts = len(step.draft_token_ids.get(request_id, ()))
            n = step.num_scheduled_tokens[request_id] - num_drafts
            request.num_computed_tokens += n + result.num_accepted_drafts.get(request_id, 0)
            request.num_scheduled_ahead -= n
            if self.kv.enable_prefix_caching:
                extend_block_hashes(
                    request.block_hashes,
                    request.token_ids,
                    self.kv.block_size,
                    request.cache_salt,
                )
                self.kv.cache_full_blocks(
                    request_id,
                    request.block_hashes,
                    request.num_computed_tokens,
                    request.token_ids,
                    request.lora,
                )
        for request_id, entries in result.prompt_logprobs.items():
            if request_id in in_step and self.requests.get(request_id) is in_step[request_id]:
                in_step[request_id].gather_prompt_logprobs(entries)
        outputs: ClientOutputs = {}
        logprobs = result.logprobs or [None] * len(result.request_ids)
        for request_id, token, lp in zip(
            result.request_ids, result.sampled_token_ids, logprobs, strict=True
        ):
            maybe = self.requests.get(request_id)
            if maybe is None or in_step.get(request_id) is not maybe:
                continue  # ended mid-step: its token is dropped
            request = maybe
            request.num_output_placeholders -= 1
            new_tokens, reason = self._append(request, step, result, token)
            out = RequestOutput(
                request_id, new_tokens, reason, logprobs=None if lp is None else [lp]
            )
            if not request.first_output_sent:
                out.num_cached_tokens = request.num_cached_tokens
                out.prompt_logprobs = request.take_prompt_logprobs()
                request.first_output_sent = True
                request.first_token_time = self._clock()
            if reason is not None:
                if request.remote_decode and self.lender is not None:  # before its blocks go
                    out.kv_transfer_params = self.lender.hold(request)
                self._finish(request, reason)
                out.timings = self._timings(request)
            elif self.hands_off and request.num_output_tokens == 1:
                self._hand_off(request)
            outputs.setdefault(request.client_id, []).append(out)
        for request_id in to_free:
            self.kv.free(request_id)
        return outputs

    def _append(
        self, request: Request, step: SchedulerOutput, result: ModelRunnerOutput, token: int
    ) -> tuple[list[int], FinishReason | None]:
        """Append the step's new tokens (accepted drafts, then the sampled one) up to the
        first that ends the request; a speculative step gives back its rejected slots."""
        drafts = step.draft_token_ids.get(request.request_id, [])
        accepted = result.num_accepted_drafts.get(request.request_id, 0)
        if drafts:
            self.speculation.accepted(request.request_id, len(drafts), accepted)
        new_tokens: list[int] = []
        reason: FinishReason | None = None
        for t in [*drafts[:accepted], token]:
            request.token_ids.append(t)
            new_tokens.append(t)
            self.num_generated_tokens_total += 1
            reason = self.limits.stop_reason(request, t)
            if reason is not None:
                break
        if drafts and reason is None:
            self.kv.truncate(request.request_id, request.num_tokens)
        return new_tokens, reason

    def _hand_off(self, request: Request) -> None:
        """The prompt is done here: the request leaves, its KV blocks stay allocated."""
        self.running.remove(request)
        del self.requests[request.request_id]
        self._finished_for_workers.append(request.request_id)  # workers drop its state
        request.sent_to_workers = False
        request.status = RequestStatus.HANDED_OFF
        self._handoffs.append(request)

    def _timings(self, request: Request) -> RequestTimings:
        now = self._clock()
        received = request.received_time or now
        scheduled = request.scheduled_time or received
        first = request.first_token_time or now
        return RequestTimings(scheduled - received, first - scheduled, now - first)

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
                RequestOutput(request.request_id, [], FinishReason.ERROR, error, ErrorKind.INTERNAL)
            )
        return outputs

    def _finish(self, request: Request, reason: FinishReason) -> None:
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.incoming:
            self.incoming.remove(request)
        elif request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(request)
        if not self._in_flight.free_later(request.request_id):
            self.kv.free(request.request_id)
        if request.sent_to_workers:
            self._finished_for_workers.append(request.request_id)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        del self.requests[request.request_id]
        self.speculation.forget(request.request_id)
        logger.info(
            "[%s] finished (%s): %d prompt (%d cached) + %d output tokens",
            request.request_id,
            reason,
            request.num_prompt_tokens,
            request.num_cached_tokens,
            request.num_output_tokens,
        )

    def reset_prefix_cache(self) -> None:
        self.kv.reset_prefix_cache()
        logger.info("prefix cache reset")

    # ------------------------------------------------------------------ stats

    def stats(self) -> SchedulerStats:
        spec = self.speculation.counters
        lora_on = self.lora_slots.max_loras > 0
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting) + len(self.incoming),
            num_kv_blocks_total=self.kv.num_blocks,
            num_kv_blocks_in_use=self.kv.num_used_blocks,
            num_tokens_scheduled=self._last_num_scheduled,
            num_requests_total=self.num_requests_total,
            num_generated_tokens_total=self.num_generated_tokens_total,
            num_preemptions_total=self.num_preemptions_total,
            prefix_cache_queries_total=self.kv.prefix_queries,
            prefix_cache_hits_total=self.kv.prefix_hits,
            num_prompt_tokens_total=self.num_prompt_tokens_total,
            iteration_tokens_buckets=list(self.iteration_tokens.cumulative),
            iteration_tokens_sum=self.iteration_tokens.total,
            num_prompt_tokens_waiting=sum(
                max(0, r.num_prompt_tokens - r.num_computed_tokens)
                for r in (*self.waiting, *self.running)
            ),
            spec_decode_num_drafts=spec.num_drafts,
            spec_decode_num_draft_tokens=spec.num_draft_tokens,
            spec_decode_num_accepted_tokens=spec.num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=list(spec.accepted_per_pos),
            # Only with LoRA on: a priority queue's iteration sorts it, on every output.
            lora_running=adapter_counts(r.lora for r in self.running) if lora_on else {},
            lora_waiting=(
                adapter_counts(r.lora for r in (*self.waiting, *self.incoming)) if lora_on else {}
            ),
            lora_swaps_total=self.lora_slots.num_swaps_total,
            max_loras=self.lora_slots.max_loras,
        )
