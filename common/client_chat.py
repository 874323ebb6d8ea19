"""``tandem chat``: a conversation with a running server in the terminal.

The conversation lives in this process's memory (``Chat.messages``) and is sent whole
with every turn, as a chat API is used; replies stream from ``/v1/chat/completions`` as
they are generated. Ctrl-C during a reply stops it: the connection is closed, which
aborts the request in the server, and the words already shown stay in the conversation
(what was seen is what the model is told it said). Ctrl-C at the prompt only clears the
line; Ctrl-D or ``/exit`` ends the session (exit 0). A turn the server refuses is said
on stderr and left out of the conversation."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any, TextIO

from common.client_http import ClientError, TandemClient

PROMPT = ">>> "
EXIT_COMMANDS = ("/exit", "/quit")
_DIM, _RESET = "\x1b[2m", "\x1b[0m"  # a reasoning section, shown apart from the answer


class Chat:
    """The session: the server, the model, the sampling fields and the conversation."""

    def __init__(
        self,
        client: TandemClient,
        model: str,
        sampling: dict[str, Any],
        out: TextIO = sys.stdout,
    ) -> None:
        self.client = client
        self.model = model
        self.sampling = sampling
        self.out = out
        self.messages: list[dict[str, str]] = []
        # Escape codes only where a terminal reads them.
        self._dim, self._reset = (_DIM, _RESET) if out.isatty() else ("", "")
        self._dimmed = False  # inside a reasoning section's dim text

    def run(self) -> int:
        # Line editing and history for input(); not on every platform, nor needed.
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401
        self.out.write(
            f"Chatting with {self.model} at {self.client.url}. "
            "Ctrl-C stops a reply; Ctrl-D or /exit ends.\n"
        )
        while True:
            try:
                line = input(PROMPT)
            except EOFError:
                self.out.write("\n")
                return 0
            except KeyboardInterrupt:
                self.out.write("\n")
                continue
            text = line.strip()
            if text in EXIT_COMMANDS:
                return 0
            if text:
                self.turn(text)

    def turn(self, text: str) -> None:
        """Send the conversation with ``text`` added and show the reply as it streams;
        keep both (or, after Ctrl-C, what was shown of the reply)."""
        asked = [*self.messages, {"role": "user", "content": text}]
        body = {"model": self.model, "messages": asked, **self.sampling}
        reply: list[str] = []
        try:
            self._show(self.client.stream("/v1/chat/completions", body), reply)
        except KeyboardInterrupt:
            self.client.reset()  # the interrupted stream's connection is dropped
            self.out.write(f"{self._end_dim()}\n[stopped]\n")
        except ClientError as e:
            self.out.write("\n")
            self.out.flush()
            print(f"tandem chat: {e}", file=sys.stderr)
            return
        else:
            self.out.write("\n")
        self.out.flush()
        if reply:
            self.messages = [*asked, {"role": "assistant", "content": "".join(reply)}]

    def _show(self, events: Iterator[dict[str, Any]], reply: list[str]) -> None:
        """Write a reply's deltas as they come (reasoning dim); its answer into ``reply``."""
        for event in events:
            for choice in event.get("choices") or []:
                delta = choice.get("delta") or {}
                if reasoning := delta.get("reasoning_content"):
                    self.out.write(("" if self._dimmed else self._dim) + reasoning)
                    self._dimmed = True
                if content := delta.get("content"):
                    self.out.write(self._end_dim() + content)
                    reply.append(content)
            self.out.flush()
        self.out.write(self._end_dim())

    def _end_dim(self) -> str:
        """The escape that ends a dim reasoning section, if one is open."""
        was, self._dimmed = self._dimmed, False
        return self._reset if was else ""
