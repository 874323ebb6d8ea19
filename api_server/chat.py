"""``POST /v1/chat/completions``, OpenAI's ``chat.completion`` format: the model's chat
template (or ``--chat-template``, or vLLM's per-request ``chat_template``), ``n``
choices, ``logprobs``/``top_logprobs``, usage chunks.

The ``GenerationDriver`` runs it; this object only says how messages become a prompt
and how pieces become ``chat.completion(.chunk)`` bodies.
"""

from __future__ import annotations

from typing import Any

from jinja2 import TemplateError

from api_server.chat_protocol import AssistantMessage, ChatCompletionRequest, ToolMessage
from api_server.driver import Choice, Generation, Parsed, Prompt
from api_server.errors import OPENAI_ERRORS, ApiError, ErrorFormat, error_body
from api_server.generation import CompletionService, OutputRules, Piece
from api_server.http_util import sse, validate
from api_server.output_reader import OutputReader
from api_server.prompt_logprobs import vllm_prompt_logprobs
from api_server.protocol import GenerationRequest, unknown_fields
from api_server.reasoning import Reasoning, ReasoningParser
from api_server.tool_calls import ToolCalling
from api_server.tool_parsers import pick_tool_parser
from api_server.tool_protocol import ToolUse
from common.messages import ModelInfo, TokenLogprobs


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


# Enough of a prompt's end to see whether its template opened a reasoning section.
_PROMPT_TAIL_TOKENS = 8

# apply_chat_template's own parameters: a request's chat_template_kwargs may not set them.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


class ChatTemplate:
    """Messages -> prompt token ids through a Jinja chat template; conversations with
    tools through the tool-call format's (``tool_calls.ToolCalling``)."""

    def __init__(
        self,
        service: CompletionService,
        chat_template: str | None,
        tool_call_parser: str = "auto",
        reasoning: ReasoningParser | None = None,
    ) -> None:
        self.service = service
        self.template = chat_template or getattr(service.tokenizer, "chat_template", None)
        self.tools = ToolCalling(
            pick_tool_parser(tool_call_parser, self.template),
            self.template,
            chat_template is not None,
        )
        self.reasoning = reasoning

    def reasoning_of(self, req: ChatCompletionRequest, ids: list[int]) -> Reasoning | None:
        """How this prompt's output holds its reasoning (None: the server reads none)."""
        if self.reasoning is None:
            if req.thinking_token_budget is not None:
                raise ApiError(
                    400,
                    "a thinking budget needs a server started with --reasoning-parser",
                    param="thinking_token_budget",
                )
            return None
        tail = self.service.tokenizer.decode(ids[-_PROMPT_TAIL_TOKENS:])
        return Reasoning(
            self.reasoning,
            self.reasoning.opens(tail),
            req.thinking_token_budget,
            req.include_reasoning,
        )

    def output_rules(
        self, req: ChatCompletionRequest, ids: list[int], use: ToolUse | None
    ) -> tuple[OutputRules, Reasoning | None]:
        """The grammar and stop bounds of this prompt's output, and its reasoning."""
        rules = self.tools.rules(use)
        reasoning = self.reasoning_of(req, ids)
        if reasoning is not None:
            rules = reasoning.rules(rules, req.structured_output())
        return rules, reasoning

    def reader(self, prompt: Prompt, id_prefix: str = "call_") -> OutputReader | None:
        """A reader of one choice's output; None when it is plain text."""
        reasoning = prompt.reasoning
        tools = self.tools.reader(prompt.tools, id_prefix)
        if reasoning is None and tools is None:
            return None
        return OutputReader(
            reasoning.reader() if reasoning else None,
            tools,
            shown_reasoning=bool(reasoning and reasoning.shown),
        )

    def prompt_ids(self, req: ChatCompletionRequest, use: ToolUse | None = None) -> list[int]:
        with_tools = use is not None or any(
            isinstance(m, ToolMessage) or (isinstance(m, AssistantMessage) and m.tool_calls)
            for m in req.messages
        )
        template = req.chat_template or (self.tools.template if with_tools else self.template)
        tools = {"tools": use.template_tools()} if use is not None else {}
        if not template:
            raise ApiError(
                400,
                f"model '{self.service.served_model_name}' has no chat template; use /v1/completions, "
                "or start the server with --chat-template FILE",
                param="messages",
            )
        extra = req.chat_template_kwargs or {}
        reserved = sorted(_RESERVED_TEMPLATE_KWARGS & set(extra))
        if reserved:
            raise ApiError(
                400,
                f"'chat_template_kwargs' may not set {', '.join(reserved)}",
                param="chat_template_kwargs",
            )
        try:
            text = self.service.tokenizer.apply_chat_template(
                req.template_messages(),
                chat_template=template,
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                tokenize=False,
                **tools,
                **extra,
            )
        except (TemplateError, ValueError, TypeError) as e:
            raise ApiError(
                400, f"the chat template rejected these messages: {e}", param="messages"
            ) from None
        # The template already wrote the special tokens (BOS and turn markers).
        ids: list[int] = self.service.tokenizer.encode(
            text, add_special_tokens=req.add_special_tokens
        )
        if req.truncate_prompt_tokens is not None:
            ids = ids[-req.truncate_prompt_tokens :]
        return ids


