"""Sliding-window rate limits, on an injected clock."""

from __future__ import annotations

import pytest

from api_server.rate_limit import RateLimited, RateLimiter
from tests.unit.clock import ManualClock


def test_requests_per_minute_slide() -> None:
    clock = ManualClock(1000.0)
    limiter = RateLimiter(requests_per_minute=3, clock=clock)
    for dt in (0, 10, 20):
        clock.now += dt
        limiter.admit("a")  # at 1000, 1010, 1030
    with pytest.raises(RateLimited) as refused:
        limiter.admit("a")
    assert refused.value.retry_after_s == pytest.approx(30.0)  # the 1000 one ages out at 1060
    assert refused.value.retry_after_header == "30"
    limiter.admit("b")  # callers are separate
    clock.now = 1060.0
    limiter.admit("a")  # the first has left the window
    with pytest.raises(RateLimited):
        limiter.admit("a")


def test_refused_requests_are_not_counted() -> None:
    clock = ManualClock(1000.0)
    limiter = RateLimiter(requests_per_minute=1, clock=clock)
    limiter.admit("a")
    for _ in range(5):
        clock.now += 10
        with pytest.raises(RateLimited):
            limiter.admit("a")
    clock.now = 1060.0
    limiter.admit("a")  # the five refusals did not extend the wait


def test_tokens_per_minute() -> None:
    clock = ManualClock(1000.0)
    limiter = RateLimiter(tokens_per_minute=100, clock=clock)
    limiter.admit("a")
    limiter.charge("a", 60)
    clock.now += 5
    limiter.admit("a")  # 60 < 100: admitted
    limiter.charge("a", 50)  # 110 spent
    clock.now += 5
    with pytest.raises(RateLimited) as refused:
        limiter.admit("a")
    assert "100 tokens per minute" in str(refused.value)
    # 11 tokens must age out: the first charge (60) does so at 1060.
    assert refused.value.retry_after_s == pytest.approx(1060.0 - clock.now)
    limiter.admit("b")
    clock.now = 1060.0
    limiter.admit("a")


def test_zero_disables_and_idle_callers_are_forgotten() -> None:
    clock = ManualClock(1000.0)
    unlimited = RateLimiter(clock=clock)
    for _ in range(1000):
        unlimited.admit("a")
        unlimited.charge("a", 10**6)
    limiter = RateLimiter(requests_per_minute=5, clock=clock)
    for i in range(10):
        limiter.admit(f"caller-{i}")
    clock.now += 61
    limiter.forget_idle()
    assert not limiter._windows
