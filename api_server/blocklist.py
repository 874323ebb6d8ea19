"""``--guard-blocklist FILE``: a ``ContentGuard`` refusing the words and patterns of a
file, one entry a line.

The format (docs/guardrails.md): a line is taken without its surrounding whitespace;
blank lines and lines starting with ``#`` are skipped; ``re:PATTERN`` is a Python regular
expression, searched as written (case-sensitive unless it says ``(?i)``); any other line
is a word or phrase, matched case-insensitively as a whole word (not inside a longer
one: ``cat`` hits "Cat!" but not "category"), a space in it matching any run of
whitespace. A file that cannot be read, an empty or invalid pattern, or one that matches
empty text is refused at startup with a ``BlocklistError`` naming the line.

An output is scanned as it grows (``BlocklistScan``): the end of the text is held back
while it may be the start of a blocked word, so no part of a blocked word is ever sent
and a cut falls right before it. Words are therefore searched over the held-back and
new text only (their look-behind reading the character before); a pattern is searched
over the new text and the last ``LOOKBACK_CHARS`` characters already let through, and
a match that began in text already let through cuts at the start of the new text (what
was sent stays sent).
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass
from pathlib import Path

from api_server.content_guard import ContentGuard, GuardHit, NoContentGuard

REGEX_PREFIX = "re:"
# How far back in text already let through a pattern's match may begin; longer matches
# that began earlier are not seen (each push costs a search over this many characters).
# Also the longest end held back as a phrase's start (a space in one matches any run).
LOOKBACK_CHARS = 256
# Probes for a pattern that matches empty text (it would block every text).
_EMPTY_PROBES = ("", "word", "two words.\n")


class BlocklistError(ValueError):
    """A blocklist file that cannot be used; the message names the file and the line."""


@dataclass(frozen=True)
class Entry:
    line: int
    pattern: re.Pattern[str]
    word: str | None  # a word entry, lowercased, single-spaced; None for a pattern


def _word_regex(word: str) -> str:
    return r"\s+".join(re.escape(part) for part in word.split())


def _is_word_char(ch: str) -> bool:
    return ch.isalnum() or ch == "_"  # what ``\w`` matches, near enough to hold text back


def _entry(line: int, text: str, where: str) -> Entry:
    if not text.startswith(REGEX_PREFIX):
        word = " ".join(text.lower().split())
        pattern = re.compile(rf"(?<!\w){_word_regex(word)}(?!\w)", re.IGNORECASE)
        return Entry(line, pattern, word)
    source = text[len(REGEX_PREFIX) :]
    if not source:
        raise BlocklistError(f"{where}: '{REGEX_PREFIX}' without a pattern")
    try:
        compiled = re.compile(source)
    except re.error as e:
        raise BlocklistError(f"{where}: {text!r} is not a valid regular expression: {e}") from None
    for probe in _EMPTY_PROBES:
        m = compiled.search(probe)
        if m is not None and m.start() == m.end():
            raise BlocklistError(
                f"{where}: {text!r} matches empty text, so it would block every text; "
                "make it match at least one character"
            )
    return Entry(line, compiled, None)


def parse_blocklist(text: str, source: str = "--guard-blocklist") -> list[Entry]:
    """The entries of a blocklist file's text; ``source`` names it in errors."""
    entries = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if line and not line.startswith("#"):
            entries.append(_entry(number, line, f"{source} line {number}"))
    return entries


