"""The fused decode step against the Python layers it replaces, on one model: random
prompts prefilled on both sides, then decode steps of several batch shapes, each side
with its own KV caches; hidden states and caches must stay bit-identical."""

from __future__ import annotations

import torch

from tests.parity.families import VOCAB
from worker.attention import build_metadata
from worker.models.decode_stack import DecodeStack
from worker.models.decoder import DecoderLM, FusedDecode

BLOCK = 4
NUM_PROMPTS = 17  # one past a GEMM tile of 14: the last batch needs two tiles


def fused_against_python(model: DecoderLM, fused: FusedDecode, seed: int) -> tuple[int, list[int]]:
    """Steps ``model`` with ``fused`` as its fused decode and without it; asserts equal
    outputs after every decode step and equal caches at the end. Returns the prefill's
    token count and each decode step's rows, in order (the prefill never takes the fused
    path). ``fused`` is the model's fused decode again afterwards."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [int(n) for n in torch.randint(3, 14, (NUM_PROMPTS,), generator=gen)]
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]
    blocks = [list(range(8 * i, 8 * i + 8)) for i in range(len(prompts))]
    shape = model.kv_cache_shape(8 * len(prompts), BLOCK)
    caches = {
        side: [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(model.num_layers)]
        for side in ("fused", "python")
    }

    def step(
        side: str, seqs: list[int], tokens: list[list[int]], starts: list[int]
    ) -> torch.Tensor:
        counts = [len(t) for t in tokens]
        ids = torch.tensor([t for ts in tokens for t in ts])
        pos = torch.tensor([s + i for s, n in zip(starts, counts, strict=True) for i in range(n)])
        meta = build_metadata([blocks[i] for i in seqs], starts, counts, BLOCK, torch.device("cpu"))
        model.fused_decode = fused if side == "fused" else None
        with torch.inference_mode():
            return model(ids, pos, caches[side], meta)

    everyone = list(range(len(prompts)))
    prefill_tokens = sum(lengths)
    for side in caches:
        step(side, everyone, prompts, [0] * len(prompts))
    batches = ([0], [1, 2], [0, 3, 4], [1, 2, 3, 4], [0, 1, 2, 3, 4], everyone, [16], everyone)
    for seqs in batches:
        tokens = [[int(torch.randint(0, VOCAB, (1,), generator=gen))] for _ in seqs]
        starts = [lengths[i] for i in seqs]
        out = {side: step(side, seqs, tokens, starts) for side in caches}
        assert torch.equal(out["fused"], out["python"]), f"decode rows {seqs}"
        for i in seqs:
            lengths[i] += 1
    for fused_cache, python_cache in zip(caches["fused"], caches["python"], strict=True):
        assert torch.equal(fused_cache, python_cache)
    model.fused_decode = fused
    return prefill_tokens, [len(seqs) for seqs in batches]


def takes_gguf_raw_rows(fused: DecodeStack) -> bool:
    """Asserts that a stack over GGUF projections sends decode_rows as many rows as its
    QuantLinears fuse wherever this build takes raw rows (AVX512-BF16), none elsewhere;
    returns whether it takes them here."""
    raw = bool(fused.kernels.decode_rows_max_rows(False) > 0)
    assert fused.raw_gguf
    assert fused.raw_rows == (fused.gguf_fused_max_rows if raw else 0)
    return raw
