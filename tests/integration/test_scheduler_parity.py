"""Greedy outputs of 16 concurrent requests do not depend on how they were scheduled:
prefix caching on or off, step budgets of 16, 64 or unlimited, a KV pool so small
that requests are preempted and recomputed, each with async scheduling (each step
planned while the worker runs the last: the default) and some without it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.parity.ties import LogprobsFn, assert_greedy_parity, our_logprobs_fn
from tests.stack import TandemStack

SYSTEM = (
    "<|im_start|>system\nYou are a careful assistant. Explain your answer in a few sentences.<|im_end|>\n"
    "<|im_start|>user\n"
)
ASSISTANT = "<|im_end|>\n<|im_start|>assistant\n"
QUESTIONS = [
    "What is the boiling point of water?",
    "Name a primary colour.",
    "What is 7 times 6?",
    "Which planet is the largest?",
    "What do bees make?",
    "How many legs does a spider have?",
    "What is the capital of Japan?",
    "What language is spoken in Brazil?",
    "Who wrote Hamlet?",
    "What gas do plants absorb?",
    "What is the opposite of hot?",
    "How many days are in a week?",
    "What is frozen water called?",
    "Which animal barks?",
    "What colour is the sky?",
    "What is 10 minus 3?",
]
MAX_TOKENS = 24
BASE = ("--dtype", "float32", "--max-num-seqs", "16")


def run_all(stack: TandemStack) -> list[list[int]]:
    async def go() -> list[list[int]]:
        async with httpx.AsyncClient(timeout=300) as client:

            async def one(question: str) -> list[int]:
                body = {
                    "model": "smollm2-135m-instruct",
                    "prompt": SYSTEM + question + ASSISTANT,
                    "max_tokens": MAX_TOKENS,
                    "temperature": 0,
                    "return_token_ids": True,
                }
                r = await client.post(f"{stack.url}/v1/completions", json=body)
                assert r.status_code == 200, r.text
                return list(r.json()["choices"][0]["token_ids"])

            return list(await asyncio.gather(*(one(q) for q in QUESTIONS)))

    return asyncio.run(go())


@pytest.fixture(scope="module")
def baseline(smollm2_dir: Path) -> Iterator[tuple[list[list[int]], list[list[int]]]]:
    with TandemStack(*BASE, "--max-num-batched-tokens", "8192") as stack:
        first = run_all(stack)
        second = run_all(stack)  # now every prompt's shared prefix is cached
        stats = httpx.get(f"{stack.url}/stats").json()
        assert stats["prefix_cache_hits"] > 0
        yield first, second


@pytest.fixture(scope="module")
def logprobs_fn(smollm2_dir: Path) -> LogprobsFn:
    return our_logprobs_fn(smollm2_dir)


def assert_same(outputs: list[list[int]], reference: list[list[int]], fn: LogprobsFn) -> None:
    from transformers import AutoTokenizer

    from common.model_files import resolve_model_dir

    tok = AutoTokenizer.from_pretrained(str(resolve_model_dir("smollm2-135m-instruct")))
    for question, ours, ref in zip(QUESTIONS, outputs, reference, strict=True):
        assert_greedy_parity(tok.encode(SYSTEM + question + ASSISTANT), ours, ref, fn, fn)


def test_prefix_cache_hits_change_nothing(baseline, logprobs_fn) -> None:
    first, second = baseline
    assert sum(len(o) for o in first) > 10 * len(first)  # real answers, not just EOS
    assert_same(second, first, logprobs_fn)


@pytest.mark.parametrize(
    "flags",
    [
        ("--no-enable-prefix-caching", "--max-num-batched-tokens", "8192"),
        ("--max-num-batched-tokens", "16"),
        # Chunks of 64 also run with each step planned after the last: one stack for both.
        ("--no-async-scheduling", "--max-num-batched-tokens", "64"),
    ],
    ids=["prefix-cache-off", "budget-16", "sync-budget-64"],
)
def test_scheduling_choices_change_nothing(flags: tuple[str, ...], baseline, logprobs_fn) -> None:
    with TandemStack(*BASE, *flags) as stack:
        outputs = run_all(stack)
    assert_same(outputs, baseline[0], logprobs_fn)


# Preemption planned after each step is under slow; the fast suite preempts with the
# default, async scheduling (and runs sync scheduling above, at a budget of 64).
@pytest.mark.parametrize(
    "scheduling",
    [pytest.param(("--no-async-scheduling",), marks=pytest.mark.slow), ("--async-scheduling",)],
    ids=["sync", "async"],
)
def test_preemption_changes_nothing(scheduling: tuple[str, ...], baseline, logprobs_fn) -> None:
    # Prompts of ~40 tokens take ~10 blocks of 4: 32 blocks admit three requests,
    # whose decodes then run out of blocks within a few tokens.
    flags = ("--block-size", "4", "--num-kv-blocks", "32", "--no-enable-prefix-caching")
    with TandemStack(*BASE, *flags, *scheduling) as stack:
        outputs = run_all(stack)
        stats = httpx.get(f"{stack.url}/stats").json()
    assert stats["preemptions"] > 0
    assert_same(outputs, baseline[0], logprobs_fn)
