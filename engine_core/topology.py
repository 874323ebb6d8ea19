"""The pools' layout, decided once.

``build_topology`` turns the config's ``KVMode`` and the pools' handshakes into what the
engine steps: a ``Slot`` per pool keyed by ``PoolRole`` (the pool, its scheduler and its
end of the hand-off), the ``Handoff`` between the pools (``NoHandoff`` for a unified
pool), and the ``Placement`` of new prompts (the one pool, or the router that picks the
prefill or the decode pool). Nothing after it asks which layout it is, or which pool.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from common.config import TandemConfig
from common.messages import PoolRole, SchedulerOutput, WorkerReady
from common.pool_config import KVMode
from engine_core.executor import PoolEvents
from engine_core.handoff import Handoff, HandoffSide, HandoffStats, NoHandoff, SharedMemoryHandoff
from engine_core.handoff_pull import ShmCopyHandoff
from engine_core.handoff_tcp import TcpHandoff
from engine_core.kv_cache import KVCacheManager
from engine_core.kv_events import KVEventLog, NoKVEvents
from engine_core.remote_kv import NoRemoteKV, RemoteKV, unified_instance
from engine_core.request import Request
from engine_core.router import Router
from engine_core.scheduler import Scheduler


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
    """A pool with its scheduler, its end of the hand-off, and the steps it is running,
    oldest first: at most ``depth`` (2 with async scheduling: one running, the next
    waiting at the workers)."""

    pool: Pool
    scheduler: Scheduler
    side: HandoffSide = field(default_factory=HandoffSide)
    depth: int = 1
    in_flight: deque[SchedulerOutput] = field(default_factory=deque)

    @property
    def role(self) -> PoolRole:
        return self.pool.role

    def can_submit(self) -> bool:
        if not self.in_flight:
            return True
        return len(self.in_flight) < self.depth and self.scheduler.can_schedule_ahead


class Placement(Protocol):
    """Which pool's scheduler a new request queues in."""

    def place(self, request: Request) -> Scheduler: ...


@dataclass(frozen=True)
class OnePool:
    scheduler: Scheduler

    def place(self, request: Request) -> Scheduler:
        return self.scheduler


@dataclass(frozen=True)
class Topology:
    slots: dict[PoolRole, Slot]
    handoff: Handoff
    placement: Placement
    remote: RemoteKV | NoRemoteKV = field(default_factory=NoRemoteKV)  # a fleet's split

    def kv_managers(self) -> list[KVCacheManager]:
        """Each KV manager once (split pools over shared memory share one)."""
        return list({id(s.scheduler.kv): s.scheduler.kv for s in self.slots.values()}.values())


def build_topology(
    config: TandemConfig,
    pools: Mapping[PoolRole, Pool],
    readies: Mapping[PoolRole, WorkerReady],
    clock: Callable[[], float] = time.monotonic,
) -> Topology:
    """The slots, hand-off and placement of ``config.disagg.kv_mode``, with KV managers
    sized by what the pools' workers found."""
    sched = config.scheduler
    depth = sched.max_steps_in_flight
    first = next(iter(readies.values()))

    def manager(role: PoolRole) -> KVCacheManager:
        log = KVEventLog(first.block_size) if config.cache.kv_events.enabled else NoKVEvents()
        return KVCacheManager(
            readies[role].num_kv_blocks, first.block_size, sched.enable_prefix_caching, log
        )

    mode = config.disagg.kv_mode
    if mode is KVMode.NONE:
        pool = pools[PoolRole.UNIFIED]
        scheduler, remote = unified_instance(
            config, manager(PoolRole.UNIFIED), first, pool.kv_addresses, clock
        )
        slot = Slot(pool, scheduler, remote.side, depth)
        return Topology({PoolRole.UNIFIED: slot}, NoHandoff(), OnePool(scheduler), remote)

    disagg = config.disagg
    prefill_kv = manager(PoolRole.PREFILL)
    if mode is KVMode.SHARED:
        sizes = {str(role): ready.num_kv_blocks for role, ready in readies.items()}
        if len(set(sizes.values())) != 1:
            raise RuntimeError(f"the pools map KV segments of different sizes: {sizes}")
        decode_kv = prefill_kv  # one block pool
    else:
        decode_kv = manager(PoolRole.DECODE)
    loras = config.model.step_max_loras
    prefill = Scheduler(sched, prefill_kv, first.model, clock, hands_off=True, max_loras=loras)
    decode = Scheduler(sched, decode_kv, first.model, clock, max_loras=loras)
    stats = HandoffStats()
    lease, policy = disagg.kv_transfer_lease_s, disagg.kv_load_failure_policy
    bytes_per_block = readies[PoolRole.DECODE].num_kv_bytes_per_block
    handoff: SharedMemoryHandoff | TcpHandoff
    if mode is KVMode.SHARED:
        handoff = SharedMemoryHandoff(decode, stats)
    elif mode is KVMode.SHM_COPY:
        ranks = disagg.tp_size(PoolRole.DECODE)
        handoff = ShmCopyHandoff(
            prefill_kv, decode, ranks, lease, policy, bytes_per_block, stats, clock
        )
    else:
        # TP: every decode rank takes its own heads; else the one worker's address
        # (further decode workers are replicas whose answers are not used).
        decode_pool = pools[PoolRole.DECODE]
        tp = disagg.tp_size(PoolRole.DECODE) > 1
        destinations = decode_pool.kv_addresses if tp else [readies[PoolRole.DECODE].kv_address]
        handoff = TcpHandoff(
            prefill_kv, decode, destinations, lease, policy, bytes_per_block, stats, clock
        )
    slots = {
        PoolRole.PREFILL: Slot(pools[PoolRole.PREFILL], prefill, handoff.prefill_side, depth),
        PoolRole.DECODE: Slot(pools[PoolRole.DECODE], decode, handoff.decode_side, depth),
    }
    return Topology(slots, handoff, Router(prefill, decode, disagg, stats))
