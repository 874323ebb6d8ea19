"""A traced request's spans in the engine core, made when it finishes.

With ``--otlp-traces-endpoint`` set and a request that carries trace context
(``EngineRequest.trace_headers``), ``RequestSpans`` notes when each of its prefill
chunks ran (the step that held it, from sent to answered) and when it began to decode,
and makes its spans when its last output leaves the engine:

    llm_request    its arrival at the API server -> its end (vLLM's name; gen_ai.*)
      queue        received by the engine -> first scheduled
      prefill      one per chunk: the step that computed it, sent -> answered
      kv_handoff   split pools: the prefill pool's last chunk done -> the decode
                   pool's first step sent (the KV moved, or its block ids did);
                   a fleet's decode instance: its pull of the prompt's KV from the
                   prefill instance, sent -> landed (or how else it ended)
      decode       the first decode step sent -> finished

Every span is made at the end with explicit times, so the step loop only appends a
chunk per step to a traced request while it prefills, and does nothing once it decodes
(per-step spans would cost every token). ``NoRequestSpans`` (tracing off) does nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Status, StatusCode

from common.messages import FinishReason, PoolRole, RequestOutput, SchedulerOutput
from common.tracing import Tracing, parent_context
from engine_core.request import KVPullRecord, Request
from engine_core.scheduler import ClientOutputs

logger = logging.getLogger(__name__)


@dataclass
class _Chunk:
    """A prefill chunk: the pool and step that computed it."""

    role: PoolRole
    num_tokens: int
    start: float  # engine clock
    end: float | None = None  # None while its step runs


@dataclass
class _Traced:
    request: Request
    parent: Context  # the API server's request span, from the wire's headers
    chunks: list[_Chunk] = field(default_factory=list)
    decode_role: PoolRole | None = None
    decode_start: float | None = None


class NoRequestSpans:
    """Tracing off: nothing is noted, nothing is made."""

    def arrived(self, request: Request, headers: dict[str, str] | None) -> None:
        return None

    def submitted(self, role: PoolRole, step: SchedulerOutput) -> None:
        return None

    def step_done(self, role: PoolRole, step: SchedulerOutput) -> None:
        return None

    def finished(self, outputs: ClientOutputs) -> None:
        return None


class RequestSpans(NoRequestSpans):
    """Phase times of the traced requests in the engine, and their spans at the end."""

    def __init__(
        self,
        tracer: trace.Tracer,
        model_name: str,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._tracer = tracer
        self._model_name = model_name
        self._clock = clock  # the engine's (the scheduler stamps requests with it)
        # Spans carry wall-clock times; the engine counts on a monotonic clock.
        self._epoch_offset = wall_clock() - clock()
        self._live: dict[str, _Traced] = {}  # by request id, until its last output
        self._prefilling: dict[str, _Traced] = {}  # of those, the ones not decoding yet
        self._open: dict[tuple[PoolRole, int], list[_Chunk]] = {}  # by running step
        self._last_done: dict[PoolRole, float] = {}  # when each pool last answered a step

    def arrived(self, request: Request, headers: dict[str, str] | None) -> None:
        """Trace ``request`` if the API server sent its context."""
        if headers is None:
            return
        traced = _Traced(request, parent_context(headers))
        self._live[request.request_id] = traced
        self._prefilling[request.request_id] = traced

    def submitted(self, role: PoolRole, step: SchedulerOutput) -> None:
        """``step`` went to ``role``'s workers: a chunk for each traced request it
        prefills, the decode start of each it is the first decode step of."""
        if not self._prefilling:
            return
        now = self._clock()
        # The step's requests (at most max_num_seqs), not every traced one waiting.
        for request_id, n in step.num_scheduled_tokens.items():
            traced = self._prefilling.get(request_id)
            if traced is None:
                continue
            request = traced.request
            n -= len(step.draft_token_ids.get(request_id, ()))
            # The scheduler counts a step's tokens as scheduled ahead until it is done,
            # so this step's first position is where the computed and earlier ones end.
            first = request.num_computed_tokens + request.num_scheduled_ahead - n
            if first < request.num_prompt_tokens:
                chunk = _Chunk(role, n, now)
                traced.chunks.append(chunk)
                self._open.setdefault((role, step.step_id), []).append(chunk)
            else:
                traced.decode_role, traced.decode_start = role, now
                del self._prefilling[request_id]

    def step_done(self, role: PoolRole, step: SchedulerOutput) -> None:
        """``role``'s workers answered ``step``: its chunks end now. (With async
        scheduling a step is sent while the one before runs: it starts when that ends.)"""
        now = self._clock()
        chunks = self._open.pop((role, step.step_id), None)
        if chunks:
            started = self._last_done.get(role, 0.0)
            for chunk in chunks:
                chunk.start, chunk.end = max(chunk.start, started), now
        self._last_done[role] = now

    def finished(self, outputs: ClientOutputs) -> None:
        """Outputs leaving the engine: the spans of each traced request they end."""
        if not self._live:
            return
        for request_outputs in outputs.values():
            for out in request_outputs:
                if out.finish_reason is None:
                    continue
                traced = self._live.pop(out.request_id, None)
                if traced is None:
                    continue
                self._prefilling.pop(out.request_id, None)
                try:  # a tracing fault costs this request's spans, never the engine
                    self._emit(traced, out, self._clock())
                except Exception:
                    logger.exception("[%s] tracing: no spans for it", out.request_id)

    # ------------------------------------------------------------------ spans

    def _ns(self, t: float) -> int:
        """An engine-clock time as OpenTelemetry's: nanoseconds since the epoch."""
        return int((t + self._epoch_offset) * 1e9)

    def _emit(self, traced: _Traced, out: RequestOutput, end: float) -> None:
        request = traced.request
        received = request.received_time if request.received_time is not None else end
        scheduled = request.scheduled_time if request.scheduled_time is not None else end
        root = self._tracer.start_span(
            "llm_request",
            context=traced.parent,
            kind=SpanKind.SERVER,  # as vLLM's
            # From the API server's arrival stamp (its wall clock, as ours on one host).
            start_time=min(int(request.arrival_time * 1e9), self._ns(received)),
            attributes=self._attributes(request, out, received, scheduled, end),
        )
        if out.finish_reason == FinishReason.ERROR:
            root.set_status(Status(StatusCode.ERROR, out.error or "the engine failed it"))
        inside = trace.set_span_in_context(root)
        self._span("queue", inside, received, scheduled)
        pulled = request.kv_pull
        if pulled is not None:
            self._pull_span(inside, pulled)
        for i, chunk in enumerate(traced.chunks):
            attributes: dict[str, Any] = {"tandem.pool": str(chunk.role)}
            attributes["tandem.prefill.chunk"] = i
            attributes["tandem.prefill.num_tokens"] = chunk.num_tokens
            self._span("prefill_chunk", inside, chunk.start, chunk.end or end, attributes)
        start = traced.decode_start
        if start is not None:
            last = traced.chunks[-1] if traced.chunks else None
            if last is not None and last.end is not None:
                start = max(start, last.end)  # sent while the last chunk ran (async)
            if last is not None and last.role != traced.decode_role:
                moved = {
                    "tandem.from_pool": str(last.role),
                    "tandem.to_pool": str(traced.decode_role),
                }
                self._span("kv_handoff", inside, last.end or start, start, moved)
            decoded: dict[str, Any] = {"tandem.pool": str(traced.decode_role)}
            decoded["gen_ai.usage.output_tokens"] = request.num_output_tokens
            self._span("decode_steps", inside, start, end, decoded)
        root.end(end_time=self._ns(end))

    def _pull_span(self, context: Context, pulled: KVPullRecord) -> None:
        attributes: dict[str, Any] = {
            "tandem.kv.outcome": pulled.outcome,
            "tandem.kv.num_blocks": pulled.num_blocks,
            "tandem.kv.num_bytes": pulled.num_bytes,
            "tandem.kv.source_engine_id": pulled.source_engine_id,
        }
        error = None if pulled.outcome == "done" else f"the KV pull {pulled.outcome}"
        self._span("kv_handoff", context, pulled.started, pulled.ended, attributes, error)

    def _span(
        self,
        name: str,
        context: Context,
        start: float,
        end: float,
        attributes: dict[str, Any] | None = None,
        error: str | None = None,
    ) -> None:
        span = self._tracer.start_span(
            name, context=context, start_time=self._ns(start), attributes=attributes
        )
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=self._ns(max(start, end)))

    def _attributes(
        self, request: Request, out: RequestOutput, received: float, scheduled: float, end: float
    ) -> dict[str, Any]:
        """OpenTelemetry's GenAI attributes, and vLLM's names for what they lack."""
        params = request.sampling_params
        arrival = request.arrival_time  # the API server's wall clock
        attributes: dict[str, Any] = {
            "gen_ai.request.model": request.lora.name if request.lora else self._model_name,
            "gen_ai.request.id": request.request_id,
            "gen_ai.request.max_tokens": params.max_tokens,
            "gen_ai.request.temperature": params.temperature,
            "gen_ai.request.top_p": params.top_p,
            "gen_ai.usage.input_tokens": request.num_prompt_tokens,
            "gen_ai.usage.output_tokens": request.num_output_tokens,
            "gen_ai.usage.prompt_tokens": request.num_prompt_tokens,  # vLLM's names
            "gen_ai.usage.completion_tokens": request.num_output_tokens,
            "gen_ai.response.finish_reasons": (str(out.finish_reason),),
            "gen_ai.latency.time_in_queue": scheduled - received,
            "gen_ai.latency.e2e": end + self._epoch_offset - arrival,
            "tandem.num_cached_tokens": request.num_cached_tokens,
        }
        first = request.first_token_time
        if first is not None:
            ttft = first + self._epoch_offset - arrival
            attributes["gen_ai.server.time_to_first_token"] = ttft
            attributes["gen_ai.latency.time_to_first_token"] = ttft  # vLLM's name
            attributes["gen_ai.latency.time_in_model_prefill"] = first - scheduled
            attributes["gen_ai.latency.time_in_model_decode"] = end - first
            attributes["gen_ai.latency.time_in_model_inference"] = end - scheduled
        return attributes


def request_spans(tracing: Tracing, model_name: str) -> NoRequestSpans:
    """The engine's request spans: ``RequestSpans`` when this process exports traces."""
    if tracing.exports:
        return RequestSpans(tracing.tracer, model_name)
    return NoRequestSpans()
