"""How waiting requests join the running batch, chosen once from ``--batching``.

``continuous``: whenever the step budget, ``max_num_seqs`` and free blocks allow.
``static`` (kept for comparison only): a batch forms while nothing runs, opens once
``max_num_seqs`` requests wait or the first has waited ``--batch-wait-timeout-s``, runs
to completion, and nothing joins it meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from common.config import SchedulerConfig


class Batching(Protocol):
    def arrived(self) -> None:
        """A request was queued."""

    def quota(self, num_waiting: int, num_running: int) -> int:
        """How many waiting requests may be admitted now (budget and blocks permitting)."""

    def admitted(self) -> None:
        """One of them was."""


class ContinuousBatching:
    def arrived(self) -> None:
        pass

    def quota(self, num_waiting: int, num_running: int) -> int:
        return num_waiting

    def admitted(self) -> None:
        pass


class StaticBatching:
    def __init__(
        self, max_num_seqs: int, wait_timeout_s: float, clock: Callable[[], float]
    ) -> None:
        self.max_num_seqs = max_num_seqs
        self.wait_timeout_s = wait_timeout_s
        self._clock = clock
        self._quota = 0  # requests still to admit into the batch forming now
        self._wait_start: float | None = None  # when the first request of the next arrived

    def arrived(self) -> None:
        if self._wait_start is None:
            self._wait_start = self._clock()

    def quota(self, num_waiting: int, num_running: int) -> int:
        if self._quota > 0:
            return self._quota
        if num_running or not num_waiting:
            return 0
        now = self._clock()
        waited = now - (now if self._wait_start is None else self._wait_start)
        if num_waiting < self.max_num_seqs and waited < self.wait_timeout_s:
            return 0
        self._quota = min(num_waiting, self.max_num_seqs)
        self._wait_start = None
        return self._quota

    def admitted(self) -> None:
        self._quota = max(0, self._quota - 1)


def make_batching(config: SchedulerConfig, clock: Callable[[], float]) -> Batching:
    if config.batching == "static":
        return StaticBatching(config.max_num_seqs, config.batch_wait_timeout_s, clock)
    return ContinuousBatching()
