"""A fleet behind vLLM's router: does routing by KV events keep the prefix cache hot?

A multi-tenant workload: each tenant has its own long system prompt (~1,500 tokens), and
requests (a tenant's prompt + a short question) arrive by a Poisson process. Measured,
one after the other in one run: three replicas behind ``vllm-router`` with ``kv_aware``
(fed by the replicas' KV events), the same with ``round_robin``, and one instance holding
the three replicas' KV blocks together. Per setup: the prefix-cache hit rate (prompt
tokens found cached / looked up, summed over the instances) and TTFT p50/p95.

    .venv/bin/python -m bench.fleet [--tenants 8] [--requests 96] [--rate 0.5]

Each instance runs one worker thread and the KV blocks given by ``--blocks`` (per
replica), so a replica holds some tenants' prompts but not all of them.
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

WORDS = [
    "amber",
    "basil",
    "cedar",
    "delta",
    "ember",
    "fjord",
    "garnet",
    "harbor",
    "indigo",
    "juniper",
    "kestrel",
    "lagoon",
]


def system_prompt(tenant: int, num_words: int) -> str:
    """A tenant's own ~1.1 tokens-per-word text, unlike every other tenant's."""
    rng = random.Random(tenant)
    words = " ".join(rng.choice(WORDS) for _ in range(num_words))
    return f"Tenant {tenant} instructions: {words}\n"


@contextlib.contextmanager
def fleet(replicas: int, policy: str, blocks: int) -> Iterator[tuple[str, list[str]]]:
    """``tandem fleet`` (the router's URL, the instances' URLs)."""
    base, events = free_port(), free_port()
    flags = ["--replicas", str(replicas), "--policy", policy, "--instance-base-port", str(base)]
    flags += ["--kv-events-base-port", str(events), "--worker-threads", "1"]
    with tandem_process(*flags, "--num-kv-blocks", str(blocks), command="fleet") as (url, _):
        yield url, [f"http://127.0.0.1:{base + i}" for i in range(replicas)]


@contextlib.contextmanager
def single(blocks: int) -> Iterator[tuple[str, list[str]]]:
    with tandem_process("--worker-threads", "1", "--num-kv-blocks", str(blocks)) as (url, _):
        yield url, [url]


def cache_counts(instances: list[str]) -> tuple[int, int]:
    """Prompt tokens looked up and found, summed over the instances."""
    queries = hits = 0
    for url in instances:
        stats = httpx.get(f"{url}/stats", timeout=10).json()
        queries += stats["prefix_cache_queries"]
        hits += stats["prefix_cache_hits"]
    return queries, hits


async def run_workload(url: str, prompts: list[str], gaps: list[float]) -> list[float]:
    async with httpx.AsyncClient(timeout=600) as client:

        async def one(i: int, delay: float) -> float:
            await asyncio.sleep(delay)
            body = {"prompt": prompts[i], "max_tokens": 16, "temperature": 0}
            return (await stream(client, url, body)).ttft_s

        starts = [sum(gaps[: i + 1]) for i in range(len(gaps))]
        return list(await asyncio.gather(*(one(i, s) for i, s in enumerate(starts))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--rate", type=float, default=0.5, help="requests per second")
    parser.add_argument("--prompt-words", type=int, default=1360, help="~1,500 tokens")
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--blocks", type=int, default=400, help="KV blocks per replica")
    args = parser.parse_args()
    rng = random.Random(0)
    systems = [system_prompt(t, args.prompt_words) for t in range(args.tenants)]
    tenants = [rng.randrange(args.tenants) for _ in range(args.requests)]
    prompts = [systems[t] + f"Question {i}: what comes next?" for i, t in enumerate(tenants)]
    gaps = [rng.expovariate(args.rate) for _ in range(args.requests)]
    setups = {
        f"{args.replicas} replicas, kv_aware": lambda: fleet(
            args.replicas, "kv_aware", args.blocks
        ),
        f"{args.replicas} replicas, round_robin": lambda: fleet(
            args.replicas, "round_robin", args.blocks
        ),
        f"1 instance, {args.replicas}x the KV": lambda: single(args.replicas * args.blocks),
    }
    before = host_rates()
    results: dict[str, Any] = {}
    for name, start in setups.items():
        with start() as (url, instances):
            q0, h0 = cache_counts(instances)
            began = time.perf_counter()
            ttfts = asyncio.run(run_workload(url, prompts, gaps))
            wall = time.perf_counter() - began
            time.sleep(0.5)  # the last heartbeat's counters
            q1, h1 = cache_counts(instances)
        results[name] = {
            "ttft_s": ttfts,
            "hit_rate": (h1 - h0) / max(1, q1 - q0),
            "wall_s": wall,
        }
        print(f"{name}: hit rate {results[name]['hit_rate']:.3f}", flush=True)
    after = host_rates()
    rows = [
        [name, r["hit_rate"], percentile(r["ttft_s"], 50), percentile(r["ttft_s"], 95)]
        for name, r in results.items()
    ]
    names = list(results)
    kv, rr, one = (results[n] for n in names)
    ratios = {
        "hit_rate_kv_aware_over_single": kv["hit_rate"] / max(1e-9, one["hit_rate"]),
        "ttft_p50_round_robin_over_kv_aware": percentile(rr["ttft_s"], 50)
        / percentile(kv["ttft_s"], 50),
    }
    path = write_results(
        "fleet",
        {"args": vars(args), "results": results, "ratios": ratios, "host": [before, after]},
    )
    print(
        f"\n{args.requests} requests of {args.tenants} tenants (~1,500-token system prompts), "
        f"Poisson {args.rate}/s, {machine()['cpu']} ({machine()['cores']} cores)\n"
    )
    print_table(["setup", "prefix hit rate", "TTFT p50 s", "TTFT p95 s"], rows)
    print(
        f"\nkv_aware hit rate / one instance's: {ratios['hit_rate_kv_aware_over_single']:.2f} "
        f"(target >= 0.9); TTFT p50 round_robin / kv_aware: "
        f"{ratios['ttft_p50_round_robin_over_kv_aware']:.2f} (target >= 2)"
    )
    print(host_line(before, after))
    print(f"JSON: {path}")


if __name__ == "__main__":
    main()
