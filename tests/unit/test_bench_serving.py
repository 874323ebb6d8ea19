"""The serving benchmark's own logic: SSE parsing, aggregates and goodput, workloads, and
the closed-loop accounting of one-at-a-time peers."""

from __future__ import annotations

from typing import Any

import pytest

from bench.peers.transformers_peer import sequential_results
from bench.serving import interleaved_order
from bench.serving_report import yardstick
from bench.stats import RequestResult, Slo, chunk_text, meets, parse_sse_line, summarize
from bench.workloads import make_requests


def test_sse_lines() -> None:
    assert parse_sse_line(": keep-alive") is None
    assert parse_sse_line("") is None
    assert parse_sse_line("data: [DONE]") is None
    chunk = parse_sse_line('data: {"choices": [{"text": "Hi", "index": 0}]}')
    assert chunk is not None and chunk_text(chunk) == "Hi"
    chat = parse_sse_line('data:{"choices": [{"delta": {"content": "yo"}}]}')
    assert chat is not None and chunk_text(chat) == "yo"
    usage = parse_sse_line('data: {"choices": [], "usage": {"completion_tokens": 3}}')
    assert usage is not None and chunk_text(usage) == ""
    with pytest.raises(RuntimeError, match="boom"):
        parse_sse_line('data: {"error": {"message": "boom"}}')


def result(ttft: float, gaps: list[float], error: str | None = None) -> RequestResult:
    times = [ttft]
    for g in gaps:
        times.append(times[-1] + g)
    return RequestResult(0.0, ttft, times, times[-1], len(times), error)


def test_summary_percentiles_throughput_and_goodput() -> None:
    results = [
        result(0.5, [0.1] * 9),  # meets both bounds
        result(3.0, [0.1] * 9),  # TTFT too slow
        result(0.5, [0.1] * 5 + [0.5] * 4),  # ITL p95 too slow
        result(0.2, [], error="HTTP 503"),  # failed
    ]
    s = summarize(results, wall_s=10.0, slo=Slo(ttft_s=2.0, itl_p95_s=0.2))
    assert (s["requests"], s["errors"]) == (4, 1)
    assert s["output_tokens"] == 30
    assert s["output_tok_s"] == pytest.approx(3.0)
    assert s["requests_s"] == pytest.approx(0.3)
    assert s["ttft_s"]["p50"] == pytest.approx(0.5)
    assert s["itl_s"]["p50"] == pytest.approx(0.1)
    assert s["goodput_requests"] == 1
    assert s["goodput_req_s"] == pytest.approx(0.1)
    assert meets(result(2.0, [0.19] * 20), Slo()) and not meets(result(2.01, []), Slo())
    assert not meets(result(1.0, [0.1] * 10 + [0.3] * 2), Slo())  # p95 of gaps over 0.2


def test_workloads_are_seeded_and_shaped() -> None:
    mixed = make_requests("mixed", 32, seed=3)
    assert mixed == make_requests("mixed", 32, seed=3) != make_requests("mixed", 32, seed=4)
    assert all(32 <= len(r.prompt_ids) <= 1024 and 64 <= r.max_tokens <= 256 for r in mixed)
    shared = make_requests("shared-prefix", 4)
    assert len({tuple(r.prompt_ids[:1000]) for r in shared}) == 1
    interference = make_requests("long-prompt-interference", 8)
    assert [r.kind for r in interference].count("long") == 2
    assert all(len(r.prompt_ids) == 2000 for r in interference if r.kind == "long")
    assert [len(r.prompt_ids) for r in make_requests("single", 2)] == [256, 256]
    chat = make_requests("chat", 32)
    assert len({tuple(r.prompt_ids) for r in chat}) == 32  # distinct prompts
    assert all(24 <= len(r.prompt_ids) <= 64 and r.max_tokens == 128 for r in chat)
    long = make_requests("long-context", 4)
    assert all(3000 <= len(r.prompt_ids) <= 4000 and r.max_tokens == 256 for r in long)
    with pytest.raises(ValueError, match="unknown workload"):
        make_requests("nope", 1)


def test_sequential_peer_closed_loop_queueing() -> None:
    # Three requests of 1 s service each (token at +0.5 s and +1 s), back to back.
    services = [(float(i), float(i + 1), [i + 0.5, i + 1.0]) for i in range(3)]
    alone, wall = sequential_results(services, concurrency=1)
    assert wall == 3.0
    assert [r.ttft_s for r in alone] == [0.5, 0.5, 0.5]  # each sent as the last one ended
    crowd, _ = sequential_results(services, concurrency=3)
    assert [r.ttft_s for r in crowd] == [0.5, 1.5, 2.5]  # all sent at once: they queue
    assert [r.e2e_s for r in crowd] == [1.0, 2.0, 3.0]
    assert [r.itls_s for r in crowd] == [[0.5]] * 3


