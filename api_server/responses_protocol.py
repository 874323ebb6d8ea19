"""OpenAI's Responses request (pydantic): ``input`` as text or items, ``instructions``,
function tools in the Responses' flat spelling, ``text.format``, ``previous_response_id``;
turned into a chat request for the shared template and pipeline.

Errors name the field as the Responses request spells it (``tools.1.parameters``,
``input.3.call_id``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from api_server.chat_protocol import (
    AssistantMessage,
    ChatCompletionRequest,
    ChatMessage,
    ToolMessage,
    called_ids,
    text_message,
)
from api_server.errors import ApiError
from api_server.protocol import JsonSchemaFormat, ResponseFormat
from api_server.tool_protocol import (
    FunctionDef,
    FunctionName,
    NamedToolChoice,
    ToolCall,
    ToolCallFunction,
    ToolChoiceField,
    ToolDef,
)

# Tools OpenAI runs on its side: nothing here can run them.
HOSTED_TOOL_TYPES = frozenset(
    {
        "web_search",
        "web_search_preview",
        "file_search",
        "computer_use_preview",
        "computer_use",
        "code_interpreter",
        "image_generation",
        "mcp",
        "local_shell",
        "shell",
        "apply_patch",
    }
)


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class InputText(_Body):
    type: Literal["input_text", "output_text", "text"]
    text: str


class MessageItem(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]

    def text(self) -> str:
        return (
            self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        )


class FunctionCallItem(_Body):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None


class FunctionCallOutputItem(_Body):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningItem(_Body):
    """A past turn's reasoning, sent back by clients; dropped, as templates drop it."""

    type: Literal["reasoning"]


def _item_type(item: Any) -> str | None:
    """An input item's kind: its ``type``; a bare ``{"role", "content"}`` is a message
    (OpenAI's "easy" input message, which the SDKs send without a type)."""
    if isinstance(item, dict):
        kind = item.get("type", "message")
        return kind if isinstance(kind, str) else None
    return getattr(item, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]


class Tool(_Body):
    """A function tool, flat as the Responses API spells it; hosted tools by ``type``."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(_Body):
    type: Literal["function"]
    name: str


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextOptions(_Body):
    format: TextFormat | None = None


# Responses parameters without effect here: accepted, ignored, reported.
INAPPLICABLE_RESPONSES_FIELDS = (
    "metadata",
    "service_tier",
    "reasoning",
    "truncation",
    "include",
    "user",
    "safety_identifier",
    "prompt_cache_key",
    "background",
)


class ResponsesRequest(_Body):
    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    text: TextOptions | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None

    def input_messages(self, called: set[str]) -> list[ChatMessage]:
        """This turn's input as chat messages: calls and their outputs as the assistant's
        ``tool_calls`` and ``tool`` messages. ``called``: the call ids made before it."""
        if isinstance(self.input, str):
            return [text_message("user", self.input)]
        out: list[ChatMessage] = []
        called = set(called)
        for i, item in enumerate(self.input):
            if isinstance(item, MessageItem):
                out.append(text_message(item.role, item.text()))
            elif isinstance(item, FunctionCallItem):
                call = ToolCall(
                    id=item.call_id,
                    function=ToolCallFunction(name=item.name, arguments=item.arguments),
                )
                called.add(item.call_id)
                last = out[-1] if out else None
                if isinstance(last, AssistantMessage) and last.tool_calls:
                    last.tool_calls.append(call)  # parallel calls: one assistant turn
                else:
                    out.append(AssistantMessage(content="", tool_calls=[call]))
            elif isinstance(item, FunctionCallOutputItem):
                if item.call_id not in called:
                    raise ApiError(
                        400,
                        f"call_id {item.call_id!r} answers no earlier function_call",
                        param=f"input.{i}.call_id",
                    )
                out.append(ToolMessage(content=item.text(), tool_call_id=item.call_id))
        return out

    def as_chat(self, history: list[ChatMessage], owner: str | None) -> ResponsesChat:
        """The request in chat terms after ``history`` (the stored conversation that
        ``previous_response_id`` names; its instructions are not carried over)."""
        system = [text_message("system", self.instructions)] if self.instructions else []
        called = called_ids(history)
        messages = [*system, *history, *self.input_messages(called)]
        if not messages:  # an empty list, or reasoning items alone
            raise ApiError(400, "'input' holds no message to answer", param="input")
        chat = ResponsesChat(
            source=self,
            owner=owner,
            history=history,
            model=self.model,
            messages=messages,
            max_tokens=self.max_output_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            stream=self.stream,
            response_format=self._response_format(),
            tools=self._chat_tools(),
            tool_choice=self._chat_tool_choice(),
            parallel_tool_calls=self.parallel_tool_calls,
        )
        try:  # checked here so that a refusal names the Responses field
            chat.tool_use()
        except ApiError as e:
            e.param = _responses_param(e.param)
            raise
        return chat

    def _response_format(self) -> ResponseFormat | None:
        fmt = self.text.format if self.text else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return ResponseFormat(type="json_object")
        if fmt.schema_ is None:
            raise ApiError(400, "a json_schema format needs 'schema'", param="text.format.schema")
        schema = JsonSchemaFormat(name=fmt.name, schema=fmt.schema_, strict=fmt.strict)
        return ResponseFormat(type="json_schema", json_schema=schema)

    def _chat_tools(self) -> list[ToolDef] | None:
        if not self.tools:
            return None
        defs = []
        for i, t in enumerate(self.tools):
            if t.type != "function":
                hosted = t.type in HOSTED_TOOL_TYPES or t.type.startswith("web_search")
                kind = "a hosted tool" if hosted else "not a tool type served here"
                raise ApiError(
                    400,
                    f"tool type {t.type!r} is {kind}: only function tools are served",
                    param=f"tools.{i}.type",
                )
            if t.name is None:
                raise ApiError(400, "a function tool needs 'name'", param=f"tools.{i}.name")
            function = FunctionDef(
                name=t.name, description=t.description, parameters=t.parameters, strict=t.strict
            )
            defs.append(ToolDef(type="function", function=function))
        return defs

    def _chat_tool_choice(self) -> ToolChoiceField | None:
        choice = self.tool_choice
        if isinstance(choice, FunctionChoice):
            return NamedToolChoice(type="function", function=FunctionName(name=choice.name))
        return choice


class ResponsesChat(ChatCompletionRequest):
    """The chat request a Responses request becomes, with what its answer repeats and who
    may continue it (never read from a body: only ``ResponsesRequest.as_chat`` makes one)."""

    source: ResponsesRequest | None = Field(default=None, exclude=True)
    owner: str | None = Field(default=None, exclude=True)
    history: list[ChatMessage] = Field(default_factory=list, exclude=True)


def _responses_param(param: str | None) -> str | None:
    """A chat request's tool field as the Responses request spells it."""
    if param is None:
        return None
    return param.replace(".function.parameters", ".parameters").replace(".function.name", ".name")
