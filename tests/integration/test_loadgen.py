"""The benchmarks' load generator (bench/loadgen.py) against the real server: every
streamed token stamped, the usage's count taken, a refused request recorded as failed
rather than raised, in both the closed and the open loop."""

from __future__ import annotations

import asyncio

from bench.loadgen import run_load
from bench.workloads import BenchRequest
from tests.stack import TandemStack

MODEL = "smollm2-135m-instruct"


def test_closed_loop_stamps_every_token(server: TandemStack) -> None:
    requests = [BenchRequest([1, 2, 3, 40 + i], 6) for i in range(3)]
    results, wall_s = asyncio.run(run_load(server.url, MODEL, requests, concurrency=2))
    assert len(results) == 3
    for result in results:
        assert result.error is None
        assert result.output_tokens == 6  # the usage chunk's completion_tokens
        # One stamp a chunk with text: a token that ends inside a UTF-8 character has none.
        assert 1 <= len(result.token_times_s) <= 6
        assert result.token_times_s == sorted(result.token_times_s)
        assert result.ttft_s == result.token_times_s[0]
        assert 0 < result.ttft_s <= result.e2e_s <= wall_s
    # Two clients: the third request is sent when one of the first two has ended.
    starts = sorted(r.start_s for r in results)
    first_end = min(r.start_s + r.e2e_s for r in results[:2])
    assert starts[2] >= first_end


def test_open_loop_records_a_refused_request_as_failed(server: TandemStack) -> None:
    requests = [BenchRequest([5, 6, 7], 4), BenchRequest([8, 9], 4)]
    results, _ = asyncio.run(run_load(server.url, "no-such-model", requests, rate=20.0))
    assert len(results) == 2
    for result in results:
        assert result.error is not None and result.error.startswith("HTTP 404")
        assert "no-such-model" in result.error
        assert result.output_tokens == 0 and result.token_times_s == []
