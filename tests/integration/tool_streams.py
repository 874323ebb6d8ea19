"""Reading a streamed chat answer with tool calls, as the openai SDK yields it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def read_stream(chunks: Iterable[Any]) -> tuple[str, list[tuple[str, str]], str | None]:
    """Content, (name, arguments) per call in index order, and the finish reason."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                if d.id is not None:  # the first delta names the call
                    assert d.index not in calls and d.function and d.function.name
                    calls[d.index] = [d.function.name, ""]
                calls[d.index][1] += (d.function.arguments or "") if d.function else ""
            finish = choice.finish_reason or finish
    return content, [(n, a) for n, a in (calls[i] for i in sorted(calls))], finish
