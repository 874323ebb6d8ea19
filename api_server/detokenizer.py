"""Incremental detokenization and stop strings, per request.

``IncrementalDetokenizer`` turns token ids into text as they arrive without ever
splitting a multi-byte character (``tokenizers``' ``DecodeStream`` holds back tokens
that end inside one). ``StopStringMatcher`` holds back text that could be the start
of a stop string, and on a match cuts the text before it (as OpenAI does).
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def push(self, token_ids: list[int]) -> str:
        """Text completed by these tokens (possibly empty)."""
        parts = [self._stream.step(self._tokenizer, token_id) for token_id in token_ids]
        return "".join(p for p in parts if p)


class StopStringMatcher:
    """Stop strings over a request's text; with ``ends_at``, only over the text before
    its first occurrence (a tool call's trigger: the call after it is never cut)."""

    def __init__(self, stops: list[str], ends_at: str | None = None) -> None:
        self._stops = [s for s in stops if s]
        self._held = ""
        self._ends_at = ends_at
        self._tail = ""  # the last characters let through, where ends_at may begin
        self.matched: str | None = None  # the stop string that ended generation

    @property
    def hit(self) -> bool:
        return self.matched is not None

    def push(self, text: str) -> str:
        """Text that is safe to emit now. After a match, ``hit`` is set and the text
        before the stop string is returned; later calls return nothing."""
        if self.hit:
            return ""
        if not self._stops:
            return text
        pending = self._held + text
        limit = len(pending)  # stop strings count only where they end before ends_at
        if self._ends_at is not None:
            seen = self._tail + pending
            at = seen.find(self._ends_at)
            if at >= 0:
                limit = max(0, at - len(self._tail))
        found = [
            (i, stop)
            for stop in self._stops
            if (i := pending.find(stop)) >= 0 and i + len(stop) <= limit
        ]
        if not found and limit < len(pending):  # past ends_at: no stop string from here on
            self._stops, self._held = [], ""
            return pending
        if found:
            cut, self.matched = min(found)
            self._held = ""
            return pending[:cut]
        keep = self._longest_stop_prefix_suffix(pending)
        self._held = pending[len(pending) - keep :] if keep else ""
        emitted = pending[: len(pending) - keep]
        if self._ends_at:
            self._tail = (self._tail + emitted)[-len(self._ends_at) :]
        return emitted

    def flush(self) -> str:
        """At the end of generation: the held-back text was no stop string after all."""
        held, self._held = self._held, ""
        return "" if self.hit else held

    def _longest_stop_prefix_suffix(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that starts some stop string."""
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best
