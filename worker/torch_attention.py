"""Attention by PyTorch ops: the kernels ``TorchOps`` runs (and ``NativeOps`` where it has
none of its own).

All decode tokens (one query each) attend in one batched SDPA call over their blocks,
gathered whole and padded; prefill chunks (a few per step) each take one SDPA call,
causal, or, after tokens already in the cache, two flash-attention calls (the cached
prefix unmasked, the chunk's own tokens causal) merged by their log-sum-exps; a sliding
window keeps one call with the window's mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worker.attention import AttentionMetadata, PrefillChunk, gather_blocks


def decode_attention_torch(
    q: torch.Tensor,  # [num_decodes, heads, head_dim]
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """Decode attention by PyTorch ops: gather each decode's blocks, then one SDPA."""
    assert meta.decode_block_table is not None  # only called when the step has decodes
    keys, values = gather_blocks(kv_cache, meta.decode_block_table)  # [n, KVH, L, D]
    return _attend(q.unsqueeze(2), keys, values, meta.decode_mask(window), scale).squeeze(2)


def prefill_attention_torch(
    q: torch.Tensor,  # [q, heads, dim]: one chunk's queries
    keys: torch.Tensor,  # [kv_heads, context_end, dim]
    values: torch.Tensor,
    chunk: PrefillChunk,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """One prefill chunk's attention through PyTorch's SDPA: ``[q, heads, dim]``."""
    chunk_q = q.transpose(0, 1)[None]  # a leading batch dim of 1: 3-D inputs take a
    keys, values = keys[None], values[None]  # much slower SDPA kernel on CPU
    if q.device.type == "cpu" and chunk.sees_whole_prefix(window):
        chunk_out = _attend_after_prefix(chunk_q, keys, values, chunk.context_start, scale)
    else:
        chunk_out = _attend(chunk_q, keys, values, chunk.mask(window), scale)
    return chunk_out[0].transpose(0, 1)


def _attend_after_prefix(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int, scale: float
) -> torch.Tensor:
    """A chunk after ``prefix`` tokens already cached (``[1, H, q, D]`` x ``[1, KVH,
    prefix + q, D]``, no window), on CPU: the prefix, which every query sees whole (no
    mask), and the chunk's own tokens (causal) as two flash-attention calls, merged by
    their log-sum-exps. One call with the offset causal mask computes every query against
    every key, masked or not: a 1,452-token chunk after 2,048 cached tokens took 71 ms a
    layer that way, 56 this way (SmolLM2's heads, bfloat16, docs/benchmarks.md)."""
    group = q.shape[-3] // k.shape[-3]
    if group > 1:  # the flash op itself takes no grouped heads
        k, v = k.repeat_interleave(group, -3), v.repeat_interleave(group, -3)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    seen, seen_lse = flash(q, k[..., :prefix, :], v[..., :prefix, :], 0.0, False, scale=scale)
    own, own_lse = flash(q, k[..., prefix:, :], v[..., prefix:, :], 0.0, True, scale=scale)
    top = torch.maximum(seen_lse, own_lse)
    seen_w = (seen_lse - top).exp().unsqueeze(-1)  # float32, [1, H, q, 1]
    own_w = (own_lse - top).exp().unsqueeze(-1)
    merged = (seen.float() * seen_w + own.float() * own_w) / (seen_w + own_w)
    return merged.to(q.dtype)


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """``[..., H, q, D]`` x ``[..., KVH, L, D]``; ``mask`` True = attend, None = causal."""
    gqa = q.shape[-3] != k.shape[-3]
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=gqa
    )
