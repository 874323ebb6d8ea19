"""How long a peer has been silent, counted in the watcher's own running time.

A heartbeat's absence is judged by the process waiting for it. When the whole machine
pauses (a VM's stolen time, memory reclaim on a busy host, SIGSTOP to the service), the
peer and the watcher stop alike; read off the clock, the pause looks like a peer that
stopped answering, and every service on the machine takes its own parts for dead at
once. So the time between two looks counts at most ``max_gap_s``: the watcher's own
polling interval, or a little over it.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class Silence:
    """``heard()`` on every message from the peer; ``look()`` while waiting, returning
    the seconds of silence so far. Before the first ``heard()`` nothing is counted (a peer
    not yet connected is waited for, not declared dead)."""

    def __init__(self, max_gap_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_gap_s = max_gap_s
        self._clock = clock
        self._last_look: float | None = None
        self.silent_s = 0.0

    @property
    def ever_heard(self) -> bool:
        return self._last_look is not None

    def heard(self) -> None:
        self._last_look = self._clock()
        self.silent_s = 0.0

    def look(self) -> float:
        if self._last_look is None:
            return 0.0
        now = self._clock()
        self.silent_s += min(now - self._last_look, self.max_gap_s)
        self._last_look = now
        return self.silent_s
