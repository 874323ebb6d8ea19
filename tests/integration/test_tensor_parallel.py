"""SmolLM2 served at tensor-parallel size 2 (two worker processes in a gloo group, 9
attention heads split 3 + 6 by GQA group): the greedy tokens of size 1 for 8 concurrent
prompts (float32; ties as ARCHITECTURE.md defines them), and a rank killed mid-generation
takes the service down cleanly, naming it. The ranks run on the CPU on every host: one
GPU cannot hold two ranks, and tensor parallelism over NCCL is not tested here."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from tests.integration.test_faults import long_stream
from tests.parity.ties import assert_greedy_parity, our_logprobs_fn
from tests.stack import CPU_WORKERS, TandemStack

MODEL = "smollm2-135m-instruct"
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Here is a short poem about the sea:\n",
    "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n",
    "The three primary colours are",
    "Once upon a time, in a small village by the sea,",
    "import numpy as np\n",
    "List of planets in order:",
]
MAX_TOKENS = 32


async def greedy_all(url: str) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, output ids) of every prompt, all sent at once."""
    async with httpx.AsyncClient(timeout=300) as client:

        async def one(prompt: str) -> tuple[list[int], list[int]]:
            body = {
                "model": MODEL,
                "prompt": prompt,
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "return_token_ids": True,
            }
            r = await client.post(f"{url}/v1/completions", json=body)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            return list(choice["prompt_token_ids"]), list(choice["token_ids"])

        return list(await asyncio.gather(*(one(p) for p in PROMPTS)))


def rank_of(proc: psutil.Process) -> str | None:
    argv = proc.cmdline()
    return argv[argv.index("--rank") + 1] if "--rank" in argv else None


@pytest.fixture(scope="module")
def two_ranks(smollm2_dir: Path) -> Iterator[TandemStack]:
    """Two ranks, each step planned after the last (the other test schedules ahead)."""
    flags = ("--tensor-parallel-size", "2", "--dtype", "float32", "--no-async-scheduling")
    with TandemStack(*flags, env=CPU_WORKERS) as stack:
        yield stack


# Under slow: the fast suite serves two ranks with the default, async scheduling below
# (and tests/parity/test_tensor_parallel.py steps them in process).
@pytest.mark.slow
def test_two_ranks_serve_the_greedy_tokens_of_one(
    two_ranks: TandemStack, server: TandemStack, smollm2_dir: Path
) -> None:
    assert sorted(filter(None, map(rank_of, two_ranks.descendants()))) == ["0", "1"]
    sharded = asyncio.run(greedy_all(two_ranks.url))
    whole = asyncio.run(greedy_all(server.url))  # the shared float32 stack, one rank
    ours = our_logprobs_fn(smollm2_dir)
    for (prompt, a), (prompt_b, b) in zip(sharded, whole, strict=True):
        assert prompt == prompt_b
        assert_greedy_parity(prompt, a, b, ours, ours)
    stats = httpx.get(f"{two_ranks.url}/stats", timeout=10).json()
    assert stats["num_kv_blocks_in_use"] == 0


def test_two_ranks_with_async_scheduling_serve_the_greedy_tokens_of_one(
    server: TandemStack, smollm2_dir: Path
) -> None:
    """The next step leaves the engine before rank 0's tokens reach it: rank 1 takes
    them from rank 0 (a broadcast), or its KV would go wrong from the second token."""
    flags = ("--tensor-parallel-size", "2", "--dtype", "float32", "--async-scheduling")
    with TandemStack(*flags, env=CPU_WORKERS) as stack:
        sharded = asyncio.run(greedy_all(stack.url))
        stats = httpx.get(f"{stack.url}/stats", timeout=10).json()
    whole = asyncio.run(greedy_all(server.url))
    ours = our_logprobs_fn(smollm2_dir)
    for (prompt, a), (_, b) in zip(sharded, whole, strict=True):
        assert_greedy_parity(prompt, a, b, ours, ours)
    assert stats["num_kv_blocks_in_use"] == 0


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--tensor-parallel-size", "2"], "worker-1"),
        (
            ["--prefill-workers", "1", "--decode-workers", "1", "--decode-tp", "2"],
            "decode worker-1",
        ),
    ],
    ids=["unified", "split-decode-pool"],
)
def test_a_rank_killed_mid_generation_stops_the_service_naming_it(
    smollm2_dir: Path, flags: list[str], named: str
) -> None:
    stack = TandemStack(*flags, "--grace-period-s", "1", env=CPU_WORKERS).start()
    events: list[tuple[float, str]] = []
    thread = threading.Thread(target=long_stream, args=(stack.url, events))
    thread.start()
    deadline = time.monotonic() + 60
    while len(events) < 10:
        assert time.monotonic() < deadline, "the stream never started"
        time.sleep(0.02)
    rank1 = next(p for p in stack.descendants() if rank_of(p) == "1")
    everyone = stack.descendants()
    rank1.kill()
    thread.join(timeout=20)
    assert not thread.is_alive(), "the stream hung"
    assert events[-1][1] == "[DONE]" and "error" in json.loads(events[-2][1])
    assert events[-2][0] - events[-3][0] < 2.0  # ended within 2 s of the last token
    assert stack.proc is not None and stack.proc.wait(timeout=30) != 0
    why = stack.log().split("tandem: ")[-1]
    assert named in why and "killed by signal 9" in why, why
    _, alive = psutil.wait_procs(everyone, timeout=10)
    assert not alive, alive
    stack.stop()
