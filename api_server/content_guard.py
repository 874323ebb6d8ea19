"""What the server refuses to read or write, chosen once at startup: a ``ContentGuard``
checks each prompt's text and scans each output as it grows (``--guard-blocklist``:
``blocklist.py``); ``NoContentGuard``, the default, lets everything through, so no route
asks whether a guard is on.

The routes act on what it finds (``generation.py``): a prompt that hits is refused (400,
code ``content_filter``), an output that hits ends there with finish reason
``content_filter`` and is aborted in the engine, as a stop string ends one. Text already
streamed before a hit is never recalled (docs/guardrails.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class GuardHit:
    """A match of the guard's rules: which rule (for the log only: a client is never told
    what matched), and where it starts in the text checked."""

    rule: str
    start: int


class OutputScan(Protocol):
    """One output's text as it grows. The scan may hold back the end of the text (the
    start of what could become a match) until the next text, or the end, settles it."""

    hit: GuardHit | None  # set once the output matched; it gives nothing more after

    def push(self, text: str) -> str:
        """The text that may be sent now (held-back text first); on a hit, the part
        before the match."""
        ...

    def finish(self, text: str = "") -> str:
        """The output ended after ``text``: all that is still held back, up to any hit
        (the end of the output ends a word)."""
        ...


class ContentGuard(Protocol):
    @property
    def checks_prompts(self) -> bool:
        """Whether ``check`` can refuse a prompt: a route reads a prompt's text for it
        only then (a completion's token-id prompt is decoded only for it or ``echo``)."""
        ...

    def check(self, text: str) -> GuardHit | None:
        """The first match in a whole text (a prompt), or None."""
        ...

    def scan(self) -> OutputScan:
        """A scan for one output (one choice of one request)."""
        ...


class _PassThrough:
    def __init__(self) -> None:
        self.hit: GuardHit | None = None

    def push(self, text: str) -> str:
        return text

    def finish(self, text: str = "") -> str:
        return text


class NoContentGuard:
    """No guard: every prompt passes, outputs pass as they come."""

    checks_prompts = False

    def check(self, text: str) -> GuardHit | None:
        return None

    def scan(self) -> OutputScan:
        return _PassThrough()
