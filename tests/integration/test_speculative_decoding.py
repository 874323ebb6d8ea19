"""Speculative decoding (``--speculative-config`` ngram) changes no output: 16 concurrent
greedy requests on the embedded SmolLM2 (float32) equal speculation off token for token
(ties as ARCHITECTURE.md), with stop strings, ``max_tokens`` and EOS falling inside
drafted runs, with the prefix cache warm, under preemption, with a JSON schema and
through split pools; a seeded sampled request gives the same text with it on and off."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.parity.ties import LogprobsFn, assert_greedy_parity, our_logprobs_fn
from tests.stack import TandemStack

MODEL = "smollm2-135m-instruct"
CODE = """def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal + tax
"""
SENTENCE = "the quick brown fox jumps over the lazy dog near the quiet river bank"
ASKS = [
    f"Rewrite this code with subtotal renamed to base:\n{CODE}",
    f"Rewrite this code with items renamed to products:\n{CODE}",
    f"Copy this code exactly:\n{CODE}",
    f"Add a docstring to this function:\n{CODE}",
    f"Repeat exactly: {SENTENCE}, {SENTENCE}.",
    f"Repeat this sentence three times: {SENTENCE}.",
    "List the numbers from 1 to 30, separated by commas.",
    "Write the alphabet in capital letters with spaces between the letters.",
    "What is the capital of Japan?",
    "Name a primary colour.",
    "What do bees make?",
    "Who wrote Hamlet?",
    "Explain in two sentences why the sky is blue.",
    "What is 7 times 6?",
    "Write a haiku about the sea.",
    "How many legs does a spider have?",
]
PROMPTS = [f"<|im_start|>user\n{a}<|im_end|>\n<|im_start|>assistant\n" for a in ASKS]
# Odd lengths and stop strings, so an end falls inside a drafted run.
MAX_TOKENS = [61, 77, 90, 45, 83, 70, 59, 66, 24, 24, 24, 24, 40, 24, 33, 24]
STOPS: list[list[str] | None] = [None] * 16
STOPS[1], STOPS[4], STOPS[6] = ["tax_rate)"], ["river bank, the"], ["17"]
SPEC = json.dumps(
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
)
BASE = ("--dtype", "float32", "--max-num-seqs", "16")
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "year": {"type": "integer"}},
    "required": ["city", "year"],
}


def run_all(stack: TandemStack) -> list[dict[str, Any]]:
    """Each prompt's choice (token ids, text, finish reason), all sent at once."""

    async def go() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(timeout=600) as client:

            async def one(i: int) -> dict[str, Any]:
                body = {
                    "model": MODEL,
                    "prompt": PROMPTS[i],
                    "max_tokens": MAX_TOKENS[i],
                    "temperature": 0,
                    "return_token_ids": True,
                    "stop": STOPS[i],
                }
                r = await client.post(f"{stack.url}/v1/completions", json=body)
                assert r.status_code == 200, r.text
                return dict(r.json()["choices"][0])

            return list(await asyncio.gather(*(one(i) for i in range(len(PROMPTS)))))

    return asyncio.run(go())


def structured_and_seeded(stack: TandemStack) -> list[str]:
    """A JSON-schema answer and two seeded sampled ones."""
    texts = []
    body: dict[str, Any] = {
        "model": MODEL,
        "prompt": PROMPTS[0],
        "max_tokens": 60,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}},
    }
    r = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    texts.append(r.json()["choices"][0]["text"])
    for seed in (7, 11):
        body = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 60, "temperature": 0.8,
                "top_p": 0.95, "seed": seed}  # fmt: skip
        r = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        texts.append(r.json()["choices"][0]["text"])
    return texts


@pytest.fixture(scope="module")
def baseline(smollm2_dir: Path) -> Iterator[tuple[list[dict[str, Any]], list[str]]]:
    with TandemStack(*BASE) as stack:
        yield run_all(stack), structured_and_seeded(stack)


@pytest.fixture(scope="module")
def logprobs_fn(smollm2_dir: Path) -> LogprobsFn:
    return our_logprobs_fn(smollm2_dir)


def assert_same(
    outputs: list[dict[str, Any]], reference: list[dict[str, Any]], fn: LogprobsFn
) -> None:
    from transformers import AutoTokenizer

    from common.model_files import resolve_model_dir

    tok = AutoTokenizer.from_pretrained(str(resolve_model_dir(MODEL)))
    for prompt, ours, ref in zip(PROMPTS, outputs, reference, strict=True):
        if ours["token_ids"] == ref["token_ids"]:
            assert (ours["text"], ours["finish_reason"]) == (ref["text"], ref["finish_reason"])
            continue
        assert_greedy_parity(tok.encode(prompt), ours["token_ids"], ref["token_ids"], fn, fn)


def spec_stats(stack: TandemStack) -> dict[str, Any]:
    return dict(httpx.get(f"{stack.url}/stats").json()["spec_decode"])


def test_ngram_speculation_changes_no_output(baseline, logprobs_fn) -> None:
    reference, others = baseline
    stops = [c["finish_reason"] for c in reference]
    assert stops.count("stop") >= 6 and stops.count("length") >= 4, stops  # every kind of end
    with TandemStack(*BASE, "--speculative-config", SPEC) as stack:
        first = run_all(stack)
        second = run_all(stack)  # the prompts' blocks now come from the prefix cache
        assert httpx.get(f"{stack.url}/stats").json()["prefix_cache_hits"] > 0
        assert structured_and_seeded(stack) == others
        stats = spec_stats(stack)
        metrics = httpx.get(f"{stack.url}/metrics").text
    assert_same(first, reference, logprobs_fn)
    assert_same(second, reference, logprobs_fn)
    # Drafts were verified and most copying runs were accepted.
    assert stats["num_drafts"] > 50 and stats["num_accepted_tokens"] > 100, stats
    assert stats["num_accepted_tokens_per_pos"][0] >= stats["num_accepted_tokens_per_pos"][-1]
    accepted = stats["num_accepted_tokens"]
    assert f'tandem:spec_decode_num_accepted_tokens_total{{model_name="{MODEL}"}} {accepted}' in (
        metrics.replace(".0\n", "\n")
    )


def test_speculation_under_preemption_changes_no_output(baseline, logprobs_fn) -> None:
    flags = ("--block-size", "4", "--num-kv-blocks", "96", "--no-enable-prefix-caching")
    with TandemStack(*BASE, *flags, "--speculative-config", SPEC) as stack:
        outputs = run_all(stack)
        stats = httpx.get(f"{stack.url}/stats").json()
    assert stats["preemptions"] > 0 and stats["spec_decode"]["num_accepted_tokens"] > 0, stats
    assert_same(outputs, baseline[0], logprobs_fn)


@pytest.mark.slow
def test_speculation_through_split_pools_changes_no_output(baseline, logprobs_fn) -> None:
    flags = ("--prefill-workers", "1", "--decode-workers", "1")
    with TandemStack(*BASE, *flags, "--speculative-config", SPEC) as stack:
        outputs = run_all(stack)
        stats = spec_stats(stack)
    assert stats["num_accepted_tokens"] > 0, stats
    assert_same(outputs, baseline[0], logprobs_fn)


def test_speculation_with_tensor_parallelism_is_refused_at_start() -> None:
    stack = TandemStack(*BASE, "--tensor-parallel-size", "2", "--speculative-config", SPEC)
    stack.start(wait=False)
    assert stack.proc is not None
    assert stack.proc.wait(timeout=60) != 0
    assert "--speculative-config with tensor parallelism is not served yet" in stack.log()
