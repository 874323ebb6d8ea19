"""A cursor over a model's output, for reading tool calls written under their grammar,
and the two helpers a stream's tags need (a held-back tail, a tag inside a regex).

Every read says whether the text ran out before the thing read was complete, so the
same walk serves a stream's partial text and a finished answer.
"""

from __future__ import annotations


class Cursor:
    def __init__(self, text: str, at: int = 0) -> None:
        self.text = text
        self.at = at

    @property
    def ended(self) -> bool:
        return self.at >= len(self.text)

    def expect(self, literal: str) -> bool | None:
        """Step over ``literal``: True if it is here, None if the text ends inside it
        (the cursor then stays put), False if something else is here."""
        rest = self.text[self.at : self.at + len(literal)]
        if rest == literal:
            self.at += len(literal)
            return True
        return None if literal.startswith(rest) else False

    def until(self, stop: str) -> str | None:
        """The text up to ``stop`` (stepping over both), or None if ``stop`` is not here yet."""
        end = self.text.find(stop, self.at)
        if end < 0:
            return None
        word, self.at = self.text[self.at : end], end + len(stop)
        return word

    def json_value(self) -> tuple[str, bool]:
        """The JSON value starting here as written so far, and whether it is complete.
        A scalar outside brackets is complete only once something follows it."""
        depth, in_string, escaped = 0, False, False
        start = i = self.at
        text = self.text
        while i < len(text):
            c = text[i]
            if in_string:
                if escaped:
                    escaped = False
                elif c == "\\":
                    escaped = True
                elif c == '"':
                    in_string = False
                    if depth == 0:
                        self.at = i + 1
                        return text[start : i + 1], True
            elif c == '"':
                in_string = True
            elif c in "{[":
                depth += 1
            elif c in "}]":
                if depth == 0:  # a scalar ended by its container's bracket
                    self.at = i
                    return text[start:i], True
                depth -= 1
                if depth == 0:
                    self.at = i + 1
                    return text[start : i + 1], True
            elif depth == 0 and c in ",)\n; ":
                self.at = i
                return text[start:i], True
            i += 1
        self.at = i
        return text[start:], False


def held_prefix(text: str, tag: str) -> int:
    """Length of the longest tail of ``text`` that begins ``tag`` (held back from a
    stream until the next text says whether the tag follows)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


_REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~/")


def regex_literal(text: str) -> str:
    """``text`` as a literal inside a Lark ``/regex/`` (``/`` escaped, as it would end it)."""
    return "".join(f"\\{c}" if c in _REGEX_META else "\\n" if c == "\n" else c for c in text)
