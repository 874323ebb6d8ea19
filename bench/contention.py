"""``python -m bench.contention``: what another process's CPU costs a decode step.

Served, the worker shares the host's cores with the API server, the engine core and the
clients, which wake once or more a step. This runs the real ``EngineCore`` and
``ModelRunner`` in process (``bench.step_profile``'s inline pool: no sockets), every step
``--batch`` rows, beside a competitor process that burns ``--share`` of one core in
bursts of each ``--bursts-ms`` length (sleeping between them). Each measurement beside it
comes right after one alone, so that the host's drift falls on both, and the pair's
ratio is kept; rounds alternate. Each line gives the step's mean time alone and beside,
the competitor's measured CPU, and the *amplification*: the step's extra time over what
the competitor's CPU would cost if the worker's threads shared the loss evenly (its CPU a
step / the worker's threads). 1 is that even share; 2 is every core the competitor takes
stopping all the worker's threads, as a fork-join region does while one of its threads
has lost its core.

    .venv/bin/python -m bench.contention [--batch 32] [--share 0.075] [--bursts-ms 3 0.3 0.05]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from typing import Any

import psutil
import torch

from bench.harness import print_table, write_results
from bench.step_profile import Setup

# Busy for b seconds, asleep for s, until killed.
_COMPETITOR = """
import sys, time
busy, sleep = float(sys.argv[1]), float(sys.argv[2])
while True:
    end = time.perf_counter() + busy
    while time.perf_counter() < end:
        pass
    time.sleep(sleep)
"""


def mean_step_s(setup: Setup, batch: int, steps: int) -> float:
    """The mean of ``steps`` decode steps of ``batch`` rows, from a fresh engine (every
    measurement starts at the same contexts)."""
    core, _ = setup.decoding_core(batch)
    start = time.perf_counter()
    for _ in range(steps):
        core.step()
    return (time.perf_counter() - start) / steps


def beside_competitor(
    setup: Setup, batch: int, steps: int, burst_s: float, share: float
) -> tuple[float, float]:
    """The mean step beside a competitor busy ``burst_s`` at a time for ``share`` of one
    core, and the competitor's measured CPU seconds a second."""
    sleep_s = burst_s * (1 / share - 1)
    proc = subprocess.Popen([sys.executable, "-c", _COMPETITOR, str(burst_s), str(sleep_s)])
    try:
        time.sleep(0.3)  # started and in its loop
        usage = psutil.Process(proc.pid)
        cpu_before, wall_before = sum(usage.cpu_times()[:2]), time.perf_counter()
        step = mean_step_s(setup, batch, steps)
        cpu = (sum(usage.cpu_times()[:2]) - cpu_before) / (time.perf_counter() - wall_before)
    finally:
        proc.kill()
        proc.wait()
    return step, cpu


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.contention", description=__doc__)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--share", type=float, default=0.075, help="of one core (default: 0.075)")
    p.add_argument("--bursts-ms", type=float, nargs="+", default=[3.0, 0.3, 0.05])
    p.add_argument("--name", default="contention")
    args = p.parse_args(argv)
    if not 0 < args.share < 1:
        p.error("--share must be between 0 and 1")
    threads = torch.get_num_threads()
    setup = Setup(args.model, torch.bfloat16, args.batch, "none", "auto")
    # Per burst length, one (alone, beside, competitor's CPU) triple a round.
    runs: dict[float, list[tuple[float, float, float]]] = {b: [] for b in args.bursts_ms}
    for _ in range(args.rounds):
        for burst_ms in args.bursts_ms:
            alone = mean_step_s(setup, args.batch, args.steps)
            step, cpu = beside_competitor(setup, args.batch, args.steps, burst_ms / 1e3, args.share)
            runs[burst_ms].append((alone, step, cpu))
    rows: list[list[object]] = []
    lines: list[dict[str, Any]] = []
    for burst_ms, triples in runs.items():
        alone = statistics.median(a for a, _, _ in triples)
        step = statistics.median(s for _, s, _ in triples)
        ratio = statistics.median(s / a for a, s, _ in triples)
        cpu = statistics.median(c for _, _, c in triples)
        # The step's extra time over the competitor's CPU a step split evenly.
        amplification = (ratio - 1) * threads / cpu
        rows.append(
            [f"{burst_ms:g} ms", f"{100 * cpu:.1f}%", f"{1e3 * alone:.2f}", f"{1e3 * step:.2f}",
             f"{100 * (ratio - 1):+.1f}%", f"{amplification:.2f}"]
        )  # fmt: skip
        lines.append({"burst_ms": burst_ms, "alone_beside_cpu": triples})
    print(f"\n{args.batch}-row decode steps on {threads} threads, medians of {args.rounds} rounds")
    print_table(
        [
            "competitor bursts",
            "its CPU (one core)",
            "alone ms",
            "beside ms",
            "paired",
            "amplification",
        ],
        rows,
    )
    path = write_results(args.name, {"args": vars(args), "threads": threads, "runs": lines})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
