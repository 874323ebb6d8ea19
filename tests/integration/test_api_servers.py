"""Several API-server processes on one port (``--api-server-count``): the kernel spreads
connections over them, metrics add up across them, cancel-by-id reaches a request
whichever process holds it, and rate limits count per process (documented)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.stack import TandemStack, module_of

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def two(smollm2_dir: Path) -> Iterator[TandemStack]:
    with TandemStack("--api-server-count", "2", "--max-num-seqs", "32") as stack:
        yield stack


def series(url: str, name: str) -> dict[str, float]:
    """Samples of one metric: label set -> value."""
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(f"tandem:{name}{{"):
            labels, value = line.rsplit(" ", 1)
            out[labels] = float(value)
    return out


def test_two_processes_serve_32_streams(two: TandemStack) -> None:
    names = [str(module_of(p)) for p in two.descendants()]
    assert sorted(names) == ["api_server", "api_server", "engine_core", "worker"]

    async def one(client: httpx.AsyncClient, i: int) -> str:
        body = {
            "model": MODEL,
            "prompt": f"Story {i}:",
            "max_tokens": 8,
            "ignore_eos": True,
            "stream": True,
        }
        async with client.stream("POST", f"{two.url}/v1/completions", json=body) as r:
            lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        return str(json.loads(lines[-2][6:])["choices"][0]["finish_reason"])

    async def run() -> list[str]:
        limits = httpx.Limits(max_keepalive_connections=0)  # a connection each: spread
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            return list(await asyncio.gather(*(one(client, i) for i in range(32))))

    assert asyncio.run(run()) == ["length"] * 32
    per_process = series(two.url, "api_server_requests_total")
    assert len(per_process) == 2 and all(v > 0 for v in per_process.values()), per_process
    assert sum(per_process.values()) == 32
    # Per-request series from both processes add up, whichever one answers the scrape.
    finished = series(two.url, "request_success_total")
    assert sum(v for k, v in finished.items() if 'finished_reason="length"' in k) == 32


def test_api_servers_serve_without_torch(two: TandemStack) -> None:
    """Having answered chat requests (templates rendered, tokens detokenized), neither API
    server has torch loaded (api_server/tokenizer_loader.py); the worker has, which shows
    that the check sees it where it is."""
    for _ in range(4):  # SO_REUSEPORT spreads connections: likely both processes serve one
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        r = httpx.post(f"{two.url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
    loaded = [
        (module_of(p), any("libtorch" in m.path for m in p.memory_maps()))
        for p in two.descendants()
    ]
    assert sorted(loaded) == [
        ("api_server", False),
        ("api_server", False),
        ("engine_core", False),
        ("worker", True),
    ]


def test_cancel_by_id_reaches_the_process_that_holds_the_request(two: TandemStack) -> None:
    async def cancel_one(client: httpx.AsyncClient, i: int) -> tuple[int, str]:
        body = {
            "model": MODEL,
            "prompt": f"Count {i}:",
            "max_tokens": 3000,
            "ignore_eos": True,
            "stream": True,
        }
        async with client.stream("POST", f"{two.url}/v1/completions", json=body) as r:
            request_id = r.headers["x-request-id"]
            status = 0
            last = ""
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if not status:  # streaming: cancel it over another connection
                    cancel = await client.post(f"{two.url}/v1/requests/{request_id}/cancel")
                    status = cancel.status_code
                if line != "data: [DONE]":
                    last = line
        return status, str(json.loads(last[6:])["choices"][0]["finish_reason"])

    async def run() -> list[tuple[int, str]]:
        limits = httpx.Limits(max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            return list(await asyncio.gather(*(cancel_one(client, i) for i in range(8))))

    results = asyncio.run(run())
    assert all(status in (200, 202) for status, _ in results), results  # 202: forwarded
    assert [finish for _, finish in results] == ["abort"] * 8  # every one ended


def test_rate_limits_count_per_process(smollm2_dir: Path) -> None:
    """Documented: with N processes a caller may get up to N times --rate-limit-rpm."""
    with TandemStack("--api-server-count", "2", "--rate-limit-rpm", "3") as stack:
        statuses = []
        for _ in range(12):
            with httpx.Client(limits=httpx.Limits(max_keepalive_connections=0)) as client:
                r = client.post(
                    f"{stack.url}/v1/completions",
                    json={"model": MODEL, "prompt": "Hi", "max_tokens": 1},
                    timeout=60,
                )
            statuses.append(r.status_code)
        admitted = statuses.count(200)
        assert 3 <= admitted <= 6 and statuses.count(429) == 12 - admitted, statuses
