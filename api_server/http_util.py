"""Request parsing and response framing shared by the routes."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from api_server.generation import ApiError, EngineRequestError, Piece
from api_server.protocol import validation_error_param

T = TypeVar("T", bound=BaseModel)


async def json_body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    return body


async def parse(request: Request, schema: type[T], served_model_name: str) -> T:
    """The body as ``schema``: 400 for bad JSON, 422 naming a bad field, 404 for
    another model's name."""
    body = await json_body(request)
    try:
        req = schema.model_validate(body)
    except ValidationError as e:
        message, param = validation_error_param(e)
        raise ApiError(422, message, param=param) from None
    model = getattr(req, "model", served_model_name)
    if model != served_model_name:
        raise ApiError(
            404,
            f"model '{model}' does not exist; this server serves '{served_model_name}'",
            "not_found_error",
            "model",
            "model_not_found",
        )
    return req


async def first_piece(pieces: AsyncGenerator[Piece, None]) -> Piece:
    """Wait for the first piece before answering, so that a refusal (queue full, engine
    down) is a proper HTTP status rather than an error inside a stream."""
    try:
        return await anext(pieces)
    except EngineRequestError as e:
        await pieces.aclose()
        raise e.api_error() from None
    except BaseException:
        await pieces.aclose()
        raise


async def chain(first: Piece, rest: AsyncGenerator[Piece, None]) -> AsyncGenerator[Piece, None]:
    yield first
    async for piece in rest:
        yield piece


def sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"
