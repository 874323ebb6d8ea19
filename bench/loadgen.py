"""Load over the real HTTP API: streaming ``/v1/completions`` requests sent by a fixed
number of concurrent clients (closed loop) or at Poisson arrival times (open loop).

The client is aiohttp, as in vLLM's own serving benchmark. The load generator shares the
cores with the server it measures, so every microsecond it spends on a token is taken
from the server, and more from a faster one: at 32 clients httpx's streaming cost ~80 us
of client CPU a token against aiohttp's ~31 (2-core AMD EPYC, Tandem at ~1,500 tok/s;
docs/benchmarks.md)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from typing import Any

import aiohttp

from bench.stats import RequestResult, chunk_text, parse_sse_line
from bench.workloads import BenchRequest


def request_body(
    model: str, request: BenchRequest, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Greedy, exactly ``max_tokens`` tokens (EOS ignored), streamed with usage."""
    return {
        **(extra or {}),
        "model": model,
        "prompt": request.prompt_ids,
        "max_tokens": request.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


# An SSE line longer than this (aiohttp raises ValueError) fails its request.
_MAX_LINE_BYTES = 1 << 22


async def send_one(
    client: aiohttp.ClientSession,
    url: str,
    model: str,
    request: BenchRequest,
    t0: float,
    extra: dict[str, Any] | None = None,
) -> RequestResult:
    start = time.perf_counter()
    stamps: list[float] = []
    usage_tokens: int | None = None
    try:
        async with client.post(
            f"{url}/v1/completions", json=request_body(model, request, extra)
        ) as r:
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:200]}")
            async for raw in r.content:
                chunk = parse_sse_line(raw.decode())
                if chunk is None:
                    continue
                if chunk_text(chunk):
                    stamps.append(time.perf_counter() - start)
                usage = chunk.get("usage")
                if usage:
                    usage_tokens = int(usage["completion_tokens"])
    except (aiohttp.ClientError, TimeoutError, RuntimeError, ValueError) as e:
        return RequestResult(start - t0, 0.0, [], time.perf_counter() - start, 0, str(e))
    end = time.perf_counter() - start
    return RequestResult(
        start - t0,
        stamps[0] if stamps else end,
        stamps,
        end,
        usage_tokens if usage_tokens is not None else len(stamps),
    )


async def run_load(
    url: str,
    model: str,
    requests: Sequence[BenchRequest],
    concurrency: int | None = None,
    rate: float | None = None,
    seed: int = 0,
    extra: dict[str, Any] | None = None,
) -> tuple[list[RequestResult], float]:
    """Every request, in order; ``concurrency`` clients each send their next request when
    the last one ends, or (``rate``) requests arrive as a Poisson process; ``extra``
    fields go into every body. Returns the results and the wall time of the run."""
    if (concurrency is None) == (rate is None):
        raise ValueError("give exactly one of concurrency and rate")
    results: list[RequestResult | None] = [None] * len(requests)
    # A fresh connection per request: a server closing an idle keep-alive connection
    # (llama-server does) must not fail the next request sent on it.
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=600.0),
        read_bufsize=_MAX_LINE_BYTES,
    ) as client:
        t0 = time.perf_counter()
        if concurrency is not None:
            queue = list(enumerate(requests))[::-1]

            async def worker() -> None:
                while queue:
                    i, req = queue.pop()
                    results[i] = await send_one(client, url, model, req, t0, extra)

            await asyncio.gather(*(worker() for _ in range(concurrency)))
        else:
            assert rate is not None
            rng = random.Random(seed)
            arrivals, t = [], 0.0
            for _ in requests:
                t += rng.expovariate(rate)
                arrivals.append(t)

            async def timed(i: int, req: BenchRequest, at: float) -> None:
                await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
                results[i] = await send_one(client, url, model, req, t0, extra)

            await asyncio.gather(
                *(timed(i, r, a) for i, (r, a) in enumerate(zip(requests, arrivals, strict=True)))
            )
        wall = time.perf_counter() - t0
    return [r for r in results if r is not None], wall
