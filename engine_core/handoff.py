"""Prefill -> decode hand-offs: how a request whose prompt the prefill pool computed
reaches the decode pool, and how every hand-off ends exactly once.

``SharedMemoryHandoff`` (``--kv-transfer shm``): both pools' workers map one KV block
pool and the engine keeps one ``KVCacheManager``; handing over moves the request, with
its block ids, from one scheduler to the other. Zero bytes are copied.

``TcpHandoff`` (``--kv-transfer tcp``): each pool has its own KV memory and manager. A
handed-off request waits until the decode pool can allocate its blocks (blocks it
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

import bisect
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from common.messages import (
    KV_TRANSFER_BUCKETS_S,
    ErrorKind,
    FinishReason,
    KVReceive,
    KVSend,
    KVTransferResult,
    KVTransferStats,
    ModelRunnerOutput,
    RequestOutput,
)
from common.pool_config import KVLoadFailurePolicy
from engine_core.kv_cache import KVCacheManager
from engine_core.request import Request, RequestStatus
from engine_core.scheduler import ClientOutputs, Scheduler

logger = logging.getLogger(__name__)

OUTCOMES = ("done", "failed", "aborted", "refused", "expired", "worker_died")


def merge(into: ClientOutputs, more: ClientOutputs) -> ClientOutputs:
    for client, outputs in more.items():
        into.setdefault(client, []).extend(outputs)
    return into


def _error(request: Request, message: str) -> ClientOutputs:
    return {
        request.client_id: [
            RequestOutput(request.request_id, [], FinishReason.ERROR, message, ErrorKind.INTERNAL)
        ]
    }


def _aborted(request: Request) -> ClientOutputs:
    return {request.client_id: [RequestOutput(request.request_id, [], FinishReason.ABORT)]}


@dataclass
class Orders:
    """KV transfer orders for one pool's next step."""

    sends: list[KVSend] = field(default_factory=list)
    receives: list[KVReceive] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.sends or self.receives or self.cancels)


class HandoffStats:
    """Outcome counters and the duration histogram, each hand-off counted once."""

    def __init__(self) -> None:
        self.outcomes = dict.fromkeys((*OUTCOMES, "local_prefill"), 0)
        self.num_bytes = 0
        self._buckets = [0] * (len(KV_TRANSFER_BUCKETS_S) + 1)
        self._sum_s = 0.0

    def ended(self, outcome: str, duration_s: float | None = None, num_bytes: int = 0) -> None:
        self.outcomes[outcome] += 1
        self.num_bytes += num_bytes
        if duration_s is not None:
            self._buckets[bisect.bisect_left(KV_TRANSFER_BUCKETS_S, duration_s)] += 1
            self._sum_s += duration_s

    def snapshot(self) -> KVTransferStats:
        cumulative = list(itertools.accumulate(self._buckets))
        return KVTransferStats(dict(self.outcomes), self.num_bytes, cumulative, self._sum_s)


class SharedMemoryHandoff:
    """One KV pool, one manager: a hand-off moves block ids, never bytes."""

    def __init__(self, decode: Scheduler, clock: Callable[[], float] = time.monotonic) -> None:
        self.decode = decode
        self.stats = HandoffStats()

    @property
    def in_flight(self) -> dict[str, Request]:
        return {}  # a move has no in-between

    def start(self, request: Request) -> ClientOutputs:
        self.decode.accept(request)  # same manager: its blocks are already the decode pool's
        self.stats.ended("done", 0.0)
        return {}

    def tick(self) -> ClientOutputs:
        return {}

    def take_orders(self, pool: str) -> Orders:
        return Orders()

    def has_orders(self) -> bool:
        return False

    def on_step_done(self, pool: str, result: ModelRunnerOutput) -> ClientOutputs:
        return {}

    def on_result(self, pool: str, result: KVTransferResult) -> ClientOutputs:
        return {}

    def abort(self, request_id: str) -> ClientOutputs | None:
        return None

    def fail_all(self, reason: str, outcome: str = "worker_died") -> ClientOutputs:
        return {}


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
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.prefill_kv = prefill_kv
        self.decode = decode
        self.destinations = destinations  # per decode rank: where its KV heads go
        self.lease_s = lease_s
        self.policy = policy
        self.bytes_per_block = bytes_per_block
        self._clock = clock
        self.stats = HandoffStats()
        self.pending: deque[Request] = deque()  # waiting for decode blocks
        self.active: dict[str, Transfer] = {}  # by transfer id
        self._by_request: dict[str, Transfer] = {}
        self._orders = {"prefill": Orders(), "decode": Orders()}
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
            return _error(
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
        self._orders["prefill"].sends.append(
            KVSend(transfer.transfer_id, transfer.src_blocks, self.destinations)
        )
        self._orders["decode"].receives.append(
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

    def take_orders(self, pool: str) -> Orders:
        orders, self._orders[pool] = self._orders[pool], Orders()
        return orders

    def has_orders(self) -> bool:
        return any(self._orders.values())

    def on_step_done(self, pool: str, result: ModelRunnerOutput) -> ClientOutputs:
        if pool == "prefill":
            for transfer_id in result.kv_copied:
                transfer = self.active.get(transfer_id)
                if transfer is not None and not transfer.copied:
                    transfer.copied = True
                    self.prefill_kv.free(transfer.request.request_id)
        return {}

    def on_result(self, pool: str, result: KVTransferResult) -> ClientOutputs:
        transfer = self.active.get(result.transfer_id)
        if transfer is None:
            logger.info("ignored a result for transfer %s, which has ended", result.transfer_id)
            return {}
        if not result.ok:
            return self._failed(transfer, "failed", result.error or f"the {pool} side failed")
        if pool != "decode":
            return {}
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
        for pool in ("prefill", "decode"):
            self._orders[pool].cancels.append(transfer.transfer_id)

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
        return _error(request, f"the KV hand-off to the decode pool {outcome}: {why}")

    def abort(self, request_id: str) -> ClientOutputs | None:
        """End a request caught between the pools; None if it is not here."""
        transfer = self._by_request.get(request_id)
        if transfer is not None:
            self._release(transfer)
            self.stats.ended("aborted")
            transfer.request.status = RequestStatus.FINISHED
            return _aborted(transfer.request)
        for request in self.pending:
            if request.request_id == request_id:
                self.pending.remove(request)
                self.prefill_kv.free(request_id)
                self.stats.ended("aborted")
                request.status = RequestStatus.FINISHED
                return _aborted(request)
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
            merge(out, _error(request, reason))
        return out


Handoff = SharedMemoryHandoff | TcpHandoff  # and its subclass ShmCopyHandoff
