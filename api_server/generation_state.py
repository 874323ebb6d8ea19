"""One HTTP request's generation as the driver and the format objects hold it: its
prompts (with the format's output rules), one ``Choice`` per engine request collecting
the pieces as they come, and the usage summed over them. The audit log reads it when the
request ends (``audit_middleware.py``)."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from api_server.generation import OutputRules, Piece
from api_server.protocol import GenerationRequest, usage
from api_server.reasoning import Reasoning
from api_server.tool_protocol import ToolUse


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    echo: str = ""  # text put before the completion (completions' ``echo``)
    # The format's grammar and stop-string bounds for this prompt's output.
    rules: OutputRules = field(default_factory=OutputRules)
    tools: ToolUse | None = None  # chat: the request's function tools, resolved
    reasoning: Reasoning | None = None  # chat: how the output holds its reasoning section
    # The client's text of this prompt, as the content guard reads it: a completion's
    # prompt, a conversation's message contents (not the chat template's own text).
    text: str = ""


@dataclass
class Choice:
    """One choice of a generation: its engine request's pieces, as they come."""

    index: int
    prompt: Prompt
    pieces: AsyncGenerator[Piece, None]
    collected: list[Piece] = field(default_factory=list)
    text_offset: int = 0  # characters of this choice streamed so far (echo included)
    reader: Any = None  # the format's own per-choice reading state (chat: tool calls)

    @property
    def last(self) -> Piece | None:
        return self.collected[-1] if self.collected else None

    @property
    def num_completion_tokens(self) -> int:
        return self.last.num_completion_tokens if self.last else 0

    @property
    def num_cached_tokens(self) -> int:
        return self.last.num_cached_tokens if self.last else 0

    @property
    def token_ids(self) -> list[int]:
        return [t for p in self.collected for t in p.token_ids]

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.collected)


@dataclass
class Generation:
    """One HTTP request's generation, as the format objects see it."""

    request_id: str
    model: str
    created: int
    request: GenerationRequest
    choices: list[Choice]

    @property
    def num_prompt_tokens(self) -> int:
        """Each prompt counted once, however many choices it has."""
        return sum(len(c.prompt.ids) for c in self.choices if c.index % self.request.n == 0)

    def usage(self) -> dict[str, Any]:
        """Usage summed over every choice, so far; a prompt's cached tokens are the most
        any of its choices found."""
        cached: dict[int, int] = {}
        for c in self.choices:
            prompt = c.index // self.request.n
            cached[prompt] = max(cached.get(prompt, 0), c.num_cached_tokens)
        return usage(
            self.num_prompt_tokens,
            sum(c.num_completion_tokens for c in self.choices),
            sum(cached.values()),
        )
