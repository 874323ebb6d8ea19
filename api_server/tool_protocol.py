"""OpenAI's function tools as a chat request spells them, resolved into one ``ToolUse``.

Accepted: ``tools`` with ``tool_choice`` (``none``, ``auto``, ``required``, or
``{"type": "function", "function": {"name": ...}}``) and ``parallel_tool_calls``, and
the legacy ``functions`` with ``function_call`` (``none``, ``auto``, ``{"name": ...}``).
Everything a grammar or a template would trip on later is a 400 here, naming the field.
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from api_server.errors import ApiError
from common.grammar import GrammarError, check_structured_output
from common.messages import StructuredOutput, StructuredOutputKind

# OpenAI's rule for function names; it also keeps names safe inside every call format.
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class FunctionDef(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @property
    def arguments_schema(self) -> dict[str, Any]:
        """The arguments' JSON schema (any object when the tool declares none)."""
        return self.parameters if self.parameters else _ANY_OBJECT


class ToolDef(_Body):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


class ToolCallFunction(_Body):
    name: str
    arguments: str  # JSON text, as OpenAI sends it back


class ToolCall(_Body):
    """An assistant message's call, as clients send the conversation back."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


ToolChoiceField = Literal["none", "auto", "required"] | NamedToolChoice
FunctionCallField = Literal["none", "auto"] | FunctionName


class ToolMode(enum.Enum):
    NONE = "none"  # tools shown to the template, the output is plain text
    AUTO = "auto"  # text until the parser's trigger, then calls under the grammar
    REQUIRED = "required"  # calls from the first token (one named tool, or any)


@dataclass(frozen=True)
class ToolUse:
    """What one request asks of its tools, checked."""

    tools: list[FunctionDef]
    mode: ToolMode
    parallel: bool  # several calls in one answer
    legacy: bool = False  # asked as ``functions``: answered as ``function_call``

    @property
    def constrains(self) -> bool:
        return self.mode != ToolMode.NONE and bool(self.tools)

    def template_tools(self) -> list[dict[str, Any]]:
        """The tools as chat templates take them (transformers' ``tools=``)."""
        return [
            {"type": "function", "function": t.model_dump(exclude_none=True)} for t in self.tools
        ]


def resolve_tool_use(
    tools: list[ToolDef] | None,
    tool_choice: ToolChoiceField | None,
    parallel_tool_calls: bool | None,
    functions: list[FunctionDef] | None,
    function_call: FunctionCallField | None,
) -> ToolUse | None:
    """The request's tools and choice in one object, or None when it has none."""
    if functions is not None and tools is not None:
        raise ApiError(400, "send 'tools' or the legacy 'functions', not both", param="functions")
    legacy = functions is not None
    defs = [t.function for t in tools or []] if not legacy else list(functions or [])
    choice: ToolChoiceField | FunctionCallField | None = function_call if legacy else tool_choice
    param = "function_call" if legacy else "tool_choice"
    if not defs:
        if choice not in (None, "none"):
            raise ApiError(400, f"'{param}' needs 'tools'", param=param)
        return None
    _check_definitions(defs, "functions" if legacy else "tools")
    if choice in (None, "auto"):
        return ToolUse(defs, ToolMode.AUTO, parallel_tool_calls is not False, legacy)
    if choice == "none":
        return ToolUse(defs, ToolMode.NONE, False, legacy)
    if choice == "required":
        return ToolUse(defs, ToolMode.REQUIRED, parallel_tool_calls is not False, legacy)
    name = choice.function.name if isinstance(choice, NamedToolChoice) else choice.name  # type: ignore[union-attr]
    named = [d for d in defs if d.name == name]
    if not named:
        known = ", ".join(d.name for d in defs)
        raise ApiError(
            400, f"'{param}' names function '{name}', which is not in tools ({known})", param=param
        )
    return ToolUse(named, ToolMode.REQUIRED, False, legacy)


def _check_definitions(defs: list[FunctionDef], param: str) -> None:
    seen: set[str] = set()
    for i, d in enumerate(defs):
        where = f"{param}.{i}" + (".function" if param == "tools" else "")
        if not _NAME.fullmatch(d.name):
            raise ApiError(
                400,
                f"function name {d.name!r} must be 1-64 letters, digits, _ or -",
                param=f"{where}.name",
            )
        if d.name in seen:
            raise ApiError(400, f"function '{d.name}' is defined twice", param=f"{where}.name")
        seen.add(d.name)
        if d.arguments_schema.get("type", "object") != "object":
            raise ApiError(
                400, "a function's parameters must be an object schema", param=f"{where}.parameters"
            )
        try:  # the grammar engine that will constrain the call must compile it
            check_structured_output(
                StructuredOutput(StructuredOutputKind.JSON_SCHEMA, json.dumps(d.arguments_schema))
            )
        except GrammarError as e:
            raise ApiError(
                400, f"the parameters schema cannot be compiled: {e}", param=f"{where}.parameters"
            ) from None
