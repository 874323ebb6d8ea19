from __future__ import annotations

import pytest

from engine_core.kv_cache import KVCacheManager


def test_allocate_grows_in_order_and_free_returns_last_block_first() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4)
    assert kv.allocate("a", 5) == [0, 1]  # 5 tokens -> 2 blocks
    assert kv.allocate("a", 8) == []  # still fits
    assert kv.allocate("a", 9) == [2]
    assert kv.allocate("b", 4) == [3]
    assert kv.blocks_of("a") == [0, 1, 2]
    assert kv.num_used_blocks == 4
    assert list(kv.free_queue) == [4, 5, 6, 7, 8, 9]
    kv.free("a")
    assert list(kv.free_queue) == [4, 5, 6, 7, 8, 9, 2, 1, 0]
    assert kv.ref_counts == [0, 0, 0, 1, 0, 0, 0, 0, 0, 0]
    assert kv.allocate("c", 12) == [4, 5, 6]
    kv.free("b")
    kv.free("c")
    assert kv.num_used_blocks == 0
    assert list(kv.free_queue) == [7, 8, 9, 2, 1, 0, 3, 6, 5, 4]


def test_can_allocate_counts_only_new_blocks() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=2)
    kv.allocate("a", 4)
    assert kv.can_allocate("a", 6)
    assert not kv.can_allocate("a", 7)
    assert not kv.can_allocate("b", 3)
    with pytest.raises(RuntimeError, match="needs 2 blocks, 1 free"):
        kv.allocate("b", 3)
    assert kv.num_used_blocks == 2  # a failed allocate takes nothing


def test_free_unknown_request_is_a_noop_and_usage_fraction() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=16)
    kv.free("nobody")
    kv.allocate("a", 17)
    assert kv.usage == 0.5
    kv.free("a")
    kv.free("a")  # idempotent: the request no longer holds blocks
    assert kv.usage == 0.0 and kv.num_free_blocks == 4


def test_invalid_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="at least one block"):
        KVCacheManager(num_blocks=0, block_size=16)
