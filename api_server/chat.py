"""``POST /v1/chat/completions``: the model's chat template over the shared generation
pipeline, answered as OpenAI ``chat.completion`` bodies or ``chat.completion.chunk``
SSE events."""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from jinja2 import TemplateError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from api_server.generation import ApiError, CompletionService, EngineRequestError, Piece, collect
from api_server.http_util import caller_of, chain, first_piece, parse, sse
from api_server.protocol import ChatCompletionRequest, error_body, now, usage
from common.messages import TokenLogprobs

logger = logging.getLogger(__name__)


def chat_logprobs(
    tokenizer: Any, token_ids: list[int], logprobs: list[TokenLogprobs]
) -> dict[str, Any] | None:
    if not logprobs:
        return None

    def entry(token_id: int, value: float) -> dict[str, Any]:
        token = tokenizer.decode([token_id])
        return {"token": token, "logprob": value, "bytes": list(token.encode())}

    return {
        "content": [
            {
                **entry(t, lp.logprob),
                "top_logprobs": [
                    entry(i, v) for i, v in zip(lp.top_token_ids, lp.top_logprobs, strict=True)
                ],
            }
            for t, lp in zip(token_ids, logprobs, strict=True)
        ]
    }


class ChatRoute:
    def __init__(self, service: CompletionService, chat_template: str | None) -> None:
        self.service = service
        self.template = chat_template or getattr(service.tokenizer, "chat_template", None)

    def prompt_ids(self, req: ChatCompletionRequest) -> list[int]:
        if not self.template:
            raise ApiError(
                400,
                f"model '{self.service.served_model_name}' has no chat template; use /v1/completions, "
                "or start the server with --chat-template FILE",
                param="messages",
            )
        try:
            text = self.service.tokenizer.apply_chat_template(
                req.template_messages(),
                chat_template=self.template,
                add_generation_prompt=True,
                tokenize=False,
            )
        except TemplateError as e:
            raise ApiError(
                400, f"the chat template rejected these messages: {e}", param="messages"
            ) from None
        # The template already wrote the special tokens (BOS and turn markers).
        ids: list[int] = self.service.tokenizer.encode(text, add_special_tokens=False)
        return ids

    async def handle(self, request: Request) -> Response:
        service = self.service
        req = await parse(request, ChatCompletionRequest, service.served_model_name)
        info = service.model_info()
        prompt_ids = self.prompt_ids(req)
        request_id, pieces = service.start(req, prompt_ids, info, "chat", caller=caller_of(request))
        first = await first_piece(pieces)
        headers = {"X-Request-Id": request_id}
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            events = self._stream(first, pieces, request_id, len(prompt_ids), include_usage)
            return StreamingResponse(
                events,
                media_type="text/event-stream",
                headers={**headers, "Cache-Control": "no-cache"},
            )
        collected = await collect(first, pieces)
        last = collected[-1]
        ids = [t for p in collected for t in p.token_ids]
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": "".join(p.text for p in collected)},
            "logprobs": chat_logprobs(
                service.tokenizer, ids, [lp for p in collected for lp in p.logprobs]
            ),
            "finish_reason": last.finish_reason,
        }
        if req.return_token_ids:
            choice["token_ids"] = ids
        logger.info(
            "[%s] finished (%s) with %d tokens",
            request_id,
            last.finish_reason,
            last.num_completion_tokens,
        )
        body = {
            "id": request_id,
            "object": "chat.completion",
            "created": now(),
            "model": service.served_model_name,
            "choices": [choice],
            "usage": usage(len(prompt_ids), last.num_completion_tokens, last.num_cached_tokens),
        }
        return JSONResponse(body, headers=headers)

    async def _stream(
        self,
        first: Piece,
        pieces: AsyncGenerator[Piece, None],
        request_id: str,
        num_prompt: int,
        include_usage: bool,
    ) -> AsyncGenerator[str, None]:
        created, model = now(), self.service.served_model_name

        def chunk(
            delta: dict[str, Any], finish: str | None, logprobs: dict[str, Any] | None
        ) -> dict[str, Any]:
            body: dict[str, Any] = {
                "id": request_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [
                    {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
                ],
            }
            if include_usage:
                body["usage"] = None
            return body

        yield sse(chunk({"role": "assistant", "content": ""}, None, None))
        last: Piece | None = None
        try:
            async with aclosing(pieces):
                async for piece in chain(first, pieces):
                    last = piece
                    lps = chat_logprobs(self.service.tokenizer, piece.token_ids, piece.logprobs)
                    delta = {"content": piece.text} if piece.text else {}
                    if piece.text or piece.finish_reason:
                        yield sse(chunk(delta, piece.finish_reason, lps))
        except EngineRequestError as e:
            logger.error("[%s] failed: %s", request_id, e)
            yield sse(error_body(str(e), "server_error"))
            last = None
        if include_usage and last is not None:
            final = usage(num_prompt, last.num_completion_tokens, last.num_cached_tokens)
            yield sse(
                {
                    "id": request_id,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": model,
                    "choices": [],
                    "usage": final,
                }
            )
        if last is not None:
            logger.info(
                "[%s] finished (%s) with %d tokens",
                request_id,
                last.finish_reason,
                last.num_completion_tokens,
            )
        yield sse("[DONE]")
