"""``POST /v1/messages``, Anthropic's Messages format: its bodies (text and
``tool_use`` content blocks), stream events and error format. The request schema is
``anthropic_protocol.py``; the ``GenerationDriver`` runs it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from api_server.anthropic_protocol import INAPPLICABLE_ANTHROPIC_FIELDS, MessagesRequest
from api_server.chat import ChatTemplate
from api_server.chat_protocol import ChatCompletionRequest
from api_server.driver import Choice, Generation, Parsed, Prompt
from api_server.errors import ANTHROPIC_ERRORS, ErrorFormat
from api_server.generation import Piece
from api_server.http_util import validate
from api_server.output_reader import OutputReader
from api_server.protocol import GenerationRequest, unknown_fields
from common.messages import ModelInfo

TOOL_USE_ID_PREFIX = "toolu_"


def stop_reason(piece: Piece | None, called: bool) -> str:
    """A turn cut by ``max_tokens`` says so even inside a call; one that made calls
    ended to have them run. One the content guard ended is Anthropic's ``refusal`` (its
    stop reason when a classifier stops a stream)."""
    if piece is not None and piece.finish_reason == "content_filter":
        return "refusal"
    if piece is not None and piece.finish_reason == "length":
        return "max_tokens"
    if called:
        return "tool_use"
    return "stop_sequence" if piece is not None and piece.stop_string is not None else "end_turn"


def event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps({'type': name, **data}, ensure_ascii=False)}\n\n"


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as its ``input`` object; a call cut by ``max_tokens`` (which
    ``stop_reason`` reports) has none yet."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


@dataclass
class BlockStream:
    """One choice's content blocks as stream events: a ``thinking`` block while the
    model reasons, a text block while it writes text, a ``tool_use`` block per call, each
    closed before the next opens."""

    reader: OutputReader | None
    index: int = -1
    open_kind: str | None = None
    events: list[str] = field(default_factory=list)

    def push(self, text: str, final: bool) -> list[str]:
        self.events = []
        if self.reader is None:
            self._text(text)
        else:
            got = self.reader.push(text, final)
            if got.reasoning:
                if self.open_kind != "thinking":
                    self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                delta = {"type": "thinking_delta", "thinking": got.reasoning}
                self._add("content_block_delta", {"index": self.index, "delta": delta})
            self._text(got.content)
            for call in got.calls:
                if "id" in call:
                    block = {
                        "type": "tool_use",
                        "id": call["id"],
                        "name": call["function"]["name"],
                        "input": {},
                    }
                    self._open("tool_use", block)
                fragment = call["function"]["arguments"]
                if fragment:
                    delta = {"type": "input_json_delta", "partial_json": fragment}
                    self._add("content_block_delta", {"index": self.index, "delta": delta})
        if final:
            if self.index < 0:  # an empty answer still has its (empty) text block
                self._open("text", {"type": "text", "text": ""})
            self._close()
        return self.events

    def _text(self, text: str) -> None:
        if not text:
            return
        if self.open_kind != "text":
            self._open("text", {"type": "text", "text": ""})
        delta = {"type": "text_delta", "text": text}
        self._add("content_block_delta", {"index": self.index, "delta": delta})

    def _open(self, kind: str, block: dict[str, Any]) -> None:
        self._close()
        self.index += 1
        self.open_kind = kind
        self._add("content_block_start", {"index": self.index, "content_block": block})

    def _close(self) -> None:
        if self.open_kind is not None:
            self._add("content_block_stop", {"index": self.index})
            self.open_kind = None

    def _add(self, name: str, data: dict[str, Any]) -> None:
        self.events.append(event(name, data))


class MessagesFormat:
    name = "messages"
    id_prefix = "msg_"
    errors: ErrorFormat = ANTHROPIC_ERRORS

    def __init__(self, template: ChatTemplate) -> None:
        self.template = template

    def parse(self, body: dict[str, Any], owner: str | None) -> Parsed:
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
        use = request.tool_use()
        ids = self.template.prompt_ids(request, use)
        rules, reasoning = self.template.output_rules(request, ids, use)
        text = request.content_text()
        return [Prompt(ids, rules=rules, tools=use, reasoning=reasoning, text=text)]

    def _reader(self, choice: Choice) -> OutputReader | None:
        return self.template.reader(choice.prompt, TOOL_USE_ID_PREFIX)

    def _blocks(self, choice: Choice) -> BlockStream:
        """The choice's block stream, made on first use."""
        if choice.reader is None:
            choice.reader = BlockStream(self._reader(choice))
        blocks: BlockStream = choice.reader
        return blocks

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
        return [event("message_start", {"message": start})]

    def stream_piece(self, gen: Generation, choice: Choice, piece: Piece) -> list[str]:
        return self._blocks(choice).push(piece.text, piece.finish_reason is not None)

    def stream_end(self, gen: Generation) -> list[str]:
        choice = gen.choices[0]
        last = choice.last
        reader = self._blocks(choice).reader
        called = reader is not None and reader.has_calls
        delta = {
            "stop_reason": stop_reason(last, called),
            "stop_sequence": last.stop_string if last else None,
        }
        usage = {"output_tokens": choice.num_completion_tokens}
        return [event("message_delta", {"delta": delta, "usage": usage}), event("message_stop", {})]

    def stream_error(self, gen: Generation, message: str) -> list[str]:
        return [event("error", {"error": {"type": "api_error", "message": message}})]

    def body(self, gen: Generation) -> dict[str, Any]:
        choice = gen.choices[0]
        last = choice.last
        reader = self._reader(choice)
        content: list[dict[str, Any]] = [{"type": "text", "text": choice.text}]
        if reader is not None:
            got = reader.push(choice.text, final=True)
            thought = reader.reasoning_text if reader.shown_reasoning else ""
            content = (
                [{"type": "thinking", "thinking": thought, "signature": ""}] if thought else []
            )
            content += [{"type": "text", "text": got.content}] if got.content else []
            content += [
                {
                    "type": "tool_use",
                    "id": c["id"],
                    "name": c["function"]["name"],
                    "input": tool_input(c["function"]["arguments"]),
                }
                for c in reader.message_calls()
            ]
        return {
            **self._message(gen),
            "content": content,
            "stop_reason": stop_reason(last, reader is not None and reader.has_calls),
            "stop_sequence": last.stop_string if last else None,
            "usage": {
                "input_tokens": gen.num_prompt_tokens,
                "output_tokens": choice.num_completion_tokens,
            },
        }
