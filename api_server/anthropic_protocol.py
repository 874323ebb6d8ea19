"""Anthropic's Messages request (pydantic): content blocks, custom tools and their
``tool_choice``, turned into an OpenAI chat request for the shared template and pipeline.

Errors name the field in Anthropic's terms (``messages.2.content.0.tool_use_id``,
``tools.1.input_schema``), since the client sent those, not the chat request they become.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from api_server.chat_protocol import (
    AssistantMessage,
    ChatCompletionRequest,
    ChatMessage,
    ToolMessage,
    text_message,
)
from api_server.errors import ApiError
from api_server.protocol import MAX_STOP_STRINGS, JsonSchemaFormat, ResponseFormat
from api_server.tool_protocol import (
    FunctionDef,
    FunctionName,
    NamedToolChoice,
    ToolCall,
    ToolCallFunction,
    ToolChoiceField,
    ToolDef,
)


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class TextBlock(_Body):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Body):
    """An assistant's call, as clients send the conversation back."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Body):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool = False

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else _joined(self.content)


class ThinkingBlock(_Body):
    """A past turn's reasoning, sent back by clients; the template drops it, as
    Anthropic's models ignore earlier turns' thinking."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


Block = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")
]


def _joined(blocks: list[Any]) -> str:
    return "".join(b.text for b in blocks if isinstance(b, TextBlock))


class Message(_Body):
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else _joined(self.content)

    def blocks(self) -> list[Any]:
        return [] if isinstance(self.content, str) else list(self.content)


class OutputFormat(_Body):
    """Anthropic's structured outputs: ``{"type": "json_schema", "schema": {...}}``."""

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class Tool(_Body):
    """A custom tool. Anthropic's server tools (``web_search_…``, ``bash_…``) carry a
    versioned ``type`` and run at Anthropic: refused by name."""

    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None


class Thinking(_Body):
    """Extended thinking: ``enabled`` with a budget of reasoning tokens, or ``disabled``
    (passed to the template as ``enable_thinking: false``)."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(default=None, ge=0)

    def budget(self) -> int | None:
        return self.budget_tokens if self.type == "enabled" else None

    def template_kwargs(self) -> dict[str, Any] | None:
        return {"enable_thinking": False} if self.type == "disabled" else None


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


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
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None  # needs --reasoning-parser when enabled
    # Refused when used: Tandem has no MCP connector.
    mcp_servers: list[Any] | None = None

    def refuse_unsupported(self) -> None:
        if self.mcp_servers:
            raise ApiError(400, "'mcp_servers' is not supported", param="mcp_servers")

    def as_chat(self) -> ChatCompletionRequest:
        """The same request in OpenAI chat terms, for the shared template and pipeline."""
        messages = []
        if self.system:
            system = self.system if isinstance(self.system, str) else _joined(self.system)
            messages.append(text_message("system", system))
        messages += self._chat_messages()
        response_format = None
        if self.output_format is not None:
            response_format = ResponseFormat(
                type="json_schema",
                json_schema=JsonSchemaFormat(schema=self.output_format.schema_),
            )
        tools = self._chat_tools()
        choice = self.tool_choice
        chat = ChatCompletionRequest(
            model=self.model,
            messages=messages,
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            stop=self.stop_sequences,
            stream=self.stream,
            response_format=response_format,
            tools=tools,
            tool_choice=self._chat_tool_choice(),
            parallel_tool_calls=False if choice and choice.disable_parallel_tool_use else None,
            thinking_token_budget=self.thinking.budget() if self.thinking else None,
            chat_template_kwargs=self.thinking.template_kwargs() if self.thinking else None,
        )
        try:  # checked here so that a refusal names the Anthropic field
            chat.tool_use()
        except ApiError as e:
            e.param = _anthropic_param(e.param)
            raise
        return chat

    def _chat_messages(self) -> list[ChatMessage]:
        """Tool results become ``tool`` messages (before the turn's text, as Anthropic
        puts them first); an assistant's ``tool_use`` blocks its ``tool_calls``."""
        out: list[ChatMessage] = []
        called: set[str] = set()
        for i, m in enumerate(self.messages):
            blocks = m.blocks()
            for j, b in enumerate(blocks):
                if not isinstance(b, ToolResultBlock):
                    continue
                if m.role != "user" or b.tool_use_id not in called:
                    raise ApiError(
                        400,
                        f"tool_result {b.tool_use_id!r} answers no earlier tool_use block",
                        param=f"messages.{i}.content.{j}.tool_use_id",
                    )
                text = f"Error: {b.text()}" if b.is_error else b.text()
                out.append(ToolMessage(content=text, tool_call_id=b.tool_use_id))
            calls = [
                ToolCall(
                    id=b.id,
                    function=ToolCallFunction(name=b.name, arguments=json.dumps(b.input)),
                )
                for b in blocks
                if isinstance(b, ToolUseBlock)
            ]
            if calls and m.role != "assistant":
                raise ApiError(
                    400, "tool_use blocks belong to assistant turns", param=f"messages.{i}.content"
                )
            called |= {c.id for c in calls}
            text = m.text()
            if text or calls or not any(isinstance(b, ToolResultBlock) for b in blocks):
                out.append(
                    AssistantMessage(content=text, tool_calls=calls or None)
                    if m.role == "assistant"
                    else text_message(m.role, text)
                )
        return out

    def _chat_tools(self) -> list[ToolDef] | None:
        if not self.tools:
            return None
        defs = []
        for i, t in enumerate(self.tools):
            if t.type not in (None, "custom"):
                raise ApiError(
                    400,
                    f"tool type {t.type!r} is not supported: only custom tools "
                    "(name, description, input_schema)",
                    param=f"tools.{i}.type",
                )
            if t.input_schema is None:
                raise ApiError(400, "a tool needs 'input_schema'", param=f"tools.{i}.input_schema")
            function = FunctionDef(
                name=t.name, description=t.description, parameters=t.input_schema
            )
            defs.append(ToolDef(type="function", function=function))
        return defs

    def _chat_tool_choice(self) -> ToolChoiceField | None:
        choice = self.tool_choice
        if choice is None:
            return None
        if choice.type == "tool":
            if choice.name is None:
                raise ApiError(400, "tool_choice 'tool' needs 'name'", param="tool_choice.name")
            return NamedToolChoice(type="function", function=FunctionName(name=choice.name))
        mapped: dict[str, ToolChoiceField] = {"auto": "auto", "any": "required", "none": "none"}
        return mapped[choice.type]


def _anthropic_param(param: str | None) -> str | None:
    """A chat request's field name as the Messages request spells it."""
    if param is None:
        return None
    return param.replace(".function.parameters", ".input_schema").replace(".function.name", ".name")
