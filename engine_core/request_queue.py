"""Waiting queues: first come first served, or by priority with aging. The queue is the
scheduling policy, chosen once (``make_queue``): it also ranks running requests for
preemption (``urgency``).

Priority (lower runs first, as in vLLM) ages: a request's effective priority improves
by one for every ``aging_s`` seconds it has waited, so no request waits forever behind
a stream of more urgent ones. Since every waiting request ages at the same rate, the
order never changes while they wait: the key ``priority + arrival_time / aging_s``
is fixed at arrival and a heap keeps it.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator
from typing import Protocol

from common.config import SchedulerConfig
from engine_core.request import Request


class RequestQueue(Protocol):
    def urgency(self, request: Request) -> tuple[int, float]:
        """Sort key of running requests, most urgent first (the last is preempted)."""
        ...

    def add(self, request: Request) -> None: ...
    def readd_preempted(self, request: Request) -> None: ...
    def peek(self) -> Request: ...
    def pop(self) -> Request: ...
    def remove(self, request: Request) -> None: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Request]: ...


def make_queue(config: SchedulerConfig) -> RequestQueue:
    if config.scheduling_policy == "priority":
        return PriorityQueue(config.priority_aging_s)
    return FcfsQueue()


class FcfsQueue:
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def urgency(self, request: Request) -> tuple[int, float]:
        return 0, request.arrival_time

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def readd_preempted(self, request: Request) -> None:
        self._queue.appendleft(request)  # it arrived before everything still waiting

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityQueue:
    def __init__(self, aging_s: float) -> None:
        if aging_s <= 0:
            raise ValueError(f"priority aging interval must be positive, got {aging_s}")
        self._aging_s = aging_s
        self._heap: list[tuple[float, float, int, Request]] = []
        self._tiebreak = itertools.count()

    def key(self, request: Request) -> float:
        return request.priority + request.arrival_time / self._aging_s

    def urgency(self, request: Request) -> tuple[int, float]:
        return request.priority, request.arrival_time

    def add(self, request: Request) -> None:
        heapq.heappush(
            self._heap, (self.key(request), request.arrival_time, next(self._tiebreak), request)
        )

    def readd_preempted(self, request: Request) -> None:
        self.add(request)  # its original key puts it back where it belongs

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        self._heap = [entry for entry in self._heap if entry[3] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in sorted(self._heap, key=lambda e: e[:3]))