def point(system: str, c: int, tok_s: float, itl_p50: float, itl_p95: float) -> dict[str, Any]:
    summary = {"output_tok_s": tok_s, "itl_s": {"p50": itl_p50, "p95": itl_p95}}
    return {"system": system, "concurrency": c, "summary": summary, "by_kind": {}}


def test_yardstick_states_12s_goals_met_or_not() -> None:
    points = [
        point("tandem", 1, 60, 0.015, 0.02),
        point("llama-server-bf16", 1, 50, 0.020, 0.03),
        point("tandem-gguf", 1, 90, 0.011, 0.02),
        point("llama-server", 1, 80, 0.010, 0.02),
        point("tandem", 8, 300, 0.02, 0.03),
        point("vllm", 8, 200, 0.03, 0.04),
        point("tandem", 32, 700, 0.04, 0.056),
        point("vllm", 32, 500, 0.06, 0.066),
        point("llama-server", 32, 300, 0.05, 0.050),
    ]
    lines = yardstick(points, {"tandem": 2 << 30, "vllm": 3 << 30, "llama-server": 1 << 30})
    text = "\n".join(lines)
    assert "c=8: tandem 300.0 tok/s = 1.50x the best peer (vllm, 200.0); goal ahead -> met" in text
    assert (
        "c=32: tandem 700.0 tok/s = 1.40x the best peer (vllm, 500.0); goal >= 2x -> NOT met"
        in text
    )
    assert "-> NOT below llama-server" in text  # its ITL p95 (50 ms) is under Tandem's 56
    assert "c=1: tandem ITL p50 = 0.75x llama-server-bf16's; goal <= 1.0x -> met" in text
    assert "c=1: tandem-gguf ITL p50 = 1.10x llama-server's; goal <= 1.0x -> NOT met" in text
    assert "peak RSS: tandem (all processes) = 0.67x vLLM's; goal <= 1x -> met" in text
    points[-1] = point("llama-server", 32, 300, 0.05, 0.070)
    assert "-> below every peer" in "\n".join(yardstick(points, {}))


def test_one_client_points_interleave_request_by_request() -> None:
    order = interleaved_order(["a", "b", "c"], 4)
    assert order == [
        (0, "a"), (0, "b"), (0, "c"),
        (1, "b"), (1, "c"), (1, "a"),
        (2, "c"), (2, "a"), (2, "b"),
        (3, "a"), (3, "b"), (3, "c"),
    ]  # fmt: skip
    # Every system takes every request once, in order; none is always first.
    for system in "abc":
        assert [i for i, s in order if s == system] == [0, 1, 2, 3]
    firsts = [order[3 * i][1] for i in range(4)]
    assert set(firsts) == {"a", "b", "c"}
    assert interleaved_order(["alone"], 2) == [(0, "alone"), (1, "alone")]


def test_paired_rounds_alternate_and_ratios_are_head_over_base() -> None:
    from bench.paired import paired_summary, round_order

    assert [round_order(i) for i in range(4)] == [
        ("base", "head"),
        ("head", "base"),
        ("base", "head"),
        ("head", "base"),
    ]

    def side(tok_s: float, itl_p50: float, itl_p99: float) -> dict[str, Any]:
        return {"output_tok_s": tok_s, "itl_s": {"p50": itl_p50, "p99": itl_p99}}

    rounds = [
        {"base": side(100.0, 0.020, 0.090), "head": side(120.0, 0.016, 0.045)},
        {"base": side(80.0, 0.025, 0.080), "head": side(100.0, 0.020, 0.040)},
        {"base": side(110.0, 0.018, 0.050), "head": side(99.0, 0.020, 0.060)},
    ]
    summary = paired_summary(rounds)
    assert summary["tok_s_ratios"] == pytest.approx([1.2, 1.25, 0.9])
    assert summary["itl_p50_ratios"] == pytest.approx([0.8, 0.8, 0.020 / 0.018])
    assert summary["head_faster_rounds"] == 2
    assert summary["median_tok_s"] == {"base": 100.0, "head": 100.0}
    assert summary["median_itl_p50_s"] == pytest.approx({"base": 0.020, "head": 0.020})
    assert summary["itl_p99_ratios"] == pytest.approx([0.5, 0.5, 1.2])
    assert summary["median_itl_p99_s"] == pytest.approx({"base": 0.080, "head": 0.045})
