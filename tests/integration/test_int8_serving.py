"""``tandem serve --quantization int8`` as a user runs it: the real processes and sockets,
SmolLM2's projections in W8A8, streamed and whole completions that answer sensibly, a
batch of requests (one step, rows of many lengths) answering each as it answers alone,
and the choice reported in the worker's log."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator

import pytest

from tests.stack import CPU_WORKERS, TandemStack, completion

PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "def add(a, b):\n", "Water boils at"]


@pytest.fixture(scope="module")
def int8_stack() -> Iterator[TandemStack]:
    with TandemStack("--quantization", "int8", "--dtype", "float32", env=CPU_WORKERS) as s:
        yield s


def greedy(url: str, prompt: str) -> str:
    result = completion(url, prompt, max_tokens=12, temperature=0)
    return str(result["choices"][0]["text"])


def test_int8_answers_and_logs_its_kernels(int8_stack: TandemStack) -> None:
    assert "Paris" in greedy(int8_stack.url, PROMPTS[0])
    assert greedy(int8_stack.url, PROMPTS[1]).startswith(" 5, 6")
    log = int8_stack.log()
    assert "quantized 120 projections to int8 per channel (W8A8 on" in log


def test_a_batch_answers_each_request_as_alone(int8_stack: TandemStack) -> None:
    alone = [greedy(int8_stack.url, p) for p in PROMPTS]
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda p: greedy(int8_stack.url, p), PROMPTS))
    assert together == alone  # per-token scales: a row's arithmetic is its own
