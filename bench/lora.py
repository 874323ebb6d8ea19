"""Mixed-adapter serving: output tok/s at 32 clients with 1, 4 and 8 LoRA adapters in
use (requests spread round-robin over them) against the base model alone, in one run on
one host, SmolLM2 with random rank-16 PEFT adapters on all seven projections.

    .venv/bin/python -m bench.lora [--clients 32] [--requests 96] [--dtype auto]

The issue's target: 8 adapters >= 0.8x the base model's tok/s. vLLM for CPU is not run:
say so in the notes where its CPU build's LoRA support is checked (docs/lora.md).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench.harness import (
    host_line,
    host_rates,
    print_table,
    tandem_bench_flags,
    tandem_server,
    write_results,
)
from bench.loadgen import send_one
from bench.stats import RequestResult, Slo, summarize
from bench.workloads import BenchRequest, make_requests
from common.model_files import resolve_model_dir

MODEL = "smollm2-135m-instruct"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTER_COUNTS = (1, 4, 8)


def make_adapters(base: Path, root: Path, count: int, rank: int = 16) -> list[Path]:
    """``count`` random PEFT adapters of ``base`` (made once, then reused)."""
    # Imported here: the load generator's own process stays free of torch's threads.
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = []
    for i in range(count):
        path = root / f"adapter-{i}-r{rank}"
        if not (path / "adapter_model.safetensors").is_file():
            torch.manual_seed(i)
            model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
            lora = LoraConfig(
                r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False
            )
            get_peft_model(model, lora).save_pretrained(str(path))
        paths.append(path)
    return paths


async def run_mixed(
    url: str, models: list[str], requests: list[BenchRequest], clients: int
) -> tuple[list[RequestResult], float]:
    """Closed loop: ``clients`` clients, request i on ``models[i % len(models)]``."""
    results: list[RequestResult] = []
    queue = list(enumerate(requests))[::-1]
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=600.0)
    ) as client:
        t0 = time.perf_counter()

        async def worker() -> None:
            while queue:
                i, req = queue.pop()
                results.append(await send_one(client, url, models[i % len(models)], req, t0))

        await asyncio.gather(*(worker() for _ in range(clients)))
        return results, time.perf_counter() - t0


def measure(
    flags: list[str], models: list[str], requests: list[BenchRequest], clients: int
) -> dict[str, Any]:
    with tandem_server(*flags) as url:
        asyncio.run(run_mixed(url, models, requests[:clients], clients))  # warm-up
        results, wall = asyncio.run(run_mixed(url, models, requests, clients))
    return summarize(results, wall, Slo())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache/tandem/lora-bench")
    args = parser.parse_args()
    base = resolve_model_dir(MODEL)
    adapters = make_adapters(base, args.cache, max(ADAPTER_COUNTS))
    requests = make_requests("chat", args.requests)
    common = [*tandem_bench_flags(args.dtype, args.clients), "--served-model-name", MODEL]
    before = host_rates()
    points: dict[str, dict[str, Any]] = {"base": measure(common, [MODEL], requests, args.clients)}
    for count in ADAPTER_COUNTS:
        names = [f"a{i}" for i in range(count)]
        flags = [*common, "--enable-lora", "--max-loras", str(count), "--lora-modules"]
        flags += [f"{n}={p}" for n, p in zip(names, adapters, strict=False)]
        points[f"{count} adapters"] = measure(flags, names, requests, args.clients)
    base_tok_s = points["base"]["output_tok_s"]
    rows = [
        [
            name,
            p["output_tok_s"],
            p["output_tok_s"] / base_tok_s,
            (p["itl_s"]["p50"] or 0) * 1e3,
            (p["ttft_s"]["p50"] or 0) * 1e3,
            p["errors"],
        ]
        for name, p in points.items()
    ]
    path = write_results(
        "lora",
        {"clients": args.clients, "dtype": args.dtype, "points": points},
    )
    print(f"\n{args.clients} clients, chat workload, {args.requests} requests, dtype {args.dtype}")
    print(host_line(before, host_rates()))
    print_table(["served", "tok/s", "x base", "ITL p50 ms", "TTFT p50 ms", "errors"], rows)
    print(f"(JSON: {path})")


if __name__ == "__main__":
    main()
