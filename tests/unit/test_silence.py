"""common.silence: a peer's silence in the watcher's own running time."""

from __future__ import annotations

import pytest

from common.silence import Silence
from tests.unit.clock import ManualClock


def test_counts_nothing_before_the_peer_is_first_heard() -> None:
    clock = ManualClock(100.0)
    silence = Silence(max_gap_s=0.2, clock=clock)
    clock.now += 60.0
    assert silence.look() == 0.0
    assert not silence.ever_heard


def test_looks_at_the_polling_interval_add_up_to_the_wall_time() -> None:
    clock = ManualClock(100.0)
    silence = Silence(max_gap_s=0.2, clock=clock)
    silence.heard()
    for _ in range(5):
        clock.now += 0.2
        silence.look()
    assert silence.silent_s == pytest.approx(1.0)
    assert silence.ever_heard


def test_a_pause_between_two_looks_counts_as_one_gap() -> None:
    clock = ManualClock(100.0)
    silence = Silence(max_gap_s=0.2, clock=clock)
    silence.heard()
    clock.now += 0.1
    assert silence.look() == pytest.approx(0.1)
    clock.now += 30.0  # the machine was paused
    assert silence.look() == pytest.approx(0.3)


def test_hearing_the_peer_starts_the_count_again() -> None:
    clock = ManualClock(100.0)
    silence = Silence(max_gap_s=0.5, clock=clock)
    silence.heard()
    clock.now += 0.4
    silence.look()
    clock.now += 0.1
    silence.heard()
    assert silence.silent_s == 0.0
    clock.now += 0.3
    assert silence.look() == pytest.approx(0.3)
