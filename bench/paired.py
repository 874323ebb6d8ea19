"""Two Tandem builds served side by side, paired: this checkout against another commit.

The host's speed drifts by 10-20% over minutes, more than most changes are worth, so
comparing two separate `bench.serving` runs says little. Here both servers are up at
once, one checkout each (the other commit cloned into a temporary directory, its native
kernels built there on first start), and they take the same requests in alternating
rounds (A B, B A, A B, ...): each round pair sees the same drift, and the ratio per pair
is what is reported, beside the medians. An idle Tandem server takes ~1% of a core
(heartbeats; measured over 5 s after a load), so the one not measured hardly slows the
other.

    python -m bench.paired --base 3214cdd --concurrency 32 --rounds 3

Prints a table per round and the paired ratios; writes ``bench/results/NAME.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

from bench.harness import (
    MODEL,
    host_line,
    host_rates,
    print_table,
    tandem_bench_flags,
    tandem_process,
    write_results,
)
from bench.loadgen import run_load
from bench.stats import Slo, summarize
from bench.workloads import WORKLOADS, make_requests

REPO = Path(__file__).resolve().parents[1]
SIDES = ("base", "head")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.paired", description=__doc__.split("\n")[0])
    p.add_argument("--base", required=True, help="the commit to compare this checkout with")
    p.add_argument("--workload", default="chat", choices=WORKLOADS)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--num-requests", type=int, default=64, help="requests a round")
    p.add_argument("--rounds", type=int, default=3, help="rounds per side")
    p.add_argument("--base-flags", default="", help="extra `tandem serve` flags for the base")
    p.add_argument("--head-flags", default="", help="extra `tandem serve` flags for this checkout")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--name", default=None, help="results name (default: paired-WORKLOAD-cN)")
    return p.parse_args(argv)


def round_order(index: int) -> tuple[str, str]:
    """Which side goes first in round ``index``: alternating, so neither always follows
    the other (a server warmed by the previous round's load, or slowed by its tail)."""
    return SIDES if index % 2 == 0 else (SIDES[1], SIDES[0])


def paired_summary(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Per side the median of its rounds' tok/s, ITL p50 and ITL p99 (a stall every
    stream sees once, as a long pause of one process, shows in the p99 alone); per round
    the ratio head / base of tok/s (above 1: this checkout is faster) and of the ITL
    percentiles (below 1)."""
    tok_s = [r["head"]["output_tok_s"] / r["base"]["output_tok_s"] for r in rounds]

    def itl_ratios(q: str) -> list[float]:
        return [r["head"]["itl_s"][q] / r["base"]["itl_s"][q] for r in rounds]

    def itl_medians(q: str) -> dict[str, float]:
        return {s: statistics.median(r[s]["itl_s"][q] for r in rounds) for s in SIDES}

    return {
        "median_tok_s": {s: statistics.median(r[s]["output_tok_s"] for r in rounds) for s in SIDES},
        "median_itl_p50_s": itl_medians("p50"),
        "median_itl_p99_s": itl_medians("p99"),
        "tok_s_ratios": tok_s,
        "itl_p50_ratios": itl_ratios("p50"),
        "itl_p99_ratios": itl_ratios("p99"),
        "head_faster_rounds": sum(x > 1 for x in tok_s),
    }


def checkout(rev: str, into: Path) -> Path:
    """A clone of this repository at ``rev`` (committed work only)."""
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(into)], check=True)
    subprocess.run(["git", "-C", str(into), "checkout", "--quiet", rev], check=True)
    return into


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    requests = make_requests(args.workload, args.num_requests)
    common = tandem_bench_flags(args.dtype, args.concurrency)
    flags = {"base": args.base_flags.split(), "head": args.head_flags.split()}
    rounds: list[dict[str, dict[str, Any]]] = []
    host_before = host_rates()
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="tandem-paired-") as tmp:
        cwds = {"base": checkout(args.base, Path(tmp) / "base"), "head": REPO}
        urls = {}
        for side in SIDES:
            urls[side], _ = stack.enter_context(
                tandem_process(*common, *flags[side], cwd=cwds[side])
            )
        for i in range(args.rounds):
            measured: dict[str, dict[str, Any]] = {}
            for side in round_order(i):
                # The same prompts every round: none may be served from a cache.
                httpx.post(f"{urls[side]}/reset_prefix_cache", timeout=30).raise_for_status()
                results, wall = asyncio.run(
                    run_load(urls[side], MODEL, requests, concurrency=args.concurrency)
                )
                measured[side] = summarize(results, wall, Slo())
            rounds.append(measured)
            print_table(
                ("round", "side", "tok/s", "ITL p50 ms", "ITL p95 ms", "ITL p99 ms", "errors"),
                [
                    (
                        i,
                        s,
                        f"{m['output_tok_s']:.1f}",
                        f"{1e3 * m['itl_s']['p50']:.1f}",
                        f"{1e3 * m['itl_s']['p95']:.1f}",
                        f"{1e3 * m['itl_s']['p99']:.1f}",
                        m["errors"],
                    )
                    for s, m in measured.items()
                ],
            )
    summary = paired_summary(rounds)
    host = {"before": host_before, "after": host_rates()}
    print(
        f"\nhead / base tok/s per round: {', '.join(f'{x:.3f}' for x in summary['tok_s_ratios'])}"
        f" (head faster in {summary['head_faster_rounds']} of {len(rounds)}); medians "
        f"{summary['median_tok_s']['base']:.1f} -> {summary['median_tok_s']['head']:.1f} tok/s, "
        f"ITL p99 {1e3 * summary['median_itl_p99_s']['base']:.1f} -> "
        f"{1e3 * summary['median_itl_p99_s']['head']:.1f} ms"
    )
    name = args.name or f"paired-{args.workload}-c{args.concurrency}"
    print(host_line(host["before"], host["after"]))
    path = write_results(
        name, {"args": vars(args), "host": host, "rounds": rounds, "summary": summary}
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
