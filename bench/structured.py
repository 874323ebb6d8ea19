"""What constrained decoding costs per token: the same streams with and without a grammar,
one at a time and 32 at once, for two kinds of constraint:

- ``json``: completions under a JSON schema (``response_format``) against free ones;
- ``tools``: chat completions that must call a tool (``tool_choice: required``, the
  hermes format, its arguments under the same schema) against free chat streams with
  the same tool in their prompt (``tool_choice: none``).

The cost is the time per output token of each stream, (end - first token) / (tokens -
1), client-side: tool-call chunks carry argument fragments, not one token each, so a
per-chunk gap would not compare. Free and constrained runs alternate (free, constrained,
free, constrained) so the host's drift hits both. The schema (a list of 16 short
strings) keeps every constrained output inside the grammar for ~100 tokens, so the mask
is computed on most steps, not just at the end.

    .venv/bin/python -m bench.structured [--kinds json tools] [--batches 1 32] [--repeats 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import httpx

from bench.harness import Timing, print_table, stream, tandem_server, write_results

SCHEMA = {
    "type": "object",
    "properties": {
        "words": {
            "type": "array",
            "items": {"type": "string", "minLength": 3, "maxLength": 12},
            "minItems": 16,
            "maxItems": 16,
        }
    },
    "required": ["words"],
    "additionalProperties": False,
}
MAX_TOKENS = 128
USAGE = {"stream_options": {"include_usage": True}}


@dataclass(frozen=True)
class Kind:
    """One constraint and its free baseline, on the route both are served by."""

    name: str
    route: str

    def body(self, i: int, constrained: bool) -> dict[str, Any]:
        ask = f"List sixteen words about topic number {i} as JSON:"
        body: dict[str, Any] = {"max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": i, **USAGE}
        if self.route == "/v1/completions":
            body["prompt"] = ask
        else:
            body["messages"] = [{"role": "user", "content": ask}]
        if self.name == "tools":  # both with the tool in the prompt, so prefills equal
            tool = {"type": "function", "function": {"name": "list_words", "parameters": SCHEMA}}
            choice = "required" if constrained else "none"
            body |= {"tools": [tool], "tool_choice": choice, "parallel_tool_calls": False}
        if not constrained:
            body["ignore_eos"] = True
        elif self.name == "json":
            body["response_format"] = {"type": "json_schema", "json_schema": {"schema": SCHEMA}}
        return body


KINDS = {"json": Kind("json", "/v1/completions"), "tools": Kind("tools", "/v1/chat/completions")}


def per_token_s(t: Timing) -> float | None:
    """Seconds per output token after the first, None for a stream of one token."""
    if t.output_tokens < 2:
        return None
    return (t.e2e_s - t.ttft_s) / (t.output_tokens - 1)


async def run_batch(url: str, kind: Kind, n: int, constrained: bool) -> list[Timing]:
    async with httpx.AsyncClient(timeout=600) as client:
        runs = (stream(client, url, kind.body(i, constrained), kind.route) for i in range(n))
        return list(await asyncio.gather(*runs))


async def measure(
    url: str, kinds: list[Kind], batches: list[int], repeats: int
) -> list[dict[str, Any]]:
    for kind in kinds:  # warm up each grammar path (the tokenizer's load, the templates)
        await run_batch(url, kind, 1, True)
    rows = []
    for kind in kinds:
        for n in batches:
            tpot: dict[bool, list[float]] = {False: [], True: []}
            tokens: dict[bool, int] = {False: 0, True: 0}
            for _ in range(repeats):
                for constrained in (False, True):
                    timings = await run_batch(url, kind, n, constrained)
                    tpot[constrained] += [s for t in timings if (s := per_token_s(t)) is not None]
                    tokens[constrained] += sum(t.output_tokens for t in timings)
            free, held = statistics.median(tpot[False]), statistics.median(tpot[True])
            rows.append(
                {
                    "kind": kind.name,
                    "batch": n,
                    "free_ms_per_token": 1000 * free,
                    "constrained_ms_per_token": 1000 * held,
                    "constrained_tokens_per_stream": tokens[True] / (n * repeats),
                    "overhead": held / free - 1,
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", help="an already running server (default: start one)")
    parser.add_argument("--kinds", nargs="+", choices=sorted(KINDS), default=["json", "tools"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    kinds = [KINDS[k] for k in args.kinds]
    flags = ("--dtype", args.dtype, "--tool-call-parser", "hermes")
    with nullcontext(args.url) if args.url else tandem_server(*flags) as url:
        rows = asyncio.run(measure(url, kinds, args.batches, args.repeats))
    path = write_results("structured", {"args": vars(args), "schema": SCHEMA, "rows": rows})
    print(f"\nConstrained vs free streams, median ms per output token (dtype {args.dtype});")
    print(f"schema (the JSON output's and the tool's arguments'): {json.dumps(SCHEMA)}")
    keys = ["free_ms_per_token", "constrained_ms_per_token", "constrained_tokens_per_stream"]
    print_table(
        ["kind", "batch", *keys, "overhead"],
        [
            [r["kind"], r["batch"], *(r[k] for k in keys), f"{100 * r['overhead']:+.1f}%"]
            for r in rows
        ],
    )
    print(f"\n(JSON: {path})")


if __name__ == "__main__":
    main()
