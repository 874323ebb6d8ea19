"""What tracing costs a token: the same load on two Tandem servers, one exporting traces
(``--otlp-traces-endpoint`` to an OTLP/HTTP sink in this process, every request traced)
and one not, in one window, interleaved pass by pass.

    .venv/bin/python -m bench.tracing_overhead [--clients 32] [--requests 128] [--passes 3]

Per server: output tok/s, TPOT p50, and server CPU per output token (the engine, worker
and API-server processes' user+system time over the pass, divided by its tokens) — the
cost tracing adds, less noisy on a shared host than throughput. Prints a table, writes
``bench/results/tracing-overhead.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import psutil
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from bench.harness import free_port, print_table, tandem_bench_flags, tandem_process, write_results
from bench.loadgen import run_load
from bench.stats import Slo, summarize
from bench.workloads import make_requests

MODEL = "smollm2-135m-instruct"


class SpanSink:
    """An OTLP/HTTP receiver that counts the spans it is sent and keeps nothing else."""

    def __init__(self) -> None:
        self.num_spans = 0
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = ExportTraceServiceRequest.FromString(body)
                sink.num_spans += sum(
                    len(s.spans) for r in request.resource_spans for s in r.scope_spans
                )
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@contextmanager
def span_sink() -> Iterator[SpanSink]:
    sink = SpanSink()
    try:
        yield sink
    finally:
        sink.server.shutdown()
        sink.server.server_close()


def cpu_seconds(launcher_pid: int) -> float:
    """User + system CPU of the launcher's processes (engine, workers, API server)."""
    total = 0.0
    for p in psutil.Process(launcher_pid).children(recursive=True):
        try:
            times = p.cpu_times()
            total += times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--requests", type=int, default=128, help="per pass and server")
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--workload", default="chat")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument(
        "--on-first", action="store_true", help="start the traced server first (order check)"
    )
    args = parser.parse_args()
    flags = tandem_bench_flags(args.dtype, args.clients)
    with ExitStack() as stack:
        sink = stack.enter_context(span_sink())
        started = {
            "off": lambda: stack.enter_context(tandem_process(*flags)),
            "on": lambda: stack.enter_context(
                tandem_process(*flags, "--otlp-traces-endpoint", sink.url)
            ),
        }
        # The second server starts while the first runs: start order may favour either
        # (the thread governor); --on-first swaps it, to tell that from tracing's cost.
        first = ["on", "off"] if args.on_first else ["off", "on"]
        servers = {name: started[name]() for name in first}
        passes: dict[str, list[dict[str, Any]]] = {name: [] for name in servers}
        for k in range(args.passes + 1):  # pass 0 warms both up and is not counted
            order = list(servers) if k % 2 else list(servers)[::-1]
            for name in order:
                url, pid = servers[name]
                requests = make_requests(args.workload, args.requests, seed=1000 * k + 7)
                cpu = cpu_seconds(pid)
                results, wall = asyncio.run(
                    run_load(url, MODEL, requests, concurrency=args.clients)
                )
                point = summarize(results, wall, Slo())
                point["server_cpu_s"] = cpu_seconds(pid) - cpu
                point["worker_threads"] = httpx.get(f"{url}/stats").json()["worker_threads"]
                if k:
                    passes[name].append(point)
        num_spans = sink.num_spans
    rows, summary = [], {}
    for name, points in passes.items():
        tokens = sum(p["output_tokens"] for p in points)
        wall = sum(p["wall_s"] for p in points)
        cpu_us = 1e6 * sum(p["server_cpu_s"] for p in points) / max(tokens, 1)
        tpot = sorted(p["tpot_s"]["p50"] or 0.0 for p in points)[len(points) // 2]
        errors = sum(p["errors"] for p in points)
        summary[name] = {"tok_s": tokens / wall, "cpu_us_per_token": cpu_us, "tpot_p50_s": tpot}
        threads = [p["worker_threads"] for p in points]
        rows.append([name, tokens / wall, 1e3 * tpot, cpu_us, threads, errors])
    off, on = summary["off"], summary["on"]
    cost = {
        "tok_s_change": on["tok_s"] / off["tok_s"] - 1,
        "cpu_per_token_change": on["cpu_us_per_token"] / off["cpu_us_per_token"] - 1,
    }
    path = write_results(
        "tracing-overhead",
        {
            "args": vars(args),
            "passes": passes,
            "summary": summary,
            "cost": cost,
            "spans": num_spans,
        },
    )
    print(f"{num_spans} spans received; {args.passes} passes of {args.requests} requests each")
    print(f"tracing on vs off: tok/s {cost['tok_s_change']:+.1%}, ", end="")
    print(f"server CPU per token {cost['cpu_per_token_change']:+.1%}  ({path})")
    print(f"servers started in the order {first}")
    print_table(
        ["tracing", "tok/s", "TPOT p50 ms", "CPU us/token", "worker threads", "errors"], rows
    )


if __name__ == "__main__":
    main()
