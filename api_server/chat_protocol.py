"""The chat completions request (pydantic): messages with tool calls and tool results,
the tools themselves, and vLLM's chat-template controls."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field

from api_server.errors import ApiError
from api_server.protocol import MAX_LOGPROBS, GenerationRequest, _Body
from api_server.tool_protocol import (
    FunctionCallField,
    FunctionDef,
    ToolCall,
    ToolChoiceField,
    ToolDef,
    ToolUse,
    resolve_tool_use,
)

_TOOL_FIELDS = ("tools", "tool_choice", "functions", "function_call")


class ContentPart(_Body):
    type: Literal["text"]
    text: str


class _Message(_Body):
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class SystemMessage(_Message):
    role: Literal["system", "developer"] = "system"  # "developer": OpenAI's newer name


class UserMessage(_Message):
    role: Literal["user"] = "user"


class AssistantMessage(_Message):
    role: Literal["assistant"] = "assistant"
    tool_calls: list[ToolCall] | None = None


class ToolMessage(_Message):
    """A tool's result, answering the assistant call ``tool_call_id`` names."""

    role: Literal["tool"] = "tool"
    tool_call_id: str


# One type per role, as OpenAI's own schema has them, so /openapi.json says which
# fields each role takes (a tool message without its call's id is not a valid body).
ChatMessage = Annotated[
    SystemMessage | UserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")
]


def text_message(
    role: Literal["system", "developer", "user", "assistant"], content: str
) -> ChatMessage:
    """A message of ``role`` carrying only text."""
    if role == "user":
        return UserMessage(content=content)
    if role == "assistant":
        return AssistantMessage(content=content)
    return SystemMessage(role=role, content=content)


def called_ids(messages: list[ChatMessage]) -> set[str]:
    """The ids of the tool calls the assistant messages among ``messages`` made."""
    return {c.id for m in messages if isinstance(m, AssistantMessage) for c in m.tool_calls or []}


class ChatCompletionRequest(GenerationRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # vLLM's chat-template controls.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the template writes them
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # Function tools (api_server/tool_protocol.py), and the legacy functions.
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoiceField | None = None
    functions: list[FunctionDef] | None = None
    function_call: FunctionCallField | None = None
    parallel_tool_calls: bool | None = None
    # Reasoning (--reasoning-parser): vLLM's names.
    thinking_token_budget: int | None = Field(default=None, ge=0)
    include_reasoning: bool = True

    def refused_fields(self) -> dict[str, bool]:
        refused = super().refused_fields()
        return {name: used for name, used in refused.items() if name not in _TOOL_FIELDS}

    def ignored_fields(self) -> list[str]:
        return [name for name in super().ignored_fields() if name != "parallel_tool_calls"]

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.stream and self.prompt_logprobs is not None:  # as vLLM: no chunk carries them
            raise ApiError(
                400,
                "'prompt_logprobs' is not served with 'stream' on chat",
                param="prompt_logprobs",
            )
        if self.continue_final_message and self.add_generation_prompt:
            raise ApiError(
                400,
                "'continue_final_message' needs 'add_generation_prompt': false",
                param="continue_final_message",
            )
        self._check_tool_results()

    def tool_use(self) -> ToolUse | None:
        return resolve_tool_use(
            self.tools,
            self.tool_choice,
            self.parallel_tool_calls,
            self.functions,
            self.function_call,
        )

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def _check_tool_results(self) -> None:
        """Every tool result answers a call an earlier assistant message made."""
        called: set[str] = set()
        for i, m in enumerate(self.messages):
            if isinstance(m, AssistantMessage):
                called |= {c.id for c in m.tool_calls or []}
            if isinstance(m, ToolMessage) and m.tool_call_id not in called:
                raise ApiError(
                    400,
                    f"tool_call_id {m.tool_call_id!r} answers no earlier assistant tool call",
                    param=f"messages.{i}.tool_call_id",
                )

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages as chat templates take them: "developer" is OpenAI's newer name for
        the system role; a call's arguments as an object (templates serialize them)."""
        out: list[dict[str, Any]] = []
        for i, m in enumerate(self.messages):
            message: dict[str, Any] = {
                "role": "system" if m.role == "developer" else m.role,
                "content": m.text(),
            }
            if isinstance(m, AssistantMessage) and m.tool_calls:
                message["tool_calls"] = [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {
                            "name": c.function.name,
                            "arguments": _arguments(
                                c.function.arguments, f"messages.{i}.tool_calls.{j}"
                            ),
                        },
                    }
                    for j, c in enumerate(m.tool_calls)
                ]
            if isinstance(m, ToolMessage):
                message["tool_call_id"] = m.tool_call_id
                if m.name is not None:
                    message["name"] = m.name
            out.append(message)
        return out

    def content_text(self) -> str:
        """Every message's text, a message a line: what the content guard reads of a
        conversation (not the template's own text, the tools or calls' arguments)."""
        return "\n".join(m.text() for m in self.messages)


def _arguments(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ApiError(
            400, f"a call's arguments are not JSON: {e}", param=f"{where}.function.arguments"
        ) from None
