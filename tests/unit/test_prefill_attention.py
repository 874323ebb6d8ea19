"""A prefill chunk's attention over the paged cache against a float64 reference: from the
first token (one causal call), after cached tokens (on CPU: the cached prefix unmasked and
the chunk's own tokens causal, two flash calls merged by their log-sum-exps), and with a
sliding window (one call through the window's mask); through PyTorch's ops and through the
native ones (bfloat16 chunks without a window on the native kernel where it is built)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker.attention import build_metadata
from worker.native import load_native_kernels
from worker.ops import NativeOps, Ops, TorchOps
from worker.paged_attention import paged_attention

BLOCK = 16


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, window: int | None
) -> torch.Tensor:
    """``q`` [L, H, D] at positions start.., ``k``/``v`` [start + L, KVH, D], float64."""
    group = q.shape[1] // k.shape[1]
    keys = k.double().repeat_interleave(group, 1)
    values = v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys) * q.shape[-1] ** -0.5
    query_pos = torch.arange(start, start + q.shape[0])[:, None]
    key_pos = torch.arange(k.shape[0])[None]
    allowed = key_pos <= query_pos
    if window is not None:
        allowed &= key_pos > query_pos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", F.softmax(scores, -1), values)


OPS: dict[str, Ops] = {"torch": TorchOps(), "native": NativeOps(load_native_kernels())}


@pytest.mark.parametrize("ops", sorted(OPS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("start", "length", "window"),
    [(0, 100, None), (200, 77, None), (200, 1, None), (160, 300, None), (200, 77, 50)],
)
def test_chunk_matches_reference(
    ops: str, dtype: torch.dtype, start: int, length: int, window: int | None
) -> None:
    gen = torch.Generator().manual_seed(start + length)
    heads, kv_heads, dim = 9, 3, 64
    end = start + length
    num_blocks = -(-end // BLOCK) + 4
    k_all = torch.randn(end, kv_heads, dim, generator=gen).to(dtype)
    v_all = torch.randn(end, kv_heads, dim, generator=gen).to(dtype)
    q = torch.randn(length, heads, dim, generator=gen).to(dtype)
    blocks = torch.randperm(num_blocks, generator=gen)[: -(-end // BLOCK)].tolist()
    cache = torch.zeros(2, num_blocks, kv_heads, BLOCK, dim, dtype=dtype)
    for pos in range(start):  # the prefix, cached by earlier steps
        cache[0, blocks[pos // BLOCK], :, pos % BLOCK] = k_all[pos]
        cache[1, blocks[pos // BLOCK], :, pos % BLOCK] = v_all[pos]
    meta = build_metadata([blocks], [start], [length], BLOCK, torch.device("cpu"))
    ours = paged_attention(
        q, k_all[start:], v_all[start:], cache, meta, OPS[ops], dim**-0.5, window
    )
    exact = reference(q, k_all, v_all, start, window)
    tol = 2e-6 if dtype == torch.float32 else 2e-2
    assert (ours.double() - exact).abs().max() < tol
