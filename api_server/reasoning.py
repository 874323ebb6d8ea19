"""Reasoning sections (``<think>…</think>``), one format object each, chosen once per
server (``--reasoning-parser``): where a section starts, how its text is read apart from
the answer's, and the grammar that bounds it (a token budget) and puts a structured
output or tool grammar after it, never inside it.

``qwen3``: the model opens the section itself (``<think>``), unless the template already
did; with ``enable_thinking: false`` Qwen3's template writes an empty section into the
prompt, so the output is all answer. ``deepseek_r1``: the template opens the section, so
the output is reasoning until ``</think>`` (a leading ``<think>`` the model repeats is
dropped).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from api_server.generation import OutputRules
from api_server.tool_scan import held_prefix, regex_literal
from common.messages import StructuredOutput, StructuredOutputKind


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    opened_by_template: bool  # the generation prompt opens the section
    start: str = "<think>"
    end: str = "</think>"

    def opens(self, prompt_tail: str) -> bool:
        """Whether the output begins inside the section, given the prompt's last text."""
        return self.opened_by_template or prompt_tail.rstrip().endswith(self.start)

    def grammar(
        self, inside: bool, budget: int | None, after: StructuredOutput | None
    ) -> StructuredOutput:
        """The whole output's grammar: the section (at most ``budget`` tokens of it, then
        its end is forced), then ``after`` (free text when None)."""
        end = regex_literal(self.end)
        bound = f"[max_tokens={budget}]" if budget is not None else ""
        section = f'"{self.start}"? think "{self.end}"'
        head = section if inside else f'("{self.start}" think "{self.end}")?'
        grammars: list[dict[str, Any]] = []
        if after is None:
            rest = "ANSWER"
            rules = ["ANSWER: /(.|\\n)*/"]
        else:
            rest = "@answer"
            rules = []
            grammars = _as_grammars(after)
            grammars[0] = {**grammars[0], "name": "answer"}
        lark = "\n".join(
            [
                f"start: {head} {rest}",
                f"think{bound}: THINK",
                f"THINK: /(.|\\n)*/ & ~/(.|\\n)*{end}(.|\\n)*/",
                *rules,
            ]
        )
        top = {"grammars": [{"lark_grammar": lark}, *grammars]}
        return StructuredOutput(StructuredOutputKind.LLGUIDANCE, json.dumps(top))

    def reader(self, inside: bool) -> ReasoningReader:
        return ReasoningReader(self, inside)


def _as_grammars(structured: StructuredOutput) -> list[dict[str, Any]]:
    from common.grammar import grammar_text  # llguidance's conversion, as the worker uses

    text = grammar_text(structured)
    if text.lstrip().startswith("{"):
        grammars: list[dict[str, Any]] = json.loads(text)["grammars"]
        return grammars
    return [{"lark_grammar": text}]


REASONING_PARSERS: tuple[ReasoningParser, ...] = (
    ReasoningParser("qwen3", opened_by_template=False),
    ReasoningParser("deepseek_r1", opened_by_template=True),
)
REASONING_PARSERS_BY_NAME = {p.name: p for p in REASONING_PARSERS}


@dataclass
class ReasoningReader:
    """One choice's output, read as it grows into its reasoning and its answer."""

    parser: ReasoningParser
    inside: bool  # the output begins inside the section
    text: str = ""
    _reasoning: str = ""
    _answer: str = ""

    def push(self, text: str, final: bool) -> tuple[str, str]:
        """What is new of the reasoning and of the answer. Not ``final``: a tail that may
        begin a tag is held back."""
        self.text += text
        reasoning, answer = self._split(final)
        new = reasoning[len(self._reasoning) :], answer[len(self._answer) :]
        self._reasoning, self._answer = reasoning, answer
        return new

    def _split(self, final: bool) -> tuple[str, str]:
        p, text = self.parser, self.text
        stripped = text.lstrip()
        if stripped.startswith(p.start):
            body = stripped[len(p.start) :]
        elif not final and p.start.startswith(stripped):
            return "", ""  # may still become the opening tag
        elif self.inside:
            body = text
        else:
            return "", text
        at = body.find(p.end)
        if at >= 0:
            return body[:at], body[at + len(p.end) :]
        return (body if final else body[: len(body) - held_prefix(body, p.end)]), ""


@dataclass(frozen=True)
class Reasoning:
    """What one request's output does with its reasoning section."""

    parser: ReasoningParser
    inside: bool  # the output begins inside the section
    budget: int | None  # most tokens of reasoning, then its end is forced
    shown: bool = True  # vLLM's include_reasoning: false drops it from the answer

    def rules(self, rules: OutputRules, structured: StructuredOutput | None) -> OutputRules:
        """``rules`` with their grammar (a tool call's, else the request's structured
        output) moved after the section, and the section bounded by the budget."""
        after = rules.grammar or structured
        if after is None and self.budget is None:
            return rules  # nothing to constrain: the text is only read apart
        return OutputRules(self.parser.grammar(self.inside, self.budget, after), rules.stops_end_at)

    def reader(self) -> ReasoningReader:
        return ReasoningReader(self.parser, self.inside)
