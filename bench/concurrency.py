"""Continuous batching pays: 16 streaming requests sent at once vs one after another.

Starts its own ``tandem serve`` (or uses ``--url``), sends the same 16 requests
sequentially and then concurrently, and prints aggregate output tokens/s, TTFT and
inter-token latency for both. Writes ``bench/results/concurrency.json``.

    .venv/bin/python -m bench.concurrency [--requests 16] [--max-tokens 128] [--dtype auto]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from contextlib import nullcontext
from typing import Any

import httpx

from bench.harness import Timing, percentile, print_table, stream, tandem_server, write_results

TOPICS = [
    "the ocean",
    "a robot",
    "the moon",
    "a library",
    "volcanoes",
    "trains",
    "a garden",
    "winter",
    "chess",
    "bread",
    "a lighthouse",
    "bees",
    "the desert",
    "music",
    "a city at night",
    "rivers",
]


def summarize(mode: str, wall_s: float, timings: list[Timing]) -> dict[str, Any]:
    tokens = sum(t.output_tokens for t in timings)
    itls = [x for t in timings for x in t.itls_s]
    return {
        "mode": mode,
        "wall_s": wall_s,
        "output_tokens": tokens,
        "tok_per_s": tokens / wall_s,
        "ttft_p50_s": percentile([t.ttft_s for t in timings], 50),
        "itl_p50_ms": 1000 * percentile(itls, 50),
        "itl_p95_ms": 1000 * percentile(itls, 95),
    }


async def measure(url: str, n: int, max_tokens: int) -> list[dict[str, Any]]:
    bodies = [
        {
            "prompt": f"Write a short story about {TOPICS[i % len(TOPICS)]}.",
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        for i in range(n)
    ]
    async with httpx.AsyncClient(timeout=600) as client:
        await stream(client, url, {"prompt": "Warm up.", "max_tokens": 8})
        start = time.perf_counter()
        sequential = [await stream(client, url, b) for b in bodies]
        seq = summarize("sequential", time.perf_counter() - start, sequential)
        start = time.perf_counter()
        concurrent = await asyncio.gather(*(stream(client, url, b) for b in bodies))
        conc = summarize(f"concurrent x{n}", time.perf_counter() - start, list(concurrent))
    return [seq, conc]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", help="an already running server (default: start one)")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    with nullcontext(args.url) if args.url else tandem_server("--dtype", args.dtype) as url:
        runs = asyncio.run(measure(url, args.requests, args.max_tokens))
    speedup = runs[1]["tok_per_s"] / runs[0]["tok_per_s"]
    path = write_results("concurrency", {"args": vars(args), "runs": runs, "speedup": speedup})
    print(
        f"\n{args.requests} streaming requests of {args.max_tokens} tokens (dtype {args.dtype})\n"
    )
    keys = ["wall_s", "output_tokens", "tok_per_s", "ttft_p50_s", "itl_p50_ms", "itl_p95_ms"]
    print_table(["mode", *keys], [[r["mode"], *(r[k] for k in keys)] for r in runs])
    print(f"\naggregate throughput, concurrent / sequential: {speedup:.1f}x  (JSON: {path})")


if __name__ == "__main__":
    main()
