"""Prefix caching pays: time to first token for requests sharing a 1,000-token prefix,
with prefix caching on vs off, in one run.

    .venv/bin/python -m bench.prefix_cache [--requests 8] [--dtype auto]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics

import httpx

from bench.harness import percentile, print_table, stream, tandem_server, write_results

WORDS = [
    "river",
    "stone",
    "lantern",
    "harbor",
    "meadow",
    "signal",
    "copper",
    "violet",
    "orchard",
    "thunder",
    "quill",
    "ember",
    "glacier",
    "saffron",
    "beacon",
    "marble",
    "willow",
    "canyon",
    "falcon",
    "ribbon",
]


def shared_prefix(num_words: int = 905) -> str:
    # SmolLM2's tokenizer gives about 1.1 tokens per word of this text: ~1,000 tokens.
    return "Notes: " + " ".join(WORDS[(i * 7) % len(WORDS)] for i in range(num_words)) + "\n"


async def measure(url: str, prefix: str, n: int) -> list[float]:
    async with httpx.AsyncClient(timeout=300) as client:
        await stream(
            client, url, {"prompt": prefix + "Warm-up question?", "max_tokens": 1, "temperature": 0}
        )
        ttfts = []
        for i in range(n):
            body = {
                "prompt": prefix + f"Question {i}: what is item {i}?",
                "max_tokens": 4,
                "temperature": 0,
            }
            ttfts.append((await stream(client, url, body)).ttft_s)
        return ttfts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    prefix = shared_prefix()
    results = {}
    for mode, flag in (
        ("prefix caching on", "--enable-prefix-caching"),
        ("prefix caching off", "--no-enable-prefix-caching"),
    ):
        with tandem_server("--dtype", args.dtype, flag) as url:
            ttfts = asyncio.run(measure(url, prefix, args.requests))
            prompt_tokens = httpx.get(f"{url}/stats").json()
        results[mode] = {"ttft_s": ttfts, "stats": prompt_tokens}
    rows = []
    for mode, r in results.items():
        t = r["ttft_s"]
        rows.append(
            [mode, statistics.median(t), percentile(t, 95), r["stats"]["prefix_cache_hit_rate"]]
        )
    speedup = statistics.median(results["prefix caching off"]["ttft_s"]) / statistics.median(
        results["prefix caching on"]["ttft_s"]
    )
    path = write_results(
        "prefix_cache",
        {
            "requests": args.requests,
            "dtype": args.dtype,
            "results": results,
            "ttft_speedup": speedup,
        },
    )
    print(
        f"\n{args.requests} requests sharing a ~1,000-token prefix, one at a time (dtype {args.dtype})\n"
    )
    print_table(["mode", "TTFT p50 s", "TTFT p95 s", "prefix hit rate"], rows)
    print(f"\nTTFT p50, caching off / on: {speedup:.1f}x  (JSON: {path})")


if __name__ == "__main__":
    main()
