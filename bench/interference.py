"""Chunked prefill keeps streams smooth: inter-token latency of running streams while
2,000-token prompts arrive, with chunked prefill vs without, in one run.

    .venv/bin/python -m bench.interference [--streams 4] [--long-prompts 3] [--chunk 256]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics

import httpx

from bench.harness import Timing, percentile, print_table, stream, tandem_server, write_results
from bench.prefix_cache import shared_prefix


async def measure(
    url: str, streams: int, long_prompts: int, gap_s: float
) -> tuple[list[Timing], list[Timing]]:
    async with httpx.AsyncClient(timeout=600) as client:
        await stream(client, url, {"prompt": "Warm up.", "max_tokens": 2})

        async def decode_stream(i: int) -> Timing:
            body = {
                "prompt": f"Story {i}: once upon a time",
                "max_tokens": 160,
                "ignore_eos": True,
                "temperature": 0,
            }
            return await stream(client, url, body)

        async def long_prompt(i: int) -> Timing:
            await asyncio.sleep(1.0 + i * gap_s)  # the streams are decoding by then
            # Distinct words per prompt so nothing is served from the prefix cache.
            body = {
                "prompt": f"Variant {i}. " + shared_prefix(1810)[7 * i :],
                "max_tokens": 1,
                "temperature": 0,
            }
            return await stream(client, url, body)

        decodes = asyncio.gather(*(decode_stream(i) for i in range(streams)))
        longs = asyncio.gather(*(long_prompt(i) for i in range(long_prompts)))
        return list(await decodes), list(await longs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--long-prompts", type=int, default=3)
    parser.add_argument("--gap-s", type=float, default=4.0, help="seconds between long prompts")
    parser.add_argument(
        "--chunk", type=int, default=256, help="step token budget with chunked prefill"
    )
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    modes = {
        f"chunked prefill ({args.chunk}/step)": ["--max-num-batched-tokens", str(args.chunk)],
        "no chunked prefill": ["--no-enable-chunked-prefill", "--no-enable-prefix-caching"],
    }
    modes[next(iter(modes))].append("--no-enable-prefix-caching")
    rows, payload = [], {}
    for mode, flags in modes.items():
        with tandem_server("--dtype", args.dtype, *flags) as url:
            decodes, longs = asyncio.run(measure(url, args.streams, args.long_prompts, args.gap_s))
        itls = [x for t in decodes for x in t.itls_s]
        ttfts = [t.ttft_s for t in longs]
        rows.append(
            [
                mode,
                1000 * percentile(itls, 50),
                1000 * percentile(itls, 99),
                1000 * max(itls),
                statistics.median(ttfts),
            ]
        )
        payload[mode] = {"itl_s": itls, "long_prompt_ttft_s": ttfts}
    path = write_results("interference", {"args": vars(args), "results": payload})
    print(
        f"\n{args.streams} decode streams while {args.long_prompts} prompts of ~2,000 tokens arrive "
        f"(dtype {args.dtype})\n"
    )
    print_table(["mode", "ITL p50 ms", "ITL p99 ms", "ITL max ms", "long-prompt TTFT p50 s"], rows)
    print(f"\nJSON: {path}")


if __name__ == "__main__":
    main()
