"""Split pools give the unified pool's greedy outputs, token for token (float32; ties as
ARCHITECTURE.md defines them): 16 concurrent requests with prompts of 5 to 750 tokens
(some longer than the step budget of 512, some sharing a prefix, the longest past
Gemma's 512-token sliding window; SmolLM2's at half those lengths and half the budget,
chunked as often at half the float32 prefill work), through prefill and decode pools handing KV over
shared memory and over TCP, with conditional disaggregation on and off. SmolLM2 runs in
every suite; Gemma-3-270M (sliding-window layers) and the other combinations under
``slow``. Every stack here runs on the CPU, on any host: shm hand-offs and tensor
parallelism over gloo are CPU features (tests/parity/test_cuda_stacks.py splits pools
on a GPU)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from common.model_files import resolve_model_dir
from tests.parity.ties import LogprobsFn, assert_greedy_parity, our_logprobs_fn
from tests.stack import CPU_WORKERS, TandemStack

MAX_TOKENS = 12
# Long prompts first, so that the shorter ones arrive while the prefill pool is busy. A
# step budget of a quarter of the default keeps prompts past it at a quarter of the
# float32 prefill work (which took most of this file's ~7 minutes at 3,000 tokens).
LENGTHS = [750, 650, 5, 525, 12, 425, 40, 275, 150, 175, 100]
SHARED_TAILS = [5, 10, 50, 150, 475]  # after one 150-token prefix
STEP_BUDGET = 512
# Gemma's prompts must pass its 512-token window; SmolLM2 has none, so its prompts and
# step budget are halved (the same chunking, half the prefill work in each of its stacks).
SCALE = {"gemma-3-270m": 1, "smollm2-135m-instruct": 2}


def base_flags(model: str) -> tuple[str, ...]:
    budget = STEP_BUDGET // SCALE[model]
    return ("--dtype", "float32", "--max-num-seqs", "16", "--max-num-batched-tokens", str(budget))


WORDS = [
    "river",
    "stone",
    "light",
    "garden",
    "music",
    "winter",
    "paper",
    "window",
    "bread",
    "silver",
    "forest",
    "engine",
    "morning",
    "harbor",
    "letter",
    "mountain",
    "candle",
    "thunder",
    "orchard",
    "lantern",
    "meadow",
    "violin",
    "compass",
    "glacier",
    "ribbon",
    "falcon",
    "canyon",
    "saddle",
    "marble",
    "pepper",
    "anchor",
    "blossom",
]


def prompts(model: str) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(str(resolve_model_dir(model)))
    rng = random.Random(11)
    text = " ".join(rng.choice(WORDS) + ("." if rng.random() < 0.1 else "") for _ in range(9000))
    ids: list[int] = tok.encode(text, add_special_tokens=False)
    scale = SCALE[model]
    out = [ids[i * 7 : i * 7 + max(n // scale, 5)] for i, n in enumerate(LENGTHS)]
    shared = ids[4000 : 4000 + 150 // scale]
    out += [
        shared + ids[5000 + 50 * i : 5000 + 50 * i + max(n // scale, 5)]
        for i, n in enumerate(SHARED_TAILS)
    ]
    assert len(out) == 16 and max(map(len, out)) == 750 // scale
    assert sum(len(p) > STEP_BUDGET // scale for p in out) >= 3  # chunked over several steps
    return out


def run_all(stack: TandemStack, model: str, batch: list[list[int]]) -> list[list[int]]:
    async def go() -> list[list[int]]:
        async with httpx.AsyncClient(timeout=600) as client:

            async def one(prompt: list[int]) -> list[int]:
                body = {
                    "model": model,
                    "prompt": prompt,
                    "max_tokens": MAX_TOKENS,
                    "temperature": 0,
                    "return_token_ids": True,
                }
                r = await client.post(f"{stack.url}/v1/completions", json=body)
                assert r.status_code == 200, r.text
                return list(r.json()["choices"][0]["token_ids"])

            return list(await asyncio.gather(*(one(p) for p in batch)))

    return asyncio.run(go())


class Reference:
    def __init__(self, model: str) -> None:
        self.model = model
        self.prompts = prompts(model)
        with TandemStack("--model", model, *base_flags(model), env=CPU_WORKERS) as stack:
            self.outputs = run_all(stack, model, self.prompts)
        assert sum(map(len, self.outputs)) > 8 * len(self.outputs)
        self.logprobs: LogprobsFn = our_logprobs_fn(resolve_model_dir(model))


@pytest.fixture(scope="module")
def smollm2(smollm2_dir: Path) -> Reference:
    return Reference("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def gemma() -> Iterator[Reference]:
    yield Reference("gemma-3-270m")


def split(
    reference: Reference,
    kv_transfer: str,
    conditional: bool,
    prefill_tp: int = 1,
    decode_tp: int = 1,
    *extra: str,
) -> dict[str, Any]:
    flags = [
        *extra,
        *("--prefill-tp", str(prefill_tp), "--decode-tp", str(decode_tp)),
        "--model",
        reference.model,
        *base_flags(reference.model),
        "--prefill-workers",
        "1",
        "--decode-workers",
        "1",
        "--kv-transfer",
        kv_transfer,
        # on: short prompts stay in the decode pool (shm: while prefill is busy)
        "--disagg-min-prompt-tokens",
        "50" if conditional else "0",
    ]
    if prefill_tp == decode_tp == 1:
        # Both workers take both cores (default: one each), as the unified reference does:
        # the prefill pool does most of this work, and a worker whose cores are taken
        # gives a thread up (ThreadGovernor). ~30% off each run here; the outputs do not
        # depend on thread counts.
        flags += ["--worker-threads", "2"]
    with TandemStack(*flags, env=CPU_WORKERS) as stack:
        outputs = run_all(stack, reference.model, reference.prompts)
        # every request ends its hand-off one way or the other before it answers
        stats = stack.stats_when(
            lambda s: sum(s["kv_transfers"]["outcomes"].values()) == len(reference.prompts)
        )
    for prompt, ours, ref in zip(reference.prompts, outputs, reference.outputs, strict=True):
        assert_greedy_parity(prompt, ours, ref, reference.logprobs, reference.logprobs)
    transfers = stats["kv_transfers"]["outcomes"]
    assert sum(transfers.values()) == len(reference.prompts)
    assert transfers["done"] > 0  # prompts really went through the hand-off
    if conditional:
        assert transfers["local_prefill"] > 0  # and some really stayed
    else:
        assert transfers["local_prefill"] == 0
    assert stats["num_kv_blocks_in_use"] == 0 and set(stats["pools"]) == {"prefill", "decode"}
    assert sum(v for k, v in transfers.items() if k not in ("done", "local_prefill")) == 0
    return stats


# tcp at equal widths is under slow: the fast suite's tcp hand-offs are those of
# tcp-tp1-to-tp2-async below (and tests/integration/test_split_pools.py's).
@pytest.mark.parametrize(
    ("kv_transfer", "conditional"),
    [("shm", True), pytest.param("tcp", False, marks=pytest.mark.slow)],
    ids=["shm-conditional", "tcp"],
)
def test_split_pools_match_the_unified_pool(
    smollm2: Reference, kv_transfer: str, conditional: bool
) -> None:
    stats = split(smollm2, kv_transfer, conditional)
    if kv_transfer == "tcp":
        assert stats["kv_transfers"]["bytes"] > 0


# Gemma's own concern is its sliding-window layers' KV crossing pools: one run per
# transport (SmolLM2 covers every transport x conditional combination).
@pytest.mark.slow
@pytest.mark.parametrize(
    ("kv_transfer", "conditional"), [("shm", True), ("tcp", False)], ids=["shm-conditional", "tcp"]
)
def test_gemma_split_pools_match_the_unified_pool(
    gemma: Reference, kv_transfer: str, conditional: bool
) -> None:
    split(gemma, kv_transfer, conditional)


# Pools of different tensor-parallel widths: the hand-off re-shards the KV heads (SmolLM2's
# 3 KV heads lie 1 + 2 over two ranks). The shm case plans each step after the last
# (--no-async-scheduling); the tcp case schedules ahead (the default): each pool holds
# two steps, so a hand-off's KV orders ride a step sent while the one before it runs, and
# the decode pool's rank 0 broadcasts its tokens to rank 1 (the engine has not seen them
# when it sends the next step). The shm case is under slow (the fast suite re-shards
# once, with the default scheduling).
@pytest.mark.parametrize(
    ("kv_transfer", "prefill_tp", "decode_tp", "scheduling"),
    [
        pytest.param("shm", 2, 1, ("--no-async-scheduling",), marks=pytest.mark.slow),
        ("tcp", 1, 2, ("--async-scheduling",)),
    ],
    ids=["shm-tp2-to-tp1", "tcp-tp1-to-tp2-async"],
)
def test_split_pools_of_different_widths_match_the_unified_pool(
    smollm2: Reference,
    kv_transfer: str,
    prefill_tp: int,
    decode_tp: int,
    scheduling: tuple[str, ...],
) -> None:
    stats = split(smollm2, kv_transfer, False, prefill_tp, decode_tp, *scheduling)
    assert stats["kv_transfers"]["bytes"] > 0  # copied (shm too: the layouts differ)


# The transport x conditional combinations SmolLM2 does not run at equal widths above
# (shm without it, tcp with it) ride on these, and async scheduling over shm (one block
# pool: a block the decode pool frees after its last step in flight is the prefill
# pool's next): one configuration per stack start-up.
@pytest.mark.slow
@pytest.mark.parametrize(
    ("kv_transfer", "prefill_tp", "decode_tp", "conditional", "scheduling"),
    [
        ("shm", 1, 2, False, ("--no-async-scheduling",)),
        ("tcp", 2, 1, True, ("--no-async-scheduling",)),
        ("shm", 2, 2, False, ("--async-scheduling",)),
    ],
    ids=["shm-tp1-to-tp2", "tcp-tp2-to-tp1-conditional", "shm-tp2-to-tp2-async"],
)
def test_split_pools_of_different_widths_match_the_unified_pool_more(
    smollm2: Reference,
    kv_transfer: str,
    prefill_tp: int,
    decode_tp: int,
    conditional: bool,
    scheduling: tuple[str, ...],
) -> None:
    stats = split(smollm2, kv_transfer, conditional, prefill_tp, decode_tp, *scheduling)
    copied = prefill_tp != decode_tp or kv_transfer == "tcp"
    assert (stats["kv_transfers"]["bytes"] > 0) == copied
