"""HTTP routes: OpenAI completions (SSE streaming), models, health, stats.

A request's path: parse + validate (``protocol.py``) -> tokenize -> ``EngineClient``
(``client.py``) -> incremental detokenize + stop strings (``detokenizer.py``) -> SSE
chunks or one JSON body. Errors are OpenAI error bodies.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from api_server.client import EngineClient, EngineDeadError
from api_server.detokenizer import IncrementalDetokenizer, StopStringMatcher
from api_server.protocol import (
    CompletionRequest,
    ErrorType,
    completion_chunk,
    error_body,
    finish_reason_text,
    now,
    usage,
    validation_error_param,
)
from common.messages import EngineRequest, FinishReason, ModelInfo

logger = logging.getLogger(__name__)

RETRY_AFTER_S = "1"


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: ErrorType = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type_,
            param,
            code,
        )

    def response(self) -> JSONResponse:
        headers = {"Retry-After": RETRY_AFTER_S} if self.status in (429, 503) else None
        return JSONResponse(
            error_body(self.message, self.type, self.param, self.code), self.status, headers=headers
        )


@dataclass(frozen=True)
class Piece:
    """Text produced by one engine output, and the finish reason on the last one."""

    text: str
    finish_reason: str | None
    num_completion_tokens: int
    token_ids: list[int]


class CompletionService:
    """Everything the routes share: the tokenizer, the engine client, the model name."""

    def __init__(self, served_model_name: str, tokenizer: Any, client: EngineClient) -> None:
        self.served_model_name = served_model_name
        self.tokenizer = tokenizer
        self.client = client

    def model_info(self) -> ModelInfo:
        if self.client.is_dead:
            raise ApiError(503, f"the engine is down: {self.client.dead_reason}", "server_error")
        if not self.client.ready or self.client.model is None:
            raise ApiError(503, "the model is still loading; retry shortly", "server_error")
        return self.client.model

    def tokenize(self, prompt: str | list[int], info: ModelInfo) -> list[int]:
        ids: list[int] = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ApiError(400, "the prompt is empty", param="prompt")
        bad = next((t for t in ids if t >= info.vocab_size), None)
        if bad is not None:
            raise ApiError(
                400,
                f"token id {bad} is outside the vocabulary (size {info.vocab_size})",
                param="prompt",
            )
        return ids

    @staticmethod
    def completion_budget(num_prompt: int, max_tokens: int | None, info: ModelInfo) -> int:
        limit = info.max_model_len
        if num_prompt >= limit:
            raise ApiError(
                400,
                f"the prompt has {num_prompt} tokens; this model's context length is {limit} tokens",
                param="prompt",
                code="context_length_exceeded",
            )
        if max_tokens is None:
            return limit - num_prompt
        if num_prompt + max_tokens > limit:
            raise ApiError(
                400,
                f"this model's context length is {limit} tokens, but {num_prompt + max_tokens} were "
                f"requested ({num_prompt} in the prompt, {max_tokens} for the completion)",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return max_tokens

    async def run(self, request: EngineRequest, stops: list[str]) -> AsyncGenerator[Piece, None]:
        """Engine outputs -> text pieces; a stop string ends the request early."""
        detok = IncrementalDetokenizer(self.tokenizer.backend_tokenizer)
        matcher = StopStringMatcher(stops)
        num_tokens = 0
        pending_ids: list[int] = []  # ids whose text is not complete yet
        # aclosing: leaving early (stop string, client gone) aborts it in the engine now.
        async with aclosing(self.client.generate(request)) as outputs:
            async for out in outputs:
                if out.finish_reason == FinishReason.ERROR:
                    raise EngineDeadError(out.error or "the engine failed this request")
                num_tokens += len(out.new_token_ids)
                pending_ids += out.new_token_ids
                text = matcher.push(detok.push(out.new_token_ids))
                finish = "stop" if matcher.hit else finish_reason_text(out.finish_reason)
                if finish is not None and not matcher.hit:
                    text += matcher.flush()
                if text or finish is not None:
                    yield Piece(text, finish, num_tokens, pending_ids)
                    pending_ids = []
                if finish is not None:
                    return


async def _json_body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    return body


def _sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


def create_app(service: CompletionService) -> Starlette:
    async def completions(request: Request) -> Response:
        body = await _json_body(request)
        try:
            req = CompletionRequest.model_validate(body)
        except ValidationError as e:
            message, param = validation_error_param(e)
            raise ApiError(422, message, param=param) from None
        if req.model != service.served_model_name:
            raise ApiError(
                404,
                f"model '{req.model}' does not exist; this server serves "
                f"'{service.served_model_name}'",
                "not_found_error",
                "model",
                "model_not_found",
            )
        info = service.model_info()
        prompt_ids = service.tokenize(req.prompt, info)
        max_tokens = service.completion_budget(len(prompt_ids), req.max_tokens, info)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        engine_request = EngineRequest(
            request_id=request_id,
            client_id=service.client.client_id,
            prompt_token_ids=prompt_ids,
            sampling_params=req.sampling_params(max_tokens),
            arrival_time=time.time(),
        )
        logger.info(
            "[%s] completion: %d prompt tokens, max_tokens=%d, stream=%s",
            request_id,
            len(prompt_ids),
            max_tokens,
            req.stream,
        )
        pieces = service.run(engine_request, req.stop_strings())
        created, model = now(), service.served_model_name
        headers = {"X-Request-Id": request_id}
        if req.stream:
            return StreamingResponse(
                _stream(pieces, request_id, model, created, len(prompt_ids), req.return_token_ids),
                media_type="text/event-stream",
                headers={**headers, "Cache-Control": "no-cache"},
            )
        text: list[str] = []
        token_ids: list[int] = []
        finish: str | None = None
        n = 0
        try:
            async with aclosing(pieces):
                async for piece in pieces:
                    text.append(piece.text)
                    token_ids += piece.token_ids
                    finish, n = piece.finish_reason, piece.num_completion_tokens
        except EngineDeadError as e:
            raise ApiError(503, str(e), "server_error") from None
        logger.info("[%s] finished (%s) with %d tokens", request_id, finish, n)
        body = completion_chunk(
            request_id,
            model,
            created,
            "".join(text),
            finish,
            usage(len(prompt_ids), n),
            token_ids if req.return_token_ids else None,
        )
        if req.return_token_ids:
            body["prompt_token_ids"] = prompt_ids
        return JSONResponse(body, headers=headers)

    async def _stream(
        pieces: AsyncGenerator[Piece, None],
        request_id: str,
        model: str,
        created: int,
        num_prompt: int,
        with_ids: bool,
    ) -> AsyncGenerator[str, None]:
        try:
            async with aclosing(pieces):
                async for piece in pieces:
                    last_usage = (
                        usage(num_prompt, piece.num_completion_tokens)
                        if piece.finish_reason
                        else None
                    )
                    ids = piece.token_ids if with_ids else None
                    chunk = completion_chunk(
                        request_id, model, created, piece.text, piece.finish_reason, last_usage, ids
                    )
                    yield _sse(chunk)
                    if piece.finish_reason:
                        logger.info(
                            "[%s] finished (%s) with %d tokens",
                            request_id,
                            piece.finish_reason,
                            piece.num_completion_tokens,
                        )
        except EngineDeadError as e:
            logger.error("[%s] failed: %s", request_id, e)
            yield _sse(error_body(str(e), "server_error"))
        yield _sse("[DONE]")

    async def models(request: Request) -> Response:
        created = now()
        info = service.client.model
        card: dict[str, Any] = {
            "id": service.served_model_name,
            "object": "model",
            "created": created,
            "owned_by": "tandem",
        }
        if info is not None:
            card["max_model_len"] = info.max_model_len
        return JSONResponse({"object": "list", "data": [card]})

    async def health(request: Request) -> Response:
        client = service.client
        if client.is_dead:
            return JSONResponse(
                {"status": "dead", "model_loaded": False, "reason": client.dead_reason}, 503
            )
        if not client.ready:
            return JSONResponse({"status": "loading", "model_loaded": False}, 503)
        return JSONResponse({"status": "ok", "model_loaded": True})

    async def stats(request: Request) -> Response:
        s = service.client.stats
        total = s.num_kv_blocks_total
        return JSONResponse(
            {
                "active_requests": s.num_running,
                "waiting_requests": s.num_waiting,
                "total_requests": s.num_requests_total,
                "tokens_generated": s.num_generated_tokens_total,
                "num_kv_blocks_total": total,
                "num_kv_blocks_in_use": s.num_kv_blocks_in_use,
                "cache_usage": s.num_kv_blocks_in_use / total if total else 0.0,
                "engine_ready": service.client.ready,
            }
        )

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)  # registered for ApiError only
        return exc.response()

    async def not_found(request: Request, exc: Exception) -> Response:
        return JSONResponse(
            error_body(f"no route {request.method} {request.url.path}", "not_found_error"), 404
        )

    async def method_not_allowed(request: Request, exc: Exception) -> Response:
        return JSONResponse(
            error_body(
                f"{request.method} is not allowed on {request.url.path}", "invalid_request_error"
            ),
            405,
        )

    return Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/stats", stats, methods=["GET"]),
        ],
        exception_handlers={ApiError: api_error, 404: not_found, 405: method_not_allowed},
    )
