"""The reasoning formats: reading a section apart from the answer however the text is
chunked, where a section starts, and the grammars that bound it (compiled by llguidance)."""

from __future__ import annotations

import json

import llguidance
import pytest

from api_server.generation import OutputRules
from api_server.reasoning import REASONING_PARSERS, REASONING_PARSERS_BY_NAME, Reasoning
from common.config import REASONING_PARSERS as CONFIGURED
from common.grammar import grammar_text
from common.messages import StructuredOutput, StructuredOutputKind

QWEN3 = REASONING_PARSERS_BY_NAME["qwen3"]
R1 = REASONING_PARSERS_BY_NAME["deepseek_r1"]


def read(parser_name: str, inside: bool, text: str, step: int) -> tuple[str, str, list[str]]:
    """Reasoning and answer of ``text`` pushed ``step`` characters at a time, and every
    answer delta (none may hold a tag)."""
    reader = REASONING_PARSERS_BY_NAME[parser_name].reader(inside)
    reasoning, answer, deltas = "", "", []
    chunks = [text[i : i + step] for i in range(0, len(text), step)] or [""]
    for i, chunk in enumerate(chunks):
        r, a = reader.push(chunk, final=i == len(chunks) - 1)
        reasoning, answer = reasoning + r, answer + a
        deltas.append(a)
    return reasoning, answer, deltas


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize(
    ("parser", "inside", "text", "expected"),
    [
        ("qwen3", False, "<think>a < b</think>\n\nyes", ("a < b", "\n\nyes")),
        ("qwen3", False, "no section </think> here", ("", "no section </think> here")),
        ("qwen3", True, "step one</think>done", ("step one", "done")),
        ("qwen3", False, "<think>cut by length", ("cut by length", "")),
        ("deepseek_r1", True, "hmm</think>42", ("hmm", "42")),
        ("deepseek_r1", True, "<think>hmm</think>42", ("hmm", "42")),
        ("deepseek_r1", True, "all reasoning", ("all reasoning", "")),
        ("qwen3", False, "<thin", ("", "<thin")),
    ],
)
def test_reading_is_the_same_however_the_text_is_chunked(
    parser: str, inside: bool, text: str, expected: tuple[str, str], step: int
) -> None:
    reasoning, answer, deltas = read(parser, inside, text, step)
    assert (reasoning, answer) == expected
    if expected[0]:
        assert all("<think>" not in d and "</think>" not in d for d in deltas)


def test_where_a_section_starts() -> None:
    assert QWEN3.opens("<|im_start|>assistant\n<think>\n")
    assert not QWEN3.opens("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not QWEN3.opens("<|im_start|>assistant\n")
    assert R1.opens("<|Assistant|>")
    assert tuple(p.name for p in REASONING_PARSERS) == CONFIGURED


def test_rules_move_a_grammar_after_the_section() -> None:
    schema = StructuredOutput(StructuredOutputKind.JSON_SCHEMA, '{"type": "object"}')
    plain = OutputRules()
    assert Reasoning(QWEN3, True, None).rules(plain, None) is plain  # nothing to bound
    for budget, after in [(5, None), (None, schema), (3, schema)]:
        rules = Reasoning(QWEN3, True, budget).rules(OutputRules(None, "<tool_call>"), after)
        assert rules.grammar is not None and rules.stops_end_at == "<tool_call>"
        assert rules.grammar.kind == StructuredOutputKind.LLGUIDANCE
        text = grammar_text(rules.grammar)
        assert llguidance.LLMatcher.validate_grammar(text) == ""
        lark = json.loads(text)["grammars"][0]["lark_grammar"]
        assert (f"max_tokens={budget}" in lark) == (budget is not None)
    lark_after = StructuredOutput(StructuredOutputKind.GRAMMAR, 'start: "yes" | "no"')
    rules = Reasoning(R1, True, 2).rules(OutputRules(lark_after), None)
    assert rules.grammar is not None
    assert llguidance.LLMatcher.validate_grammar(grammar_text(rules.grammar)) == ""
