"""``RequestSpans`` driven by an in-process ``EngineCore`` with fake pools and a manual
clock: the spans a traced request gets at its end (queue, a prefill span per chunk, the
hand-off between split pools, decode), their times, parents and GenAI attributes; an
untraced request gets none, and tracing off is ``NoRequestSpans``."""

from __future__ import annotations

import itertools

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from common.config import CacheConfig, SchedulerConfig, TandemConfig
from common.messages import EngineRequest, FinishReason, PoolRole, RequestOutput, SamplingParams
from common.pool_config import DisaggConfig
from common.tracing import NoTracing
from engine_core.core import EngineCore
from engine_core.request_spans import NoRequestSpans, RequestSpans, request_spans
from tests.unit.clock import ManualClock
from tests.unit.fake_pools import BLOCK, FakePool

TRACE_ID = 0x4BF92F3577B34DA6A3CE929D0E0E4736
CLIENT_SPAN = 0x00F067AA0BA902B7
HEADERS = {"traceparent": f"00-{TRACE_ID:032x}-{CLIENT_SPAN:016x}-01"}
WALL = 1_700_000_000.0  # the wall clock when the engine clock reads 1000
STEP_S = 0.01


def make(
    split: bool, async_scheduling: bool = False
) -> tuple[EngineCore, InMemorySpanExporter, ManualClock]:
    config = TandemConfig(
        cache=CacheConfig(block_size=BLOCK, num_kv_blocks=16),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=4,  # a 10-token prompt runs in chunks of 4, 4, 2
            async_scheduling=async_scheduling,
        ),
        disagg=DisaggConfig(prefill_workers=1, decode_workers=1, kv_transfer="shm")
        if split
        else DisaggConfig(),
    )
    roles = (PoolRole.PREFILL, PoolRole.DECODE) if split else (PoolRole.UNIFIED,)
    depth = 2 if async_scheduling else 1
    # A step ends on the poll after the one that sent it: each chunk takes a step's time.
    pools = {r: FakePool(r, 16, step_polls=2, max_in_flight=depth) for r in roles}
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    clock = ManualClock(1000.0)
    spans = RequestSpans(provider.get_tracer("test"), "tiny", clock, lambda: WALL)
    core = EngineCore(config, pools, clock, spans=spans)
    core.start()
    return core, exporter, clock


def serve(
    core: EngineCore, clock: ManualClock, *requests: EngineRequest
) -> dict[str, list[RequestOutput]]:
    """Run until every request ended, passing each step's outputs to the spans as the
    engine process does when it sends them."""
    for r in requests:
        core.add_request(r)
    outputs: dict[str, list[RequestOutput]] = {}
    for _ in range(200):
        clock.now += STEP_S
        result = core.step()
        core.spans.finished(result.outputs)
        for out in result.outputs.get(b"client", []):
            outputs.setdefault(out.request_id, []).append(out)
        if len(outputs) == len(requests) and all(
            o[-1].finish_reason is not None for o in outputs.values()
        ):
            return outputs
    raise AssertionError(f"not done: {outputs}")


def request(request_id: str, traced: bool = True) -> EngineRequest:
    return EngineRequest(
        request_id,
        b"client",
        list(range(1, 11)),
        SamplingParams(max_tokens=5, temperature=0.5),
        WALL - 0.5,  # the API server stamped it half a second before the engine saw it
        trace_headers=HEADERS if traced else None,
    )


def by_name(spans: tuple[ReadableSpan, ...]) -> dict[str, list[ReadableSpan]]:
    named: dict[str, list[ReadableSpan]] = {}
    for span in spans:
        named.setdefault(span.name, []).append(span)
    return named


def start(span: ReadableSpan) -> int:
    assert span.start_time is not None
    return span.start_time


