"""Paged attention over the KV cache, for a batch mixing prefill chunks and decodes.

KV cache of one layer: ``[2, num_blocks, num_kv_heads, block_size, head_dim]`` (K, then
V): within a block each KV head's rows are contiguous, so attention reads one run per
block and head rather than rows interleaved by head. Token ``p`` of a request lives in
slot ``block_ids[p // block_size] * block_size + p % block_size``: block
``slot // block_size``, row ``slot % block_size`` of each head. The step's metadata is
built once (``worker/model_runner.py``) and passed explicitly to every layer: no global
attention context.

This module is the layout and the metadata only; ``worker/paged_attention.py`` runs a
layer's attention through the ops chosen for the device (``worker/ops.py``), whose
PyTorch kernels are ``worker/torch_attention.py``'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch


@dataclass(frozen=True)
class PrefillChunk:
    """Tokens ``[token_start, token_end)`` of the batch: one request's chunk whose first
    token sits at position ``context_start``; ``block_ids`` hold positions ``[0, end)``."""

    token_start: int
    token_end: int
    context_start: int
    block_ids: torch.Tensor  # [ceil(end / block_size)]
    _masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict, compare=False)

    @property
    def context_end(self) -> int:
        return self.context_start + self.token_end - self.token_start

    def sees_whole_prefix(self, window: int | None) -> bool:
        """Whether tokens are cached before this chunk and every one of its queries sees
        all of them (no window cuts any off)."""
        return self.context_start > 0 and (window is None or window >= self.context_end)

    def mask(self, window: int | None) -> torch.Tensor | None:
        """[chunk_len, context_len] bool (True = attend); None = plain causal."""
        if window not in self._masks:
            end = self.context_end
            if self.context_start == 0 and (window is None or window >= end):
                self._masks[window] = None
            else:
                device = self.block_ids.device
                query_pos = torch.arange(self.context_start, end, device=device).unsqueeze(1)
                key_pos = torch.arange(end, device=device).unsqueeze(0)
                allowed = key_pos <= query_pos
                if window is not None:
                    allowed &= key_pos > query_pos - window
                self._masks[window] = allowed
        return self._masks[window]


@dataclass(frozen=True)
class AttentionMetadata:
    """Where this step's tokens go in the cache and what each one attends to."""

    block_size: int
    slot_mapping: torch.Tensor  # [num_tokens]: cache slot written by each token
    decode_token_indices: torch.Tensor | None  # [num_decodes]
    # [num_decodes, max_blocks]: each decode's blocks, padded with block 0
    decode_block_table: torch.Tensor | None
    decode_context_lens: torch.Tensor | None  # [num_decodes]: the query is the last
    prefills: tuple[PrefillChunk, ...]
    positions_end: int  # one past the step's last position: what RoPE's table must hold
    _decode_masks: dict[int | None, torch.Tensor] = field(default_factory=dict, compare=False)

    @cached_property
    def fresh_prefills(self) -> tuple[PrefillChunk, ...]:
        """The prefill chunks with nothing cached before them (their keys are the step's
        own K/V rows), found once per step rather than once per layer."""
        return tuple(chunk for chunk in self.prefills if chunk.context_start == 0)

    def decode_mask(self, window: int | None) -> torch.Tensor:
        """[num_decodes, 1, 1, max_blocks * block_size] bool, once per window per step."""
        assert self.decode_block_table is not None and self.decode_context_lens is not None
        if window not in self._decode_masks:
            # Built only by the PyTorch path: the native kernel takes the lengths.
            width = self.decode_block_table.shape[1] * self.block_size
            key_pos = torch.arange(width, device=self.decode_context_lens.device).unsqueeze(0)
            allowed = key_pos < self.decode_context_lens.unsqueeze(1)
            if window is not None:
                query_pos = self.decode_context_lens.unsqueeze(1) - 1
                allowed = allowed & (key_pos > query_pos - window)
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
    slots: list[int] = []
    decode_tables: list[list[int]] = []
    decode_lens: list[int] = []
    decode_indices: list[int] = []
    prefills: list[PrefillChunk] = []
    token_start = positions_end = 0
    for blocks, start, length in zip(block_tables, context_starts, chunk_lens, strict=True):
        end = start + length
        positions_end = max(positions_end, end)
        num_blocks = -(-end // block_size)
        if num_blocks > len(blocks):
            raise ValueError(f"{len(blocks)} blocks of {block_size} cannot hold {end} tokens")
        used = blocks[:num_blocks]
        slots += _slots(used, block_size, start, end)
        if length == 1:
            decode_indices.append(token_start)
            decode_tables.append(used)
            decode_lens.append(end)
        else:
            block_ids = torch.tensor(used, dtype=torch.long, device=device)
            prefills.append(PrefillChunk(token_start, token_start + length, start, block_ids))
        token_start += length
    slot_mapping = torch.tensor(slots, dtype=torch.long, device=device)
    if not decode_tables:
        return AttentionMetadata(
            block_size, slot_mapping, None, None, None, tuple(prefills), positions_end
        )
    max_blocks = max(len(t) for t in decode_tables)
    table = torch.tensor([t + [0] * (max_blocks - len(t)) for t in decode_tables])
    lens = torch.tensor(decode_lens, dtype=torch.long)
    return AttentionMetadata(
        block_size=block_size,
        slot_mapping=slot_mapping,
        decode_token_indices=torch.tensor(decode_indices, dtype=torch.long, device=device),
        decode_block_table=table.to(device),
        decode_context_lens=lens.to(device),
        prefills=tuple(prefills),
        positions_end=positions_end,
    )


def _slots(block_ids: list[int], block_size: int, start: int, end: int) -> list[int]:
    """Cache slots of positions ``[start, end)`` (a run per block). Built from Python ints:
    tensor ops would cost ~15 us per request, 0.5 ms of a 32-sequence decode step."""
    slots: list[int] = []
    position = start
    while position < end:
        block, offset = divmod(position, block_size)
        run = min(block_size - offset, end - position)
        first = block_ids[block] * block_size + offset
        slots += range(first, first + run)
        position += run
    return slots


def gather_blocks(
    kv_cache: torch.Tensor, block_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of whole blocks in one copy: ``block_ids`` ``[..., nb]`` gives two
    ``[..., kv_heads, nb * block_size, head_dim]`` tensors (SDPA's layout). Copying blocks
    (kilobytes each) rather than slots (a few hundred bytes each) is many times faster
    on CPU."""
    two, _, kv_heads, block_size, head_dim = kv_cache.shape
    kv = kv_cache.transpose(1, 2).index_select(2, block_ids.reshape(-1))  # [2, KVH, m, B, D]
    length = block_ids.shape[-1] * block_size
    kv = kv.view(two, kv_heads, *block_ids.shape[:-1], length, head_dim).movedim(1, -3)
    return kv[0], kv[1]
