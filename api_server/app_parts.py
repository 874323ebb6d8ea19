"""What every HTTP app of Tandem shares (a model's API server, ``app.py``, and the model
router, ``model_router.py``): the chat page, the error handlers (the route's API flavour
for an ``ApiError``; 413, 408, 404 and 405 in OpenAI's body), CORS for the origins the
operator named, and the guard's settings."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response

from api_server.errors import OPENAI_ERRORS, ApiError, ErrorFormat, error_body, error_response
from api_server.guard import BodyTooLarge, BodyTooSlow, too_large_body, too_slow_body

STATIC_DIR = Path(__file__).parent / "static"  # the chat page: plain HTML/JS/CSS
# The chat page loads only its own script and stylesheet and talks only to this server.
CHAT_PAGE_CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)

Handler = Callable[[Request, Exception], Any]


async def chat_page(request: Request) -> Response:
    return FileResponse(
        STATIC_DIR / "index.html",
        headers={"Cache-Control": "no-cache", "Content-Security-Policy": CHAT_PAGE_CSP},
    )


def exception_handlers(
    error_formats: Mapping[str, ErrorFormat], max_body_bytes: int, read_timeout_s: float
) -> dict[Any, Handler]:
    """``ApiError`` in its path's flavour (``error_formats``, else OpenAI's), a body over
    the limit 413, one too slow 408, and unknown routes and methods 404 and 405."""

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)  # registered for ApiError only
        return error_response(exc, error_formats.get(request.url.path, OPENAI_ERRORS))

    async def body_too_large(request: Request, exc: Exception) -> Response:
        return JSONResponse(too_large_body(max_body_bytes), 413)

    async def body_too_slow(request: Request, exc: Exception) -> Response:
        return JSONResponse(too_slow_body(read_timeout_s), 408, headers={"Connection": "close"})

    async def not_found(request: Request, exc: Exception) -> Response:
        message = f"no route {request.method} {request.url.path}"
        return JSONResponse(error_body(message, "not_found_error"), 404)

    async def method_not_allowed(request: Request, exc: Exception) -> Response:
        message = f"{request.method} is not allowed on {request.url.path}"
        return JSONResponse(error_body(message, "invalid_request_error"), 405)

    return {
        ApiError: api_error,
        BodyTooLarge: body_too_large,
        BodyTooSlow: body_too_slow,
        404: not_found,
        405: method_not_allowed,
    }


def cors(allowed_origins: tuple[str, ...]) -> list[Middleware]:
    """CORS only for the origins the operator named; none by default."""
    if not allowed_origins:
        return []
    return [
        Middleware(
            CORSMiddleware,
            allow_origins=list(allowed_origins),
            allow_methods=["GET", "POST", "DELETE"],
            allow_headers=["Authorization", "Content-Type", "x-api-key"],
            expose_headers=["X-Request-Id", "X-Tandem-Ignored-Fields"],
        )
    ]
