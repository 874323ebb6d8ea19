"""``POST /v1/responses``, OpenAI's Responses format: its ``response`` object (output
items: ``reasoning``, ``message``, ``function_call``), its typed stream events, and the
store behind ``GET``/``DELETE /v1/responses/{id}`` and ``previous_response_id``.

The request becomes a chat request (``responses_protocol.py``) and runs through the chat
template, grammar and readers; this object only shapes what comes back.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from api_server.chat import ChatFormat
from api_server.chat_protocol import AssistantMessage, ChatMessage, called_ids
from api_server.driver import Choice, Generation, Parsed, Prompt
from api_server.errors import OPENAI_ERRORS, ApiError, ErrorFormat
from api_server.generation import Piece
from api_server.http_util import key_id_of, validate
from api_server.output_reader import OutputReader
from api_server.protocol import GenerationRequest, unknown_fields
from api_server.response_store import ResponseStore
from api_server.responses_protocol import (
    INAPPLICABLE_RESPONSES_FIELDS,
    ResponsesChat,
    ResponsesRequest,
)
from api_server.tool_protocol import ToolCall, ToolCallFunction
from common.messages import ModelInfo

# Finish reasons that leave a response "incomplete", and the reason it then gives.
INCOMPLETE_REASONS = {"length": "max_output_tokens", "content_filter": "content_filter"}


def _id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


def event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps({'type': name, **data}, ensure_ascii=False)}\n\n"


@dataclass
class OutputItems:
    """One answer's output items as they grow, and the stream events that say so: each
    item is added, filled by deltas, and done before the next is added."""

    reader: OutputReader | None
    items: list[dict[str, Any]] = field(default_factory=list)
    sequence: int = 0
    _open: dict[str, Any] | None = None
    _events: list[str] = field(default_factory=list)

    def emit(self, name: str, data: dict[str, Any]) -> str:
        text = event(name, {**data, "sequence_number": self.sequence})
        self.sequence += 1
        return text

    def push(self, text: str, final: bool, cut: bool = False) -> list[str]:
        self._events = []
        got = self.reader.push(text, final) if self.reader else None
        reasoning = got.reasoning if got else ""
        content = got.content if got else text
        if reasoning:
            item = self._item("reasoning")
            item["content"][0]["text"] += reasoning
            self._delta("response.reasoning_text.delta", item, reasoning, content_index=0)
        if content:
            item = self._item("message")
            item["content"][0]["text"] += content
            self._delta("response.output_text.delta", item, content, content_index=0, logprobs=[])
        for call in got.calls if got else []:
            if "id" in call:
                self._open_item(
                    {
                        "type": "function_call",
                        "id": _id("fc_"),
                        "call_id": call["id"],
                        "name": call["function"]["name"],
                        "arguments": "",
                        "status": "in_progress",
                    }
                )
            fragment = call["function"]["arguments"]
            if fragment and self._open is not None:
                self._open["arguments"] += fragment
                self._delta("response.function_call_arguments.delta", self._open, fragment)
        if final:
            if not self.items:
                self._item("message")  # an empty answer is still one (empty) message
            self._close("incomplete" if cut else "completed")
        return self._events

    def _item(self, kind: str) -> dict[str, Any]:
        if self._open is not None and self._open["type"] == kind:
            return self._open
        if kind == "reasoning":
            part: dict[str, Any] = {"type": "reasoning_text", "text": ""}
            item = {"type": "reasoning", "id": _id("rs_"), "summary": [], "content": [part]}
        else:
            part = {"type": "output_text", "text": "", "annotations": []}
            item = {"type": "message", "id": _id("msg_"), "status": "in_progress"}
            item |= {"role": "assistant", "content": [part]}
        self._open_item(item)
        return item

    def _open_item(self, item: dict[str, Any]) -> None:
        self._close("completed")
        self._open = item
        self.items.append(item)
        index = len(self.items) - 1
        added = {**item, "content": []} if item["type"] == "message" else dict(item)
        self._events.append(
            self.emit("response.output_item.added", {"output_index": index, "item": added})
        )
        if item["type"] == "message":
            part = {"type": "output_text", "text": "", "annotations": []}
            self._events.append(
                self.emit(
                    "response.content_part.added",
                    {
                        "item_id": item["id"],
                        "output_index": index,
                        "content_index": 0,
                        "part": part,
                    },
                )
            )

    def _delta(self, name: str, item: dict[str, Any], delta: str, **extra: Any) -> None:
        where = {"item_id": item["id"], "output_index": len(self.items) - 1}
        self._events.append(self.emit(name, {**where, **extra, "delta": delta}))

    def _close(self, status: str) -> None:
        item, self._open = self._open, None
        if item is None:
            return
        where = {"item_id": item["id"], "output_index": len(self.items) - 1}
        if item["type"] == "message":
            part = item["content"][0]
            done = {**where, "content_index": 0, "text": part["text"], "logprobs": []}
            self._events.append(self.emit("response.output_text.done", done))
            self._events.append(
                self.emit("response.content_part.done", {**where, "content_index": 0, "part": part})
            )
        elif item["type"] == "reasoning":
            done = {**where, "content_index": 0, "text": item["content"][0]["text"]}
            self._events.append(self.emit("response.reasoning_text.done", done))
        else:
            done = {**where, "name": item["name"], "arguments": item["arguments"]}
            self._events.append(self.emit("response.function_call_arguments.done", done))
        if "status" in item:
            item["status"] = status
        self._events.append(
            self.emit(
                "response.output_item.done", {"output_index": where["output_index"], "item": item}
            )
        )


class ResponsesFormat:
    name = "responses"
    id_prefix = "resp_"
    errors: ErrorFormat = OPENAI_ERRORS

    def __init__(self, chat: ChatFormat, store: ResponseStore) -> None:
        self.chat = chat
        self.store = store

    def parse(self, body: dict[str, Any], owner: str | None) -> Parsed:
        req = validate(body, ResponsesRequest, status=400)  # OpenAI answers 400
        history: list[ChatMessage] = []
        if req.previous_response_id is not None:
            stored = self.store.get(owner, req.previous_response_id)
            if stored is None:
                raise ApiError(
                    400,
                    f"previous response {req.previous_response_id!r} is not found (unknown, "
                    "expired, made with another key, or not stored)",
                    param="previous_response_id",
                )
            history = stored.conversation
        request = req.as_chat(history, owner)
        unknown = unknown_fields(req)
        ignored = [n for n in INAPPLICABLE_RESPONSES_FIELDS if n in req.model_fields_set]
        return Parsed(request, unknown, list(dict.fromkeys([*ignored, *unknown])))

    def prompts(self, request: GenerationRequest, info: ModelInfo) -> list[Prompt]:
        return self.chat.prompts(request, info)

    def _items(self, choice: Choice) -> OutputItems:
        if choice.reader is None:
            choice.reader = OutputItems(self.chat.template.reader(choice.prompt))
        items: OutputItems = choice.reader
        return items

    def _response(
        self, gen: Generation, status: str, items: list[dict[str, Any]]
    ) -> dict[str, Any]:
        request = gen.request
        assert isinstance(request, ResponsesChat) and request.source is not None
        source = request.source
        choice = gen.choices[0]
        usage = gen.usage()
        cut = INCOMPLETE_REASONS.get(choice.last.finish_reason or "") if choice.last else None
        if status != "in_progress":
            status = "incomplete" if cut else "completed"
        return {
            "id": gen.request_id,
            "object": "response",
            "created_at": gen.created,
            "status": status,
            "model": gen.model,
            "output": items,
            "error": None,
            "incomplete_details": {"reason": cut} if status == "incomplete" else None,
            "instructions": source.instructions,
            "max_output_tokens": source.max_output_tokens,
            "temperature": source.temperature,
            "top_p": source.top_p,
            "tools": [t.model_dump(exclude_none=True) for t in source.tools or []],
            "tool_choice": source.tool_choice
            if isinstance(source.tool_choice, str) or source.tool_choice is None
            else source.tool_choice.model_dump(),
            "parallel_tool_calls": source.parallel_tool_calls is not False,
            "text": {
                "format": source.text.format.model_dump(by_alias=True, exclude_none=True)
                if source.text and source.text.format
                else {"type": "text"}
            },
            "previous_response_id": source.previous_response_id,
            "store": source.store,
            "metadata": {},
            "usage": {
                "input_tokens": usage["prompt_tokens"],
                "input_tokens_details": usage["prompt_tokens_details"],
                "output_tokens": usage["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage["total_tokens"],
            },
        }

    def _finish(self, gen: Generation, items: list[dict[str, Any]]) -> dict[str, Any]:
        """The final response object; kept when the request asked for it."""
        body = self._response(gen, "completed", items)
        request = gen.request
        assert isinstance(request, ResponsesChat) and request.source is not None
        if request.source.store:
            self.store.put(request.owner, gen.request_id, body, _conversation(request, items))
        return body

    def stream_start(self, gen: Generation) -> list[str]:
        items = self._items(gen.choices[0])
        skeleton = self._response(gen, "in_progress", [])
        return [
            items.emit("response.created", {"response": skeleton}),
            items.emit("response.in_progress", {"response": skeleton}),
        ]

    def stream_piece(self, gen: Generation, choice: Choice, piece: Piece) -> list[str]:
        cut = piece.finish_reason in INCOMPLETE_REASONS
        return self._items(choice).push(piece.text, piece.finish_reason is not None, cut)

    def stream_end(self, gen: Generation) -> list[str]:
        items = self._items(gen.choices[0])
        body = self._finish(gen, items.items)
        name = "response.completed" if body["status"] == "completed" else "response.incomplete"
        return [items.emit(name, {"response": body})]

    def stream_error(self, gen: Generation, message: str) -> list[str]:
        items = self._items(gen.choices[0])
        error = {"code": "server_error", "message": message, "param": None}
        return [items.emit("error", error)]

    def body(self, gen: Generation) -> dict[str, Any]:
        choice = gen.choices[0]
        items = OutputItems(self.chat.template.reader(choice.prompt))
        cut = choice.last is not None and choice.last.finish_reason in INCOMPLETE_REASONS
        items.push(choice.text, final=True, cut=cut)
        return self._finish(gen, items.items)

    async def get(self, request: Request) -> Response:
        stored = self.store.get(key_id_of(request), request.path_params["response_id"])
        if stored is None:
            raise _not_found(request.path_params["response_id"])
        return JSONResponse(stored.body)

    async def delete(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        if not self.store.delete(key_id_of(request), response_id):
            raise _not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})


def _not_found(response_id: str) -> ApiError:
    return ApiError(
        404,
        f"no response {response_id!r} is kept here",
        "not_found_error",
        code="response_not_found",
    )


def _conversation(request: ResponsesChat, items: list[dict[str, Any]]) -> list[ChatMessage]:
    """The turn as a next one continues it: history, this input, then the answer as an
    assistant message (instructions are the request's own and are not carried over)."""
    source = request.source
    assert source is not None
    called = called_ids(request.history)
    text = "".join(i["content"][0]["text"] for i in items if i["type"] == "message")
    calls = [
        ToolCall(
            id=i["call_id"], function=ToolCallFunction(name=i["name"], arguments=i["arguments"])
        )
        for i in items
        if i["type"] == "function_call"
    ]
    answer = AssistantMessage(content=text, tool_calls=calls or None)
    return [*request.history, *source.input_messages(called), answer]
