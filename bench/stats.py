"""Per-request results and the aggregates a serving benchmark reports."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from bench.harness import percentile


@dataclass
class RequestResult:
    """One request as its client saw it: times in seconds from its send."""

    start_s: float  # when it was sent, from the start of the run
    ttft_s: float
    token_times_s: list[float] = field(default_factory=list)  # arrival of each output token
    e2e_s: float = 0.0
    output_tokens: int = 0
    error: str | None = None

    @property
    def itls_s(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.token_times_s)]


@dataclass(frozen=True)
class Slo:
    """Goodput counts requests meeting both bounds."""

    ttft_s: float = 2.0
    itl_p95_s: float = 0.2


def meets(result: RequestResult, slo: Slo) -> bool:
    if result.error is not None or result.ttft_s > slo.ttft_s:
        return False
    itls = result.itls_s
    return not itls or percentile(itls, 95) <= slo.itl_p95_s


def summarize(results: Sequence[RequestResult], wall_s: float, slo: Slo) -> dict[str, Any]:
    """Throughput, latency percentiles and goodput of one measured point."""
    ok = [r for r in results if r.error is None]
    tokens = sum(r.output_tokens for r in ok)
    ttfts = [r.ttft_s for r in ok]
    itls = [x for r in ok for x in r.itls_s]
    e2es = [r.e2e_s for r in ok]
    # Per output token after the first: where a chunk carries several tokens (speculative
    # decoding), the gap between chunks (ITL) is not the time per token.
    tpots = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]

    def pcts(values: list[float]) -> dict[str, float | None]:
        return {f"p{q}": (percentile(values, q) if values else None) for q in (50, 95, 99)}

    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "wall_s": wall_s,
        "output_tokens": tokens,
        "output_tok_s": tokens / wall_s if wall_s > 0 else 0.0,
        "requests_s": len(ok) / wall_s if wall_s > 0 else 0.0,
        "ttft_s": pcts(ttfts),
        "itl_s": pcts(itls),
        "tpot_s": pcts(tpots),
        "e2e_s": pcts(e2es),
        "goodput_requests": sum(meets(r, slo) for r in results),
        "goodput_req_s": sum(meets(r, slo) for r in results) / wall_s if wall_s > 0 else 0.0,
        "slo": asdict(slo),
    }


def parse_sse_line(line: str) -> dict[str, Any] | None:
    """The JSON of one ``data:`` line of an OpenAI stream; None for other lines and
    ``[DONE]``. A chunk carrying ``error`` raises."""
    import json

    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if not data or data == "[DONE]":
        return None
    chunk: dict[str, Any] = json.loads(data)
    if "error" in chunk:
        error = chunk["error"]
        raise RuntimeError(error.get("message", str(error)) if isinstance(error, dict) else error)
    return chunk


def chunk_text(chunk: dict[str, Any]) -> str:
    """The text a completions (or chat) chunk adds; empty for usage-only chunks."""
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "text" in choice:
        return str(choice.get("text") or "")
    return str((choice.get("delta") or {}).get("content") or "")
