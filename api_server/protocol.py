"""OpenAI HTTP schemas (pydantic) and their translation into engine sampling params."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from common.messages import FinishReason, SamplingParams

MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20


class _Strict(BaseModel):
    # Unknown fields are refused, never silently ignored; NaN/Infinity are refused.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class TokenizeRequest(_Strict):
    model: str
    prompt: str
    add_special_tokens: bool = True


class DetokenizeRequest(_Strict):
    model: str
    tokens: list[Annotated[int, Field(ge=0)]]


class GenerationRequest(_Strict):
    """Fields shared by completions and chat completions."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extensions: output (and prompt) token ids in the response; a scheduling
    # priority (lower runs first, with --scheduling-policy priority); a salt that keeps
    # this request's prefix-cache entries apart from other tenants'.
    return_token_ids: bool = False
    priority: int = Field(default=0, ge=-(2**31), le=2**31 - 1)
    cache_salt: str | None = Field(default=None, min_length=1)

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def num_logprobs(self) -> int | None:
        return None

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=max(self.top_k, 0),  # -1 (vLLM) and 0 both mean off
            seed=self.seed,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logprobs=self.num_logprobs(),
            min_tokens=self.min_tokens,
        )


class CompletionRequest(GenerationRequest):
    prompt: (
        str | TokenIds | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]
    )
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    n: int = Field(default=1, ge=1)
    echo: bool = False

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string, or token ids."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if all(isinstance(p, int) for p in self.prompt):
            return [[int(p) for p in self.prompt]]
        return [str(p) for p in self.prompt]


class ContentPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[ContentPart]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(GenerationRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict[str, str]]:
        # "developer" is OpenAI's newer name for the system role.
        return [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in self.messages
        ]


def validation_error_param(error: ValidationError) -> tuple[str, str | None]:
    """A one-line message naming the offending field, and that field's name."""
    errors: list[Any] = list(error.errors())
    # For a union field (``stop``: a string or a list) pydantic reports one error per
    # branch; the branch the value fits by type has the telling one ("at most 16 items",
    # not "should be a valid string").
    first = next((e for e in errors if not str(e.get("type", "")).endswith("_type")), errors[0])
    loc = ".".join(
        str(p) for p in first.get("loc", ()) if not str(p).startswith(("function-", "str", "list"))
    )
    if first.get("type") == "extra_forbidden":
        return f"'{loc}' is not supported", loc or None
    return f"'{loc or 'body'}': {first.get('msg', 'invalid value')}", loc or None


def finish_reason_text(reason: FinishReason | None) -> str | None:
    return None if reason is None else str(reason)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion_chunk(
    request_id: str,
    model: str,
    created: int,
    text: str,
    finish_reason: str | None,
    usage_: dict[str, int] | None = None,
    token_ids: list[int] | None = None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": 0,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
    }
    if token_ids is not None:
        choice["token_ids"] = token_ids
    body: dict[str, Any] = {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
    }
    if usage_ is not None:
        body["usage"] = usage_
    return body


def now() -> int:
    return int(time.time())


ErrorType = Literal[
    "invalid_request_error",
    "authentication_error",
    "not_found_error",
    "rate_limit_error",
    "server_error",
]


def error_body(
    message: str, type_: ErrorType, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error shape: ``{"type": "error", "error": {"type", "message"}}``."""
    return {
        "type": "error",
        "error": {"type": ANTHROPIC_ERROR_TYPES.get(status, "api_error"), "message": message},
    }
