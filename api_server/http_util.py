"""Request parsing and response framing shared by the routes."""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, Protocol, TypeVar, runtime_checkable

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response

from api_server.errors import ApiError
from api_server.generation import EngineRequestError, Piece
from api_server.protocol import validation_error_param

T = TypeVar("T", bound=BaseModel)


async def json_body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the body is not valid JSON: {e}") from None
    except RecursionError:  # the parser gives up around a thousand levels deep
        raise ApiError(400, "the body's JSON is nested too deeply") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    return body


def validate(body: dict[str, Any], schema: type[T], status: int = 422) -> T:
    """The body as ``schema``; an invalid field is ``status`` (422) naming it."""
    try:
        return schema.model_validate(body)
    except ValidationError as e:
        message, param = validation_error_param(e, body)
        raise ApiError(status, message, param=param) from None


async def parse(request: Request, schema: type[T], served_model_name: str) -> T:
    """The body of a non-generation route as ``schema``: 400 for bad JSON, 422 naming a
    bad field, 404 for another model's name."""
    req = validate(await json_body(request), schema)
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


def caller_of(request: Request) -> str:
    """The caller the ``Guard`` identified, for rate-limit charges."""
    return str(request.scope.get("state", {}).get("caller", ""))


def key_id_of(request: Request) -> str | None:
    """The API key (by digest prefix) or OIDC tenant that made this request; None when
    sign-in is off."""
    key_id = request.scope.get("state", {}).get("key_id")
    return None if key_id is None else str(key_id)


def tenant_of(request: Request) -> str | None:
    """The OIDC tenant that signed this request in; None for API keys or no sign-in."""
    tenant = request.scope.get("state", {}).get("tenant")
    return None if tenant is None else str(tenant)


def sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


@runtime_checkable
class Discardable(Protocol):
    """A response that holds something until it has been sent (a model router's hold on
    a model): ``discard`` lets it go when the response will never be sent."""

    async def discard(self) -> None: ...


async def _until_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def cancel_on_disconnect(
    handler: Callable[[Request], Awaitable[Response]],
) -> Callable[[Request], Awaitable[Response]]:
    """Run ``handler`` but cancel it if the client goes away first, so a request still
    queued or generating a non-streamed answer is aborted in the engine (the
    generation's ``finally`` sends the abort). Streams are watched by Starlette itself
    once the response starts."""

    @functools.wraps(handler)
    async def wrapped(request: Request) -> Response:
        await request.body()  # read (and cache) the body first: the watcher reads the channel next
        work = asyncio.ensure_future(handler(request))
        watch = asyncio.ensure_future(_until_disconnect(request))
        try:
            await asyncio.wait([work, watch], return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            # a handler may finish all the same (its cancel came too late): what it
            # holds for the answer nobody will read is let go
            late = None if work.cancelled() or work.exception() else work.result()
            if isinstance(late, Discardable):
                await late.discard()
            return Response(status_code=499)  # nobody is listening any more
        return work.result()

    return wrapped
