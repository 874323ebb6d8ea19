"""The fused decode step (every layer in one native call) against the Python layers it
replaces, on tiny random bfloat16 checkpoints: bit-identical hidden states and KV caches
for decode steps of 1-4 rows; chosen exactly for llama-shaped models with the GEMV, and
never for a step holding a prefill or more than 4 rows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.parity.families import VOCAB, build
from worker.attention import AttentionMetadata, build_metadata
from worker.models.decoder import DecoderLM
from worker.models.loader import load_model
from worker.native import load_native_kernels
from worker.ops import NativeOps

BLOCK = 4
FUSED = ["llama", "llama-gqa3", "llama-mqa", "llama3-rope", "qwen2"]  # qwen2: q/k/v biases


def load(family: str, tmp_path: Path) -> DecoderLM:
    build(family, tmp_path)
    model = load_model(
        tmp_path, torch.bfloat16, torch.device("cpu"), NativeOps(load_native_kernels())
    )
    assert isinstance(model, DecoderLM)
    return model


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_not_for_models_of_another_shape(family: str, tmp_path: Path) -> None:
    assert load(family, tmp_path).fused_decode is None


@pytest.mark.parametrize("family", FUSED)
def test_bit_identical_to_the_python_layers(family: str, tmp_path: Path) -> None:
    model = load(family, tmp_path)
    fused = model.fused_decode
    if not load_native_kernels().has_bf16_gemv():
        assert fused is None  # no GEMV on this CPU: the Python layers run every step
        return
    assert fused is not None
    taken: list[int] = []
    takes = fused.takes

    def counted(meta: AttentionMetadata, num_tokens: int) -> bool:
        taken.append(num_tokens)
        return takes(meta, num_tokens)

    fused.takes = counted  # type: ignore[method-assign]

    gen = torch.Generator().manual_seed(len(family))
    prompts = [
        torch.randint(0, VOCAB, (length,), generator=gen).tolist() for length in (5, 9, 3, 12, 7)
    ]
    blocks = [list(range(8 * i, 8 * i + 8)) for i in range(len(prompts))]
    shape = model.kv_cache_shape(8 * len(prompts) * BLOCK)
    caches = {
        side: [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(model.num_layers)]
        for side in ("fused", "python")
    }

    def step(
        side: str, seqs: list[int], tokens: list[list[int]], starts: list[int]
    ) -> torch.Tensor:
        lengths = [len(t) for t in tokens]
        ids = torch.tensor([t for ts in tokens for t in ts])
        pos = torch.tensor([s + i for s, n in zip(starts, lengths, strict=True) for i in range(n)])
        meta = build_metadata(
            [blocks[i] for i in seqs], starts, lengths, BLOCK, torch.device("cpu")
        )
        model.fused_decode = fused if side == "fused" else None
        with torch.inference_mode():
            return model(ids, pos, caches[side], meta)

    everyone = list(range(len(prompts)))
    for side in caches:  # the prompts, in one prefill step: never the fused path
        step(side, everyone, prompts, [0] * len(prompts))
    assert taken == [sum(map(len, prompts))]
    lengths = [len(p) for p in prompts]
    for seqs in ([0], [1, 2], [0, 3, 4], [1, 2, 3, 4], [0, 1, 2, 3, 4], [4]):
        tokens = [[int(torch.randint(0, VOCAB, (1,), generator=gen))] for _ in seqs]
        starts = [lengths[i] for i in seqs]
        out = {side: step(side, seqs, tokens, starts) for side in caches}
        assert torch.equal(out["fused"], out["python"]), f"decode rows {seqs}"
        for i in seqs:
            lengths[i] += 1
    for fused_cache, python_cache in zip(caches["fused"], caches["python"], strict=True):
        assert torch.equal(fused_cache, python_cache)
    assert taken[1:] == [1, 2, 3, 4, 5, 1]  # asked each step; 5 rows go to the Python layers
