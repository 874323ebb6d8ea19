"""Prometheus metrics, named as vLLM's with the prefix ``tandem:`` (so a vLLM dashboard
ports by swapping the prefix), each labelled ``model_name``.

Two kinds, and how several API-server processes add up:
- engine-wide figures (running/waiting requests, KV usage, token counters, preemptions,
  prefix-cache counters, tokens per step) come from the engine's own cumulative
  ``SchedulerStats``; every API server exports the same values, so a scrape of any one
  gives the whole engine (do not sum them across processes);
- per-request latencies (TTFT, inter-token, end-to-end, queue, prefill, decode),
  finished-request counts, content-guard hits and HTTP counts are observed by the
  process that served the request; with several processes, scrape each and sum by
  series (``sum by (le)``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Literal, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from common.messages import (
    ITERATION_TOKEN_BUCKETS,
    KV_TRANSFER_BUCKETS_S,
    KVTransferStats,
    RequestTimings,
    SchedulerStats,
)

PREFIX = "tandem:"
# Where the content guard found a match: the prompt (refused) or the output (ended).
GuardPlace = Literal["prompt", "completion"]
GUARD_PLACES: tuple[GuardPlace, ...] = ("prompt", "completion")

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0,
)  # fmt: skip


class EngineFigures(Protocol):
    """Where the engine's latest figures are (the ``EngineClient``, fed by heartbeats)."""

    stats: SchedulerStats
    pools: dict[str, SchedulerStats]
    kv_transfers: KVTransferStats | None


