"""A clock the test moves by hand, for components that take ``clock=`` (the scheduler,
the engine core, hand-offs, rate limits, heartbeat silence)."""

from __future__ import annotations


class ManualClock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
