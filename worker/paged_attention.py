"""A layer's paged attention: this step's K/V written into the cache, then decodes and
prefill chunks attended through the ops chosen for the device (``worker/ops.py``)."""

from __future__ import annotations

import torch

from worker.attention import AttentionMetadata, gather_blocks
from worker.ops import Ops


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], RoPE applied
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,
    kv_cache: torch.Tensor,  # [2, num_blocks, num_kv_heads, block_size, head_dim]
    meta: AttentionMetadata,
    ops: Ops,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend. Returns ``[num_tokens, heads, dim]``."""
    ops.write_kv(kv_cache, meta.slot_mapping, k, v)
    only_decodes = not meta.prefills  # then every token is a decode, in order
    out = q if only_decodes else torch.empty_like(q)  # only_decodes returns decode_out instead
    if meta.decode_token_indices is not None:
        # [n, H, D]; when every token is a decode, they are all of q, in order.
        decode_q = q if only_decodes else q.index_select(0, meta.decode_token_indices)
        decode_out = ops.decode_attention(decode_q, kv_cache, meta, scale, window)
        if only_decodes:
            return decode_out
        out.index_copy_(0, meta.decode_token_indices, decode_out)
    if meta.fresh_prefills:  # their keys are this step's own: every such chunk at once
        ops.fresh_prefill_attention(out, q, k, v, meta.fresh_prefills, scale, window)
    for chunk in meta.prefills:
        if chunk.context_start == 0:
            continue
        keys, values = gather_blocks(kv_cache, chunk.block_ids)  # [KVH, L, D]
        keys, values = keys[:, : chunk.context_end], values[:, : chunk.context_end]
        out[chunk.token_start : chunk.token_end] = ops.prefill_attention(
            q[chunk.token_start : chunk.token_end], keys, values, chunk, scale, window
        )
    return out
