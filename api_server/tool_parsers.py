"""Tool-call formats, one object each, chosen once per server (``--tool-call-parser``).

A format names its trigger (the text that starts its calls), the grammar its calls are
decoded under (llguidance's Lark, each call's arguments under that tool's JSON schema),
the tool-aware chat template that teaches it to a model whose own template knows no
tools, and how to read calls back out of the text. Because decoding follows the
grammar, reading is a walk over a known shape, not a guess: calls and their arguments
come out as the model wrote them, streamed or not, whatever the arguments' strings hold.

A call's arguments are always the JSON text of an object. The Python-style formats
(``pythonic``, ``gemma3``) write ``name(key=value, ...)`` with each value a JSON literal
(so ``true``, not ``True``), and the arguments are those values under their keys.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, ClassVar

from api_server.tool_protocol import FunctionDef, ToolMode, ToolUse
from api_server.tool_scan import Cursor, held_prefix, regex_literal

# Arguments in one spelling (what ``json.dumps`` writes), so that a small model cannot
# wander into unbounded whitespace.
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass
class CallText:
    """One call as read so far: its name once complete, its arguments' JSON text (it only
    ever grows, so streamed fragments concatenate to the final text)."""

    name: str | None = None
    arguments: str = ""
    complete: bool = False


@dataclass
class Extracted:
    content: str  # never holds the trigger, nor a tail that may begin it
    calls: list[CallText] = field(default_factory=list)


def _lit(text: str) -> str:
    return json.dumps(text)  # a Lark string literal with JSON escapes


def json_grammar(schema: dict[str, Any]) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": _COMPACT})


class ToolParser(ABC):
    """One format: ``open call (sep call)* close``; every call starts with ``call_head``;
    the trigger starts ``open + call_head``."""

    name: ClassVar[str]
    template: ClassVar[str]  # file under api_server/templates/
    trigger: ClassVar[str]
    trigger_anywhere: ClassVar[bool]  # False: calls only as the whole answer
    open: ClassVar[str] = ""
    call_head: ClassVar[str]
    sep: ClassVar[str]
    close: ClassVar[str] = ""

    def chat_template(self) -> str:
        return resources.files("api_server").joinpath("templates", self.template).read_text()

    @abstractmethod
    def _call_rules(self, i: int, tool: FunctionDef) -> list[str]:
        """Lark rules; the first is ``named_<i>``: what follows ``call_head`` for this tool."""

    @abstractmethod
    def _read_call(self, cur: Cursor) -> CallText | None:
        """A call after its ``call_head``; None if the text breaks the format."""

    def grammar(self, use: ToolUse) -> str:
        """The Lark grammar of this request's output."""
        rules = [r for i, tool in enumerate(use.tools) for r in self._call_rules(i, tool)]
        named = " | ".join(f"named_{i}" for i in range(len(use.tools)))
        more = f"({_lit(self.sep)} call)*" if use.parallel else ""
        close = _lit(self.close) if self.close else ""
        head = self.open + self.call_head
        if use.mode == ToolMode.REQUIRED:
            start = f"start: {_lit(head)} ({named}) {more} {close}"
        elif self.trigger_anywhere:
            # text that never writes the trigger, or text up to it and then calls
            rest = head[len(self.trigger) :]
            start = (
                f"start: CONTENT | lead {_lit(rest) if rest else ''} ({named}) {more} {close}\n"
                f"CONTENT: /(.|\\n)*/ & ~/(.|\\n)*{regex_literal(self.trigger)}(.|\\n)*/\n"
                f"lead[lazy]: /(.|\\n)*/ {_lit(self.trigger)}"
            )
        else:
            start = (
                f"start: CONTENT | {_lit(head)} ({named}) {more} {close}\n"
                f"CONTENT: /(.|\\n)*/ & ~/{regex_literal(self.trigger)}(.|\\n)*/"
            )
        return "\n".join(
            ["%llguidance {}", start, f"call: {_lit(self.call_head)} ({named})", *rules]
        )

    def extract(self, text: str, final: bool) -> Extracted:
        """Content and calls in ``text`` (the whole output so far). Not ``final``: a tail
        of the content that could begin the trigger is held back."""
        if self.trigger_anywhere:
            at = text.find(self.trigger)
            if at < 0:
                return Extracted(
                    text if final else text[: len(text) - held_prefix(text, self.trigger)]
                )
        elif text.startswith(self.trigger):
            at = 0
        else:  # content, unless what there is so far may still become the trigger
            return Extracted("" if not final and self.trigger.startswith(text) else text)
        cur = Cursor(text, at)
        calls: list[CallText] = []
        if cur.expect(self.open) and cur.expect(self.call_head):
            while True:
                call = self._read_call(cur)
                if call is None or call.name is None:
                    break
                calls.append(call)
                if not call.complete or not cur.expect(self.sep) or not cur.expect(self.call_head):
                    break
        return Extracted(text[:at], calls)


