"""A cumulative histogram of tokens per engine step, carried in ``SchedulerStats`` so
every API server can export the engine's ``iteration_tokens_total`` histogram."""

from __future__ import annotations

import bisect

from common.messages import ITERATION_TOKEN_BUCKETS


class IterationTokens:
    def __init__(self, bounds: tuple[int, ...] = ITERATION_TOKEN_BUCKETS) -> None:
        self.bounds = bounds
        self._counts = [0] * (len(bounds) + 1)  # per bucket; the last is above every bound
        self.total = 0

    def observe(self, num_tokens: int) -> None:
        self._counts[bisect.bisect_left(self.bounds, num_tokens)] += 1
        self.total += num_tokens

    @property
    def cumulative(self) -> list[int]:
        """Steps with at most ``bounds[i]`` tokens, then all steps (Prometheus ``le``)."""
        out, running = [], 0
        for count in self._counts:
            running += count
            out.append(running)
        return out
