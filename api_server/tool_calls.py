"""Tool calling on chat completions: the server's one call format, the rules a request's
output follows under it, and one choice's text read back as content and calls.

Decoding does the hard part: under ``required`` or a named tool the output is calls
from the first token; under ``auto`` the model writes text freely and, once it writes
the format's trigger, the rest is calls (a lazy grammar). Either way every call's
arguments satisfy its tool's JSON schema, and stop strings never apply inside a call.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from api_server.generation import OutputRules
from api_server.tool_parsers import ToolParser
from api_server.tool_protocol import ToolMode, ToolUse
from common.messages import StructuredOutput, StructuredOutputKind


def call_id(prefix: str = "call_") -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


class ToolCalling:
    """The server's tool-call format and the template that teaches it."""

    def __init__(self, parser: ToolParser, model_template: str | None, user_template: bool) -> None:
        self.parser = parser
        # A template of the user's (--chat-template), or a model's own that renders tools,
        # is kept; otherwise tool conversations render through the format's own.
        knows_tools = user_template or (model_template is not None and "tools" in model_template)
        self.template = model_template if knows_tools else parser.chat_template()

    def rules(self, use: ToolUse | None) -> OutputRules:
        if use is None or not use.constrains:
            return OutputRules()
        grammar = StructuredOutput(StructuredOutputKind.GRAMMAR, self.parser.grammar(use))
        required = use.mode == ToolMode.REQUIRED
        return OutputRules(grammar, "" if required else self.parser.trigger)

    def reader(self, use: ToolUse | None, id_prefix: str = "call_") -> ToolCallReader | None:
        """A reader of calls for a request with tools (ids as its API spells them)."""
        if use is None or not use.constrains:
            return None
        return ToolCallReader(self.parser, id_prefix)


@dataclass
class _Sent:
    id: str
    name: str
    arguments: str = ""


@dataclass
class ToolCallReader:
    """One choice's output, read as it grows: what of its content and calls is new."""

    parser: ToolParser
    id_prefix: str = "call_"
    text: str = ""
    _content: str = ""
    _calls: list[_Sent] = field(default_factory=list)

    def push(self, text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """New content, and the ``delta.tool_calls`` entries for what is new in the calls:
        a call's id, type and name in its first entry, its arguments in fragments."""
        self.text += text
        got = self.parser.extract(self.text, final)
        content = got.content[len(self._content) :]
        self._content = got.content
        deltas: list[dict[str, Any]] = []
        for i, call in enumerate(got.calls):
            assert call.name is not None  # extract() lists a call once it has its name
            if i == len(self._calls):
                self._calls.append(_Sent(call_id(self.id_prefix), call.name))
                deltas.append(
                    {
                        "index": i,
                        "id": self._calls[i].id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": ""},
                    }
                )
            sent = self._calls[i]
            fragment = call.arguments[len(sent.arguments) :]
            if fragment:
                sent.arguments = call.arguments
                deltas.append({"index": i, "function": {"arguments": fragment}})
        return content, deltas

    @property
    def has_calls(self) -> bool:
        return bool(self._calls)

    def message_calls(self) -> list[dict[str, Any]]:
        """The calls read so far as ``message.tool_calls`` entries."""
        return [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in self._calls
        ]
