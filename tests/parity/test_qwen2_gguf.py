"""A Qwen2 GGUF file as a user passes one (``--model file.gguf --quantization gguf``): a
tiny random Qwen2 written as llama.cpp writes Qwen2.5's (``tests/parity/tiny_gguf.py``:
Q4_0 projections, float32 q/k/v biases, a Q8_0 embedding the tied LM head reads).
Float32 logits within 1e-3 of transformers' model loaded from the same file, the
served greedy tokens equal to its, and in bfloat16 a fused decode step that takes the
biases to ``decode_rows`` where this CPU takes raw rows (that step's bit-identity to the
Python layers: ``tests/unit/test_decode_stack_gguf.py``)."""

from __future__ import annotations

import shutil
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from common.model_files import ensure_local_gguf_converted
from tests.fused_steps import takes_gguf_raw_rows
from tests.parity.test_gguf_models import Batch, assert_float32_logits_follow, quantized
from tests.parity.tiny_gguf import LAYERS, write_tiny_qwen2_gguf
from tests.stack import CPU_WORKERS, TandemStack, completion
from worker.models.base import CausalLM
from worker.models.decode_stack import DecodeStack
from worker.models.decoder import DecoderLM
from worker.models.quant_linear import QuantLinear

MAX_TOKENS = 16
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a small"]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = write_tiny_qwen2_gguf(tmp_path_factory.mktemp("qwen2-gguf") / "tiny-qwen2.gguf")
    converted = ensure_local_gguf_converted(path)  # what tandem serve does with it
    yield path
    # The conversion is cached under the file's path and time, which no later run repeats.
    shutil.rmtree(converted, ignore_errors=True)
    (converted.parent / f".{converted.name}.lock").unlink(missing_ok=True)


@pytest.fixture(scope="module")
def reference(tiny_gguf: Path) -> tuple[Any, PreTrainedModel]:
    directory, name = str(tiny_gguf.parent), tiny_gguf.name
    tok = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    return tok, model.eval()


def test_float32_logits_match_transformers_on_the_same_gguf(
    tiny_gguf: Path, reference: tuple[Any, PreTrainedModel]
) -> None:
    model = quantized(str(tiny_gguf), torch.float32)
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    kinds = Counter(t for m in linears for t in m.type_names)
    assert kinds == {"Q4_0": 7 * LAYERS, "Q8_0": 1}  # q, k, v, o, gate, up, down; LM head
    biases = [m.bias for m in linears if m.bias is not None]
    assert len(biases) == LAYERS and all(b.dtype == torch.float32 for b in biases)
    tok, ref = reference
    prompts = [tok(text).input_ids for text in PROMPTS]
    assert_float32_logits_follow(Batch(model, prompts, torch.float32), ref)


def test_served_from_the_file_with_the_greedy_tokens_of_transformers(
    tiny_gguf: Path, reference: tuple[Any, PreTrainedModel]
) -> None:
    tok, ref = reference
    flags: tuple[str, ...] = ("--model", str(tiny_gguf), "--served-model-name", "tiny-qwen2")
    flags += ("--quantization", "gguf", "--gguf-activations", "float")  # exact: parity
    with TandemStack(*flags, "--dtype", "float32", env=CPU_WORKERS) as s:
        for text in PROMPTS:
            ids = tok(text, return_tensors="pt").input_ids
            with torch.no_grad():
                gen = ref.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)  # type: ignore[operator]
            expected = gen[0, ids.shape[1] :].tolist()
            out = completion(
                s.url,
                ids[0].tolist(),
                model="tiny-qwen2",
                max_tokens=MAX_TOKENS,
                temperature=0,
                ignore_eos=True,
                return_token_ids=True,
            )
            assert out["choices"][0]["token_ids"] == expected, text


def greedy_in_process(model: CausalLM, prompt: list[int]) -> list[int]:
    """MAX_TOKENS greedy tokens of one prompt: a prefill, then a decode step a token."""
    batch = Batch(model, [prompt], torch.float32)
    logits, out = batch.step([0]), []
    for _ in range(MAX_TOKENS):
        out.append(int(logits[0].argmax()))
        batch.seqs[0].append(out[-1])
        if len(out) < MAX_TOKENS:
            logits = batch.step([len(batch.seqs[0]) - 1])
    return out


def test_served_with_8_bit_activations_as_the_kernels_compute_in_process(
    tiny_gguf: Path, reference: tuple[Any, PreTrainedModel]
) -> None:
    """``--gguf-activations q8`` through the real processes: the served greedy tokens are
    the in-process model's on the same kernels (their own quality: bench.quality and
    test_gguf_models)."""
    tok, _ = reference
    model = quantized(str(tiny_gguf), torch.float32, "q8")
    flags: tuple[str, ...] = ("--model", str(tiny_gguf), "--served-model-name", "tiny-qwen2")
    flags += ("--quantization", "gguf", "--gguf-activations", "q8")
    with TandemStack(*flags, "--dtype", "float32", env=CPU_WORKERS) as s:
        for text in PROMPTS:
            ids = tok(text).input_ids
            out = completion(
                s.url,
                ids,
                model="tiny-qwen2",
                max_tokens=MAX_TOKENS,
                temperature=0,
                ignore_eos=True,
                return_token_ids=True,
            )
            assert out["choices"][0]["token_ids"] == greedy_in_process(model, ids), text


def test_bf16_decode_steps_take_the_raw_rows_with_their_biases(tiny_gguf: Path) -> None:
    """The DecodeStack a real Qwen2 GGUF gets: every projection GGUF, q/k/v biases in
    float32, and decode_rows for the steps where this CPU takes raw rows (AVX512-BF16)."""
    model = quantized(str(tiny_gguf), torch.bfloat16)
    assert isinstance(model, DecoderLM)
    fused = model.fused_decode
    assert isinstance(fused, DecodeStack)
    biases = [b for b in fused.biases if b is not None]
    assert len(biases) == LAYERS and all(b.dtype == torch.float32 for b in biases)
    takes_gguf_raw_rows(fused)
