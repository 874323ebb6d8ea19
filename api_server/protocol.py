"""OpenAI HTTP schemas (pydantic) and their translation into engine sampling params.

Fields are taken as vLLM takes them: every parameter the OpenAI API defines is
accepted, those that do not apply to a self-hosted model (``store``, ``service_tier``,
...) are ignored visibly (``ignored_fields``: logged and named in a response header),
unknown fields likewise unless the server runs with ``--strict-request-fields``, and
parameters whose meaning Tandem cannot honour (``tools``, beam search, ...) are refused
with 400 rather than silently dropped.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from api_server.errors import ApiError
from api_server.sampling_defaults import SamplingDefaults
from api_server.structured import StructuredOutputsParams, structured_output_of
from common.messages import FinishReason, SamplingParams, StructuredOutput

MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 300  # OpenAI's own limit on logit_bias entries


class _Body(BaseModel):
    # Unknown fields are kept (and reported by ``ignored_fields``); NaN/Infinity refused.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


def unknown_fields(model: BaseModel, prefix: str = "") -> list[str]:
    """Dotted names of fields no schema declares, at any depth. One sent at an off value
    (null or false) is not counted: it asks for nothing, and routers add some to every
    request (vllm-router: ``no_stop_trim: false``, ``return_hidden_states: false``)."""
    extra = model.model_extra or {}
    names = [
        prefix + name for name, value in extra.items() if value is not None and value is not False
    ]
    for name in type(model).model_fields:
        value = getattr(model, name)
        items = value if isinstance(value, list) else [value]
        for i, item in enumerate(items):
            if isinstance(item, BaseModel):
                where = f"{name}.{i}." if isinstance(value, list) else f"{name}."
                names += unknown_fields(item, prefix + where)
    return names


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class TokenizeRequest(_Body):
    model: str
    prompt: str
    add_special_tokens: bool = True


class DetokenizeRequest(_Body):
    model: str
    tokens: list[Annotated[int, Field(ge=0)]]


class JsonSchemaFormat(_Body):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


# OpenAI parameters that change nothing on a self-hosted model: accepted, ignored, and
# named in the response's ignored-fields header when set.
INAPPLICABLE_OPENAI_FIELDS = (
    "store",
    "metadata",
    "service_tier",
    "parallel_tool_calls",
    "reasoning_effort",
    "modalities",
    "audio",
    "prediction",
    "web_search_options",
    "verbosity",
    "prompt_cache_key",
    "safety_identifier",
    "user",
    "spaces_between_special_tokens",  # vLLM's; the detokenizer's spacing is the tokenizer's
)


class GenerationRequest(_Body):
    """Fields shared by completions and chat completions."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    # None: the model's generation_config.json default, else OpenAI's (1.0 / 1.0 / off).
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1)
    logit_bias: (
        Annotated[
            dict[str, Annotated[float, Field(ge=-100, le=100)]], Field(max_length=MAX_LOGIT_BIAS)
        ]
        | None
    ) = None
    response_format: ResponseFormat | None = None
    # vLLM's extensions: output (and prompt) token ids in the response; a scheduling
    # priority (lower runs first, with --scheduling-policy priority); a salt that keeps
    # this request's prefix-cache entries apart from other tenants'; structured outputs
    # in vLLM's new and old spellings; token filters; stop-string and detokenizer options.
    return_token_ids: bool = False
    priority: int = Field(default=0, ge=-(2**31), le=2**31 - 1)
    cache_salt: str | None = Field(default=None, min_length=1)
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    allowed_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)
    # A fleet's prefill/decode split (vLLM's NixlConnector contract): api_server/kv_transfer_params.py.
    kv_transfer_params: dict[str, Any] | None = None
    # OpenAI's parameters that change nothing here (INAPPLICABLE_OPENAI_FIELDS): declared,
    # so that --strict-request-fields refuses only fields nobody defines.
    store: Any = None
    metadata: Any = None
    service_tier: Any = None
    parallel_tool_calls: Any = None
    reasoning_effort: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    verbosity: Any = None
    prompt_cache_key: Any = None
    safety_identifier: Any = None
    user: Any = None
    spaces_between_special_tokens: Any = None
    # Refused when used (see ``refuse_unsupported``), never silently dropped.
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    use_beam_search: bool = False
    bad_words: list[str] | None = None
    # vLLM's: the logprobs of the prompt's tokens (after the first), with the top-k.
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    def refused_fields(self) -> dict[str, bool]:
        """Parameters Tandem cannot honour on this route, and whether each is used."""
        return {
            "tools": bool(self.tools),
            "tool_choice": self.tool_choice not in (None, "none"),
            "functions": bool(self.functions),
            "function_call": self.function_call not in (None, "none"),
            "use_beam_search": self.use_beam_search,
            "bad_words": bool(self.bad_words),
        }

    def refuse_unsupported(self) -> None:
        """400 for parameters whose meaning Tandem cannot honour."""
        for name, used in self.refused_fields().items():
            if used:
                raise ApiError(400, f"'{name}' is not supported", param=name)

    def check_token_ids(self, vocab_size: int) -> None:
        """400 for token ids the model does not have (they would index past its logits)."""
        named = {
            "allowed_token_ids": self.allowed_token_ids or [],
            "logit_bias": [int(k) for k in self.logit_bias or {} if k.lstrip("-").isdigit()],
        }
        for param, ids in named.items():
            bad = next((t for t in ids if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise ApiError(
                    400,
                    f"token id {bad} is outside the vocabulary (size {vocab_size})",
                    param=param,
                )

    def ignored_fields(self) -> list[str]:
        """Fields accepted but without effect here: unknown ones and inapplicable ones."""
        set_here = [name for name in INAPPLICABLE_OPENAI_FIELDS if name in self.model_fields_set]
        return list(dict.fromkeys([*set_here, *unknown_fields(self)]))

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def num_logprobs(self) -> int | None:
        return None

    def num_prompt_logprobs(self) -> int | None:
        """Top-k prompt logprobs the engine computes (None: none)."""
        return self.prompt_logprobs

    def structured_output(self) -> StructuredOutput | None:
        """The one output constraint asked for, in whichever spelling (400 if several)."""
        return structured_output_of(
            response_format=None
            if self.response_format is None
            else (
                self.response_format.type,
                None
                if self.response_format.json_schema is None
                else self.response_format.json_schema.schema_,
            ),
            structured_outputs=self.structured_outputs,
            guided_json=self.guided_json,
            guided_regex=self.guided_regex,
            guided_choice=self.guided_choice,
            guided_grammar=self.guided_grammar,
        )

    def sampling_params(self, max_tokens: int, defaults: SamplingDefaults) -> SamplingParams:
        """The engine's params; fields the request left out take ``defaults`` (the
        model's generation_config.json, or OpenAI's own)."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=_first(self.temperature, defaults.temperature, 1.0),
            top_p=_first(self.top_p, defaults.top_p, 1.0),
            top_k=max(_first(self.top_k, defaults.top_k, 0), 0),  # -1 (vLLM) and 0 mean off
            seed=self.seed,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            min_p=_first(self.min_p, defaults.min_p, 0.0),
            repetition_penalty=_first(self.repetition_penalty, defaults.repetition_penalty, 1.0),
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logprobs=self.num_logprobs(),
            prompt_logprobs=self.num_prompt_logprobs(),
            min_tokens=self.min_tokens,
            logit_bias=_logit_bias(self.logit_bias),
            allowed_token_ids=None
            if self.allowed_token_ids is None
            else list(self.allowed_token_ids),
            structured=self.structured_output(),
        )


def _first(*values: Any) -> Any:
    return next(v for v in values if v is not None)


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if not bias:
        return None
    out: dict[int, float] = {}
    for key, value in bias.items():
        if not key.lstrip("-").isdigit() or int(key) < 0:
            raise ApiError(400, f"logit_bias key {key!r} is not a token id", param="logit_bias")
        out[int(key)] = value
    return out


class CompletionRequest(GenerationRequest):
    prompt: (
        str
        | TokenIds
        | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]
        | Annotated[list[TokenIds], Field(min_length=1)]  # several prompts as token ids
    )
    # OpenAI's default for completions; 0 only with echo (a prompt scored, nothing made).
    max_tokens: int | None = Field(default=16, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    add_special_tokens: bool = True
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.suffix:
            raise ApiError(400, "'suffix' is not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise ApiError(400, "'best_of' other than n is not supported", param="best_of")
        if self.max_tokens == 0 and not self.echo:
            raise ApiError(400, "'max_tokens' 0 needs 'echo': true", param="max_tokens")

    def requested_max_tokens(self) -> int | None:
        # max_tokens 0 scores the prompt: the engine samples one token, the answer drops it
        return 1 if self.max_tokens == 0 else self.max_tokens

    @property
    def scores_only(self) -> bool:
        """``max_tokens: 0`` with ``echo``: the prompt and its logprobs, no completion."""
        return self.max_tokens == 0

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def num_prompt_logprobs(self) -> int | None:
        """``echo`` with ``logprobs`` scores the prompt too (lm-evaluation-harness's
        loglikelihood); ``prompt_logprobs`` asks vLLM's way. The larger top-k of both."""
        asked = [
            k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None
        ]
        return max(asked) if asked else None

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string, or token ids."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        ids = [p for p in self.prompt if isinstance(p, int)]
        if len(ids) == len(self.prompt):
            return [ids]
        return [[int(t) for t in p] if isinstance(p, list) else str(p) for p in self.prompt]


def validation_error_param(error: ValidationError, body: Any = None) -> tuple[str, str | None]:
    """A one-line message naming the offending field, and that field's name (its path in
    ``body``: without the tags pydantic puts in for a union's branch)."""
    errors: list[Any] = list(error.errors())
    # For a union field (``stop``: a string or a list) pydantic reports one error per
    # branch; the branch the value fits by type has the telling one ("at most 16 items",
    # not "should be a valid string").
    first = next((e for e in errors if not str(e.get("type", "")).endswith("_type")), errors[0])
    loc = ".".join(str(p) for p in _body_path(first.get("loc", ()), body))
    if first.get("type") == "extra_forbidden":
        return f"'{loc}' is not supported", loc or None
    return f"'{loc or 'body'}': {first.get('msg', 'invalid value')}", loc or None


def _body_path(loc: tuple[Any, ...], body: Any) -> list[Any]:
    """``loc`` less what is not a step into the body: a branch's name for a plain union
    (``str``, ``list[...]``, ``function-...``) and a tagged union's tag (a message's
    ``tool`` in ``messages.0.tool.tool_call_id``: the value of its ``role``)."""
    path: list[Any] = []
    node = body
    for part in loc:
        if isinstance(part, str) and part.startswith(("function-", "str", "list")):
            continue
        if isinstance(node, dict) and part not in node and part in node.values():
            continue  # the tag: the value of the discriminating field of this object
        path.append(part)
        try:
            node = node[part] if isinstance(node, (dict, list)) else None
        except (KeyError, IndexError, TypeError):
            node = None
    return path


def finish_reason_text(reason: FinishReason | None) -> str | None:
    return None if reason is None else str(reason)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def now() -> int:
    return int(time.time())