class JsonCallParser(ToolParser):
    """Calls as JSON objects: ``{"name": NAME, "<args_key>": {...}}``."""

    args_key: ClassVar[str]
    call_head = '{"name": "'
    call_end: ClassVar[str] = "}"

    def _call_rules(self, i: int, tool: FunctionDef) -> list[str]:
        mid = f'", "{self.args_key}": '
        end = self.call_end
        return [
            f"named_{i}: {_lit(tool.name + mid)} {json_grammar(tool.arguments_schema)} {_lit(end)}"
        ]

    def _read_call(self, cur: Cursor) -> CallText | None:
        name = cur.until('"')
        if name is None:
            return CallText()
        call = CallText(name)
        if not cur.expect(f', "{self.args_key}": '):
            return call
        call.arguments, done = cur.json_value()
        call.complete = done and cur.expect(self.call_end) is True
        return call


class HermesParser(JsonCallParser):
    """Qwen 2.5/3 and other chatml models: ``<tool_call>\\n{...}\\n</tool_call>``."""

    name = "hermes"
    template = "hermes.jinja"
    trigger = "<tool_call>"
    trigger_anywhere = True
    call_head = '<tool_call>\n{"name": "'
    call_end = "}\n</tool_call>"
    sep = "\n"
    args_key = "arguments"


class Llama3JsonParser(JsonCallParser):
    """Llama 3.1-3.3: the answer is ``{"name": ..., "parameters": {...}}``, calls joined by
    ``; ``."""

    name = "llama3_json"
    template = "llama3_json.jinja"
    trigger = '{"name": '
    trigger_anywhere = False
    sep = "; "
    args_key = "parameters"


class PythonicParser(ToolParser):
    """Llama 3.2/4 style: the answer is ``[name(key=value, ...), ...]``."""

    name = "pythonic"
    template = "pythonic.jinja"
    trigger = "["
    trigger_anywhere = False
    open = "["
    call_head = ""
    sep = ", "
    close = "]"

    def _call_rules(self, i: int, tool: FunctionDef) -> list[str]:
        props: dict[str, Any] = tool.arguments_schema.get("properties") or {}
        required = set(tool.arguments_schema.get("required") or [])
        keys = list(props)
        rules = [f"named_{i}: {_lit(tool.name + '(')} fresh_{i}_0 {_lit(')')}"]
        # fresh_<k>: no keyword written yet; started_<k>: some, so the next needs ", "
        for k, key in enumerate(keys):
            kw = f"kw_{i}_{k}"
            rules.append(f"{kw}: {_lit(key + '=')} {json_grammar(props[key])}")
            nxt_started, nxt_fresh = f"started_{i}_{k + 1}", f"fresh_{i}_{k + 1}"
            if key in required:
                rules.append(f"fresh_{i}_{k}: {kw} {nxt_started}")
                rules.append(f"started_{i}_{k}: {_lit(', ')} {kw} {nxt_started}")
            else:
                rules.append(f"fresh_{i}_{k}: {kw} {nxt_started} | {nxt_fresh}")
                rules.append(f"started_{i}_{k}: {_lit(', ')} {kw} {nxt_started} | {nxt_started}")
        rules += [f'fresh_{i}_{len(keys)}: ""', f'started_{i}_{len(keys)}: ""']
        return rules

    def _read_call(self, cur: Cursor) -> CallText | None:
        name = cur.until("(")
        if name is None:
            return CallText()
        call = CallText(name, "{")
        while True:
            if cur.expect(")"):
                call.arguments += "}"
                call.complete = True
                return call
            key = cur.until("=")
            if key is None:
                return call
            value, done = cur.json_value()
            call.arguments += f"{json.dumps(key)}: {value}"
            if not done:
                return call
            sep = cur.expect(", ")
            if sep is None:  # the text ends here
                return call
            if sep:
                call.arguments += ", "


class Gemma3Parser(PythonicParser):
    """Gemma 3's function calling: calls in a ```` ```tool_code ```` block, one a line."""

    name = "gemma3"
    template = "gemma3.jinja"
    trigger = "```tool_code"
    trigger_anywhere = True
    open = "```tool_code\n"
    sep = "\n"
    close = "\n```"


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, PythonicParser, Gemma3Parser)
}


def pick_tool_parser(name: str, model_template: str | None) -> ToolParser:
    """``--tool-call-parser``: a format by name, or ``auto``: the one the model's own
    template writes calls in, else the one of its turn markers' family."""
    if name != "auto":
        return TOOL_PARSERS[name]()
    template = model_template or ""
    for marker, parser in (
        ("<tool_call>", HermesParser),
        ("tool_code", Gemma3Parser),
        ("<|python_tag|>", Llama3JsonParser),
        ("<|start_header_id|>", Llama3JsonParser),
        ("<start_of_turn>", Gemma3Parser),
    ):
        if marker in template:
            return parser()
    return HermesParser()
