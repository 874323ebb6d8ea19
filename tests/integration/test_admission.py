"""Admission over HTTP: priorities order the queue, a full queue answers 503 with
Retry-After, and prompts beyond the context are refused before any streaming."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.stack import TandemStack

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def one_slot(smollm2_dir: Path) -> Iterator[TandemStack]:
    flags = (
        "--max-num-seqs",
        "1",
        "--max-waiting-requests",
        "2",
        "--scheduling-policy",
        "priority",
        "--priority-aging-s",
        "1000",
        "--max-model-len",
        "256",
    )
    with TandemStack(*flags) as stack:
        yield stack


def test_priority_order_and_full_queue(one_slot: TandemStack) -> None:
    finished: list[str] = []

    async def run() -> httpx.Response:
        async with httpx.AsyncClient(timeout=120) as client:

            async def complete(name: str, max_tokens: int, priority: int) -> httpx.Response:
                body = {
                    "model": MODEL,
                    "prompt": f"{name}: count slowly",
                    "max_tokens": max_tokens,
                    "ignore_eos": True,
                    "priority": priority,
                }
                r = await client.post(f"{one_slot.url}/v1/completions", json=body)
                finished.append(name)
                return r

            async def wait_for(running: int, waiting: int) -> None:
                for _ in range(200):
                    s = (await client.get(f"{one_slot.url}/stats")).json()
                    if (s["active_requests"], s["waiting_requests"]) == (running, waiting):
                        return
                    await asyncio.sleep(0.05)
                raise AssertionError(
                    f"stats never showed {running} running, {waiting} waiting: {s}"
                )

            blocker = asyncio.create_task(complete("blocker", 60, 0))
            await wait_for(1, 0)
            low = asyncio.create_task(complete("low", 2, 5))
            await wait_for(1, 1)
            high = asyncio.create_task(complete("high", 2, 0))
            await wait_for(1, 2)
            refused = await client.post(
                f"{one_slot.url}/v1/completions",
                json={"model": MODEL, "prompt": "one too many", "max_tokens": 2},
            )
            for task in (blocker, low, high):
                assert (await task).status_code == 200
            return refused

    refused = asyncio.run(run())
    assert refused.status_code == 503
    assert refused.headers["retry-after"]
    assert refused.json()["error"]["code"] == "queue_full"
    assert finished == ["blocker", "high", "low"]  # high was queued after low but ran first


def test_prompt_beyond_context_is_refused_with_numbers(one_slot: TandemStack) -> None:
    prompt = "word " * 300
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "stream": True}
    started = time.monotonic()
    r = httpx.post(f"{one_slot.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400
    assert r.headers["content-type"].startswith("application/json")  # refused before any streaming
    message = r.json()["error"]["message"]
    num_prompt = len(
        httpx.post(f"{one_slot.url}/tokenize", json={"model": MODEL, "prompt": prompt}).json()[
            "tokens"
        ]
    )
    assert f"{num_prompt} tokens" in message and "256 tokens" in message
    assert time.monotonic() - started < 5
    r = httpx.post(
        f"{one_slot.url}/v1/completions",
        json={"model": MODEL, "prompt": "word " * 200, "max_tokens": 100},
        timeout=30,
    )
    assert r.status_code == 400 and "256" in r.json()["error"]["message"]