class _EngineCollector(Collector):
    """Engine-wide figures read from the latest stats at scrape time. With split pools,
    the running/waiting/KV-usage gauges carry a ``pool`` label (one series per pool), and
    the KV hand-offs are exported; a unified pool's series are as they always were."""

    def __init__(self, engine: EngineFigures, model_name: str) -> None:
        self._engine = engine
        self._model = model_name

    def collect(self) -> Iterator[Metric]:
        yield from self._pool_gauges()
        yield from self._counters()
        transfers = self._engine.kv_transfers
        if transfers is not None:
            yield from self._transfers(transfers)

    def _pool_gauges(self) -> Iterator[Metric]:
        pools = self._engine.pools or {"": self._engine.stats}
        labels = ["model_name", "pool"] if self._engine.pools else ["model_name"]
        families = {
            "num_requests_running": ("Requests in the running batch.", lambda s: s.num_running),
            "num_requests_waiting": ("Requests waiting to be scheduled.", lambda s: s.num_waiting),
            "num_prompt_tokens_waiting": (
                "Prompt tokens still to prefill, of waiting and running requests.",
                lambda s: s.num_prompt_tokens_waiting,
            ),
            "kv_cache_usage_perc": (
                "Fraction of KV blocks in use (0-1).",
                lambda s: (
                    s.num_kv_blocks_in_use / s.num_kv_blocks_total if s.num_kv_blocks_total else 0.0
                ),
            ),
            "worker_threads": (
                "CPU threads the workers ran their latest steps on, summed (the adaptive "
                "thread governor gives cores up while other processes hold them).",
                lambda s: s.num_worker_threads,
            ),
        }
        for name, (doc, value_of) in families.items():
            g = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            for pool, stats in pools.items():
                g.add_metric([self._model, pool] if pool else [self._model], value_of(stats))
            yield g

    def _transfers(self, t: KVTransferStats) -> Iterator[Metric]:
        labels = ["model_name", "outcome"]
        c = CounterMetricFamily(
            PREFIX + "kv_transfers",
            "Prefill -> decode hand-offs by how they ended (local_prefill: prefilled in the "
            "decode pool instead).",
            labels=labels,
        )
        for outcome, count in t.outcomes.items():
            c.add_metric([self._model, outcome], count)
        yield c
        b = CounterMetricFamily(
            PREFIX + "kv_transfer_bytes", "KV bytes streamed between pools.", labels=["model_name"]
        )
        b.add_metric([self._model], t.num_bytes_total)
        yield b
        if t.duration_buckets:
            h = HistogramMetricFamily(
                PREFIX + "kv_transfer_duration_seconds",
                "Prompt done in the prefill pool to ready in the decode pool.",
                labels=["model_name"],
            )
            bounds = [str(float(b)) for b in KV_TRANSFER_BUCKETS_S] + ["+Inf"]
            buckets = [float(c) for c in t.duration_buckets]
            h.add_metric([self._model], list(zip(bounds, buckets, strict=True)), t.duration_sum_s)
            yield h

    def _spec_decode(self, s: SchedulerStats) -> Iterator[Metric]:
        """vLLM's spec_decode_* counters (speculative decoding)."""
        for name, doc, v in (
            ("spec_decode_num_drafts", "Verifications of drafts (a request in a step).",
             s.spec_decode_num_drafts),
            ("spec_decode_num_draft_tokens", "Drafted tokens verified.",
             s.spec_decode_num_draft_tokens),
            ("spec_decode_num_accepted_tokens", "Drafted tokens accepted.",
             s.spec_decode_num_accepted_tokens),
        ):  # fmt: skip
            c = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            c.add_metric([self._model], v)
            yield c
        per_pos = CounterMetricFamily(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Drafted tokens accepted, by their position among a request's drafts.",
            labels=["model_name", "position"],
        )
        for position, count in enumerate(s.spec_decode_num_accepted_tokens_per_pos):
            per_pos.add_metric([self._model, str(position)], count)
        yield per_pos

    def _counters(self) -> Iterator[Metric]:
        s = self._engine.stats
        labels = ["model_name"]
        value = [self._model]

        def counter(name: str, doc: str, v: float) -> CounterMetricFamily:
            c = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            c.add_metric(value, v)
            return c

        yield counter(
            "prompt_tokens", "Prompt tokens of admitted requests.", s.num_prompt_tokens_total
        )
        yield counter("generation_tokens", "Generated tokens.", s.num_generated_tokens_total)
        yield counter("num_preemptions", "Requests preempted.", s.num_preemptions_total)
        yield counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
            s.prefix_cache_queries_total,
        )  # fmt: skip
        yield counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache.",
            s.prefix_cache_hits_total,
        )  # fmt: skip
        yield counter(
            "malformed_frames", "Frames the engine's input socket could not decode (dropped).",
            s.num_malformed_frames_total,
        )  # fmt: skip
        yield counter(
            "engine_input_dropped_connections",
            "Connections the engine's input socket lost: a peer went away, or sent a frame "
            "over the size limit.",
            s.num_dropped_connections_total,
        )
        yield from self._spec_decode(s)
        if s.max_loras:
            yield from self._lora(s)
        if s.iteration_tokens_buckets:
            h = HistogramMetricFamily(
                PREFIX + "iteration_tokens_total", "Tokens per engine step.", labels=labels
            )
            bounds = [str(float(b)) for b in ITERATION_TOKEN_BUCKETS] + ["+Inf"]
            h.add_metric(
                value,
                list(zip(bounds, [float(c) for c in s.iteration_tokens_buckets], strict=True)),
                float(s.iteration_tokens_sum),
            )
            yield h

    def _lora(self, s: SchedulerStats) -> Iterator[Metric]:
        """vLLM's ``lora_requests_info`` (what the Gateway API Inference Extension's
        endpoint picker reads: the labels carry the adapters, the value is the time of
        the figures) and the adapter swaps."""
        g = GaugeMetricFamily(
            PREFIX + "lora_requests_info",
            "Running and waiting LoRA adapters (comma-separated), and --max-loras.",
            labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
        )
        g.add_metric(
            [str(s.max_loras), ",".join(sorted(s.lora_waiting)), ",".join(sorted(s.lora_running))],
            time.time(),
        )
        yield g
        c = CounterMetricFamily(
            PREFIX + "lora_swaps",
            "LoRA adapters brought into a step's --max-loras slots (first loads included).",
            labels=["model_name"],
        )
        c.add_metric([self._model], s.lora_swaps_total)
        yield c


