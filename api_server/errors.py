"""Errors a client can be answered with, and the two body formats they are written in.

Every refusal is an ``ApiError`` (status, message, and OpenAI's ``type``/``param``/
``code``); an ``ErrorFormat`` turns it into a body: OpenAI's
``{"error": {"message", "type", "param", "code"}}`` or Anthropic's
``{"type": "error", "error": {"type", "message"}}``. ``error_response`` is the one place
that sets ``Retry-After`` (on 429 and 503).
"""

from __future__ import annotations

from typing import Any, Literal, Protocol

from starlette.responses import JSONResponse

RETRY_AFTER_S = "1"

ErrorType = Literal[
    "invalid_request_error",
    "authentication_error",
    "permission_error",
    "not_found_error",
    "rate_limit_error",
    "server_error",
]


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: ErrorType = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after: str = RETRY_AFTER_S,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type_,
            param,
            code,
        )
        self.retry_after = retry_after


class ErrorFormat(Protocol):
    def body(self, error: ApiError) -> dict[str, Any]: ...


def error_body(
    message: str, type_: ErrorType, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class OpenAIErrors:
    def body(self, error: ApiError) -> dict[str, Any]:
        return error_body(error.message, error.type, error.param, error.code)


ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
}


class AnthropicErrors:
    def body(self, error: ApiError) -> dict[str, Any]:
        kind = ANTHROPIC_ERROR_TYPES.get(error.status, "api_error")
        message = error.message
        if error.param is not None and error.param not in message:  # no param field here
            message = f"{error.param}: {message}"
        return {"type": "error", "error": {"type": kind, "message": message}}


OPENAI_ERRORS = OpenAIErrors()
ANTHROPIC_ERRORS = AnthropicErrors()


def error_response(
    error: ApiError, errors: ErrorFormat = OPENAI_ERRORS, headers: dict[str, str] | None = None
) -> JSONResponse:
    """The error as a JSON response; 429 and 503 say when to retry."""
    extra = dict(headers or {})
    if error.status in (429, 503):
        extra["Retry-After"] = error.retry_after
    return JSONResponse(errors.body(error), error.status, headers=extra or None)
