"""How many compute threads a worker runs its steps on, while something else shares
its cores.

The worker's OpenMP threads meet at the end of every parallel region (hundreds a step),
each with a fixed share of the work. When another process takes one of their cores, the
thread on it waits its turn in the run queue while the others spin at the barrier: on
this 2-core host a single busy process beside the worker took 32 requests at once from
705 tok/s to 20, where one thread alone keeps 460 (docs/benchmarks.md). So the governor
watches how long the worker's threads sat runnable but not running (the kernel's
``/proc/self/task/*/schedstat``), and when that is a large share of the time they were
stepping it gives one core up; every few seconds it tries all of them again, and keeps
them if they are no longer kept waiting.

The engine core and API server share the cores too, but briefly: at 32 streams the
worker's threads wait 8-15% of the time, single windows up to ~40% during a burst of
arrivals, hence two contended windows in a row before a core is given up.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

TASKS = Path("/proc/self/task")
# Share of the threads' stepping time spent waiting for a core above which one is given
# up, in this many windows running. Measured here: a busy process on one core keeps the
# two threads waiting ~50% of every window; the real server's own API server and load
# generator, at 32 streams, 8-15% with single windows up to ~40% (a burst of arrivals).
CONTENDED_SHARE = 0.35
CONTENDED_WINDOWS = 2
WINDOW_S = 0.25  # stepping time between judgements
# How long a reduced count is kept before every thread is tried again; doubled after
# each probe that finds the cores still taken (a probe runs a window at the collapsed
# speed), back to the first once one finds them free.
PROBE_AFTER_S = 5.0
MAX_PROBE_AFTER_S = 80.0


def run_queue_wait_ns(tasks: Path = TASKS) -> int | None:
    """Nanoseconds this process's threads have spent runnable but not running, summed;
    None where the kernel keeps no schedstat."""
    total = 0
    try:
        entries = list(tasks.iterdir())
    except OSError:
        return None
    for task in entries:
        try:
            total += int((task / "schedstat").read_text().split()[1])
        except FileNotFoundError:
            continue  # the thread ended between the listing and the read
        except (OSError, IndexError, ValueError):
            return None
    return total


class ThreadGovernor:
    """Judges each window of stepping time and sets the thread count for the next steps.

    ``step_done(busy_s)`` is called after every step with the wall time the step took;
    ``set_threads`` is called (torch.set_num_threads in the worker) only when the count
    changes. ``read_wait_ns`` and ``now`` are the kernel's counter and a monotonic
    clock; unit tests pass their own."""

    def __init__(
        self,
        max_threads: int,
        set_threads: Callable[[int], None],
        read_wait_ns: Callable[[], int | None] = run_queue_wait_ns,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_threads = max_threads
        self.threads = max_threads
        self._set_threads = set_threads
        self._read_wait_ns = read_wait_ns
        self._now = now
        self._window_start_wait = read_wait_ns()
        self._window_busy_s = 0.0
        self._reduced_at: float | None = None
        self._contended = 0  # windows in a row over CONTENDED_SHARE
        self._probing = False  # the current window runs every thread again, on trial
        self._probe_after_s = PROBE_AFTER_S

    @property
    def enabled(self) -> bool:
        return self.max_threads > 1 and self._window_start_wait is not None

    def step_done(self, busy_s: float) -> None:
        if not self.enabled:
            return
        self._window_busy_s += busy_s
        if self._window_busy_s < WINDOW_S:
            return
        wait = self._read_wait_ns()
        if wait is None or self._window_start_wait is None:
            return
        window_s = self._window_busy_s
        share = (wait - self._window_start_wait) / 1e9 / (window_s * self.threads)
        self._window_start_wait, self._window_busy_s = wait, 0.0
        self._contended = self._contended + 1 if share > CONTENDED_SHARE else 0
        # A probe of every thread is judged by its first window alone.
        needed = 1 if self._probing else CONTENDED_WINDOWS
        if self._probing:
            failed = self._contended >= needed
            self._probe_after_s = (
                min(2 * self._probe_after_s, MAX_PROBE_AFTER_S) if failed else PROBE_AFTER_S
            )
        self._probing = False
        if self._contended >= needed and self.threads > 1:
            self._change(self.threads - 1, share, window_s)
            self._reduced_at, self._contended = self._now(), 0
        elif (
            self.threads < self.max_threads
            and self._reduced_at is not None
            and self._now() - self._reduced_at >= self._probe_after_s
        ):
            self._change(self.max_threads, share, window_s)
            self._reduced_at, self._probing, self._contended = None, True, 0

    def idle(self) -> None:
        """The worker has no step to run: the next window starts with the next step, so
        waits while idle (the spinning threads' last moments) are not charged to it."""
        if self.enabled:
            self._window_start_wait, self._window_busy_s = self._read_wait_ns(), 0.0

    def _change(self, threads: int, share: float, window_s: float) -> None:
        logger.info(
            "worker threads %d -> %d (threads waited for a core %.0f%% of the last %.2f s)",
            self.threads,
            threads,
            100 * share,
            window_s,
        )
        self.threads = threads
        self._set_threads(threads)
