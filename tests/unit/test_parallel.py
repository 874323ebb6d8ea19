"""Which heads, rows and vocabulary each tensor-parallel rank holds."""

from __future__ import annotations

import pytest

from worker.parallel import Heads, TensorParallel


def test_whole_gqa_groups_per_rank_even_when_they_do_not_split_evenly() -> None:
    # SmolLM2: 9 q heads in 3 groups of 3.
    assert TensorParallel(0, 2).heads(9, 3) == Heads(0, 3, 0, 1)
    assert TensorParallel(1, 2).heads(9, 3) == Heads(3, 6, 1, 2)
    assert TensorParallel(1, 2).heads(4, 2) == Heads(2, 2, 1, 1)
    assert TensorParallel(0, 1).heads(9, 3) == Heads(0, 9, 0, 3)


def test_fewer_kv_heads_than_ranks_replicates_the_one_each_rank_reads() -> None:
    assert [TensorParallel(r, 4).heads(8, 2) for r in range(4)] == [
        Heads(0, 2, 0, 1), Heads(2, 2, 0, 1), Heads(4, 2, 1, 1), Heads(6, 2, 1, 1)
    ]  # fmt: skip
    with pytest.raises(ValueError, match="multiple of its 2 KV heads"):
        TensorParallel(0, 3).heads(6, 2)


def test_rows_cover_everything_once_and_the_vocabulary_splits_evenly() -> None:
    shares = [TensorParallel(r, 3).rows(10) for r in range(3)]
    assert shares == [(0, 3), (3, 3), (6, 4)]
    assert TensorParallel(1, 2).split(49152, "vocabulary") == 24576
    with pytest.raises(ValueError, match="vocabulary"):
        TensorParallel(0, 2).split(49153, "vocabulary")
