"""``tandem serve --quantization int8`` as a user runs it: the real processes and sockets,
SmolLM2's projections in W8A8, streamed and whole completions that answer sensibly, a
batch of requests (one step, rows of many lengths) answering each as it answers alone,
and the choice reported in the worker's log. And a W8A8 checkpoint of SmolLM2 as
llm-compressor saves it (compressed-tensors), served with no flag at all, as vLLM serves
one: its own int8 weights and scales, answering sensibly."""

from __future__ import annotations

import concurrent.futures
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from common.model_files import resolve_model_dir
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


def test_a_w8a8_checkpoint_is_served_as_it_is_without_a_flag(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    from bench.peers.w8a8_checkpoint import save_w8a8  # compressed-tensors: the dev extra's

    source = resolve_model_dir("smollm2-135m-instruct")
    checkpoint = tmp_path_factory.mktemp("smollm2-w8a8")
    save_w8a8(AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32), checkpoint)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(Path(source) / name, checkpoint / name)
    args = ("--model", str(checkpoint), "--served-model-name", "smollm2-135m-instruct")
    with TandemStack(*args, "--dtype", "float32", env=CPU_WORKERS) as stack:
        assert "Paris" in greedy(stack.url, PROMPTS[0])
        log = stack.log()
    assert "is a W8A8 checkpoint (compressed-tensors): served as int8" in log
    assert "120 projections int8 from the checkpoint's W8A8 (compressed-tensors)" in log
