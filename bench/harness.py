"""What every benchmark needs: a Tandem server of its own, timed streaming requests,
percentiles, and a table plus JSON at the end."""

from __future__ import annotations

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
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from common.process import dies_with_this_process

MODEL = "smollm2-135m-instruct"
RESULTS = Path(__file__).parent / "results"


@dataclass
class Timing:
    """One streamed request: seconds from send to first token, between tokens, to end."""

    ttft_s: float
    itls_s: list[float] = field(default_factory=list)
    e2e_s: float = 0.0
    output_tokens: int = 0


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, ``q`` in [0, 100]."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


async def stream(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], route: str = "/v1/completions"
) -> Timing:
    """POST a streaming completion (or chat completion, by ``route``) and time every SSE
    chunk that carries text."""
    start = time.perf_counter()
    stamps: list[float] = []
    tokens = 0
    async with client.stream(
        "POST", f"{url}{route}", json={"model": MODEL, **body, "stream": True}
    ) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if any(_carries_output(c) for c in chunk.get("choices", [])):
                stamps.append(time.perf_counter())
            if chunk.get("usage"):  # chat chunks carry "usage": null until the last
                tokens = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    itls = [b - a for a, b in itertools.pairwise(stamps)]
    return Timing(stamps[0] - start, itls, end - start, tokens)


def _carries_output(choice: dict[str, Any]) -> bool:
    """Whether a streamed choice holds generated output: completion text, or a chat delta
    with content, reasoning or a tool call's fragment (not the opening role chunk)."""
    if choice.get("text") or choice.get("finish_reason"):
        return True
    delta = choice.get("delta") or {}
    return any(delta.get(k) for k in ("content", "reasoning_content", "tool_calls"))


def median_ms_interleaved(kinds: Mapping[str, Callable[[], None]], passes: int) -> dict[str, float]:
    """Median ms of each kind's call over ``passes``, the kinds alternating pass by pass
    (the host drifts), after one warm-up call each."""
    runs: dict[str, list[float]] = {name: [] for name in kinds}
    for fn in kinds.values():
        fn()  # warm-up
    for _ in range(passes):
        for name, fn in kinds.items():
            start = time.perf_counter()
            fn()
            runs[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(ms) for name, ms in runs.items()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tandem_bench_flags(dtype: str, max_concurrency: int) -> tuple[str, ...]:
    """The `tandem serve` flags every serving benchmark runs Tandem with: the dtype
    compared, and room for every client at once (at least vLLM's default 64 sequences)."""
    return ("--dtype", dtype, "--max-num-seqs", str(max(64, max_concurrency)))


@contextmanager
def tandem_server(*flags: str) -> Iterator[str]:
    """``tandem serve`` with these flags on a free port; yields its URL."""
    with tandem_process(*flags) as (url, _):
        yield url


@contextmanager
def tandem_process(
    *flags: str, cwd: Path | None = None, command: str = "serve"
) -> Iterator[tuple[str, int]]:
    """``tandem serve`` with these flags on a free port; yields its URL and the
    launcher's pid (the engine, worker and API server are its children). ``cwd``: the
    checkout whose code it runs (default: this one)."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "common.cli",
        command,  # or "fleet": the port is then its router's
        "--port",
        str(port),
        "--log-level",
        "warning",
        *flags,
    ]
    # The launcher dies with the benchmark if it is killed: no server left running.
    proc = subprocess.Popen(cmd, start_new_session=True, env=dies_with_this_process(), cwd=cwd)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, f"tandem {command}", 300)
        yield url, proc.pid
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def wait_healthy(url: str, proc: subprocess.Popen[bytes], name: str, timeout_s: float) -> None:
    """Until ``GET url/health`` answers 200; raises if ``proc`` exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} did not become healthy within {timeout_s:.0f} s")
        time.sleep(0.3)


def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(
                (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu
            )
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version()}


_HOST_RATES = """
import json, torch
from bench.floor import bandwidth_gb_s, matmul_tflops
print(json.dumps({
    "read_gb_s": round(bandwidth_gb_s(256, 5)["read_gb_s"], 1),
    "bf16_matmul_tflops": round(matmul_tflops(torch.bfloat16, 1024, 20), 3),
}))
"""


def host_rates() -> dict[str, float]:
    """This host's memory read bandwidth and bfloat16 matmul rate now (~2 s, in a child
    process: the benchmark's own process stays free of torch). Taken before and after a
    run: a neighbour on the host that halves the bandwidth halves the 1-client figures, and
    figures from runs under different rates do not compare."""
    out = subprocess.run(
        [sys.executable, "-c", _HOST_RATES],
        check=True,
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
    ).stdout
    rates: dict[str, float] = json.loads(out.strip().splitlines()[-1])
    return rates


def host_line(before: Mapping[str, float], after: Mapping[str, float]) -> str:
    return (
        f"host: memory read {before['read_gb_s']:.1f} -> {after['read_gb_s']:.1f} GB/s, "
        f"bf16 matmul {before['bf16_matmul_tflops']:.2f} -> "
        f"{after['bf16_matmul_tflops']:.2f} TFLOP/s (before -> after this run)"
    )


def write_results(name: str, payload: dict[str, Any]) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **payload}, indent=2))
    return path


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    cells = [[str(h) for h in headers]] + [
        [f"{c:.3f}" if isinstance(c, float) else str(c) for c in r] for r in rows
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for i, row in enumerate(cells):
        print(
            "  ".join(
                c.rjust(w) if j else c.ljust(w)
                for j, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )
        if i == 0:
            print("  ".join("-" * w for w in widths))
