"""``EngineCore``: the scheduling of one service, without sockets or threads.

It owns a scheduler per worker pool (``unified``, or ``prefill`` + ``decode``), their
KV managers (one shared by both pools with ``--kv-transfer shm``, one each with ``tcp``),
the hand-offs between pools (``handoff.py``) and the router that picks a pool for each
new prompt (``router.py``). ``step()`` is submit-then-poll: every idle pool gets its next
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
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import msgspec

from common.config import TandemConfig
from common.messages import (
    EngineRequest,
    ErrorKind,
    FinishReason,
    KVTransferStats,
    ModelInfo,
    PoolRole,
    RequestOutput,
    SchedulerOutput,
    SchedulerStats,
    WorkerReady,
)
from engine_core.executor import PoolEvents
from engine_core.handoff import Handoff, SharedMemoryHandoff, TcpHandoff, merge
from engine_core.handoff_pull import ShmCopyHandoff
from engine_core.kv_cache import KVCacheManager
from engine_core.request import Request
from engine_core.request_checks import request_error
from engine_core.router import Router
from engine_core.scheduler import ClientOutputs, Scheduler

logger = logging.getLogger(__name__)


class Pool(Protocol):
    """A pool of workers as the engine drives it (``executor.WorkerPool``, or a fake)."""

    role: PoolRole
    kv_addresses: list[str]  # per rank, after wait_ready: where a decode rank takes KV

    @property
    def busy(self) -> bool: ...

    @property
    def num_threads(self) -> int:
        """CPU threads its workers ran their latest steps on, summed."""
        ...

    def wait_ready(self) -> WorkerReady: ...

    def submit(self, step: SchedulerOutput) -> None: ...

    def poll(self) -> PoolEvents: ...

    def check_alive(self) -> None: ...


@dataclass
class Slot:
    """A pool with its scheduler and the steps it is running, oldest first: at most
    ``depth`` (2 with async scheduling: one running, the next waiting at the workers)."""

    pool: Pool
    scheduler: Scheduler
    depth: int = 1
    in_flight: deque[SchedulerOutput] = field(default_factory=deque)

    @property
    def name(self) -> str:
        return str(self.pool.role)

    def can_submit(self) -> bool:
        if not self.in_flight:
            return True
        return len(self.in_flight) < self.depth and self.scheduler.can_schedule_ahead


@dataclass(frozen=True)
class StepResult:
    outputs: ClientOutputs
    progressed: bool  # a step was submitted or completed


class EngineCore:
    def __init__(
        self,
        config: TandemConfig,
        pools: Mapping[str, Pool],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.pools = dict(pools)
        self._clock = clock
        self.slots: dict[str, Slot] = {}
        self.handoff: Handoff | None = None
        self.router: Router | None = None
        self.model: ModelInfo | None = None

    @property
    def split(self) -> bool:
        return self.config.disagg.split

    @property
    def ready(self) -> bool:
        return bool(self.slots)

    # ------------------------------------------------------------------ start

    def start(self) -> None:
        """Wait for every pool's workers, then size the KV managers from what they found."""
        readies = {name: pool.wait_ready() for name, pool in self.pools.items()}
        first = next(iter(readies.values()))
        self.model = first.model
        config = self.config.scheduler
        caching = config.enable_prefix_caching
        depth = config.max_steps_in_flight
        if not self.split:
            kv = KVCacheManager(first.num_kv_blocks, first.block_size, caching)
            self.slots["unified"] = Slot(
                self.pools["unified"],
                Scheduler(config, kv, first.model, self._clock),
                depth,
            )
            return
        disagg = self.config.disagg
        shared = disagg.kv_transfer == "shm" and not disagg.reshards  # one block pool
        sizes = {name: ready.num_kv_blocks for name, ready in readies.items()}
        if shared and len(set(sizes.values())) != 1:
            raise RuntimeError(f"the pools map KV segments of different sizes: {sizes}")
        prefill_kv = KVCacheManager(sizes["prefill"], first.block_size, caching)
        decode_kv = (
            prefill_kv if shared else KVCacheManager(sizes["decode"], first.block_size, caching)
        )
        prefill = Scheduler(config, prefill_kv, first.model, self._clock, hands_off=True)
        decode = Scheduler(config, decode_kv, first.model, self._clock)
        self.slots = {
            "prefill": Slot(self.pools["prefill"], prefill, depth),
            "decode": Slot(self.pools["decode"], decode, depth),
        }
        self.router = Router(prefill, decode, self.config.disagg)
        decode_ranks = disagg.tp_size("decode")
        lease, policy = disagg.kv_transfer_lease_s, disagg.kv_load_failure_policy
        bytes_per_block = readies["decode"].num_kv_bytes_per_block
        if shared:
            self.handoff = SharedMemoryHandoff(decode, self._clock)
        elif disagg.kv_transfer == "shm":  # pools of different widths
            self.handoff = ShmCopyHandoff(
                prefill_kv, decode, decode_ranks, lease, policy, bytes_per_block, self._clock
            )
        else:
            # TP: every decode rank takes its own heads; else the one worker's address
            # (further decode workers are replicas whose answers are not used).
            tp = decode_ranks > 1
            destinations = (
                self.pools["decode"].kv_addresses if tp else [readies["decode"].kv_address]
            )
            self.handoff = TcpHandoff(
                prefill_kv, decode, destinations, lease, policy, bytes_per_block, self._clock
            )

    # ------------------------------------------------------------------ inputs

    def add_request(self, message: EngineRequest) -> ClientOutputs:
        """Queue a request in the pool that should prefill it; an output only if refused."""
        assert self.model is not None, "start() first"
        invalid = request_error(message, self.model)
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
        target = self._first_scheduler()
        if self.router is not None and self.router.prefill_locally(request):
            target = self.router.decode
            assert self.handoff is not None
            self.handoff.stats.ended("local_prefill")
        error = target.add_request(request)
        return {} if error is None else {message.client_id: [error]}

    def _first_scheduler(self) -> Scheduler:
        return self.slots["prefill" if self.split else "unified"].scheduler

    def _locate(self, request_id: str) -> Scheduler | Handoff | None:
        for slot in self.slots.values():
            if request_id in slot.scheduler.requests:
                return slot.scheduler
        if self.handoff is not None and request_id in self.handoff.in_flight:
            return self.handoff
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
        if self.handoff is not None:
            requests += self.handoff.in_flight.values()
        ids = [
            r.request_id
            for r in requests
            if (r.request_id == request_id or r.request_id.startswith(request_id + "-"))
            and r.owner in (None, owner)
        ]
        return self.abort(ids)

    def reset_prefix_cache(self) -> None:
        for kv in {id(s.scheduler.kv): s.scheduler.kv for s in self.slots.values()}.values():
            kv.reset_prefix_cache()
        logger.info("prefix cache reset")

    # ------------------------------------------------------------------ the step

    def has_work(self) -> bool:
        busy = any(
            bool(slot.in_flight) or slot.scheduler.has_work() for slot in self.slots.values()
        )
        between = self.handoff is not None and (self.handoff.in_flight or self.handoff.has_orders())
        return busy or bool(between)

    def step(self) -> StepResult:
        """Submit each pool's next batch if it has room, then poll every pool without
        waiting."""
        out: ClientOutputs = {}
        progressed = False
        if self.handoff is not None:
            merge(out, self.handoff.tick())
        for slot in self.slots.values():
            if slot.can_submit():
                progressed |= self._submit(slot)
        for slot in self.slots.values():
            events = slot.pool.poll()
            for result in events.transfers:
                assert self.handoff is not None
                merge(out, self.handoff.on_result(slot.name, result))
            if events.result is not None:
                progressed = True
                merge(out, self._finish_step(slot, events))
        return StepResult(out, progressed)

    def _submit(self, slot: Slot) -> bool:
        orders = self.handoff.take_orders(slot.name) if self.handoff is not None else None
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
        return True

    def _finish_step(self, slot: Slot, events: PoolEvents) -> ClientOutputs:
        assert events.result is not None
        work = slot.in_flight.popleft()
        assert events.result.step_id == work.step_id, "a pool answers its steps in order"
        out = slot.scheduler.update_from_output(work, events.result)
        if self.handoff is not None:
            merge(out, self.handoff.on_step_done(slot.name, events.result))
            for request in slot.scheduler.take_handoffs():
                merge(out, self.handoff.start(request))
        return out

    def check_alive(self) -> None:
        for pool in self.pools.values():
            pool.check_alive()

    def fail_all(self, reason: str, outcome: str = "worker_died") -> ClientOutputs:
        """End every request with an error (the engine is going down)."""
        out: ClientOutputs = {}
        if self.handoff is not None:
            merge(out, self.handoff.fail_all(reason, outcome))
        for slot in self.slots.values():
            merge(out, slot.scheduler.fail_all(reason))
        return out

    @property
    def num_requests(self) -> int:
        in_between = len(self.handoff.in_flight) if self.handoff is not None else 0
        return in_between + sum(len(s.scheduler.requests) for s in self.slots.values())

    # ------------------------------------------------------------------ figures

    def pool_stats(self) -> dict[str, SchedulerStats]:
        stats = {}
        for name, slot in self.slots.items():
            stats[name] = slot.scheduler.stats()
            stats[name].num_worker_threads = slot.pool.num_threads
        return stats

    def stats(self) -> SchedulerStats:
        """Totals over the pools; a KV manager shared by both counts once."""
        per_pool = self.pool_stats()
        if not per_pool:
            return SchedulerStats()
        if len(per_pool) == 1:
            return next(iter(per_pool.values()))
        stats = list(per_pool.values())
        total = SchedulerStats()
        for name in (
            "num_running",
            "num_waiting",
            "num_tokens_scheduled",
            "num_requests_total",
            "num_generated_tokens_total",
            "num_preemptions_total",
            "num_prompt_tokens_total",
            "iteration_tokens_sum",
            "num_worker_threads",
        ):
            setattr(total, name, sum(getattr(s, name) for s in stats))
        total.iteration_tokens_buckets = [
            sum(c) for c in zip(*(s.iteration_tokens_buckets for s in stats), strict=True)
        ]
        managers = {id(slot.scheduler.kv): slot.scheduler.kv for slot in self.slots.values()}
        total.num_kv_blocks_total = sum(kv.num_blocks for kv in managers.values())
        total.num_kv_blocks_in_use = sum(kv.num_used_blocks for kv in managers.values())
        total.prefix_cache_queries_total = sum(kv.prefix_queries for kv in managers.values())
        total.prefix_cache_hits_total = sum(kv.prefix_hits for kv in managers.values())
        # A hand-off enters the decode pool without being a new request there.
        total.num_requests_total = (
            per_pool["prefill"].num_requests_total + per_pool["decode"].num_requests_total
        )
        return total

    def transfer_stats(self) -> KVTransferStats | None:
        return None if self.handoff is None else self.handoff.stats.snapshot()
