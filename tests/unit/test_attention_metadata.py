"""``build_metadata``: the cache slot of every scheduled token, and the decode rows' tables,
exactly, for decodes and prefill chunks that start and end inside blocks."""

from __future__ import annotations

import pytest
import torch

from worker.attention import build_metadata

CPU = torch.device("cpu")


def test_slots_of_decodes_and_chunks_crossing_blocks() -> None:
    # request 0: a chunk of positions 2..9 over blocks [7, 3, 5] of 4 slots
    # request 1: one decode at position 5 (block 1 of [9, 2], offset 1)
    # request 2: a chunk of positions 0..3, exactly block 6
    meta = build_metadata([[7, 3, 5], [9, 2], [6]], [2, 5, 0], [8, 1, 4], 4, CPU)
    assert meta.slot_mapping.tolist() == [
        *[30, 31],  # block 7, offsets 2-3
        *[12, 13, 14, 15],  # block 3
        *[20, 21],  # block 5, offsets 0-1
        9,  # block 2 offset 1
        *[24, 25, 26, 27],  # block 6
    ]
    assert meta.slot_mapping.dtype == torch.long
    assert meta.decode_token_indices is not None and meta.decode_token_indices.tolist() == [8]
    assert meta.decode_block_table is not None and meta.decode_block_table.tolist() == [[9, 2]]
    assert meta.decode_context_lens is not None and meta.decode_context_lens.tolist() == [6]
    assert [(c.token_start, c.token_end, c.context_start) for c in meta.prefills] == [
        (0, 8, 2),
        (9, 13, 0),
    ]


def test_decode_tables_are_padded_to_the_longest() -> None:
    meta = build_metadata([[4], [8, 1, 3]], [0, 9], [1, 1], 4, CPU)
    assert meta.slot_mapping.tolist() == [16, 13]
    assert meta.decode_block_table is not None
    assert meta.decode_block_table.tolist() == [[4, 0, 0], [8, 1, 3]]
    assert meta.prefills == ()


def test_too_few_blocks_is_an_error() -> None:
    with pytest.raises(ValueError, match="2 blocks of 4 cannot hold 9 tokens"):
        build_metadata([[1, 2]], [8], [1], 4, CPU)
