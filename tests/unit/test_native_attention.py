"""The native CPU decode-attention kernel against the PyTorch path (block gather + SDPA)
and a float64 reference: GQA ratios, head sizes, sliding windows, ragged contexts over
scattered blocks, and the dtypes served; a sequence's output is the same alone and in any
batch, blocks shared with another sequence included. Run again on the x86-64-v3 build, whose
kernel (decode_attention_avx2.cpp) an AVX-512 host's native build does not hold."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.avx2_build import assert_passes_on_the_avx2_build
from worker.attention import build_metadata
from worker.native import load_native_kernels
from worker.ops import NativeOps, TorchOps
from worker.paged_attention import paged_attention

BLOCK = 16


def reference(
    q: torch.Tensor, cache: torch.Tensor, tables: list[list[int]], lens: list[int], window: int
) -> torch.Tensor:
    """float64, one sequence at a time, straight from the definition; ``cache`` by slot,
    ``[2, slots, kv_heads, dim]``."""
    out = []
    heads, kv_heads = q.shape[1], cache.shape[2]
    for i, (blocks, length) in enumerate(zip(tables, lens, strict=True)):
        slots = torch.tensor([b * BLOCK + o for b in blocks for o in range(BLOCK)])[:length]
        first = max(0, length - window) if window else 0
        k = cache[0, slots[first:]].double().repeat_interleave(heads // kv_heads, 1)
        v = cache[1, slots[first:]].double().repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("hd,thd->ht", q[i].double(), k) * q.shape[-1] ** -0.5
        out.append(torch.einsum("ht,thd->hd", F.softmax(scores, -1), v))
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "window"),
    # (8, 1, 24): a head size off the 16-lane tiles takes the plain loops; values of groups
    # up to 4 with head sizes of 64k are converted in registers, (4, 4, 32) and the group
    # of 6 in (12, 2, 128) through the tile
    [
        (9, 3, 64, 0),
        (4, 4, 32, 0),
        (8, 2, 256, 0),
        (4, 1, 64, 20),
        (8, 1, 24, 0),
        (2, 1, 64, 45),
        (12, 2, 128, 0),
    ],
)
def test_kernel_matches_reference_and_torch_path(
    dtype: torch.dtype, heads: int, kv_heads: int, dim: int, window: int
) -> None:
    kernels = load_native_kernels()
    gen = torch.Generator().manual_seed(heads * dim + window)
    num_blocks = 450
    by_slot = torch.randn(2, num_blocks * BLOCK, kv_heads, dim, generator=gen).to(dtype)
    # The cache's layout: [2, blocks, kv_heads, BLOCK, dim]
    cache = by_slot.view(2, num_blocks, BLOCK, kv_heads, dim).transpose(2, 3).contiguous()
    # 250: sixteen tiles, the last one short; 600: past the rows the bfloat16 kernel reads
    # ahead at once (256 at head size 64, fewer at larger heads); 600, 1100 and 4500:
    # contexts the bfloat16 kernel splits into parts, of 512 tokens (two, three) and, past
    # eight of those, of 1,024 (five)
    lens = [1, 17, 64, 100, 37, 250, 600, 1100, 4500]
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for length in lens:  # scattered, unordered blocks
        n = -(-length // BLOCK) + 1  # one spare block past the context
        tables.append(perm[used : used + n])
        used += n
    q = torch.randn(len(lens), heads, dim, generator=gen).to(dtype)
    table = torch.tensor([t + [0] * (max(map(len, tables)) - len(t)) for t in tables])
    scale = dim**-0.5
    ours = kernels.decode_attention(q, cache, table, torch.tensor(lens), scale, window, BLOCK)
    exact = reference(q, by_slot, tables, lens, window)
    tol = 2e-6 if dtype == torch.float32 else 2e-2  # bf16: the output's own rounding
    assert (ours.double() - exact).abs().max() < tol

    # The model's entry point, both ways: the new tokens' K/V are written, then attended.
    meta = build_metadata(
        tables, [n - 1 for n in lens], [1] * len(lens), BLOCK, torch.device("cpu")
    )
    slots = meta.slot_mapping
    k_last, v_last = by_slot[0, slots].clone(), by_slot[1, slots].clone()
    torch_path = paged_attention(
        q, k_last, v_last, cache.clone(), meta, TorchOps(), scale, window or None
    )
    native_path = paged_attention(
        q, k_last, v_last, cache.clone(), meta, NativeOps(kernels), scale, window or None
    )
    assert (torch_path.double() - exact).abs().max() < tol
    assert (native_path.double() - exact).abs().max() < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_long_context_whose_scores_peak_in_one_part(dtype: torch.dtype) -> None:
    """3,000 tokens (the bfloat16 kernel's parts: six, of 512 or fewer), the keys of tokens 1,000 to
    1,100 turned toward the query: that part's scores are far above the rest, so parts merged
    without rescaling each to the largest max would be far off."""
    kernels = load_native_kernels()
    gen = torch.Generator().manual_seed(11)
    heads, kv_heads, dim, length = 9, 3, 64, 3000
    num_blocks = -(-length // BLOCK)
    by_slot = torch.randn(2, num_blocks * BLOCK, kv_heads, dim, generator=gen)
    q = torch.randn(1, heads, dim, generator=gen)
    for g in range(kv_heads):  # each KV head toward its first query head
        by_slot[0, 1000:1100, g] += 0.4 * q[0, g * (heads // kv_heads)]
    by_slot, q = by_slot.to(dtype), q.to(dtype)
    cache = by_slot.view(2, num_blocks, BLOCK, kv_heads, dim).transpose(2, 3).contiguous()
    table = torch.randperm(num_blocks, generator=gen)
    ours = kernels.decode_attention(
        q, cache, table[None].contiguous(), torch.tensor([length]), dim**-0.5, 0, BLOCK
    )
    exact = reference(q, by_slot, [table.tolist()], [length], 0)
    tol = 2e-6 if dtype == torch.float32 else 2e-2
    assert (ours.double() - exact).abs().max() < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 30])
def test_a_sequence_comes_out_the_same_alone_and_in_any_batch(
    dtype: torch.dtype, window: int
) -> None:
    """Blocks shared by two sequences (a cached prefix), scattered and in any order: each
    sequence's output equals its output alone, bit for bit; contexts the bfloat16 kernel
    splits into parts (1100, 600) too."""
    kernels = load_native_kernels()
    gen = torch.Generator().manual_seed(window + 3)
    heads, kv_heads, dim, num_blocks = 9, 3, 64, 150
    cache = torch.randn(2, num_blocks, kv_heads, BLOCK, dim, generator=gen).to(dtype)
    lens = [70, 33, 1100, 5, 64, 600, 120]
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for length in lens:
        n = -(-length // BLOCK)
        tables.append(perm[used : used + n])
        used += n
    tables[1][:2] = tables[0][:2]  # sequence 1 shares sequence 0's first two blocks
    width = max(map(len, tables))
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    q = torch.randn(len(lens), heads, dim, generator=gen).to(dtype)
    scale = dim**-0.5
    batch = kernels.decode_attention(q, cache, table, torch.tensor(lens), scale, window, BLOCK)
    for i in range(len(lens)):
        alone = kernels.decode_attention(
            q[i : i + 1].contiguous(),
            cache,
            table[i : i + 1].contiguous(),
            torch.tensor(lens[i : i + 1]),
            scale,
            window,
            BLOCK,
        )
        assert torch.equal(alone[0], batch[i]), f"sequence {i}"


def test_kernel_refuses_out_of_range_metadata() -> None:
    kernels = load_native_kernels()
    cache = torch.zeros(2, 4, 1, BLOCK, 8)
    q = torch.zeros(1, 1, 8)
    with pytest.raises(RuntimeError, match="block id out of range"):
        kernels.decode_attention(q, cache, torch.tensor([[9]]), torch.tensor([3]), 1.0, 0, BLOCK)
    with pytest.raises(RuntimeError, match="context length out of range"):
        kernels.decode_attention(q, cache, torch.tensor([[1]]), torch.tensor([17]), 1.0, 0, BLOCK)
    with pytest.raises(RuntimeError, match="contiguous"):
        kernels.decode_attention(
            q, cache[:, :, :, ::2], torch.tensor([[1]]), torch.tensor([3]), 1.0, 0, BLOCK // 2
        )


def test_the_avx2_build_passes_these_tests() -> None:
    """This file again on the x86-64-v3 build: the AVX2 kernel, whatever this host has."""
    assert_passes_on_the_avx2_build(__file__)
