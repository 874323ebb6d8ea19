"""Per-caller rate limits over a sliding window: requests per minute and tokens per minute.

A caller is an API key (by digest), or the client's address when no keys are set.
Requests are counted when admitted; tokens are charged as they are spent (prompt tokens
at admission, completion tokens when the request ends), so a caller who has spent the
window's tokens waits until enough of them age out. One process keeps its own windows:
with several API-server processes each enforces the limit on the traffic it sees.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field


class RateLimited(Exception):
    """A caller is over a limit; ``retry_after_s`` is when the window admits it again."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    @property
    def retry_after_header(self) -> str:
        return str(max(1, math.ceil(self.retry_after_s)))


@dataclass
class _Window:
    requests: deque[float] = field(default_factory=deque)  # admission times
    tokens: deque[tuple[float, int]] = field(default_factory=deque)  # (time, tokens)
    token_sum: int = 0


class RateLimiter:
    """Sliding-window limits; 0 disables a limit. ``clock`` is injectable for tests."""

    def __init__(
        self,
        requests_per_minute: int = 0,
        tokens_per_minute: int = 0,
        window_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rpm = requests_per_minute
        self.tpm = tokens_per_minute
        self.window_s = window_s
        self.clock = clock
        self._windows: dict[str, _Window] = {}

    @property
    def enabled(self) -> bool:
        return bool(self.rpm or self.tpm)

    def _window(self, caller: str, now: float) -> _Window:
        w = self._windows.setdefault(caller, _Window())
        horizon = now - self.window_s
        while w.requests and w.requests[0] <= horizon:
            w.requests.popleft()
        while w.tokens and w.tokens[0][0] <= horizon:
            w.token_sum -= w.tokens.popleft()[1]
        return w

    def admit(self, caller: str) -> None:
        """Count one request for ``caller``, or raise ``RateLimited`` without counting it."""
        if not self.enabled:
            return
        if len(self._windows) > 4096:
            self.forget_idle()
        now = self.clock()
        w = self._window(caller, now)
        if self.rpm and len(w.requests) >= self.rpm:
            wait = w.requests[0] + self.window_s - now
            raise RateLimited(
                f"rate limit reached: {self.rpm} requests per minute; retry in {wait:.1f} s", wait
            )
        if self.tpm and w.token_sum >= self.tpm:
            wait = self._tokens_free_at(w, w.token_sum - self.tpm + 1) - now
            raise RateLimited(
                f"rate limit reached: {self.tpm} tokens per minute ({w.token_sum} used in the "
                f"last minute); retry in {wait:.1f} s",
                wait,
            )
        w.requests.append(now)

    def charge(self, caller: str, tokens: int) -> None:
        """Record ``tokens`` spent by ``caller`` now."""
        if not self.tpm or tokens <= 0:
            return
        now = self.clock()
        w = self._window(caller, now)
        w.tokens.append((now, tokens))
        w.token_sum += tokens

    def _tokens_free_at(self, w: _Window, needed: int) -> float:
        """When at least ``needed`` of the window's tokens will have aged out."""
        freed = 0
        for t, n in w.tokens:
            freed += n
            if freed >= needed:
                return t + self.window_s
        return self.clock() + self.window_s

    def forget_idle(self) -> None:
        """Drop callers with empty windows so the table does not grow without bound."""
        now = self.clock()
        for caller in list(self._windows):
            w = self._window(caller, now)
            if not w.requests and not w.tokens:
                del self._windows[caller]
