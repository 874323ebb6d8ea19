"""``POST /v1/messages``, Anthropic's Messages format: its request schema (turned into
an OpenAI chat request for the shared template and pipeline), its bodies, stream events
and error format. The ``GenerationDriver`` runs it.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from api_server.chat import ChatTemplate
from api_server.chat_protocol import ChatCompletionRequest, ChatMessage
from api_server.driver import Choice, Generation, Parsed, Prompt
from api_server.errors import ANTHROPIC_ERRORS, ApiError, ErrorFormat
from api_server.generation import Piece
from api_server.http_util import validate
from api_server.protocol import (
    MAX_STOP_STRINGS,
    GenerationRequest,
    JsonSchemaFormat,
    ResponseFormat,
    unknown_fields,
)
from common.messages import ModelInfo


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class TextBlock(_Body):
    type: Literal["text"]
    text: str


class Message(_Body):
    role: Literal["user", "assistant", "system"]
    content: str | list[TextBlock]

    def text(self) -> str:
        return (
            self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)
        )


class OutputFormat(_Body):
    """Anthropic's structured outputs: ``{"type": "json_schema", "schema": {...}}``."""

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


# Anthropic parameters that change nothing here: accepted, ignored, reported.
INAPPLICABLE_ANTHROPIC_FIELDS = ("metadata", "service_tier", "container", "context_management")


class MessagesRequest(_Body):
    model: str
    max_tokens: int = Field(ge=1)
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    stop_sequences: Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    stream: bool = False
    output_format: OutputFormat | None = None
    # Refused when used: Tandem has no tools and no extended thinking.
    tools: list[Any] | None = None
    tool_choice: Any = None
    thinking: Any = None
    mcp_servers: list[Any] | None = None

    def refuse_unsupported(self) -> None:
        thinking = isinstance(self.thinking, dict) and self.thinking.get("type") == "enabled"
        refused = {
            "tools": bool(self.tools),
            "tool_choice": self.tool_choice is not None,
            "thinking": thinking,
            "mcp_servers": bool(self.mcp_servers),
        }
        for name, used in refused.items():
            if used:
                raise ApiError(400, f"'{name}' is not supported", param=name)

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
        response_format = None
        if self.output_format is not None:
            response_format = ResponseFormat(
                type="json_schema",
                json_schema=JsonSchemaFormat(schema=self.output_format.schema_),
            )
        return ChatCompletionRequest(
            model=self.model,
            messages=messages,
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            stop=self.stop_sequences,
            stream=self.stream,
            response_format=response_format,
        )


def stop_reason(piece: Piece | None) -> str:
    if piece is not None and piece.stop_string is not None:
        return "stop_sequence"
    return "max_tokens" if piece is not None and piece.finish_reason == "length" else "end_turn"


def event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps({'type': name, **data}, ensure_ascii=False)}\n\n"


class MessagesFormat:
    name = "messages"
    id_prefix = "msg_"
    errors: ErrorFormat = ANTHROPIC_ERRORS

    def __init__(self, template: ChatTemplate) -> None:
        self.template = template

    def parse(self, body: dict[str, Any]) -> Parsed:
        req = validate(body, MessagesRequest, status=400)  # Anthropic answers 400
        req.refuse_unsupported()
        unknown = unknown_fields(req)
        ignored = [
            name
            for name in INAPPLICABLE_ANTHROPIC_FIELDS
            if name in (req.model_extra or {}) or name in req.model_fields_set
        ]
        return Parsed(req.as_chat(), unknown, list(dict.fromkeys([*ignored, *unknown])))

    def prompts(self, request: GenerationRequest, info: ModelInfo) -> list[Prompt]:
        assert isinstance(request, ChatCompletionRequest)  # parse() made it
        return [Prompt(self.template.prompt_ids(request))]

    def _message(self, gen: Generation) -> dict[str, Any]:
        return {"id": gen.request_id, "type": "message", "role": "assistant", "model": gen.model}

    def stream_start(self, gen: Generation) -> list[str]:
        start = {
            **self._message(gen),
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": gen.num_prompt_tokens, "output_tokens": 0},
        }
        return [
            event("message_start", {"message": start}),
            event(
                "content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}
            ),
        ]

    def stream_piece(self, gen: Generation, choice: Choice, piece: Piece) -> list[str]:
        if not piece.text:
            return []
        delta = {"type": "text_delta", "text": piece.text}
        return [event("content_block_delta", {"index": 0, "delta": delta})]

    def stream_end(self, gen: Generation) -> list[str]:
        last = gen.choices[0].last
        delta = {
            "stop_reason": stop_reason(last),
            "stop_sequence": last.stop_string if last else None,
        }
        usage = {"output_tokens": gen.choices[0].num_completion_tokens}
        return [
            event("content_block_stop", {"index": 0}),
            event("message_delta", {"delta": delta, "usage": usage}),
            event("message_stop", {}),
        ]

    def stream_error(self, gen: Generation, message: str) -> list[str]:
        return [event("error", {"error": {"type": "api_error", "message": message}})]

    def body(self, gen: Generation) -> dict[str, Any]:
        choice = gen.choices[0]
        last = choice.last
        return {
            **self._message(gen),
            "content": [{"type": "text", "text": choice.text}],
            "stop_reason": stop_reason(last),
            "stop_sequence": last.stop_string if last else None,
            "usage": {
                "input_tokens": gen.num_prompt_tokens,
                "output_tokens": choice.num_completion_tokens,
            },
        }
