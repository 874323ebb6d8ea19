"""The worker's thread governor: one core fewer while its threads wait for cores, every
core again once they no longer do (a fake run-queue counter and clock drive it; the
kernel's counter is read for real in the last test)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from worker.thread_governor import (
    CONTENDED_SHARE,
    MAX_PROBE_AFTER_S,
    PROBE_AFTER_S,
    WINDOW_S,
    ThreadGovernor,
    run_queue_wait_ns,
)


class FakeHost:
    """A run-queue wait counter and a clock that steps advance."""

    def __init__(self) -> None:
        self.wait_ns = 0
        self.clock = 0.0
        self.set_calls: list[int] = []

    def window(self, governor: ThreadGovernor, share: float) -> None:
        """One window of stepping in which each thread waited ``share`` of the time."""
        self.clock += WINDOW_S
        self.wait_ns += int(share * WINDOW_S * governor.threads * 1e9)
        governor.step_done(WINDOW_S)


def governor_on(host: FakeHost, threads: int = 2) -> ThreadGovernor:
    return ThreadGovernor(threads, host.set_calls.append, lambda: host.wait_ns, lambda: host.clock)


def test_one_contended_window_is_a_burst_two_give_a_core_up() -> None:
    host = FakeHost()
    governor = governor_on(host)
    host.window(governor, 0.5)
    assert governor.threads == 2 and host.set_calls == []
    host.window(governor, 0.1)  # the run is broken: the count starts again
    host.window(governor, 0.5)
    assert host.set_calls == []
    host.window(governor, 0.5)
    assert governor.threads == 1 and host.set_calls == [1]


def test_waits_below_the_share_never_change_the_threads() -> None:
    host = FakeHost()
    governor = governor_on(host, threads=4)
    for _ in range(100):
        host.window(governor, CONTENDED_SHARE - 0.05)
    assert governor.threads == 4 and host.set_calls == []


def test_every_thread_is_tried_again_and_kept_when_no_longer_waiting() -> None:
    host = FakeHost()
    governor = governor_on(host)
    host.window(governor, 0.5)
    host.window(governor, 0.5)
    assert host.set_calls == [1]
    reduced_at = host.clock
    while host.clock + WINDOW_S < reduced_at + PROBE_AFTER_S:  # one thread, not waiting
        host.window(governor, 0.0)
    assert host.set_calls == [1]  # kept until the probe is due
    host.window(governor, 0.0)
    assert host.set_calls == [1, 2]
    for _ in range(10):
        host.window(governor, 0.05)
    assert governor.threads == 2 and host.set_calls == [1, 2]


def test_a_probe_into_contention_is_given_up_after_one_window() -> None:
    host = FakeHost()
    governor = governor_on(host)
    host.window(governor, 0.5)
    host.window(governor, 0.5)
    while host.set_calls == [1]:
        host.window(governor, 0.0)
    assert host.set_calls == [1, 2]
    host.window(governor, 0.5)  # still contended: back at once
    assert host.set_calls == [1, 2, 1]
    # The next probe comes after twice the wait, and so on up to MAX_PROBE_AFTER_S.
    waits = []
    for _ in range(6):
        reduced_at = host.clock
        while len(host.set_calls) % 2 == 1:
            host.window(governor, 0.0)
        waits.append(round(host.clock - reduced_at - WINDOW_S))
        host.window(governor, 0.5)
    expected = [min(PROBE_AFTER_S * 2**i, MAX_PROBE_AFTER_S) for i in range(1, 7)]
    assert waits == expected
    # A probe that finds the cores free resets the wait.
    while len(host.set_calls) % 2 == 1:
        host.window(governor, 0.0)
    host.window(governor, 0.0)
    host.window(governor, 0.5)
    host.window(governor, 0.5)
    reduced_at = host.clock
    while len(host.set_calls) % 2 == 1:
        host.window(governor, 0.0)
    assert round(host.clock - reduced_at - WINDOW_S) == PROBE_AFTER_S


def test_waits_while_idle_are_not_charged_to_the_next_window() -> None:
    host = FakeHost()
    governor = governor_on(host)
    host.window(governor, 0.5)
    host.wait_ns += 10**9  # a second of waiting while the worker had nothing to run
    governor.idle()
    host.window(governor, 0.1)
    host.window(governor, 0.5)
    assert governor.threads == 2 and host.set_calls == []


def test_one_thread_or_no_schedstat_turns_it_off() -> None:
    host = FakeHost()
    single = governor_on(host, threads=1)
    blind = ThreadGovernor(2, host.set_calls.append, lambda: None, lambda: host.clock)
    for _ in range(4):
        host.window(single, 1.0)
        host.window(blind, 1.0)
    assert not single.enabled and not blind.enabled and host.set_calls == []


def test_the_kernel_counts_a_thread_kept_off_its_core() -> None:
    """More spinning processes than cores: the one watched waits in the run queue."""
    spin = [sys.executable, "-c", "while True: pass"]
    spinners = [subprocess.Popen(spin) for _ in range((os.cpu_count() or 1) + 2)]
    try:
        tasks = Path(f"/proc/{spinners[0].pid}/task")
        before = run_queue_wait_ns(tasks)
        time.sleep(0.5)
        after = run_queue_wait_ns(tasks)
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    assert before is not None and after is not None
    assert after - before > 0.05e9  # of 0.5 s, with more runnable processes than cores
