"""``EngineCore``: the scheduling of one service, without sockets or threads.

It steps the topology ``topology.py`` builds once the pools are ready: a slot per worker
pool (one unified pool, or a prefill and a decode pool) with its scheduler and KV manager
(one shared by both pools with ``--kv-transfer shm``, one each with ``tcp``), the hand-off
between pools (``handoff*.py``; ``NoHandoff`` for one pool) and the placement of each new
prompt (the one pool, or ``router.py``). ``step()`` is submit-then-poll: every idle pool gets its next
batch, then every pool is polled without waiting, so each keeps a batch in flight and a
long prefill step never holds back the decode pool's steps. With ``--async-scheduling``
each pool holds two: the next step is scheduled and sent while the workers run the last,
so they start it the moment they finish. Tests drive it in-process
with fake pools; ``proc.py`` runs it behind the engine's sockets.

    outputs = core.step()        # submit to idle pools, poll all, hand off, route outputs
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from itertools import zip_longest
from pathlib import Path

import msgspec

from common.config import TandemConfig
from common.lora import read_adapter
from common.lora_config import LoRAModule
from common.messages import (
    EngineRequest,
    ErrorKind,
    FinishReason,
    KVTransferStats,
    ModelInfo,
    PeerMessage,
    PoolRole,
    RequestOutput,
    SchedulerStats,
)
from engine_core.executor import PoolEvents
from engine_core.handoff import Handoff, NoHandoff, merge
from engine_core.kv_cache import KVCacheManager
from engine_core.lora_registry import LoRARegistry
from engine_core.remote_kv import NoRemoteKV, Outgoing, RemoteKV, role_refusal
from engine_core.request import Request
from engine_core.request_checks import request_error
from engine_core.request_spans import NoRequestSpans
from engine_core.scheduler import ClientOutputs, Scheduler
from engine_core.topology import Pool, Slot, Topology, build_topology

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepResult:
    outputs: ClientOutputs
    progressed: bool  # a step was submitted or completed


class EngineCore:
    def __init__(
        self,
        config: TandemConfig,
        pools: Mapping[PoolRole, Pool],
        clock: Callable[[], float] = time.monotonic,
        spans: NoRequestSpans | None = None,
    ) -> None:
        self.config = config
        self.pools = dict(pools)
        self._clock = clock
        # Traced requests' phase times; their spans are made as their last output leaves.
        self.spans = spans or NoRequestSpans()
        self.topology: Topology | None = None
        self.model: ModelInfo | None = None
        self.loras = LoRARegistry()  # --lora-modules join at start, once checked

    @property
    def ready(self) -> bool:
        return self.topology is not None

    @property
    def slots(self) -> dict[PoolRole, Slot]:
        return self.topology.slots if self.topology is not None else {}

    @property
    def handoff(self) -> Handoff:
        return self.topology.handoff if self.topology is not None else NoHandoff()

    @property
    def remote(self) -> RemoteKV | NoRemoteKV:
        """This instance's part in a fleet's prefill/decode split."""
        return self.topology.remote if self.topology is not None else NoRemoteKV()

    # ------------------------------------------------------------------ start

    def start(self) -> None:
        """Wait for every pool's workers, then build the topology from what they found."""
        readies = {role: pool.wait_ready() for role, pool in self.pools.items()}
        self.model = next(iter(readies.values())).model
        self.loras = LoRARegistry(self._checked_lora_modules(self.model))
        self.topology = build_topology(self.config, self.pools, readies, self._clock)

    def _checked_lora_modules(self, model: ModelInfo) -> list[LoRAModule]:
        """``--lora-modules``, each read against the model the workers loaded: a bad
        adapter stops the start with the reason (``AdapterError``)."""
        modules = self.config.model.lora_adapters
        for module in modules:
            read_adapter(
                Path(module.path),
                model.lora_module_shapes,
                model.num_layers,
                self.config.model.max_lora_rank,
            )
        return modules

    # ------------------------------------------------------------------ inputs

    def add_request(self, message: EngineRequest) -> ClientOutputs:
        """Queue a request in the pool that should prefill it; an output only if refused.
        The outputs' traces are ended here (``spans.finished``): send them as they are."""
        assert self.model is not None and self.topology is not None, "start() first"
        invalid = request_error(message, self.model)
        if invalid is None and message.lora is not None and not self.config.model.enable_lora:
            invalid = "this server runs no LoRA adapters (start it with --enable-lora)"
        if invalid is not None:
            logger.warning("[%s] refused: %s", message.request_id, invalid)
            refusal = RequestOutput(
                message.request_id, [], FinishReason.ERROR, invalid, ErrorKind.INVALID
            )
            return {message.client_id: [refusal]}
        if self._locate(message.request_id) is not None:
            refusal = RequestOutput(
                message.request_id,
                [],
                FinishReason.ERROR,
                f"request id {message.request_id} is already in use",
                ErrorKind.INVALID,
            )
            return {message.client_id: [refusal]}
        request = Request.from_engine_request(message)
        misplaced = role_refusal(self.remote.role, request)
        if misplaced is not None:
            why, param = misplaced
            refusal = RequestOutput(
                message.request_id,
                [],
                FinishReason.ERROR,
                why,
                ErrorKind.INVALID,
                error_param=param,
            )
            return {message.client_id: [refusal]}
        # Traced from here: the refusals above are of requests the engine never took (one
        # reusing a running request's id must not end that request's trace).
        self.spans.arrived(request, message.trace_headers)
        if request.remote_prefill:
            out = self.remote.add(request)
        else:
            error = self.topology.placement.place(request).add_request(request)
            out = {} if error is None else {message.client_id: [error]}
        self.spans.finished(out)  # a request refused by its pool ends its trace here
        return out

    def deliver(self, peer: bytes, message: PeerMessage) -> ClientOutputs:
        """A message from another instance's engine (a fleet's prefill/decode split)."""
        return self.remote.deliver(peer, message) if self.ready else {}

    def take_peer_outbox(self) -> list[Outgoing]:
        """Messages for other instances' engines, for the side-channel thread to send."""
        return self.remote.take_outbox()

    def _locate(self, request_id: str) -> Scheduler | Handoff | RemoteKV | NoRemoteKV | None:
        for slot in self.slots.values():
            if request_id in slot.scheduler.requests:
                return slot.scheduler
        for between in (self.handoff, self.remote):
            if request_id in between.in_flight:
                return between
        return None

    def abort(self, request_ids: list[str]) -> ClientOutputs:
        """Finish these requests with ABORT wherever they are; unknown ids are ignored."""
        out: ClientOutputs = {}
        for request_id in request_ids:
            where = self._locate(request_id)
            if isinstance(where, Scheduler):
                merge(out, where.abort_requests([request_id]))
            elif where is not None:
                merge(out, where.abort(request_id) or {})
        return out

    def cancel(self, request_id: str, owner: str | None) -> ClientOutputs:
        """Abort ``request_id`` and its other choices (``<id>-<k>``) that ``owner`` may
        cancel: its own, or any made without API keys."""
        requests = [r for slot in self.slots.values() for r in slot.scheduler.requests.values()]
        requests += self.handoff.in_flight.values()
        requests += self.remote.in_flight.values()
        ids = [
            r.request_id
            for r in requests
            if (r.request_id == request_id or r.request_id.startswith(request_id + "-"))
            and r.owner in (None, owner)
        ]
        return self.abort(ids)

    def kv_managers(self) -> list[KVCacheManager]:
        """Each pool's KV manager once (none before ``start``)."""
        return self.topology.kv_managers() if self.topology is not None else []

    def reset_prefix_cache(self) -> None:
        for kv in self.kv_managers():
            kv.reset_prefix_cache()
        logger.info("prefix cache reset")

    # ------------------------------------------------------------------ the step

    def has_work(self) -> bool:
        busy = any(
            bool(slot.in_flight) or slot.scheduler.has_work() for slot in self.slots.values()
        )
        return busy or bool(self.handoff.in_flight) or self.handoff.has_orders()

    def step(self) -> StepResult:
        """Submit each pool's next batch if it has room, then poll every pool without
        waiting."""
        out = merge(self.handoff.tick(), self.remote.tick())
        progressed = False
        for slot in self.slots.values():
            if slot.can_submit():
                progressed |= self._submit(slot)
        for slot in self.slots.values():
            events = slot.pool.poll()
            for result in events.transfers:
                merge(out, slot.side.on_result(result))
            if events.result is not None:
                progressed = True
                merge(out, self._finish_step(slot, events))
        return StepResult(out, progressed)

    def _submit(self, slot: Slot) -> bool:
        orders = slot.side.take_orders()
        if not slot.scheduler.has_work() and not orders:
            return False
        work = slot.scheduler.schedule()
        if orders:
            work = msgspec.structs.replace(
                work, kv_sends=orders.sends, kv_receives=orders.receives, kv_cancels=orders.cancels
            )
        elif not work.num_scheduled_tokens and not work.finished_request_ids:
            return False  # nothing could run (a static batch still forming)
        slot.pool.submit(work)
        slot.in_flight.append(work)
        self.spans.submitted(slot.role, work)
        return True

    def _finish_step(self, slot: Slot, events: PoolEvents) -> ClientOutputs:
        assert events.result is not None
        work = slot.in_flight.popleft()
        assert events.result.step_id == work.step_id, "a pool answers its steps in order"
        self.spans.step_done(slot.role, work)
        out = slot.scheduler.update_from_output(work, events.result)
        merge(out, slot.side.on_step_done(events.result))
        for request in slot.scheduler.take_handoffs():
            merge(out, self.handoff.start(request))
        return out

    def check_alive(self) -> None:
        for pool in self.pools.values():
            pool.check_alive()

    def fail_all(self, reason: str, outcome: str = "worker_died") -> ClientOutputs:
        """End every request with an error (the engine is going down)."""
        out = merge(self.handoff.fail_all(reason, outcome), self.remote.fail_all(reason, outcome))
        for slot in self.slots.values():
            merge(out, slot.scheduler.fail_all(reason))
        return out

    @property
    def num_requests(self) -> int:
        in_between = len(self.handoff.in_flight) + len(self.remote.in_flight)
        return in_between + sum(len(s.scheduler.requests) for s in self.slots.values())

    # ------------------------------------------------------------------ figures

    def pool_stats(self) -> dict[PoolRole, SchedulerStats]:
        stats = {}
        for role, slot in self.slots.items():
            stats[role] = slot.scheduler.stats()
            stats[role].num_worker_threads = slot.pool.num_threads
        return stats

    def stats(self) -> SchedulerStats:
        """Totals over the pools; a KV manager shared by both counts once. (A hand-off
        enters the decode pool without being a new request there: requests add up.)"""
        per_pool = list(self.pool_stats().values())
        if len(per_pool) <= 1 or self.topology is None:
            return per_pool[0] if per_pool else SchedulerStats()
        managers = self.topology.kv_managers()
        return SchedulerStats(
            num_running=sum(s.num_running for s in per_pool),
            num_waiting=sum(s.num_waiting for s in per_pool),
            num_tokens_scheduled=sum(s.num_tokens_scheduled for s in per_pool),
            num_requests_total=sum(s.num_requests_total for s in per_pool),
            num_generated_tokens_total=sum(s.num_generated_tokens_total for s in per_pool),
            num_preemptions_total=sum(s.num_preemptions_total for s in per_pool),
            num_prompt_tokens_total=sum(s.num_prompt_tokens_total for s in per_pool),
            iteration_tokens_sum=sum(s.iteration_tokens_sum for s in per_pool),
            iteration_tokens_buckets=[
                sum(c) for c in zip(*(s.iteration_tokens_buckets for s in per_pool), strict=True)
            ],
            num_worker_threads=sum(s.num_worker_threads for s in per_pool),
            num_prompt_tokens_waiting=sum(s.num_prompt_tokens_waiting for s in per_pool),
            num_kv_blocks_total=sum(kv.num_blocks for kv in managers),
            num_kv_blocks_in_use=sum(kv.num_used_blocks for kv in managers),
            prefix_cache_queries_total=sum(kv.prefix_queries for kv in managers),
            prefix_cache_hits_total=sum(kv.prefix_hits for kv in managers),
            spec_decode_num_drafts=sum(s.spec_decode_num_drafts for s in per_pool),
            spec_decode_num_draft_tokens=sum(s.spec_decode_num_draft_tokens for s in per_pool),
            spec_decode_num_accepted_tokens=sum(
                s.spec_decode_num_accepted_tokens for s in per_pool
            ),
            spec_decode_num_accepted_tokens_per_pos=[
                sum(c)
                for c in zip_longest(
                    *(s.spec_decode_num_accepted_tokens_per_pos for s in per_pool), fillvalue=0
                )
            ],
            lora_running=dict(sum((Counter(s.lora_running) for s in per_pool), Counter())),
            lora_waiting=dict(sum((Counter(s.lora_waiting) for s in per_pool), Counter())),
            lora_swaps_total=sum(s.lora_swaps_total for s in per_pool),
            max_loras=per_pool[0].max_loras,
        )

    def transfer_stats(self) -> KVTransferStats | None:
        return self.handoff.snapshot() or self.remote.snapshot()
