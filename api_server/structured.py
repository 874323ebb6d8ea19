"""Structured outputs as requests spell them, turned into one ``StructuredOutput``.

Accepted spellings (at most one per request): OpenAI's ``response_format``
(``json_object`` or ``json_schema``), vLLM's ``structured_outputs`` object
(``json``/``regex``/``choice``/``grammar``/``json_object``) and its older
``guided_json``/``guided_regex``/``guided_choice``/``guided_grammar`` fields, and
Anthropic's ``output_format``. The spec is checked by the same grammar engine the
worker compiles it with (``common/grammar.py``), so a schema the engine cannot compile
is a 400 naming the problem, never a failure inside a stream.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from api_server.errors import ApiError
from common.grammar import GrammarError, check_structured_output
from common.messages import StructuredOutput, StructuredOutputKind


class StructuredOutputsParams(BaseModel):
    """vLLM's ``structured_outputs`` request object."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    # ``json`` would shadow BaseModel.json: the attribute is ``json_``, the field ``json``.
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


def _schema_text(schema: dict[str, Any] | str, param: str) -> str:
    if isinstance(schema, str):
        try:
            json.loads(schema)
        except json.JSONDecodeError as e:
            raise ApiError(400, f"'{param}' is not valid JSON: {e}", param=param) from None
        return schema
    return json.dumps(schema)


def structured_output_of(
    *,
    response_format: tuple[str, dict[str, Any] | None] | None = None,
    structured_outputs: StructuredOutputsParams | None = None,
    guided_json: dict[str, Any] | str | None = None,
    guided_regex: str | None = None,
    guided_choice: list[str] | None = None,
    guided_grammar: str | None = None,
) -> StructuredOutput | None:
    """The one constraint a request asks for, checked; None when it asks for none."""
    asked: list[tuple[str, StructuredOutput]] = []
    if response_format is not None:
        format_type, schema = response_format
        if format_type == "json_object":
            asked.append(("response_format", StructuredOutput(StructuredOutputKind.JSON_OBJECT)))
        elif format_type == "json_schema":
            if schema is None:
                raise ApiError(
                    400,
                    "'response_format' of type json_schema needs json_schema.schema",
                    param="response_format",
                )
            spec = _schema_text(schema, "response_format")
            asked.append(
                ("response_format", StructuredOutput(StructuredOutputKind.JSON_SCHEMA, spec))
            )
    so = structured_outputs
    candidates: list[tuple[str, Any, StructuredOutputKind]] = [
        ("guided_json", guided_json, StructuredOutputKind.JSON_SCHEMA),
        ("guided_regex", guided_regex, StructuredOutputKind.REGEX),
        ("guided_choice", guided_choice, StructuredOutputKind.CHOICE),
        ("guided_grammar", guided_grammar, StructuredOutputKind.GRAMMAR),
    ]
    if so is not None:
        candidates += [
            ("structured_outputs.json", so.json_, StructuredOutputKind.JSON_SCHEMA),
            ("structured_outputs.regex", so.regex, StructuredOutputKind.REGEX),
            ("structured_outputs.choice", so.choice, StructuredOutputKind.CHOICE),
            ("structured_outputs.grammar", so.grammar, StructuredOutputKind.GRAMMAR),
        ]
        if so.json_object:
            asked.append(
                (
                    "structured_outputs.json_object",
                    StructuredOutput(StructuredOutputKind.JSON_OBJECT),
                )
            )
    for param, value, kind in candidates:
        if value is None:
            continue
        if kind == StructuredOutputKind.JSON_SCHEMA:
            spec = _schema_text(value, param)
        elif kind == StructuredOutputKind.CHOICE:
            if not value:
                raise ApiError(400, f"'{param}' needs at least one choice", param=param)
            spec = json.dumps(value)
        else:
            spec = value
        asked.append((param, StructuredOutput(kind, spec)))
    if not asked:
        return None
    if len(asked) > 1:
        names = " and ".join(f"'{name}'" for name, _ in asked)
        raise ApiError(400, f"ask for one output constraint, not {names}", param=asked[1][0])
    param, structured = asked[0]
    try:
        check_structured_output(structured)
    except GrammarError as e:
        raise ApiError(400, f"'{param}' cannot be compiled: {e}", param=param) from None
    return structured
