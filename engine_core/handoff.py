"""Prefill -> decode hand-offs: what the engine asks of one, and the two that move no
bytes.

Every hand-off ends once as done, failed, aborted, refused, expired or worker_died
(``HandoffStats``). ``NoHandoff``: one unified pool, nothing between pools.
``SharedMemoryHandoff`` (``--kv-transfer shm``, pools of equal widths): both pools'
workers map one KV block pool and the engine keeps one ``KVCacheManager``; handing over
moves the request, with its block ids, from one scheduler to the other. Zero bytes are
copied. The others (``handoff_tcp.py``, ``handoff_pull.py``) stream or copy the blocks.

Each pool's slot holds a ``HandoffSide``: the orders its next step carries and what the
hand-off does when that pool's step or transfer ends, so no code asks which pool it is in.
"""

from __future__ import annotations

import bisect
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

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
from engine_core.request import Request
from engine_core.scheduler import ClientOutputs, Scheduler

logger = logging.getLogger(__name__)

OUTCOMES = ("done", "failed", "aborted", "refused", "expired", "worker_died")


def merge(into: ClientOutputs, more: ClientOutputs) -> ClientOutputs:
    for client, outputs in more.items():
        into.setdefault(client, []).extend(outputs)
    return into


def error_output(request: Request, message: str) -> ClientOutputs:
    return {
        request.client_id: [
            RequestOutput(request.request_id, [], FinishReason.ERROR, message, ErrorKind.INTERNAL)
        ]
    }


def abort_output(request: Request) -> ClientOutputs:
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

    def __init__(self, extra: tuple[str, ...] = ()) -> None:
        self.outcomes = dict.fromkeys((*OUTCOMES, "local_prefill", *extra), 0)
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


def _no_outputs(_: object) -> ClientOutputs:
    return {}


def _no_hook(_: Orders) -> None:
    return None


@dataclass
class HandoffSide:
    """One pool's end of the hand-offs: the orders its next step carries, and what the
    hand-off does when one of that pool's steps, or a transfer on its side, ends."""

    on_step_done: Callable[[ModelRunnerOutput], ClientOutputs] = _no_outputs
    on_result: Callable[[KVTransferResult], ClientOutputs] = _no_outputs
    orders_taken: Callable[[Orders], None] = _no_hook  # the step carrying them is sent
    orders: Orders = field(default_factory=Orders)

    def take_orders(self) -> Orders:
        orders, self.orders = self.orders, Orders()
        self.orders_taken(orders)
        return orders


class Handoff(Protocol):
    """What the engine asks of a hand-off, whichever moves the KV."""

    @property
    def in_flight(self) -> dict[str, Request]:
        """Requests between the pools, by id."""
        ...

    def start(self, request: Request) -> ClientOutputs: ...

    def tick(self) -> ClientOutputs: ...

    def has_orders(self) -> bool: ...

    def abort(self, request_id: str) -> ClientOutputs | None: ...

    def fail_all(self, reason: str, outcome: str = "worker_died") -> ClientOutputs: ...

    def snapshot(self) -> KVTransferStats | None: ...


class NoHandoff:
    """One unified pool: no request ever leaves it."""

    @property
    def in_flight(self) -> dict[str, Request]:
        return {}

    def start(self, request: Request) -> ClientOutputs:
        raise AssertionError("a unified pool hands nothing off")

    def tick(self) -> ClientOutputs:
        return {}

    def has_orders(self) -> bool:
        return False

    def abort(self, request_id: str) -> ClientOutputs | None:
        return None

    def fail_all(self, reason: str, outcome: str = "worker_died") -> ClientOutputs:
        return {}

    def snapshot(self) -> KVTransferStats | None:
        return None


class SharedMemoryHandoff(NoHandoff):
    """One KV pool, one manager: a hand-off moves block ids, never bytes."""

    def __init__(self, decode: Scheduler, stats: HandoffStats) -> None:
        self.decode = decode
        self.stats = stats
        self.prefill_side = HandoffSide()
        self.decode_side = HandoffSide()

    def start(self, request: Request) -> ClientOutputs:
        self.decode.accept(request)  # same manager: its blocks are already the decode pool's
        self.stats.ended("done", 0.0)
        return {}

    def snapshot(self) -> KVTransferStats | None:
        return self.stats.snapshot()