class Metrics:
    """This process's registry: the engine collector plus per-request observations.

    With several API-server processes on one port (``--api-server-count``, which sets
    ``PROMETHEUS_MULTIPROC_DIR``), per-request series live in prometheus-client's shared
    files and any process's ``/metrics`` reports the sum over all of them (engine-wide
    figures come from the engine, the same everywhere); ``tandem:api_server_requests_total``
    keeps one series per process, to show how the port spread the load.
    """

    def __init__(self, model_name: str, engine: EngineFigures) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        engine_collector = _EngineCollector(engine, model_name)
        self.shared_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if self.shared_dir:
            self.exposed = CollectorRegistry()
            MultiProcessCollector(self.exposed, path=self.shared_dir)
            self.exposed.register(engine_collector)
        else:
            self.registry.register(engine_collector)
            self.exposed = self.registry
        self.served_here = Counter(
            PREFIX + "api_server_requests",
            "Generation requests by the API-server process that took them.",
            ["model_name", "process"],
            registry=self.registry,
        ).labels(model_name, str(os.getpid()))
        self.lora_requests = Counter(
            PREFIX + "lora_requests",
            "Generation requests per LoRA adapter (the base model's are not counted here).",
            ["model_name", "lora_name"],
            registry=self.registry,
        )

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(
                PREFIX + name, doc, ["model_name"], registry=self.registry, buckets=buckets
            )

        self.ttft = histogram(
            "time_to_first_token_seconds", "Arrival to first token.", _LATENCY_BUCKETS
        ).labels(model_name)
        self.itl = histogram(
            "inter_token_latency_seconds", "Time between output tokens.", _ITL_BUCKETS
        ).labels(model_name)
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Arrival to last token.", _LATENCY_BUCKETS
        ).labels(model_name)
        self.queue = histogram(
            "request_queue_time_seconds", "Time waiting to be first scheduled.", _LATENCY_BUCKETS
        ).labels(model_name)
        self.prefill = histogram(
            "request_prefill_time_seconds", "First scheduled to first token.", _LATENCY_BUCKETS
        ).labels(model_name)
        self.decode = histogram(
            "request_decode_time_seconds", "First token to last token.", _LATENCY_BUCKETS
        ).labels(model_name)
        self.success = Counter(
            PREFIX + "request_success",
            "Finished requests by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.guardrail_hits = Counter(
            PREFIX + "guardrail_hits",
            "Prompts refused and outputs ended by the content guard (--guard-blocklist).",
            ["model_name", "where"],
            registry=self.registry,
        )
        for where in GUARD_PLACES:  # both series from the start, at 0
            self.guardrail_hits.labels(model_name, where)
        self.audit_written, self.audit_dropped = audit_counters(self.registry, model_name)
        self.http = Counter(
            "http_requests",
            "HTTP requests by route, method and status.",
            ["handler", "method", "status"],
            registry=self.registry,
        )

    def finished(self, reason: str, arrival_time: float, timings: RequestTimings | None) -> None:
        self.success.labels(self.model_name, reason).inc()
        self.e2e.observe(max(0.0, time.time() - arrival_time))
        if timings is not None:
            self.queue.observe(timings.queued_s)
            self.prefill.observe(timings.prefill_s)
            self.decode.observe(timings.decode_s)

    def guardrail_hit(self, where: GuardPlace) -> None:
        self.guardrail_hits.labels(self.model_name, where).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.exposed)


def audit_counters(registry: CollectorRegistry, model_name: str) -> tuple[Counter, Counter]:
    """The audit log's lines (``--audit-log``, ``audit_log.py``), written and dropped (a
    full queue: the sink fell behind; or a failed write). A model's API servers count
    their lines, a model router the lines of the requests it answered itself."""
    written = Counter(
        PREFIX + "audit_lines_written",
        "Audit log lines written (--audit-log).",
        ["model_name"],
        registry=registry,
    ).labels(model_name)
    dropped = Counter(
        PREFIX + "audit_lines_dropped",
        "Audit log lines dropped: the sink fell behind (its queue was full) or a write failed.",
        ["model_name"],
        registry=registry,
    ).labels(model_name)
    return written, dropped


class HttpMetrics:
    """ASGI middleware counting responses by route template, method and status."""

    def __init__(self, app: ASGIApp, metrics: Metrics, routes: frozenset[str]) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = routes

    def handler(self, path: str) -> str:
        if path in self.routes:
            return path
        if path.startswith("/static/"):
            return "/static"
        if path.startswith("/v1/requests/"):
            return "/v1/requests/{request_id}/cancel"
        return "other"  # unknown paths share one series: no unbounded label values

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_and_record(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        finally:
            self.metrics.http.labels(
                self.handler(scope["path"]), scope["method"], str(status)
            ).inc()
