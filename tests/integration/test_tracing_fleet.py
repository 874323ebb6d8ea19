"""Traces across a split fleet: ``tandem fleet --prefill 1 --decode 1`` behind the real
vllm-router, every instance exporting to a real OTLP/HTTP receiver. The decode
instance's ``llm_request`` holds a ``kv_handoff`` span for its pull of the prompt's KV
from the prefill instance (outcome, blocks, bytes, the prefill instance's engine id), and
the router passes the client's ``traceparent`` on, so the prefill instance's request and
the decode instance's sit in the client's one trace."""

from __future__ import annotations

import time
from pathlib import Path

from tests.integration.test_tracing import (
    CLIENT_SPAN,
    FAST_EXPORT,
    PROMPT,
    TRACE_ID,
    Receiver,
    Span,
    chat_stream,
)
from tests.stack import TandemStack, free_port, free_port_range

BLOCK = 16


def test_the_decode_instances_pull_is_a_kv_handoff_span_in_the_clients_trace(
    smollm2_dir: Path,
) -> None:
    port = free_port()
    receiver = Receiver(port)
    base, events, side = free_port_range(2), free_port_range(4), free_port_range(1)
    fleet = TandemStack(
        *("--prefill", "1", "--decode", "1", "--policy", "round_robin"),
        *("--instance-base-port", str(base), "--kv-events-base-port", str(events)),
        *("--kv-side-channel-base-port", str(side)),
        *("--dtype", "float32", "--worker-threads", "1", "--kv-cache-gb", "0.2"),
        *("--otlp-traces-endpoint", f"http://127.0.0.1:{port}/v1/traces"),
        env=FAST_EXPORT,
        command="fleet",
    )
    try:
        with fleet:
            usage = chat_stream(fleet.url, PROMPT, f"00-{TRACE_ID}-{CLIENT_SPAN}-01")
            spans = receiver.trace(TRACE_ID, {"kv_handoff", "decode_steps"}, timeout_s=20)
            deadline = time.monotonic() + 10  # the prefill instance exports on its own
            while _roots(spans) < 2 and time.monotonic() < deadline:
                time.sleep(0.1)
                spans = receiver.trace(TRACE_ID, set())
    finally:
        receiver.close()
    roots = {s.span_id: s for s in spans if s.name == "llm_request"}
    # Two engine requests in the client's trace: the prefill instance's (one token, its
    # KV lent) and the decode instance's (the rest, its KV pulled).
    by_tokens = sorted(roots.values(), key=lambda s: s.attributes["gen_ai.request.max_tokens"])
    assert [s.attributes["gen_ai.request.max_tokens"] for s in by_tokens] == [1, 6], spans
    prefill_root, decode_root = by_tokens
    (handoff,) = [s for s in spans if s.name == "kv_handoff"]
    assert handoff.parent_id == decode_root.span_id
    a = handoff.attributes
    assert a["tandem.kv.outcome"] == "done"
    assert a["tandem.kv.num_blocks"] == (usage["prompt_tokens"] - 1) // BLOCK
    assert a["tandem.kv.num_bytes"] > 0 and a["tandem.kv.source_engine_id"]
    decode = [s for s in spans if s.name == "decode_steps" and s.parent_id == decode_root.span_id]
    assert len(decode) == 1 and handoff.end <= decode[0].start
    # The decode instance computed only the prompt's last partial block.
    tail = [s for s in spans if s.name == "prefill_chunk" and s.parent_id == decode_root.span_id]
    computed = sum(s.attributes["tandem.prefill.num_tokens"] for s in tail)
    assert computed == usage["prompt_tokens"] - BLOCK * a["tandem.kv.num_blocks"]
    assert _chunks_of(spans, prefill_root) and prefill_root.end <= handoff.end


def _chunks_of(spans: list[Span], root: Span) -> list[Span]:
    return [s for s in spans if s.name == "prefill_chunk" and s.parent_id == root.span_id]


def _roots(spans: list[Span]) -> int:
    return sum(1 for s in spans if s.name == "llm_request")