class Blocklist:
    """A ``ContentGuard`` refusing a blocklist's entries; its scans hold back a
    possible word's start (see the module docstring)."""

    checks_prompts = True

    def __init__(self, entries: list[Entry], source: str = "--guard-blocklist") -> None:
        self.source = source
        self.entries = entries
        self._patterns = [e for e in entries if e.word is None]
        words = sorted((e for e in entries if e.word is not None), key=lambda e: -len(e.word or ""))
        self._words = words
        # Every word in one search (longest first, so a phrase is named over its first word).
        alternatives = "|".join(_word_regex(e.word or "") for e in words)
        self._any_word = re.compile(rf"(?<!\w)(?:{alternatives})(?!\w)", re.IGNORECASE)
        self._sorted_words = sorted(e.word or "" for e in words)  # for prefix look-ups
        self._longest_word = max((len(w) for w in self._sorted_words), default=0)

    @classmethod
    def from_file(cls, path: str) -> Blocklist:
        source = f"--guard-blocklist {path}"
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise BlocklistError(f"{source}: cannot read it: {e}") from None
        return cls(parse_blocklist(text, source), source)

    def check(self, text: str) -> GuardHit | None:
        hit, _ = self.search(text, 0, final=True)
        return hit

    def scan(self) -> BlocklistScan:
        return BlocklistScan(self)

    def search(self, text: str, after: int, final: bool) -> tuple[GuardHit | None, int]:
        """The leftmost match in ``text`` that ends past ``after`` (a hit), and where
        undecided text begins (``len(text)`` if none): a word that reaches the end of
        ``text`` or the start of one, which the next text decides unless ``final``."""
        hit: GuardHit | None = None
        for entry in self._patterns:
            m = _ending_after(entry.pattern, text, after)
            if m is not None and (hit is None or m.start() < hit.start):
                hit = GuardHit(self._rule(entry), m.start())
        undecided = len(text)
        if self._words:  # no word begins before ``after``: a scan holds back its start
            m = _ending_after(self._any_word, text, after, after)
            if m is not None and (final or m.end() < len(text)):
                if hit is None or m.start() < hit.start:
                    hit = GuardHit(self._rule(self._word_of(m.group())), m.start())
            elif m is not None:
                undecided = m.start()
            if not final:
                undecided = min(undecided, self._word_start(text, after))
        return hit, undecided

    def _word_start(self, text: str, after: int) -> int:
        """Where the longest end of ``text`` (past ``after``) that begins a blocked word
        starts, as a whole word would; ``len(text)`` if none does."""
        # No end with more letters than the longest word begins one; a phrase's spaces
        # may be runs of whitespace, held back up to LOOKBACK_CHARS.
        first, letters = len(text), 0
        bound = max(after, len(text) - LOOKBACK_CHARS)
        while first > bound and letters < self._longest_word:
            first -= 1
            letters += not text[first].isspace()
        for start in range(first, len(text)):
            if text[start].isspace() or (start and _is_word_char(text[start - 1])):
                continue
            tail = " ".join(text[start:].lower().split())
            if text[-1].isspace():
                tail += " "
            i = bisect.bisect_left(self._sorted_words, tail)
            if i < len(self._sorted_words) and self._sorted_words[i].startswith(tail):
                return start
        return len(text)

    def _word_of(self, matched: str) -> Entry:
        return next(
            (e for e in self._words if e.pattern.fullmatch(matched)),
            self._words[0],  # unreachable: the match is one of the words
        )

    def _rule(self, entry: Entry) -> str:
        return f"{self.source} line {entry.line}"


def _ending_after(
    pattern: re.Pattern[str], text: str, after: int, pos: int = 0
) -> re.Match[str] | None:
    """The leftmost match of ``pattern`` in ``text`` that starts at ``pos`` or later and
    ends past ``after``: one ending earlier lies in text already let through, judged
    before. (Look-behinds still see the text before ``pos``.)"""
    while (m := pattern.search(text, pos)) is not None:
        if m.end() > after:
            return m
        pos = m.start() + 1
    return None


class BlocklistScan:
    """One output scanned against a ``Blocklist`` as it grows (an ``OutputScan``)."""

    def __init__(self, blocklist: Blocklist) -> None:
        self._blocklist = blocklist
        self._sent = ""  # the last LOOKBACK_CHARS characters let through
        self._held = ""  # text not let through yet: it may begin a blocked word
        self.hit: GuardHit | None = None

    def push(self, text: str) -> str:
        return self._take(text, final=False)

    def finish(self, text: str = "") -> str:
        return self._take(text, final=True)

    def _take(self, text: str, final: bool) -> str:
        if self.hit is not None:
            return ""
        pending = self._held + text
        window = self._sent + pending
        base = len(self._sent)
        hit, undecided = self._blocklist.search(window, base, final)
        if hit is not None:
            self.hit, self._held = hit, ""
            return pending[: max(0, min(hit.start, undecided) - base)]
        cut = undecided - base
        let_through, self._held = pending[:cut], pending[cut:]
        self._sent = (self._sent + let_through)[-LOOKBACK_CHARS:]
        return let_through


def content_guard(blocklist_path: str | None) -> ContentGuard:
    """The guard ``--guard-blocklist`` chooses, once per process; a ``BlocklistError``
    for a file that cannot be used."""
    if blocklist_path is None:
        return NoContentGuard()
    return Blocklist.from_file(blocklist_path)
