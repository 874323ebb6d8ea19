"""Request bodies as the API server reads them: unknown and ignored fields, the one
structured-output constraint in any spelling, the model's sampling defaults."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from api_server.chat_protocol import ChatCompletionRequest
from api_server.errors import ApiError
from api_server.protocol import CompletionRequest, unknown_fields
from api_server.sampling_defaults import SamplingDefaults, load_sampling_defaults
from common.messages import StructuredOutput, StructuredOutputKind

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def chat(**fields: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    )


def test_unknown_fields_are_found_at_every_depth() -> None:
    req = chat(
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "x", "x_part": 1}], "y": 2}
        ],
        stream_options={"include_usage": True, "z": 3},
        top_level=4,
        store=True,
    )
    assert unknown_fields(req) == [
        "top_level",
        "stream_options.z",
        "messages.0.y",
        "messages.0.content.0.x_part",
    ]
    assert req.ignored_fields() == ["store", *unknown_fields(req)]


def test_unknown_fields_at_an_off_value_ask_for_nothing() -> None:
    """vllm-router adds SGLang's ``no_stop_trim: false`` to every request it forwards."""
    req = chat(no_stop_trim=False, return_hidden_states=None, separate_reasoning=True, n_x=0)
    assert unknown_fields(req) == ["separate_reasoning", "n_x"]


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"response_format": {"type": "text"}}, None),
        (
            {"response_format": {"type": "json_object"}},
            StructuredOutput(StructuredOutputKind.JSON_OBJECT),
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": SCHEMA},
                }
            },
            StructuredOutput(StructuredOutputKind.JSON_SCHEMA, json.dumps(SCHEMA)),
        ),
        (
            {"guided_json": json.dumps(SCHEMA)},
            StructuredOutput(StructuredOutputKind.JSON_SCHEMA, json.dumps(SCHEMA)),
        ),
        ({"guided_regex": "[a-z]+"}, StructuredOutput(StructuredOutputKind.REGEX, "[a-z]+")),
        (
            {"guided_choice": ["x", "y"]},
            StructuredOutput(StructuredOutputKind.CHOICE, '["x", "y"]'),
        ),
        (
            {"structured_outputs": {"json": SCHEMA}},
            StructuredOutput(StructuredOutputKind.JSON_SCHEMA, json.dumps(SCHEMA)),
        ),
        (
            {"structured_outputs": {"grammar": 'root ::= "yes" | "no"'}},
            StructuredOutput(StructuredOutputKind.GRAMMAR, 'root ::= "yes" | "no"'),
        ),
        (
            {"structured_outputs": {"json_object": True}},
            StructuredOutput(StructuredOutputKind.JSON_OBJECT),
        ),
    ],
)
def test_each_spelling_gives_one_constraint(
    fields: dict[str, object], expected: StructuredOutput | None
) -> None:
    assert chat(**fields).structured_output() == expected


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "one output constraint"),
        (
            {"response_format": {"type": "json_schema"}},
            "response_format",
            "needs json_schema.schema",
        ),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"guided_choice": []}, "guided_choice", "at least one choice"),
        (
            {"structured_outputs": {"grammar": "root ::= bogus"}},
            "structured_outputs.grammar",
            "compiled",
        ),
        ({"guided_json": {"type": "integer", "minimum": "x"}}, "guided_json", "compiled"),
    ],
)
def test_bad_constraints_are_400_naming_the_field(
    fields: dict[str, object], param: str, says: str
) -> None:
    with pytest.raises(ApiError) as refused:
        chat(**fields).structured_output()
    assert (refused.value.status, refused.value.param) == (400, param)
    assert says in refused.value.message


def test_refusals_of_what_cannot_be_honoured() -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"use_beam_search": True}, "use_beam_search"),
    ]
    for fields, param in cases:
        with pytest.raises(ApiError) as refused:
            chat(**fields).refuse_unsupported()
        assert (refused.value.status, refused.value.param) == (400, param)
    chat(tool_choice="none").refuse_unsupported()  # "none" asks for nothing
    with pytest.raises(ApiError, match="best_of"):
        CompletionRequest.model_validate(
            {"model": "m", "prompt": "x", "best_of": 3}
        ).refuse_unsupported()
    with pytest.raises(ApiError, match="needs 'echo'"):  # 0 only scores a prompt
        CompletionRequest.model_validate(
            {"model": "m", "prompt": "x", "max_tokens": 0}
        ).refuse_unsupported()
    scoring = CompletionRequest.model_validate(
        {"model": "m", "prompt": "x", "max_tokens": 0, "echo": True, "logprobs": 2}
    )
    scoring.refuse_unsupported()  # echo with logprobs: served (prompt logprobs)
    assert (scoring.requested_max_tokens(), scoring.num_prompt_logprobs()) == (1, 2)


def test_sampling_defaults_fill_only_what_the_request_omits() -> None:
    defaults = SamplingDefaults(temperature=0.3, top_k=20)
    params = chat().sampling_params(16, defaults)
    assert (params.temperature, params.top_k, params.top_p) == (0.3, 20, 1.0)
    params = chat(temperature=0.9, top_k=-1).sampling_params(16, defaults)
    assert (params.temperature, params.top_k) == (0.9, 0)  # the request wins; -1 is off


def test_sampling_defaults_are_read_as_asked(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": 2, "temperature": 0.6, "top_p": 0.95, "do_sample": True})
    )
    assert load_sampling_defaults(tmp_path) == SamplingDefaults(temperature=0.6, top_p=0.95)
    assert load_sampling_defaults(tmp_path, "vllm") == SamplingDefaults()
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.6, "do_sample": False})
    )
    assert load_sampling_defaults(tmp_path) == SamplingDefaults(temperature=0.0)  # greedy model
    assert load_sampling_defaults(tmp_path / "absent") == SamplingDefaults()
