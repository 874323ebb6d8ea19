"""The served path on CUDA: real stacks (launcher, engine, workers, API server) whose
workers find a GPU and use it. A unified pool and prefill/decode pools handing KV over
TCP (GPU blocks gathered on the device, sent from host memory, scattered on the device)
give the same greedy tokens, float32, ties as ARCHITECTURE.md defines them; what runs
on the CPU only (the shared-memory hand-off, the GGUF kernels) is refused with a reason.
Marked ``gpu`` (conftest skips them, saying why, where there is no CUDA device)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tests.parity.ties import assert_greedy_parity, our_logprobs_fn
from tests.stack import TandemStack, completion, free_port

pytestmark = pytest.mark.gpu
MODEL = "smollm2-135m-instruct"
BASE = ("--model", MODEL, "--dtype", "float32", "--max-num-batched-tokens", "256")
SPLIT = ("--prefill-workers", "1", "--decode-workers", "1")
LENGTHS = [700, 5, 300, 60, 40]  # 700 and 300 prefill in several steps of 256


def generate(stack: TandemStack, prompts: list[list[int]]) -> list[list[int]]:
    greedy = {"max_tokens": 12, "temperature": 0, "return_token_ids": True}
    return [
        list(completion(stack.url, prompt, model=MODEL, **greedy)["choices"][0]["token_ids"])
        for prompt in prompts
    ]


def test_split_pools_on_cuda_hand_kv_over_tcp_and_match_the_unified_pool(
    smollm2_dir: Path,
) -> None:
    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    text = " ".join(f"Line {i}: the {w} by the river." for i, w in enumerate(["lamp"] * 120))
    ids: list[int] = tok.encode(text, add_special_tokens=False)
    prompts = [ids[13 * i : 13 * i + n] for i, n in enumerate(LENGTHS)]
    with TandemStack(*BASE) as unified:
        reference = generate(unified, prompts)
        assert "unified worker ready on cuda" in unified.log()
    every_prompt_crosses = ("--disagg-min-prompt-tokens", "0")
    with TandemStack(*BASE, *SPLIT, "--kv-transfer", "tcp", *every_prompt_crosses) as split:
        outputs = generate(split, prompts)
        stats = split.stats_when(
            lambda s: sum(s["kv_transfers"]["outcomes"].values()) == len(prompts)
        )
        log = split.log()
    assert "prefill worker ready on cuda" in log and "decode worker ready on cuda" in log
    logprobs = our_logprobs_fn(smollm2_dir)
    for prompt, ours, ref in zip(prompts, outputs, reference, strict=True):
        assert len(ref) == 12
        assert_greedy_parity(prompt, ours, ref, logprobs, logprobs)
    transfers = stats["kv_transfers"]
    assert transfers["outcomes"]["done"] == len(prompts), transfers  # every prompt crossed
    assert transfers["bytes"] > 0
    assert stats["num_kv_blocks_in_use"] == 0


@pytest.mark.parametrize(
    ("flags", "reason"),
    [
        (SPLIT, "--kv-transfer shm maps KV in host memory: CPU workers only"),
        (("--quantization", "gguf"), "--quantization gguf runs on the native CPU kernels"),
        (("--quantization", "int8"), "--quantization int8 runs on the native CPU kernels"),
    ],
    ids=["shm-hand-off", "gguf-kernels", "int8-kernels"],
)
def test_cpu_only_features_are_refused_on_cuda_saying_why(
    smollm2_dir: Path, flags: tuple[str, ...], reason: str
) -> None:
    port = free_port()
    run = subprocess.run(
        [sys.executable, "-m", "common.cli", "serve", "--port", str(port), *BASE, *flags],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode != 0
    assert reason in run.stdout + run.stderr
