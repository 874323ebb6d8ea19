"""``python -m bench.offline``: engine against engine, no HTTP. Tandem's offline API
(``LLM.generate``) and OpenVINO GenAI's ``ContinuousBatchingPipeline`` take the same
seeded prompts as token ids, each generating exactly ``max_tokens`` greedily, at each
concurrency: ``c`` prompts submitted at once, wave after wave (``c = 1``: one at a
time). Systems alternate run by run (this host's speed drifts). ``--busy-cores N`` keeps
N processes spinning beside every system for the whole run (a host shared with other
work). A table on stdout, JSON in bench/results/offline.json (offline-busyN.json, or
``--name``).

Systems (each skipped with a printed reason when unavailable):
  tandem    LLM(model, dtype=...) in this process (its engine and worker are children)
            without its prefix cache (each point reruns the same prompts; OpenVINO's
            is off by default too)
  tandem-sync
            the same with --no-async-scheduling: the worker waits for the engine between
            steps
  tandem-fixed-threads
            the same with --no-adaptive-worker-threads: the worker keeps every core's
            thread even while another process holds one (compare with --busy-cores)
  openvino  OpenVINO GenAI on SmolLM2 exported to an IR (make bench-peers); computes and
            keeps its KV cache in bf16 (--dtype bfloat16) or f32
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any, Protocol

from api_server.offline import LLM
from bench.harness import MODEL, print_table, write_results
from bench.peers import openvino_peer
from bench.rss import PeakRss
from bench.workloads import WORKLOADS, make_requests
from common.config import SchedulerConfig
from common.messages import SamplingParams

MIB = 1 << 20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.offline", description=__doc__.split("\n")[0])
    p.add_argument("--workload", default="chat", choices=WORKLOADS)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    p.add_argument("--repetitions", type=int, default=2)
    p.add_argument("--systems", default="tandem,openvino", help="comma-separated (default: all)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", default=None, help="results name (default: offline[-busyN])")
    p.add_argument(
        "--busy-cores",
        type=int,
        default=0,
        help="processes kept spinning beside the systems for the whole run (default: 0)",
    )
    return p.parse_args(argv)


def run_tandem(
    prompts: list[list[int]],
    max_tokens: int,
    concurrency: list[int],
    dtype: str,
    adaptive_threads: bool = True,
    async_scheduling: bool = SchedulerConfig.async_scheduling,
) -> tuple[list[dict[str, Any]], int]:
    """Every concurrency point on one ``LLM``; and the peak RSS of its engine and worker."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    # No prefix cache on either engine: every point reruns the same prompts.
    options: dict[str, Any] = {
        "dtype": dtype,
        "enable_prefix_caching": False,
        "adaptive_worker_threads": adaptive_threads,
        "async_scheduling": async_scheduling,
        "log_level": "warning",
    }
    with LLM(MODEL, **options) as llm, PeakRss(llm.engine_pid) as peak:
        llm.generate([prompts[0]], SamplingParams(max_tokens=8, temperature=0.0))  # warm-up
        points = []
        for c in concurrency:
            outputs: list[list[int]] = []
            start = time.perf_counter()
            for i in range(0, len(prompts), c):
                outputs += [
                    r.outputs[0].token_ids for r in llm.generate(prompts[i : i + c], params)
                ]
            wall_s = time.perf_counter() - start
            tokens = sum(map(len, outputs))
            points.append(
                {
                    "concurrency": c,
                    "wall_s": wall_s,
                    "output_tokens": tokens,
                    "output_tok_s": tokens / wall_s,
                    "itl_s": [],  # generate returns whole completions: no token times
                    "outputs": outputs,
                }
            )
    return points, peak.bytes


class Engine(Protocol):
    """One system of the benchmark: why it cannot run here (None: it can), and a run of
    every concurrency point with its peak RSS."""

    name: str

    def missing(self) -> str | None: ...

    def run(
        self, prompts: list[list[int]], max_tokens: int, args: argparse.Namespace
    ) -> dict[str, Any]: ...


class TandemEngine:
    def __init__(
        self,
        name: str,
        adaptive_threads: bool,
        async_scheduling: bool = SchedulerConfig.async_scheduling,
    ) -> None:
        self.name = name
        self.adaptive_threads = adaptive_threads
        self.async_scheduling = async_scheduling

    def missing(self) -> str | None:
        return None

    def run(
        self, prompts: list[list[int]], max_tokens: int, args: argparse.Namespace
    ) -> dict[str, Any]:
        points, rss = run_tandem(
            prompts,
            max_tokens,
            args.concurrency,
            args.dtype,
            self.adaptive_threads,
            self.async_scheduling,
        )
        return {"points": points, "peak_rss_bytes": rss}


