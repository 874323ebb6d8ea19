"""Each tool-call format: its grammar compiles and takes what it writes (and nothing
else), its reader gives the same calls streamed a character at a time as at once, and a
call's strings may hold anything (quotes, braces, the format's own closing tag)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import llguidance
import llguidance.hf
import pytest
from transformers import AutoTokenizer

from api_server.detokenizer import StopStringMatcher
from api_server.errors import ApiError
from api_server.tool_calls import ToolCallReader
from api_server.tool_parsers import TOOL_PARSERS, ToolParser, pick_tool_parser
from api_server.tool_protocol import (
    FunctionDef,
    FunctionName,
    NamedToolChoice,
    ToolDef,
    ToolMode,
    ToolUse,
    resolve_tool_use,
)
from common.config import TOOL_CALL_PARSERS

WEATHER = FunctionDef(
    name="get_weather",
    parameters={
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"],
    },
)
NOOP = FunctionDef(name="noop")
TRICKY_CITY = 'P"a}r)i,s</tool_call>'
# What each format writes for: some text (where the format allows it), then
# get_weather(city=TRICKY_CITY, days=3) and noop().
CITY = json.dumps(TRICKY_CITY)
WRITTEN = {
    "hermes": (
        "Let me check. ",
        f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": {CITY}, "days": 3}}}}\n'
        '</tool_call>\n<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>',
    ),
    "llama3_json": (
        "",
        f'{{"name": "get_weather", "parameters": {{"city": {CITY}, "days": 3}}}}; '
        '{"name": "noop", "parameters": {}}',
    ),
    "pythonic": ("", f"[get_weather(city={CITY}, days=3), noop()]"),
    "gemma3": ("Sure.\n", f"```tool_code\nget_weather(city={CITY}, days=3)\nnoop()\n```"),
}
EXPECTED = [("get_weather", {"city": TRICKY_CITY, "days": 3}), ("noop", {})]


@pytest.fixture(scope="module")
def tokenizers(smollm2_dir: Path) -> tuple[Any, llguidance.LLTokenizer]:
    hf: Any = AutoTokenizer.from_pretrained(str(smollm2_dir))
    return hf, llguidance.hf.from_tokenizer(hf)


def accepts(tokenizers: tuple[Any, llguidance.LLTokenizer], grammar: str, text: str) -> bool:
    hf, llg = tokenizers
    matcher = llguidance.LLMatcher(llg, grammar)
    ok = all(matcher.consume_token(t) for t in hf.encode(text, add_special_tokens=False))
    return ok and matcher.is_accepting()


def test_every_configured_parser_exists() -> None:
    assert set(TOOL_CALL_PARSERS) == {"auto", *TOOL_PARSERS}


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_the_grammar_takes_what_the_format_writes_and_refuses_other_text(
    name: str, tokenizers: tuple[Any, llguidance.LLTokenizer]
) -> None:
    parser = TOOL_PARSERS[name]()
    text, calls = WRITTEN[name]
    auto = parser.grammar(ToolUse([WEATHER, NOOP], ToolMode.AUTO, parallel=True))
    required = parser.grammar(ToolUse([WEATHER, NOOP], ToolMode.REQUIRED, parallel=True))
    single = parser.grammar(ToolUse([WEATHER, NOOP], ToolMode.REQUIRED, parallel=False))
    assert accepts(tokenizers, auto, text + calls)
    assert accepts(tokenizers, auto, "Just an answer, no call.")
    assert accepts(tokenizers, required, calls)
    assert not accepts(tokenizers, required, "Just an answer, no call.")
    assert not accepts(tokenizers, single, calls)  # two calls where one is allowed
    # arguments outside the schema: a string where an integer goes
    bad = calls.replace("days=3", 'days="3"').replace('"days": 3', '"days": "3"')
    assert not accepts(tokenizers, required, bad)


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_streamed_a_character_at_a_time_the_calls_are_those_read_at_once(name: str) -> None:
    parser = TOOL_PARSERS[name]()
    output = "".join(WRITTEN[name])
    streamed = ToolCallReader(parser)
    content = ""
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    for i, ch in enumerate(output):
        new, deltas = streamed.push(ch, final=i == len(output) - 1)
        content += new
        for d in deltas:
            if "id" in d:  # a call's first delta: its id, type and name
                assert d["type"] == "function" and d["index"] not in names
                names[d["index"]] = d["function"]["name"]
            arguments[d["index"]] = arguments.get(d["index"], "") + d["function"]["arguments"]
    whole = ToolCallReader(parser)
    whole_content, _ = whole.push(output, final=True)
    calls = whole.message_calls()
    assert content == whole_content == WRITTEN[name][0]
    assert [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls
    ] == EXPECTED
    assert [names[i] for i in range(2)] == [n for n, _ in EXPECTED]
    assert [arguments[i] for i in range(2)] == [c["function"]["arguments"] for c in calls]


def test_content_never_shows_the_trigger_or_a_start_of_it() -> None:
    reader = ToolCallReader(TOOL_PARSERS["hermes"]())
    assert reader.push("Hello <tool", final=False) == ("Hello ", [])
    assert reader.push("box> fine", final=True) == ("<toolbox> fine", [])
    cut = ToolCallReader(TOOL_PARSERS["hermes"]())
    content, deltas = cut.push('Hi<tool_call>\n{"name": "get_weather", "argu', final=True)
    assert content == "Hi" and deltas[0]["function"]["name"] == "get_weather"
    assert cut.message_calls()[0]["function"]["arguments"] == ""  # cut before its arguments


def test_auto_picks_the_format_of_the_template() -> None:
    def picked(template: str | None) -> str:
        parser: ToolParser = pick_tool_parser("auto", template)
        return parser.name

    assert picked("<|im_start|>{{ m }}<tool_call>") == "hermes"
    assert picked("<|im_start|>user") == "hermes"
    assert picked("<|start_header_id|>user") == "llama3_json"
    assert picked("<start_of_turn>user") == "gemma3"
    assert picked(None) == "hermes"
    assert pick_tool_parser("pythonic", "<|im_start|>").name == "pythonic"


def test_stop_strings_end_where_a_call_begins() -> None:
    matcher = StopStringMatcher(["}"], ends_at="<tool_call>")
    assert matcher.push("a b <tool_") == "a b <tool_"
    assert matcher.push('call>{"x": 1}') == 'call>{"x": 1}' and not matcher.hit
    before = StopStringMatcher(["STOP"], ends_at="<tool_call>")
    assert before.push("text STOP <tool_call>") == "text " and before.matched == "STOP"
    never = StopStringMatcher(["}"], ends_at="")
    assert never.push('{"a": 1}') == '{"a": 1}' and not never.hit


def tool(name: str) -> ToolDef:
    return ToolDef(type="function", function=FunctionDef(name=name))


@pytest.mark.parametrize(
    ("tools", "choice", "param", "says"),
    [
        (
            [tool("f")],
            NamedToolChoice(type="function", function=FunctionName(name="g")),
            "tool_choice",
            "not in tools",
        ),
        (None, "required", "tool_choice", "needs 'tools'"),
        ([tool("f"), tool("f")], None, "tools.1.function.name", "defined twice"),
        ([tool("a b")], None, "tools.0.function.name", "letters, digits"),
    ],
)
def test_bad_tools_are_a_400_naming_the_field(
    tools: list[ToolDef] | None, choice: object, param: str, says: str
) -> None:
    with pytest.raises(ApiError) as refused:
        resolve_tool_use(tools, choice, None, None, None)  # type: ignore[arg-type]
    assert (refused.value.status, refused.value.param) == (400, param)
    assert says in refused.value.message


def test_a_schema_the_grammar_engine_cannot_compile_is_a_400() -> None:
    broken = ToolDef(
        type="function",
        function=FunctionDef(
            name="f", parameters={"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}
        ),
    )
    with pytest.raises(ApiError) as refused:
        resolve_tool_use([broken], None, None, None, None)
    assert refused.value.param == "tools.0.function.parameters"


def test_choices_resolve_to_modes() -> None:
    both = [tool("f"), tool("g")]
    assert resolve_tool_use(both, None, None, None, None) == ToolUse(
        [t.function for t in both], ToolMode.AUTO, True
    )
    named = resolve_tool_use(
        both, NamedToolChoice(type="function", function=FunctionName(name="g")), None, None, None
    )
    assert (
        named is not None
        and named.mode == ToolMode.REQUIRED
        and [t.name for t in named.tools] == ["g"]
    )
    single = resolve_tool_use(both, "required", False, None, None)
    assert single is not None and not single.parallel
    legacy = resolve_tool_use(None, None, None, [FunctionDef(name="f")], FunctionName(name="f"))
    assert legacy is not None and legacy.legacy and legacy.mode == ToolMode.REQUIRED
    assert resolve_tool_use(None, "none", None, None, None) is None
