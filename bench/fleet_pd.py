"""Prefill and decode instances apart (1P+2D) against three whole replicas behind
vLLM's router: do decode streams stay smooth while long prompts arrive?

The ``long-prompt-interference`` workload (a quarter 2,000-token prompts, the rest
short prompts decoding 256 tokens), Poisson arrivals, measured one setup after the
other in one run: ``tandem fleet --prefill 1 --decode 2`` (the router's PD mode; every
prompt prefilled on the prefill instance, its KV pulled by a decode instance) and
``tandem fleet --replicas 3`` (round robin). Per setup: the decode streams' inter-token
latency p50/p99 and TTFT p50, the long prompts' TTFT p50, and the pulls' bytes and time.

    .venv/bin/python -m bench.fleet_pd [--requests 24] [--rate 0.5]

Every instance runs one worker thread: both setups run three instances on this host.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import time
from collections.abc import Iterator
from typing import Any

import httpx

from bench.harness import (
    Timing,
    free_port,
    host_line,
    host_rates,
    machine,
    percentile,
    print_table,
    stream,
    tandem_process,
    write_results,
)
from bench.workloads import BenchRequest, make_requests


@contextlib.contextmanager
def fleet(shape: list[str], blocks: int) -> Iterator[tuple[str, list[str]]]:
    """``tandem fleet`` of this shape (the router's URL, the instances' URLs)."""
    base, events, side = free_port(), free_port(), free_port()
    flags = [*shape, "--policy", "round_robin", "--instance-base-port", str(base)]
    flags += ["--kv-events-base-port", str(events), "--kv-side-channel-base-port", str(side)]
    flags += ["--worker-threads", "1", "--num-kv-blocks", str(blocks)]
    with tandem_process(*flags, command="fleet") as (url, _):
        yield url, [f"http://127.0.0.1:{base + i}" for i in range(3)]


def transfer_figures(instances: list[str]) -> tuple[float, float, float]:
    """KV pulls landed, their bytes and seconds, summed over the instances' metrics."""
    done = num_bytes = seconds = 0.0
    for url in instances:
        for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
            value = line.rsplit(" ", 1)[-1]
            if line.startswith("tandem:kv_transfers_total{") and 'outcome="done"' in line:
                done += float(value)
            elif line.startswith("tandem:kv_transfer_bytes_total{"):
                num_bytes += float(value)
            elif line.startswith("tandem:kv_transfer_duration_seconds_sum{"):
                seconds += float(value)
    return done, num_bytes, seconds


async def run_workload(
    url: str, requests: list[BenchRequest], gaps: list[float]
) -> list[tuple[str, Timing]]:
    async with httpx.AsyncClient(timeout=900) as client:

        async def one(request: BenchRequest, delay: float) -> tuple[str, Timing]:
            await asyncio.sleep(delay)
            body = {
                "prompt": request.prompt_ids,
                "max_tokens": request.max_tokens,
                "ignore_eos": True,
                "temperature": 0,
            }
            return request.kind, await stream(client, url, body)

        starts = [sum(gaps[: i + 1]) for i in range(len(gaps))]
        return list(
            await asyncio.gather(*(one(r, s) for r, s in zip(requests, starts, strict=True)))
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--rate", type=float, default=0.5, help="requests per second")
    parser.add_argument("--blocks", type=int, default=600, help="KV blocks per instance")
    args = parser.parse_args()
    rng = random.Random(0)
    requests = make_requests("long-prompt-interference", args.requests, seed=0)
    gaps = [rng.expovariate(args.rate) for _ in range(args.requests)]
    setups = {
        "1 prefill + 2 decode (PD)": ["--prefill", "1", "--decode", "2"],
        "3 replicas": ["--replicas", "3"],
    }
    before = host_rates()
    results: dict[str, Any] = {}
    for name, shape in setups.items():
        with fleet(shape, args.blocks) as (url, instances):
            began = time.perf_counter()
            timings = asyncio.run(run_workload(url, requests, gaps))
            wall = time.perf_counter() - began
            time.sleep(0.5)  # the last heartbeat's counters
            pulls, num_bytes, seconds = transfer_figures(instances)
        decode = [t for kind, t in timings if kind == "decode"]
        long = [t for kind, t in timings if kind == "long"]
        itls = [x for t in decode for x in t.itls_s]
        results[name] = {
            "itl_p50_s": percentile(itls, 50),
            "itl_p99_s": percentile(itls, 99),
            "decode_ttft_p50_s": percentile([t.ttft_s for t in decode], 50),
            "long_ttft_p50_s": percentile([t.ttft_s for t in long], 50),
            "pulls": pulls,
            "pull_bytes": num_bytes,
            "pull_gb_per_s": num_bytes / seconds / 1e9 if seconds else 0.0,
            "wall_s": wall,
        }
        print(f"{name}: ITL p99 {results[name]['itl_p99_s'] * 1e3:.0f} ms", flush=True)
    after = host_rates()
    pd, replicas = (results[n] for n in setups)
    ratio = replicas["itl_p99_s"] / pd["itl_p99_s"]
    path = write_results(
        "fleet-pd",
        {"args": vars(args), "results": results, "itl_p99_ratio": ratio, "host": [before, after]},
    )
    print(
        f"\n{args.requests} requests of long-prompt-interference (a quarter 2,000-token "
        f"prompts), Poisson {args.rate}/s, {machine()['cpu']} ({machine()['cores']} cores)\n"
    )
    rows = [
        [
            name,
            r["itl_p50_s"] * 1e3,
            r["itl_p99_s"] * 1e3,
            r["decode_ttft_p50_s"],
            r["long_ttft_p50_s"],
            int(r["pulls"]),
            r["pull_gb_per_s"],
        ]
        for name, r in results.items()
    ]
    headers = ["setup", "decode ITL p50 ms", "ITL p99 ms", "decode TTFT p50 s"]
    headers += ["long TTFT p50 s", "KV pulls", "pull GB/s"]
    print_table(headers, rows)
    print(f"\nITL p99, 3 replicas / 1P+2D: {ratio:.2f}")
    print(host_line(before, after))
    print(f"JSON: {path}")


if __name__ == "__main__":
    main()