class ChatFormat:
    name = "chat"
    id_prefix = "chatcmpl-"
    errors: ErrorFormat = OPENAI_ERRORS

    def __init__(self, service: CompletionService, template: ChatTemplate) -> None:
        self.service = service
        self.template = template

    def parse(self, body: dict[str, Any], owner: str | None) -> Parsed:
        req = validate(body, ChatCompletionRequest)
        return Parsed(req, unknown_fields(req), req.ignored_fields())

    def prompts(self, request: GenerationRequest, info: ModelInfo) -> list[Prompt]:
        assert isinstance(request, ChatCompletionRequest)  # parse() made it
        use = request.tool_use()
        if use is not None and use.constrains and request.structured_output() is not None:
            raise ApiError(
                400,
                "tool calls follow their own grammar: drop 'response_format' (or send "
                "'tool_choice': 'none')",
                param="response_format",
            )
        ids = self.template.prompt_ids(request, use)
        rules, reasoning = self.template.output_rules(request, ids, use)
        text = request.content_text()
        return [Prompt(ids, rules=rules, tools=use, reasoning=reasoning, text=text)]

    def _reader(self, choice: Choice) -> OutputReader | None:
        """The choice's reader, made on first use; None for a plain-text choice."""
        if choice.reader is None:
            choice.reader = self.template.reader(choice.prompt)
        reader: OutputReader | None = choice.reader
        return reader

    @staticmethod
    def _finish(reason: str | None, reader: OutputReader | None, legacy: bool) -> str | None:
        """A turn that ended in calls says so ('length' still says a call was cut)."""
        if reason == "stop" and reader is not None and reader.has_calls:
            return "function_call" if legacy else "tool_calls"
        return reason

    def _chunk(self, gen: Generation, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "id": gen.request_id,
            "object": "chat.completion.chunk",
            "created": gen.created,
            "model": gen.model,
            "choices": choices,
        }
        options = gen.request.stream_options
        if options is not None and options.continuous_usage_stats:
            chunk["usage"] = gen.usage()
        elif options is not None and options.include_usage:
            chunk["usage"] = None
        return chunk

    def stream_start(self, gen: Generation) -> list[str]:
        return [
            sse(
                self._chunk(
                    gen,
                    [
                        {
                            "index": c.index,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                )
            )
            for c in gen.choices
        ]

    def stream_piece(self, gen: Generation, choice: Choice, piece: Piece) -> list[str]:
        if not piece.text and not piece.finish_reason:
            return []
        reader = self._reader(choice)
        delta: dict[str, Any] = {"content": piece.text} if piece.text else {}
        legacy = choice.prompt.tools is not None and choice.prompt.tools.legacy
        if reader is not None:
            got = reader.push(piece.text, piece.finish_reason is not None)
            delta = {"content": got.content} if got.content else {}
            if got.reasoning:  # vLLM's older name and its newer one
                delta |= {"reasoning_content": got.reasoning, "reasoning": got.reasoning}
            if got.calls and legacy:
                delta["function_call"] = {k: v for c in got.calls for k, v in c["function"].items()}
            elif got.calls:
                delta["tool_calls"] = got.calls
        if reader is not None and not delta and not piece.finish_reason and not piece.logprobs:
            return []  # text held back: it may begin a call
        choice_body = {
            "index": choice.index,
            "delta": delta,
            "logprobs": chat_logprobs(self.service.tokenizer, piece.token_ids, piece.logprobs),
            "finish_reason": self._finish(piece.finish_reason, reader, legacy),
        }
        if gen.request.return_token_ids:
            choice_body["token_ids"] = piece.token_ids
        return [sse(self._chunk(gen, [choice_body]))]

    def stream_end(self, gen: Generation) -> list[str]:
        events = []
        if gen.request.stream_options is not None and gen.request.stream_options.include_usage:
            usage_chunk = self._chunk(gen, [])
            usage_chunk["usage"] = gen.usage()
            events.append(sse(usage_chunk))
        return [*events, sse("[DONE]")]

    def stream_error(self, gen: Generation, message: str) -> list[str]:
        return [sse(error_body(message, "server_error")), sse("[DONE]")]

    def body(self, gen: Generation) -> dict[str, Any]:
        choices = []
        for c in gen.choices:
            message: dict[str, Any] = {"role": "assistant", "content": c.text}
            reader = self._reader(c)
            legacy = c.prompt.tools is not None and c.prompt.tools.legacy
            if reader is not None:
                content = reader.push(c.text, final=True).content
                calls = reader.message_calls()
                message["content"] = content or (None if calls else "")
                if reader.reasoning is not None:
                    thought = reader.reasoning_text if reader.shown_reasoning else ""
                    message["reasoning_content"] = message["reasoning"] = thought or None
                if calls and legacy:
                    message["function_call"] = calls[0]["function"]
                elif calls:
                    message["tool_calls"] = calls
            choice: dict[str, Any] = {
                "index": c.index,
                "message": message,
                "logprobs": chat_logprobs(
                    self.service.tokenizer,
                    c.token_ids,
                    [lp for p in c.collected for lp in p.logprobs],
                ),
                "finish_reason": self._finish(
                    c.last.finish_reason if c.last else None, reader, legacy
                ),
            }
            if gen.request.return_token_ids:
                choice["token_ids"] = c.token_ids
            choices.append(choice)
        body = {
            "id": gen.request_id,
            "object": "chat.completion",
            "created": gen.created,
            "model": gen.model,
            "choices": choices,
            "usage": gen.usage(),
        }
        first = gen.choices[0]
        scored = first.collected[0].prompt_logprobs if first.collected else None
        if gen.request.prompt_logprobs is not None and scored is not None:  # as vLLM: top level
            body["prompt_logprobs"] = vllm_prompt_logprobs(
                self.service.tokenizer, first.prompt.ids, scored, gen.request.prompt_logprobs
            )
        if gen.request.return_token_ids:  # as vLLM: the rendered prompt's ids, top level
            body["prompt_token_ids"] = first.prompt.ids
        return body
