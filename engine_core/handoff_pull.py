"""``ShmCopyHandoff``: split pools of different tensor-parallel widths over ``shm``.

A pool at TP 2 keeps each rank's KV heads in that rank's cache; a pool at TP 1 keeps
all of them in one. Their block layouts differ, so the pools cannot map one KV block
pool as ``SharedMemoryHandoff`` does: each has its own memory and manager, like ``tcp``.
But the prefill ranks keep their caches in shared memory, and each decode rank copies a
handed-off request's blocks out of them itself (the heads it holds, from whichever
prefill ranks hold those), at the start of the step that carries the order. No bytes
travel through a socket, and the prefill pool has nothing to do.

The prefill side's blocks are therefore read after the prefill pool let go of the
request: they stay allocated until every decode rank has reported them copied, and a
hand-off ended early (aborted, expired) while a decode step may be reading them frees
them only once that step is over.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from common.messages import KVReceive, ModelRunnerOutput
from common.pool_config import KVLoadFailurePolicy
from engine_core.handoff import HandoffStats, Orders
from engine_core.handoff_tcp import TcpHandoff, Transfer
from engine_core.kv_cache import KVCacheManager
from engine_core.scheduler import ClientOutputs, Scheduler


class ShmCopyHandoff(TcpHandoff):
    """Separate KV memories; each decode rank copies its heads out of the prefill ranks'
    shared memory (no sender, no stream)."""

    def __init__(
        self,
        prefill_kv: KVCacheManager,
        decode: Scheduler,
        num_decode_ranks: int,
        lease_s: float,
        policy: KVLoadFailurePolicy,
        bytes_per_block: int,
        stats: HandoffStats,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # Nothing is streamed, so no destinations: the decode ranks copy for themselves.
        super().__init__(prefill_kv, decode, [], lease_s, policy, bytes_per_block, stats, clock)
        self._num_decode_ranks = num_decode_ranks
        self._reading: set[str] = set()  # transfers the decode step in flight copies
        self._held: list[str] = []  # prefill blocks kept until that step is over

    @property
    def num_decode_ranks(self) -> int:
        return self._num_decode_ranks

    def _order(self, transfer: Transfer) -> None:
        self.decode_side.orders.receives.append(
            KVReceive(
                transfer.transfer_id,
                transfer.dst_blocks,
                transfer.dst_generations,
                src_block_ids=transfer.src_blocks,
            )
        )

    def _decode_orders_taken(self, orders: Orders) -> None:
        if orders.receives:
            self._reading = {r.transfer_id for r in orders.receives}

    def _decode_step_done(self, result: ModelRunnerOutput) -> ClientOutputs:
        self._reading = set()
        for key in self._held:
            self.prefill_kv.free(key)  # the step that read them is over
        self._held = []
        return super()._decode_step_done(result)

    def _free_prefill_side(self, transfer: Transfer) -> None:
        if transfer.transfer_id in self._reading:
            # A decode rank may be copying these blocks right now: hold them (under a
            # key no request can use) until its step is over.
            key = _HELD + transfer.transfer_id
            self.prefill_kv.rename(transfer.request.request_id, key)
            self._held.append(key)
            return
        # Not yet ordered: it never will be.
        queued = self.decode_side.orders
        queued.receives = [r for r in queued.receives if r.transfer_id != transfer.transfer_id]
        self.prefill_kv.free(transfer.request.request_id)


_HELD = "\x00held:"  # request ids come from clients as text; none starts with NUL
