"""Continuous batching pays: 16 streaming requests sent at once vs one after another.

Starts its own ``tandem serve`` (or uses ``--url``), sends the same 16 requests
sequentially and then concurrently, and prints aggregate output tokens/s, TTFT and
inter-token latency for both. Writes ``bench/results/concurrency.json``.

    .venv/bin/python bench/concurrency.py [--requests 16] [--max-tokens 128] [--dtype auto]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

MODEL = "smollm2-135m-instruct"
RESULTS = Path(__file__).parent / "results"
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


@dataclass
class RequestResult:
    ttft_s: float
    itls_s: list[float]
    e2e_s: float
    output_tokens: int


@dataclass
class RunResult:
    mode: str
    wall_s: float
    output_tokens: int
    tok_per_s: float
    ttft_p50_s: float
    itl_p50_ms: float
    itl_p95_ms: float


async def one_request(
    client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int
) -> RequestResult:
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    start = time.perf_counter()
    stamps: list[float] = []
    tokens = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            stamps.append(time.perf_counter())
            chunk = json.loads(line[6:])
            if "usage" in chunk:
                tokens = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    return RequestResult(
        stamps[0] - start,
        [b - a for a, b in itertools.pairwise(stamps)],
        end - start,
        tokens,
    )


def summarize(mode: str, wall_s: float, results: list[RequestResult]) -> RunResult:
    tokens = sum(r.output_tokens for r in results)
    itls = sorted(x for r in results for x in r.itls_s)
    return RunResult(
        mode=mode,
        wall_s=wall_s,
        output_tokens=tokens,
        tok_per_s=tokens / wall_s,
        ttft_p50_s=statistics.median(r.ttft_s for r in results),
        itl_p50_ms=1000 * statistics.median(itls),
        itl_p95_ms=1000 * itls[int(0.95 * (len(itls) - 1))],
    )


async def measure(url: str, n: int, max_tokens: int) -> list[RunResult]:
    prompts = [f"Write a short story about {TOPICS[i % len(TOPICS)]}." for i in range(n)]
    async with httpx.AsyncClient(timeout=600) as client:
        await one_request(client, url, "Warm up.", 8)
        start = time.perf_counter()
        sequential = [await one_request(client, url, p, max_tokens) for p in prompts]
        seq = summarize("sequential", time.perf_counter() - start, sequential)
        start = time.perf_counter()
        concurrent = await asyncio.gather(
            *(one_request(client, url, p, max_tokens) for p in prompts)
        )
        conc = summarize(f"concurrent x{n}", time.perf_counter() - start, list(concurrent))
    return [seq, conc]


def start_server(dtype: str) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "common.cli",
            "serve",
            "--port",
            str(port),
            "--dtype",
            dtype,
            "--log-level",
            "warning",
        ],
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"tandem serve exited with {proc.returncode}")
        time.sleep(0.5)
    proc.terminate()
    raise SystemExit("tandem serve did not become healthy")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", help="an already running server (default: start one)")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(args.dtype)
    try:
        runs = asyncio.run(measure(url, args.requests, args.max_tokens))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    speedup = runs[1].tok_per_s / runs[0].tok_per_s
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "concurrency.json"
    out.write_text(
        json.dumps(
            {
                "machine": {
                    "cpu": platform.processor() or platform.machine(),
                    "cores": os.cpu_count(),
                },
                "requests": args.requests,
                "max_tokens": args.max_tokens,
                "dtype": args.dtype,
                "runs": [asdict(r) for r in runs],
                "speedup": speedup,
            },
            indent=2,
        )
    )
    print(
        f"\n{'mode':<16} {'wall s':>8} {'tokens':>7} {'tok/s':>8} {'TTFT p50 s':>11} {'ITL p50 ms':>11} {'ITL p95 ms':>11}"
    )
    for r in runs:
        print(
            f"{r.mode:<16} {r.wall_s:>8.2f} {r.output_tokens:>7} {r.tok_per_s:>8.1f} {r.ttft_p50_s:>11.3f} "
            f"{r.itl_p50_ms:>11.1f} {r.itl_p95_ms:>11.1f}"
        )
    print(f"\naggregate throughput, concurrent / sequential: {speedup:.1f}x  (JSON: {out})")


if __name__ == "__main__":
    main()
