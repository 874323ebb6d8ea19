"""``KVPulls``: a decode instance pulling a prompt's KV from the prefill instance that
computed it (``kv_role`` ``kv_consumer`` or ``kv_both``).

A request whose ``kv_transfer_params`` say ``do_remote_prefill`` waits here until blocks
for its prompt's full blocks can be allocated (those this instance already caches are
taken, not pulled), under an owner of their own. The engine then tells its workers where
the KV lands (``KVReceive``) and sends the prefill instance a ``KVPull``. Landed and
checked, the blocks enter the prefix cache (for later requests) and become the request's
own; the scheduler takes it over as a split pool's decode scheduler takes a hand-off
(``accept``: it runs ahead of new prompts, and can be preempted like any running
request), computing only the prompt's last partial block (the block holding the last
token is always computed, so its logits can be sampled).

Every pull ends once: done, refused (the prefill instance checked it and said no: a
field at fault is a 400 naming it), failed, expired (no ack within ``ack_timeout_s``, or
not landed within ``lease_s``), aborted or worker_died. Failed and expired follow
``kv_load_failure_policy``: recompute the prompt here, or fail the request.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from common.kv_transfer_config import FailurePolicy
from common.messages import (
    ErrorKind,
    FinishReason,
    KVPull,
    KVPullAck,
    KVPullAnswer,
    KVReceive,
    KVTransferResult,
    RequestOutput,
)
from engine_core.handoff import HandoffSide, HandoffStats, abort_output, error_output, merge
from engine_core.kv_cache import extend_block_hashes
from engine_core.request import KVPullRecord, Request, RequestStatus
from engine_core.scheduler import ClientOutputs, Scheduler

logger = logging.getLogger(__name__)

Send = tuple[str, KVPull]  # to a prefill instance's side channel


@dataclass
class Pull:
    transfer_id: str
    request: Request
    owner: str  # the KV manager's owner id of the blocks it fills
    first_block: int  # blocks before it were cached here already
    num_full: int  # the prompt's full blocks wanted
    deadline: float  # for the ack, then for landing
    started: float
    dst_blocks: list[int]  # where it lands, each valid at its generation
    dst_generations: list[int]
    awaiting: int = 1  # ranks yet to report their heads landed
    num_bytes: int = 0
    acked: bool = False


@dataclass(frozen=True)
class PullTimes:
    ack_s: float  # the prefill instance takes the pull within this
    lease_s: float  # and the KV lands within this


class KVPulls:
    def __init__(
        self,
        scheduler: Scheduler,
        side: HandoffSide,
        destinations: list[str],
        times: PullTimes,
        policy: FailurePolicy,
        stats: HandoffStats,
        engine_id: str = "",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.scheduler = scheduler
        self.engine_id = engine_id  # this instance's, in its transfer ids
        self.kv = scheduler.kv
        self.side = side  # the unified pool's orders: the receives go there
        self.destinations = destinations  # each rank's KV receiver (it lands its heads)
        self.times = times
        self.policy = policy
        self.stats = stats
        self._clock = clock
        self.pending: deque[Request] = deque()  # waiting for blocks
        self.active: dict[str, Pull] = {}  # by transfer id
        self._by_request: dict[str, Pull] = {}
        self.outbox: list[Send] = []
        self._ids = itertools.count()

    @property
    def in_flight(self) -> dict[str, Request]:
        """Requests waiting for their KV, by id (not yet in the scheduler)."""
        found = {r.request_id: r for r in self.pending}
        found.update({rid: p.request for rid, p in self._by_request.items()})
        return found

    def add(self, request: Request) -> ClientOutputs:
        params = request.kv_transfer
        assert params is not None and params.do_remote_prefill
        size = self.kv.block_size
        if params.block_size not in (None, size):
            message = (
                f"the prefill instance's blocks hold {params.block_size} tokens, this "
                f"instance's {size}: give both the same --block-size"
            )
            return _invalid(request, message, "kv_transfer_params.block_size")
        if self.kv.num_blocks_for(request.num_tokens + 1) > self.kv.num_blocks:
            return error_output(request, "this instance's KV cache cannot hold the request")
        request.received_time = self._clock()
        extend_block_hashes(request.block_hashes, request.token_ids, size, request.cache_salt)
        if len(self._hits(request)) >= self._num_full(request):  # cached, or no full block
            return self._local(request)
        self.pending.append(request)
        return self._place()

    def _num_full(self, request: Request) -> int:
        """The prompt's full blocks the prefill instance holds (never the last token's)."""
        remote = (request.kv_transfer and request.kv_transfer.remote_block_ids) or []
        return min((request.num_prompt_tokens - 1) // self.kv.block_size, len(remote))

    def _hits(self, request: Request) -> list[int]:
        return self.kv.find_cached_prefix(request.block_hashes, request.num_prompt_tokens)[
            : self._num_full(request)
        ]

    def _local(self, request: Request) -> ClientOutputs:
        """Nothing to pull: the prefill instance may free the lease; prefill it here."""
        self._release(request)
        self.stats.ended("local_prefill")
        return self._queue(request)

    def _place(self) -> ClientOutputs:
        """Allocate blocks for waiting pulls, oldest first, while they fit; send them."""
        out: ClientOutputs = {}
        while self.pending:
            request = self.pending[0]
            hits, num_full = self._hits(request), self._num_full(request)
            if len(hits) >= num_full:  # another request cached them meanwhile
                self.pending.popleft()
                merge(out, self._local(request))
                continue
            if not self.kv.can_allocate(request.request_id, num_full * self.kv.block_size, hits):
                break  # wait for blocks to free
            self.pending.popleft()
            transfer_id = f"{request.request_id}#pull{next(self._ids)}@{self.engine_id}"
            owner = f"pull:{transfer_id}"
            self.kv.allocate(owner, num_full * self.kv.block_size, hits)
            dst = self.kv.blocks_of(owner)[len(hits) : num_full]
            now = self._clock()
            pull = Pull(
                transfer_id,  # unique across decode instances: the prefill side keys by it
                request,
                owner,
                len(hits),
                num_full,
                now + self.times.ack_s,
                now,
                dst,
                self.kv.generations_of(dst),
                awaiting=len(self.destinations),
            )
            self.active[pull.transfer_id] = pull
            self._by_request[request.request_id] = pull
            self.side.orders.receives.append(KVReceive(pull.transfer_id, dst, pull.dst_generations))
            self._send(request, pull.transfer_id, len(hits), num_full)
        return out

    def _send(self, request: Request, transfer_id: str, first: int, end: int) -> None:
        """Ask the prefill instance for blocks ``first:end`` (none: it may free them)."""
        params = request.kv_transfer
        assert params is not None
        remote = params.remote_block_ids or []
        pull = KVPull(
            params.remote_request_id or "",
            params.remote_engine_id or "",
            transfer_id,
            first,
            remote[first:end],
            request.block_hashes[first:end],
            self.destinations,
            self.kv.block_size,
            request.owner,
        )
        self.outbox.append((params.side_channel, pull))

    def _release(self, request: Request) -> None:
        params = request.kv_transfer
        if params is not None and params.remote_request_id and params.remote_block_ids:
            self._send(request, f"{request.request_id}#release", 0, 0)

    def _queue(self, request: Request) -> ClientOutputs:
        """Into the scheduler as a new request, to prefill here."""
        error = self.scheduler.add_request(request)
        return {} if error is None else {request.client_id: [error]}

    # ------------------------------------------------------------------ events

    def on_message(self, message: KVPullAck | KVPullAnswer) -> ClientOutputs:
        pull = self.active.get(message.transfer_id)
        if pull is None:
            return {}  # ended meanwhile (or a release's answer)
        if isinstance(message, KVPullAck) or message.ok:
            if not pull.acked:
                pull.acked = True
                pull.deadline = pull.started + self.times.lease_s
            return {}
        if message.param is not None:  # the lease is not this request's to read
            self._end(pull, cancel=True)
            self._record(pull, "refused")
            self.stats.ended("refused")
            return _invalid(pull.request, f"kv_transfer_params: {message.error}", message.param)
        return self._failed(pull, "failed", message.error or "refused", release=False)

    def on_result(self, result: KVTransferResult) -> ClientOutputs:
        """The worker landed (or could not land) a pull."""
        pull = self.active.get(result.transfer_id)
        if pull is None:
            return {}
        if not result.ok:
            return self._failed(pull, "failed", result.error or "landing failed", release=False)
        pull.awaiting -= 1
        pull.num_bytes += result.num_bytes
        if pull.awaiting > 0:
            return {}  # another rank's heads are still on the way
        if not self.kv.is_current(pull.dst_blocks, pull.dst_generations):
            # Cannot happen while the pull is active; refused rather than trusted.
            return self._failed(pull, "failed", "a landed block was reused meanwhile", False)
        request = pull.request
        self._end(pull, cancel=False)
        num_tokens = pull.num_full * self.kv.block_size
        self.kv.cache_full_blocks(
            pull.owner, request.block_hashes, num_tokens, request.token_ids, request.lora
        )
        self.kv.rename(pull.owner, request.request_id)  # the blocks are the request's now
        self.kv.record_lookup(request.num_prompt_tokens, num_tokens)
        request.num_computed_tokens = request.num_cached_tokens = num_tokens
        self.stats.ended("done", self._record(pull, "done"), pull.num_bytes)
        self.scheduler.accept(request)
        return {}

    def tick(self) -> ClientOutputs:
        """Place what now fits; end pulls past their deadline; let go of the blocks of
        pulled requests the scheduler has taken."""
        out = self._place()
        now = self._clock()
        for pull in list(self.active.values()):
            if now > pull.deadline:
                why = (
                    f"landed not within {self.times.lease_s:g} s"
                    if pull.acked
                    else f"no answer from the prefill instance within {self.times.ack_s:g} s"
                )
                merge(out, self._failed(pull, "expired", why, release=True))
        return out

    # ------------------------------------------------------------------ endings

    def _end(self, pull: Pull, cancel: bool) -> None:
        del self.active[pull.transfer_id]
        del self._by_request[pull.request.request_id]
        if cancel:
            self.kv.free(pull.owner)
            self.side.orders.cancels.append(pull.transfer_id)

    def _record(self, pull: Pull, outcome: str) -> float:
        """Note on the request how its pull ended (its trace's ``kv_handoff`` span);
        returns how long it took."""
        params = pull.request.kv_transfer
        record = KVPullRecord(
            pull.started,
            self._clock(),
            outcome,
            pull.num_full - pull.first_block,
            pull.num_bytes,
            (params.remote_engine_id if params else None) or "",
        )
        pull.request.kv_pull = record
        return record.ended - record.started

    def _failed(self, pull: Pull, outcome: str, why: str, release: bool) -> ClientOutputs:
        self._end(pull, cancel=True)
        request = pull.request
        if release:
            self._release(request)
        self.stats.ended(outcome, self._record(pull, outcome))
        logger.warning("[%s] KV pull %s: %s", request.request_id, outcome, why)
        if self.policy == "recompute":
            return self._queue(request)
        return error_output(request, f"the KV pull from the prefill instance {outcome}: {why}")

    def abort(self, request_id: str) -> ClientOutputs | None:
        """End a request waiting for its KV; None if it is not here."""
        request = self.in_flight.get(request_id)
        if request is None:
            return None
        pull = self._by_request.get(request_id)
        if pull is not None:
            self._end(pull, cancel=True)
        else:
            self.pending.remove(request)
        self._release(request)
        self.stats.ended("aborted")
        request.status = RequestStatus.FINISHED
        return abort_output(request)

    def fail_all(self, reason: str, outcome: str = "worker_died") -> ClientOutputs:
        out: ClientOutputs = {}
        for request in list(self.in_flight.values()):
            pull = self._by_request.get(request.request_id)
            if pull is not None:
                self._end(pull, cancel=True)
            else:
                self.pending.remove(request)
            self.stats.ended(outcome)
            merge(out, error_output(request, reason))
        return out


def _invalid(request: Request, message: str, param: str) -> ClientOutputs:
    refusal = RequestOutput(
        request.request_id, [], FinishReason.ERROR, message, ErrorKind.INVALID, error_param=param
    )
    return {request.client_id: [refusal]}