def end(span: ReadableSpan) -> int:
    assert span.end_time is not None
    return span.end_time


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_split_pools_give_queue_chunks_hand_off_and_decode(async_scheduling: bool) -> None:
    core, exporter, clock = make(split=True, async_scheduling=async_scheduling)
    serve(core, clock, request("a"))
    named = by_name(exporter.get_finished_spans())
    assert sorted(named) == ["decode_steps", "kv_handoff", "llm_request", "prefill_chunk", "queue"]
    (root,) = named["llm_request"]
    assert root.kind == SpanKind.SERVER
    assert root.context is not None and root.context.trace_id == TRACE_ID
    assert root.parent is not None and root.parent.span_id == CLIENT_SPAN
    for span in exporter.get_finished_spans():
        assert span.context is not None and span.context.trace_id == TRACE_ID
        if span is not root:
            assert span.parent is not None and span.parent.span_id == root.context.span_id
    attributes = dict(root.attributes or {})
    assert attributes["gen_ai.request.model"] == "tiny"
    assert attributes["gen_ai.request.id"] == "a"
    assert attributes["gen_ai.request.max_tokens"] == 5
    assert attributes["gen_ai.request.temperature"] == 0.5
    assert attributes["gen_ai.usage.input_tokens"] == 10
    assert attributes["gen_ai.usage.output_tokens"] == 5
    assert attributes["gen_ai.response.finish_reasons"] == ("length",)
    ttft = attributes["gen_ai.server.time_to_first_token"]
    assert isinstance(ttft, float) and 0.5 < ttft < 0.5 + 20 * STEP_S
    assert root.start_time == int((WALL - 0.5) * 1e9)  # the API server's arrival
    chunks = named["prefill_chunk"]
    assert all(end(c) > start(c) for c in chunks)  # each took its step's time
    assert [(c.attributes or {})["tandem.prefill.num_tokens"] for c in chunks] == [4, 4, 2]
    assert {(c.attributes or {})["tandem.pool"] for c in chunks} == {"prefill"}
    (queue,), (handoff,), (decode,) = named["queue"], named["kv_handoff"], named["decode_steps"]
    # One after another, in the order the request lived them.
    assert end(queue) <= start(chunks[0])
    for before, after in itertools.pairwise(chunks):
        assert end(before) <= start(after)
    assert start(handoff) == end(chunks[-1]) and end(handoff) == start(decode)
    assert end(handoff) > start(handoff) or async_scheduling  # waited a step for the decode pool
    assert (decode.attributes or {})["tandem.pool"] == "decode"
    assert end(decode) == end(root)
    assert not core.spans._live and not core.spans._open  # type: ignore[attr-defined]


def test_one_pool_has_no_hand_off() -> None:
    core, exporter, clock = make(split=False)
    serve(core, clock, request("a"))
    named = by_name(exporter.get_finished_spans())
    assert sorted(named) == ["decode_steps", "llm_request", "prefill_chunk", "queue"]
    assert len(named["prefill_chunk"]) == 3
    assert end(named["prefill_chunk"][-1]) <= start(named["decode_steps"][0])


def test_an_untraced_request_makes_no_span_beside_a_traced_one() -> None:
    core, exporter, clock = make(split=True)
    serve(core, clock, request("plain", traced=False), request("traced"))
    roots = by_name(exporter.get_finished_spans())["llm_request"]
    assert [(r.attributes or {})["gen_ai.request.id"] for r in roots] == ["traced"]


def test_an_aborted_request_ends_its_trace_with_what_it_lived() -> None:
    core, exporter, clock = make(split=False)
    core.add_request(request("a"))
    clock.now += STEP_S
    core.step()
    core.spans.finished(core.abort(["a"]))
    named = by_name(exporter.get_finished_spans())
    assert sorted(named) == ["llm_request", "prefill_chunk", "queue"]
    assert (named["llm_request"][0].attributes or {})["gen_ai.response.finish_reasons"] == (
        "abort",
    )


def test_tracing_off_is_the_null_object() -> None:
    assert type(request_spans(NoTracing(), "tiny")) is NoRequestSpans


def test_a_request_reusing_a_running_ones_id_leaves_that_ones_trace_alone() -> None:
    core, exporter, clock = make(split=False)
    core.add_request(request("a"))
    clock.now += STEP_S
    core.step()
    refused = core.add_request(request("a"))  # sent back as is: the engine never took it
    assert [o.finish_reason for o in refused[b"client"]] == [FinishReason.ERROR]
    assert exporter.get_finished_spans() == ()
    for _ in range(200):
        clock.now += STEP_S
        result = core.step()
        core.spans.finished(result.outputs)
        if any(o.finish_reason is not None for o in result.outputs.get(b"client", [])):
            break
    named = by_name(exporter.get_finished_spans())
    (root,) = named["llm_request"]
    assert (root.attributes or {})["gen_ai.usage.output_tokens"] == 5  # it lived to the end
    assert "decode_steps" in named


def test_a_traced_request_its_pool_refuses_ends_its_trace_there() -> None:
    core, exporter, _ = make(split=False)
    too_long = request("long")
    too_long.prompt_token_ids = list(range(1, 200))  # past the 16 blocks of 4 tokens
    refused = core.add_request(too_long)
    assert [o.finish_reason for o in refused[b"client"]] == [FinishReason.ERROR]
    (root,) = by_name(exporter.get_finished_spans())["llm_request"]
    assert root.status.status_code == StatusCode.ERROR
    assert isinstance(core.spans, RequestSpans) and not core.spans._live
