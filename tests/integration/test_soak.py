"""A soak that loses nothing: 2,000 requests at concurrency 64, random prompt and output
lengths, a quarter of the clients leaving mid-stream and one in twenty cancelling by id.
Afterwards: no 5xx, nothing running or waiting, every KV block free, and every process's
memory (PSS) within 10% of its level after the first 200 requests. The server writes an
audit log meanwhile: one line per request, exactly, and no prompt's text in it."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from tests.stack import TandemStack

MODEL = "smollm2-135m-instruct"
NUM_REQUESTS = 2000
CONCURRENCY = 64
WARM = 200
WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "for",
    "on",
    "are",
    "with",
    "as",
    "by",
    "at",
    "from",
    "his",
    "her",
    "they",
    "this",
    "that",
]


def memory(stack: TandemStack) -> dict[str, int]:
    """PSS per process (shared pages counted once across the service)."""
    out = {}
    for p in stack.descendants():
        cmd = p.cmdline()
        out[cmd[cmd.index("-m") + 1]] = p.memory_full_info().pss
    return out


async def one(
    client: httpx.AsyncClient,
    url: str,
    rng: random.Random,
    statuses: Counter[str],
    sent: dict[str, str],
) -> None:
    """One request; ``sent`` maps its id (``X-Request-Id``) to its prompt."""
    # Up to 100 words: prefill is most of the soak's compute, and what it hunts (leaks,
    # requests that do not end exactly once) lives in the request paths, not in long
    # prompts (the split-pool parity and interference tests take those).
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 100)))
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": rng.randint(1, 48),
        "temperature": rng.choice([0.0, 1.0]),
        "stream": rng.random() < 0.8,
    }
    fate = rng.random()
    if not body["stream"]:
        r = await client.post(f"{url}/v1/completions", json=body)
        statuses[str(r.status_code)] += 1
        sent[r.headers.get("x-request-id", f"none-{len(sent)}")] = prompt
        return
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        statuses[str(r.status_code)] += 1
        sent[r.headers.get("x-request-id", f"none-{len(sent)}")] = prompt
        if r.status_code != 200:
            return
        chunks = 0
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            chunks += 1
            if line == "data: [DONE]":
                return
            if "error" in json.loads(line[6:]):
                statuses["stream-error"] += 1
            if fate < 0.25 and chunks >= 2:
                statuses["left"] += 1
                return  # the client goes away mid-stream
            if 0.25 <= fate < 0.30 and chunks == 1:
                cancel = await client.post(f"{url}/v1/requests/{r.headers['x-request-id']}/cancel")
                statuses[f"cancel-{cancel.status_code}"] += 1


@pytest.mark.slow
def test_soak_loses_nothing(smollm2_dir: Path, tmp_path: Path) -> None:
    audit_log = tmp_path / "audit.jsonl"
    flags = ("--max-num-seqs", str(CONCURRENCY), "--max-model-len", "512")
    with TandemStack(*flags, "--audit-log", str(audit_log)) as stack:
        statuses: Counter[str] = Counter()
        sent: dict[str, str] = {}
        rng = random.Random(2026)
        warm: dict[str, int] = {}

        async def run() -> None:
            limits = httpx.Limits(max_connections=CONCURRENCY + 8)
            async with httpx.AsyncClient(timeout=300, limits=limits) as client:
                gate = asyncio.Semaphore(CONCURRENCY)
                done = 0

                async def bounded() -> None:
                    nonlocal done
                    async with gate:
                        await one(client, stack.url, rng, statuses, sent)
                    done += 1
                    if done == WARM:
                        warm.update(memory(stack))

                await asyncio.gather(*(bounded() for _ in range(NUM_REQUESTS)))

        started = time.monotonic()
        asyncio.run(run())
        took = time.monotonic() - started
        deadline = time.monotonic() + 30
        while True:
            stats = httpx.get(f"{stack.url}/stats").json()
            idle = (stats["active_requests"], stats["waiting_requests"]) == (0, 0)
            if idle and stats["num_kv_blocks_in_use"] == 0:
                break
            assert time.monotonic() < deadline, stats
            time.sleep(0.2)
        time.sleep(2.0)  # idle: the worker hands its allocator's free pages back
        after = memory(stack)
        print(f"\nsoak: {NUM_REQUESTS} requests in {took:.0f} s: {dict(statuses)}")
        print({name: (warm[name] >> 20, after[name] >> 20) for name in after}, "MiB PSS")
        assert not [s for s in statuses if s.startswith("5")], statuses
        assert statuses["200"] == NUM_REQUESTS and statuses["stream-error"] == 0
        assert statuses["left"] > 300 and statuses["cancel-200"] > 40
        for name, level in after.items():
            assert level <= 1.10 * warm[name], f"{name} grew from {warm[name]} to {level} bytes"
        assert stack.stop() == 0
    # The audit log: a line per request (stop() drained the writer), ids as answered.
    text = audit_log.read_text()
    lines = [json.loads(line) for line in text.splitlines()]
    print(f"audit log: {len(lines)} lines for {NUM_REQUESTS} requests")
    assert len(lines) == NUM_REQUESTS and len(sent) == NUM_REQUESTS
    assert sorted(line["request_id"] for line in lines) == sorted(sent)
    outcomes = Counter(line["outcome"] for line in lines)
    # A client that left may have had the whole answer sent already: "completed" then.
    assert outcomes["disconnected"] > 0 and not outcomes["error"], outcomes
    for line in lines:
        assert line["route"] == "/v1/completions" and line["status"] == 200, line
        assert len(line["prompt_sha256"]) == 1 and "prompt" not in line, line
    assert not [p for p in set(sent.values()) if p in text], "raw prompt text in the audit log"
