"""``TcpHandoff`` (``--kv-transfer tcp``): each pool has its own KV memory and manager.

A handed-off request waits until the decode pool can allocate its blocks (blocks it
already holds as prefix cache are taken, not sent), then the prefill worker is told to
copy the rest out and stream them to the decode worker (``KVSend``), which is told where
they land (``KVReceive``, with each block's generation). The prefill side's blocks are
freed once copied; the request decodes once the decode worker reports them landed and
checked. Every hand-off ends once as done, failed, aborted, refused (it can never fit
the decode pool), expired (not landed within ``--kv-transfer-lease-s``) or worker_died;
failed and expired follow ``--kv-load-failure-policy``: end the request with an error,
or recompute its prompt in the decode pool. Never a 200 with tokens from the wrong KV.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from common.messages import (
    KVReceive,
    KVSend,
    KVTransferResult,
    KVTransferStats,
    ModelRunnerOutput,
    PoolRole,
)
from common.pool_config import KVLoadFailurePolicy
from engine_core.handoff import HandoffSide, HandoffStats, Orders, abort_output, error_output, merge
from engine_core.kv_cache import KVCacheManager
from engine_core.request import Request, RequestStatus
from engine_core.scheduler import ClientOutputs, Scheduler

logger = logging.getLogger(__name__)


@dataclass
class Transfer:
    transfer_id: str
    request: Request
    started: float
    src_blocks: list[int]  # prefill side, the blocks sent
    dst_blocks: list[int]  # decode side, where they land (in order)
    dst_generations: list[int]
    awaiting: int = 1  # decode ranks yet to report it landed (each lands its own heads)
    num_bytes: int = 0  # landed so far
    copied: bool = False  # the prefill side's blocks were copied out and freed


class TcpHandoff:
    """Separate KV memories: decode blocks allocated, KV streamed, landing confirmed."""

    def __init__(
        self,
        prefill_kv: KVCacheManager,
        decode: Scheduler,
        destinations: list[str],
        lease_s: float,
        policy: KVLoadFailurePolicy,
        bytes_per_block: int,
        stats: HandoffStats,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.prefill_kv = prefill_kv
        self.decode = decode
        self.destinations = destinations  # per decode rank: where its KV heads go
        self.lease_s = lease_s
        self.policy = policy
        self.bytes_per_block = bytes_per_block
        self._clock = clock
        self.stats = stats
        self.pending: deque[Request] = deque()  # waiting for decode blocks
        self.active: dict[str, Transfer] = {}  # by transfer id
        self._by_request: dict[str, Transfer] = {}
        self.prefill_side = HandoffSide(self._prefill_step_done, self._prefill_result)
        self.decode_side = HandoffSide(
            self._decode_step_done, self._decode_result, self._decode_orders_taken
        )
        self._ids = itertools.count()

    @property
    def num_decode_ranks(self) -> int:
        """Decode ranks that each report a hand-off landed (their own KV heads)."""
        return len(self.destinations)

    @property
    def in_flight(self) -> dict[str, Request]:
        """Requests between the pools, by id."""
        found = {r.request_id: r for r in self.pending}
        found.update({rid: t.request for rid, t in self._by_request.items()})
        return found

    # ------------------------------------------------------------------ the path

    def start(self, request: Request) -> ClientOutputs:
        """The prefill pool is done with the prompt; its blocks stay until copied."""
        request.handoff_started = self._clock()
        needed = self.decode.kv.num_blocks_for(request.num_computed_tokens + 1)
        if needed > self.decode.kv.num_blocks:
            self.prefill_kv.free(request.request_id)
            self.stats.ended("refused")
            return error_output(
                request,
                f"the decode pool's KV cache ({self.decode.kv.num_blocks} blocks) cannot hold "
                f"this request ({needed} blocks)",
            )
        self.pending.append(request)
        return self._place()

    def _place(self) -> ClientOutputs:
        """Allocate decode blocks for waiting hand-offs, oldest first, while they fit."""
        decode_kv = self.decode.kv
        while self.pending:
            request = self.pending[0]
            num_tokens = request.num_computed_tokens  # the prompt's KV
            hits = decode_kv.find_cached_prefix(request.block_hashes, num_tokens + 1)
            if not decode_kv.can_allocate(request.request_id, num_tokens, hits):
                break  # the decode pool is full: wait for blocks to free
            self.pending.popleft()
            decode_kv.allocate(request.request_id, num_tokens, hits)
            decode_kv.record_lookup(num_tokens, len(hits) * decode_kv.block_size)
            dst = decode_kv.blocks_of(request.request_id)[len(hits) :]
            src = self.prefill_kv.blocks_of(request.request_id)[len(hits) : len(hits) + len(dst)]
            transfer = Transfer(
                f"{request.request_id}#{next(self._ids)}",
                request,
                request.handoff_started or self._clock(),
                src,
                dst,
                decode_kv.generations_of(dst),
                awaiting=self.num_decode_ranks,
            )
            self.active[transfer.transfer_id] = transfer
            self._by_request[request.request_id] = transfer
            self._order(transfer)
        return {}

    def _order(self, transfer: Transfer) -> None:
        """The prefill side streams the blocks; the decode side waits for them."""
        self.prefill_side.orders.sends.append(
            KVSend(transfer.transfer_id, transfer.src_blocks, self.destinations)
        )
        self.decode_side.orders.receives.append(
            KVReceive(transfer.transfer_id, transfer.dst_blocks, transfer.dst_generations)
        )

    def tick(self) -> ClientOutputs:
        """Place what now fits; expire transfers past their lease."""
        out = self._place()
        now = self._clock()
        for transfer in list(self.active.values()):
            if now - transfer.started > self.lease_s:
                merge(out, self._failed(transfer, "expired", f"not landed in {self.lease_s:g} s"))
        return out

    def has_orders(self) -> bool:
        return bool(self.prefill_side.orders or self.decode_side.orders)

    def snapshot(self) -> KVTransferStats | None:
        return self.stats.snapshot()

    def _prefill_step_done(self, result: ModelRunnerOutput) -> ClientOutputs:
        for transfer_id in result.kv_copied:
            transfer = self.active.get(transfer_id)
            if transfer is not None and not transfer.copied:
                transfer.copied = True
                self.prefill_kv.free(transfer.request.request_id)
        return {}

    def _decode_step_done(self, result: ModelRunnerOutput) -> ClientOutputs:
        return {}

    def _decode_orders_taken(self, orders: Orders) -> None:
        return None

    def _prefill_result(self, result: KVTransferResult) -> ClientOutputs:
        """The sending side reports only failures."""
        transfer = self._active(result)
        if transfer is None or result.ok:
            return {}
        return self._failed(
            transfer, "failed", result.error or f"the {PoolRole.PREFILL} side failed"
        )

    def _decode_result(self, result: KVTransferResult) -> ClientOutputs:
        transfer = self._active(result)
        if transfer is None:
            return {}
        if not result.ok:
            return self._failed(
                transfer, "failed", result.error or f"the {PoolRole.DECODE} side failed"
            )
        transfer.awaiting -= 1
        transfer.num_bytes += result.num_bytes
        if transfer.awaiting > 0:
            return {}  # another decode rank's heads are still on the way
        if not self.decode.kv.is_current(transfer.dst_blocks, transfer.dst_generations):
            # Cannot happen while the transfer is active; refused rather than trusted.
            return self._failed(transfer, "failed", "a landed block was reallocated meanwhile")
        self._end(transfer)
        request = transfer.request
        if not transfer.copied:  # the decode side can only land what was copied
            transfer.copied = True
            self.prefill_kv.free(request.request_id)
        self.decode.accept(request)
        self.stats.ended("done", self._clock() - transfer.started, transfer.num_bytes)
        return {}

    def _active(self, result: KVTransferResult) -> Transfer | None:
        transfer = self.active.get(result.transfer_id)
        if transfer is None:
            logger.info("ignored a result for transfer %s, which has ended", result.transfer_id)
        return transfer

    # ------------------------------------------------------------------ endings

    def _end(self, transfer: Transfer) -> None:
        del self.active[transfer.transfer_id]
        del self._by_request[transfer.request.request_id]

    def _release(self, transfer: Transfer) -> None:
        """Free both sides' blocks and tell both workers to drop the transfer."""
        self._end(transfer)
        request_id = transfer.request.request_id
        self.decode.kv.free(request_id)
        if not transfer.copied:
            self._free_prefill_side(transfer)
        for side in (self.prefill_side, self.decode_side):
            side.orders.cancels.append(transfer.transfer_id)

    def _free_prefill_side(self, transfer: Transfer) -> None:
        self.prefill_kv.free(transfer.request.request_id)

    def _failed(self, transfer: Transfer, outcome: str, why: str) -> ClientOutputs:
        self._release(transfer)
        request = transfer.request
        self.stats.ended(outcome, self._clock() - transfer.started)
        logger.warning("[%s] KV hand-off %s: %s", request.request_id, outcome, why)
        if self.policy == "recompute":
            self.decode.recompute(request)
            return {}
        return error_output(request, f"the KV hand-off to the decode pool {outcome}: {why}")

    def abort(self, request_id: str) -> ClientOutputs | None:
        """End a request caught between the pools; None if it is not here."""
        transfer = self._by_request.get(request_id)
        if transfer is not None:
            self._release(transfer)
            self.stats.ended("aborted")
            transfer.request.status = RequestStatus.FINISHED
            return abort_output(transfer.request)
        for request in self.pending:
            if request.request_id == request_id:
                self.pending.remove(request)
                self.prefill_kv.free(request_id)
                self.stats.ended("aborted")
                request.status = RequestStatus.FINISHED
                return abort_output(request)
        return None

    def fail_all(self, reason: str, outcome: str = "worker_died") -> ClientOutputs:
        """End every hand-off in flight (the engine is going down) as ``outcome``."""
        out: ClientOutputs = {}
        for request_id in list(self.in_flight):
            transfer = self._by_request.get(request_id)
            request = transfer.request if transfer else None
            if transfer is not None:
                self._release(transfer)
            else:
                request = next(r for r in self.pending if r.request_id == request_id)
                self.pending.remove(request)
                self.prefill_kv.free(request_id)
            self.stats.ended(outcome)
            assert request is not None
            merge(out, error_output(request, reason))
        return out