class OpenVinoEngine:
    name = "openvino"

    def missing(self) -> str | None:
        if openvino_peer.python() is None or openvino_peer.model_dir() is None:
            return "not installed (make bench-peers)"
        return None

    def run(
        self, prompts: list[list[int]], max_tokens: int, args: argparse.Namespace
    ) -> dict[str, Any]:
        precision = "bf16" if args.dtype == "bfloat16" else "f32"
        ov = openvino_peer.run(prompts, max_tokens, args.concurrency, precision, os.cpu_count())
        return {"version": ov.version, "points": ov.points, "peak_rss_bytes": ov.peak_rss_bytes}


ENGINES: dict[str, Engine] = {
    e.name: e
    for e in (
        TandemEngine("tandem", adaptive_threads=True),
        TandemEngine("tandem-sync", adaptive_threads=True, async_scheduling=False),
        TandemEngine("tandem-fixed-threads", adaptive_threads=False),
        OpenVinoEngine(),
    )
}


@contextlib.contextmanager
def busy_cores(count: int) -> Iterator[None]:
    """``count`` processes spinning until the block ends."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for p in spinners:
            p.kill()
            p.wait()


def _available(names: list[str]) -> list[Engine]:
    usable: list[Engine] = []
    for name in names:
        engine = ENGINES.get(name)
        if engine is None:
            raise SystemExit(f"unknown system {name!r}; one of {', '.join(ENGINES)}")
        reason = engine.missing()
        if reason is not None:
            print(f"skipping {name}: {reason}")
            continue
        usable.append(engine)
    return usable


def _rows(runs: list[dict[str, Any]], num_prompts: int) -> list[list[object]]:
    """One table row per run and point; completions compared with Tandem's of the same
    repetition and concurrency."""
    reference = {r["repetition"]: r for r in runs if r["system"] == "tandem"}
    rows: list[list[object]] = []
    for r in runs:
        for point in r["points"]:
            c, itls = point["concurrency"], point["itl_s"]
            agree = "-"
            if (same := reference.get(r["repetition"])) is not None:
                theirs = next(p for p in same["points"] if p["concurrency"] == c)["outputs"]
                equal = sum(a == b for a, b in zip(point["outputs"], theirs, strict=True))
                agree = f"{equal}/{num_prompts}"
            per_stream_ms = 1e3 * point["wall_s"] / point["output_tokens"] * min(c, num_prompts)
            rows.append(
                [
                    r["system"],
                    r["repetition"],
                    c,
                    round(point["output_tok_s"], 1),
                    round(per_stream_ms, 2),
                    round(1e3 * statistics.median(itls), 2) if itls else "-",
                    round(r["peak_rss_bytes"] / MIB),
                    agree,
                ]
            )
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    requests = make_requests(args.workload, args.num_requests, args.seed)
    prompts = [r.prompt_ids for r in requests]
    max_tokens = requests[0].max_tokens
    engines = _available(args.systems.split(","))
    runs: list[dict[str, Any]] = []
    with busy_cores(args.busy_cores):
        for rep in range(args.repetitions):
            for engine in engines:
                print(f"run {rep + 1}: {engine.name}", flush=True)
                result = engine.run(prompts, max_tokens, args)
                runs.append({"system": engine.name, "repetition": rep + 1, **result})
    print_table(
        [
            "system",
            "run",
            "c",
            "tok/s",
            "ms/token/stream",
            "ITL p50 ms",
            "peak RSS MiB",
            "same tokens as tandem",
        ],
        _rows(runs, len(prompts)),
    )
    path = write_results(
        args.name or (f"offline-busy{args.busy_cores}" if args.busy_cores else "offline"),
        {
            "workload": args.workload,
            "busy_cores": args.busy_cores,
            "num_requests": args.num_requests,
            "max_tokens": max_tokens,
            "dtype": args.dtype,
            "runs": [
                {
                    **r,
                    "points": [{k: v for k, v in p.items() if k != "outputs"} for p in r["points"]],
                }
                for r in runs
            ],
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
