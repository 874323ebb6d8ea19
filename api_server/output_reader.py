"""One choice's output read as it grows: its reasoning section, its answer's text and its
tool calls, each part new since the last read (what a stream sends next)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from api_server.reasoning import ReasoningReader
from api_server.tool_calls import ToolCallReader


@dataclass
class OutputDelta:
    reasoning: str = ""
    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)  # ``delta.tool_calls`` entries


@dataclass
class OutputReader:
    """Reasoning is split off first; the answer's text then goes to the call reader."""

    reasoning: ReasoningReader | None
    tools: ToolCallReader | None
    reasoning_text: str = ""
    shown_reasoning: bool = True

    def push(self, text: str, final: bool) -> OutputDelta:
        thought, answer = self.reasoning.push(text, final) if self.reasoning else ("", text)
        self.reasoning_text += thought
        if self.tools is None:
            return OutputDelta(thought if self.shown_reasoning else "", answer)
        content, calls = self.tools.push(answer, final)
        return OutputDelta(thought if self.shown_reasoning else "", content, calls)

    @property
    def has_calls(self) -> bool:
        return self.tools is not None and self.tools.has_calls

    def message_calls(self) -> list[dict[str, Any]]:
        return self.tools.message_calls() if self.tools is not None else []
