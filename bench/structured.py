"""What structured outputs cost per token: the same streams with and without a JSON
schema, one at a time and 32 at once.

Each stream's inter-token latency is measured client-side; constrained and free runs
alternate (free, constrained, free, constrained) so the host's drift hits both. The
schema (a list of 16 short strings) keeps every constrained output inside the grammar
for ~100 tokens, so the mask is computed on most steps, not just at the end.

    .venv/bin/python -m bench.structured [--batches 1 32] [--repeats 2] [--dtype auto]
"""

from __future__ import annotations

import argparse
import asyncio
import json
from contextlib import nullcontext
from typing import Any

import httpx

from bench.harness import Timing, percentile, print_table, stream, tandem_server, write_results

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


def bodies(n: int, constrained: bool) -> list[dict[str, Any]]:
    out = []
    for i in range(n):
        body: dict[str, Any] = {
            "prompt": f"List sixteen words about topic number {i} as JSON:",
            "max_tokens": MAX_TOKENS,
            "temperature": 1.0,
            "seed": i,
        }
        if constrained:
            body["response_format"] = {"type": "json_schema", "json_schema": {"schema": SCHEMA}}
        else:
            body["ignore_eos"] = True
        out.append(body)
    return out


async def run_batch(url: str, n: int, constrained: bool) -> list[Timing]:
    async with httpx.AsyncClient(timeout=600) as client:
        return list(await asyncio.gather(*(stream(client, url, b) for b in bodies(n, constrained))))


async def measure(url: str, batches: list[int], repeats: int) -> list[dict[str, Any]]:
    await run_batch(url, 1, True)  # warm up the grammar path (tokenizer load)
    rows = []
    for n in batches:
        itls: dict[bool, list[float]] = {False: [], True: []}
        tokens: dict[bool, int] = {False: 0, True: 0}
        for _ in range(repeats):
            for constrained in (False, True):
                timings = await run_batch(url, n, constrained)
                itls[constrained] += [x for t in timings for x in t.itls_s]
                tokens[constrained] += sum(t.output_tokens for t in timings)
        free, held = percentile(itls[False], 50), percentile(itls[True], 50)
        rows.append(
            {
                "batch": n,
                "free_itl_p50_ms": 1000 * free,
                "structured_itl_p50_ms": 1000 * held,
                "free_itl_mean_ms": 1000 * sum(itls[False]) / len(itls[False]),
                "structured_itl_mean_ms": 1000 * sum(itls[True]) / len(itls[True]),
                "structured_tokens_per_stream": tokens[True] / (n * repeats),
                "overhead_p50": held / free - 1,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", help="an already running server (default: start one)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    with nullcontext(args.url) if args.url else tandem_server("--dtype", args.dtype) as url:
        rows = asyncio.run(measure(url, args.batches, args.repeats))
    path = write_results("structured", {"args": vars(args), "schema": SCHEMA, "rows": rows})
    print(f"\nJSON-schema constrained vs free streams (dtype {args.dtype}); schema:")
    print(json.dumps(SCHEMA))
    keys = [
        "free_itl_p50_ms",
        "structured_itl_p50_ms",
        "free_itl_mean_ms",
        "structured_itl_mean_ms",
        "structured_tokens_per_stream",
    ]
    print_table(
        ["batch", *keys, "overhead (p50)"],
        [[r["batch"], *(r[k] for k in keys), f"{100 * r['overhead_p50']:+.1f}%"] for r in rows],
    )
    print(f"\n(JSON: {path})")


if __name__ == "__main__":
    main()
