"""``POST /v1/messages``: Anthropic's Messages API over the shared generation pipeline,
with Anthropic's bodies, stream events and error format."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncGenerator
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from api_server.chat import ChatRoute
from api_server.generation import ApiError, CompletionService, EngineRequestError, Piece, collect
from api_server.http_util import caller_of, chain, first_piece, json_body
from api_server.protocol import (
    MAX_STOP_STRINGS,
    ChatCompletionRequest,
    ChatMessage,
    anthropic_error_body,
    validation_error_param,
)

logger = logging.getLogger(__name__)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class TextBlock(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["user", "assistant", "system"]
    content: str | list[TextBlock]

    def text(self) -> str:
        return (
            self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)
        )


class Metadata(_Strict):
    user_id: str | None = None


class MessagesRequest(_Strict):
    model: str
    max_tokens: int = Field(ge=1)
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    stop_sequences: Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=1.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    stream: bool = False
    metadata: Metadata | None = None

    def as_chat(self) -> ChatCompletionRequest:
        """The same request in OpenAI chat terms, for the shared template and pipeline."""
        messages = []
        if self.system:
            system = (
                self.system
                if isinstance(self.system, str)
                else "".join(b.text for b in self.system)
            )
            messages.append(ChatMessage(role="system", content=system))
        messages += [ChatMessage(role=m.role, content=m.text()) for m in self.messages]
        return ChatCompletionRequest(
            model=self.model,
            messages=messages,
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            stop=self.stop_sequences,
            stream=self.stream,
        )


def error_response(status: int, message: str) -> JSONResponse:
    return JSONResponse(
        anthropic_error_body(status, message),
        status,
        headers={"Retry-After": "1"} if status in (429, 503) else None,
    )


def stop_reason(piece: Piece) -> str:
    if piece.stop_string is not None:
        return "stop_sequence"
    return "max_tokens" if piece.finish_reason == "length" else "end_turn"


def event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps({'type': name, **data}, ensure_ascii=False)}\n\n"


class MessagesRoute:
    def __init__(self, service: CompletionService, chat: ChatRoute) -> None:
        self.service = service
        self.chat = chat

    async def handle(self, request: Request) -> Response:
        try:
            return await self._handle(request)
        except ApiError as e:
            return error_response(e.status, e.message)

    async def _handle(self, request: Request) -> Response:
        service = self.service
        try:
            req = MessagesRequest.model_validate(await json_body(request))
        except ValidationError as e:
            raise ApiError(400, validation_error_param(e)[0]) from None
        if req.model != service.served_model_name:
            raise ApiError(
                404,
                f"model '{req.model}' does not exist; this server serves '{service.served_model_name}'",
            )
        info = service.model_info()
        chat = req.as_chat()
        prompt_ids = self.chat.prompt_ids(chat)
        request_id, pieces = service.start(
            chat, prompt_ids, info, "messages", caller=caller_of(request)
        )
        message_id = "msg_" + request_id.split("-", 1)[1]
        first = await first_piece(pieces)
        base = {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "model": service.served_model_name,
        }
        if req.stream:
            events = self._stream(first, pieces, base, len(prompt_ids))
            return StreamingResponse(
                events, media_type="text/event-stream", headers={"X-Request-Id": message_id}
            )
        collected = await collect(first, pieces)
        last = collected[-1]
        body = {
            **base,
            "content": [{"type": "text", "text": "".join(p.text for p in collected)}],
            "stop_reason": stop_reason(last),
            "stop_sequence": last.stop_string,
            "usage": {"input_tokens": len(prompt_ids), "output_tokens": last.num_completion_tokens},
        }
        return JSONResponse(body, headers={"X-Request-Id": message_id})

    async def _stream(
        self,
        first: Piece,
        pieces: AsyncGenerator[Piece, None],
        base: dict[str, Any],
        num_prompt: int,
    ) -> AsyncGenerator[str, None]:
        start = {
            **base,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": num_prompt, "output_tokens": 0},
        }
        yield event("message_start", {"message": start})
        yield event(
            "content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}
        )
        last: Piece | None = None
        try:
            async for piece in chain(first, pieces):
                last = piece
                if piece.text:
                    yield event(
                        "content_block_delta",
                        {"index": 0, "delta": {"type": "text_delta", "text": piece.text}},
                    )
        except EngineRequestError as e:
            yield event("error", {"error": {"type": "api_error", "message": str(e)}})
            return
        finally:
            await pieces.aclose()
        assert last is not None  # chain() yields at least the first piece
        yield event("content_block_stop", {"index": 0})
        delta = {"stop_reason": stop_reason(last), "stop_sequence": last.stop_string}
        yield event(
            "message_delta",
            {"delta": delta, "usage": {"output_tokens": last.num_completion_tokens}},
        )
        yield event("message_stop", {})
