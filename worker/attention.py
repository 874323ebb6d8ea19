"""Paged attention over the KV cache, for a batch mixing prefill chunks and decodes.

KV cache of one layer: ``[2, num_slots, num_kv_heads, head_dim]`` with
``num_slots = num_blocks * block_size``; token ``p`` of a request lives in slot
``block_ids[p // block_size] * block_size + p % block_size``. The step's metadata is
built once (``worker/model_runner.py``) and passed explicitly to every layer: no global
attention context.

CPU path: all decode tokens (one query each) attend in one batched SDPA call over
their gathered, padded contexts; prefill chunks (a few per step) each take one SDPA
call with a causal mask offset by the tokens already in the cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PrefillChunk:
    """Tokens ``[token_start, token_end)`` of the batch: one request's chunk whose first
    token sits at position ``context_start``; ``kv_slots`` covers positions ``[0, end)``."""

    token_start: int
    token_end: int
    context_start: int
    kv_slots: torch.Tensor  # [context_start + chunk_len]
    _masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict, compare=False)

    def mask(self, window: int | None) -> torch.Tensor | None:
        """[chunk_len, context_len] bool (True = attend); None = plain causal."""
        if window not in self._masks:
            end = self.context_start + self.token_end - self.token_start
            if self.context_start == 0 and (window is None or window >= end):
                self._masks[window] = None
            else:
                query_pos = torch.arange(
                    self.context_start, end, device=self.kv_slots.device
                ).unsqueeze(1)
                key_pos = torch.arange(end, device=self.kv_slots.device).unsqueeze(0)
                allowed = key_pos <= query_pos
                if window is not None:
                    allowed &= key_pos > query_pos - window
                self._masks[window] = allowed
        return self._masks[window]


@dataclass(frozen=True)
class AttentionMetadata:
    """Where this step's tokens go in the cache and what each one attends to."""

    slot_mapping: torch.Tensor  # [num_tokens]: cache slot written by each token
    decode_token_indices: torch.Tensor | None  # [num_decodes]
    decode_kv_slots: torch.Tensor | None  # [num_decodes, max_context]
    decode_valid: torch.Tensor | None  # [num_decodes, max_context] bool: slot holds context
    decode_positions: torch.Tensor | None  # [num_decodes]: each query's position
    prefills: tuple[PrefillChunk, ...]
    _decode_masks: dict[int | None, torch.Tensor] = field(default_factory=dict, compare=False)

    def decode_mask(self, window: int | None) -> torch.Tensor:
        """[num_decodes, 1, 1, max_context] bool, computed once per window per step."""
        assert self.decode_valid is not None and self.decode_positions is not None  # decodes exist
        if window not in self._decode_masks:
            allowed = self.decode_valid
            if window is not None:
                key_pos = torch.arange(allowed.shape[1], device=allowed.device).unsqueeze(0)
                allowed = allowed & (key_pos > self.decode_positions.unsqueeze(1) - window)
            self._decode_masks[window] = allowed[:, None, None, :]
        return self._decode_masks[window]


def build_metadata(
    block_tables: list[list[int]],
    context_starts: list[int],
    chunk_lens: list[int],
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """Metadata for requests scheduled in batch order; request ``i`` computes
    ``chunk_lens[i]`` tokens from position ``context_starts[i]``."""
    slot_rows: list[torch.Tensor] = []
    decode_rows: list[torch.Tensor] = []
    decode_indices: list[int] = []
    prefills: list[PrefillChunk] = []
    token_start = 0
    for blocks, start, length in zip(block_tables, context_starts, chunk_lens, strict=True):
        end = start + length
        slots = _slots_for(blocks, end, block_size)
        slot_rows.append(slots[start:end])
        if length == 1:
            decode_indices.append(token_start)
            decode_rows.append(slots)
        else:
            prefills.append(
                PrefillChunk(token_start, token_start + length, start, slots.to(device))
            )
        token_start += length
    slot_mapping = torch.cat(slot_rows).to(device)
    if not decode_rows:
        return AttentionMetadata(slot_mapping, None, None, None, None, tuple(prefills))
    max_len = max(len(r) for r in decode_rows)
    padded = torch.zeros(len(decode_rows), max_len, dtype=torch.long)
    valid = torch.zeros(len(decode_rows), max_len, dtype=torch.bool)
    for i, row in enumerate(decode_rows):
        padded[i, : len(row)] = row
        valid[i, : len(row)] = True
    return AttentionMetadata(
        slot_mapping=slot_mapping,
        decode_token_indices=torch.tensor(decode_indices, dtype=torch.long, device=device),
        decode_kv_slots=padded.to(device),
        decode_valid=valid.to(device),
        decode_positions=torch.tensor(
            [len(r) - 1 for r in decode_rows], dtype=torch.long, device=device
        ),
        prefills=tuple(prefills),
    )


def _slots_for(block_ids: list[int], num_tokens: int, block_size: int) -> torch.Tensor:
    blocks = torch.tensor(block_ids, dtype=torch.long)
    offsets = torch.arange(block_size, dtype=torch.long)
    slots = (blocks[:, None] * block_size + offsets[None, :]).reshape(-1)
    if slots.numel() < num_tokens:
        raise ValueError(f"{len(block_ids)} blocks of {block_size} cannot hold {num_tokens} tokens")
    return slots[:num_tokens]


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], RoPE applied
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,
    kv_cache: torch.Tensor,  # [2, num_slots, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend. Returns ``[num_tokens, heads, dim]``."""
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)
    if meta.decode_token_indices is not None:
        assert meta.decode_kv_slots is not None  # built together
        qd = q.index_select(0, meta.decode_token_indices).unsqueeze(2)  # [n, H, 1, D]
        kd = _gather(k_cache, meta.decode_kv_slots).transpose(1, 2)  # [n, KVH, L, D]
        vd = _gather(v_cache, meta.decode_kv_slots).transpose(1, 2)
        od = _attend(qd, kd, vd, meta.decode_mask(window), scale)
        out.index_copy_(0, meta.decode_token_indices, od.squeeze(2))
    for chunk in meta.prefills:
        qp = q[chunk.token_start : chunk.token_end].transpose(0, 1)  # [H, q, D]
        if chunk.context_start == 0:
            kp, vp = k[chunk.token_start : chunk.token_end], v[chunk.token_start : chunk.token_end]
        else:
            kp, vp = (
                k_cache.index_select(0, chunk.kv_slots),
                v_cache.index_select(0, chunk.kv_slots),
            )
        # A leading batch dim of 1: 3-D inputs take a much slower SDPA kernel on CPU.
        op = _attend(
            qp[None], kp.transpose(0, 1)[None], vp.transpose(0, 1)[None], chunk.mask(window), scale
        )
        out[chunk.token_start : chunk.token_end] = op[0].transpose(0, 1)
    return out


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``cache[slots]`` for 2-D ``slots``; index_select is several times faster on CPU
    than advanced indexing."""
    return cache.index_select(0, slots.reshape(-1)).view(*slots.shape, *cache.shape[1:])


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """``[..., H, q, D]`` x ``[..., KVH, L, D]``; ``mask`` True = attend, None = causal."""
    gqa = q.shape[-3] != k.shape[-3]
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=gqa
    )
