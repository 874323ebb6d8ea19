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
    def __init__(self, stops: list[str]) -> None:
        self._stops = [s for s in stops if s]
        self._held = ""
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
        found = [(i, stop) for stop in self._stops if (i := pending.find(stop)) >= 0]
        if found:
            cut, self.matched = min(found)
            self._held = ""
            return pending[:cut]
        keep = self._longest_stop_prefix_suffix(pending)
        self._held = pending[len(pending) - keep :] if keep else ""
        return pending[: len(pending) - keep]

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
