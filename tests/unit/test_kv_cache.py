from __future__ import annotations

import pytest

from engine_core.kv_cache import KVCacheManager, extend_block_hashes, hash_block


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
    with pytest.raises(RuntimeError, match="needs more blocks than the 1 free"):
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


def hashes(tokens: list[int], block_size: int = 4, salt: bytes = b"") -> list[bytes]:
    out: list[bytes] = []
    extend_block_hashes(out, tokens, block_size, salt)
    return out


def test_block_hashes_chain_and_cover_full_blocks_only() -> None:
    h = hashes(list(range(10)))
    assert len(h) == 2
    assert h[0] == hash_block(None, [0, 1, 2, 3]) and h[1] == hash_block(h[0], [4, 5, 6, 7])
    assert hashes([9, 9, 9, 9, 4, 5, 6, 7])[1] != h[1]  # same tokens, different parent
    assert hashes(list(range(10)), salt=b"tenant")[0] != h[0]
    grown = list(h)
    extend_block_hashes(grown, list(range(12)), 4, b"")
    assert grown[:2] == h and len(grown) == 3


def test_prefix_hit_shares_blocks_and_lru_free_order() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = list(range(10))
    assert kv.allocate("a", 10) == [0, 1, 2]
    kv.cache_full_blocks("a", hashes(a), 10, a)
    assert kv.cached_blocks == {hashes(a)[0]: 0, hashes(a)[1]: 1}

    b = [*a[:8], 50, 51, 52, 53]
    hits = kv.find_cached_prefix(hashes(b), len(b))
    assert hits == [0, 1]
    assert kv.allocate("b", 12, hits) == [3]
    assert kv.blocks_of("b") == [0, 1, 3]
    assert kv.ref_counts[:4] == [2, 2, 1, 1]
    kv.record_lookup(12, 8)
    assert (kv.prefix_queries, kv.prefix_hits) == (12, 8)

    kv.free("a")
    assert list(kv.free_queue) == [4, 5, 6, 7, 8, 9, 2]
    kv.free("b")
    assert list(kv.free_queue) == [4, 5, 6, 7, 8, 9, 2, 3, 1, 0]
    assert kv.num_used_blocks == 0

    # A freed block still hits; taking it removes it from the free queue.
    hits = kv.find_cached_prefix(hashes(a), len(a))
    assert hits == [0, 1]
    assert kv.allocate("c", 10, hits) == [4]
    assert list(kv.free_queue) == [5, 6, 7, 8, 9, 2, 3]


def test_the_block_of_the_last_token_is_never_a_hit() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    tokens = list(range(8))
    kv.allocate("a", 8)
    kv.cache_full_blocks("a", hashes(tokens), 8, tokens)
    assert kv.find_cached_prefix(hashes(tokens), 8) == [0]  # token 7 must be recomputed
    assert kv.find_cached_prefix(hashes(tokens), 9) == [0, 1]


def test_eviction_forgets_hashes_oldest_free_block_first() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2)
    tokens = [1, 2, 3, 4, 5, 6, 7]
    kv.allocate("a", 7)
    kv.cache_full_blocks("a", hashes(tokens, 2), 7, tokens)
    kv.free("a")
    assert list(kv.free_queue) == [3, 2, 1, 0]  # a's last block first
    assert kv.allocate("b", 2) == [3]  # block 3 held no full block: nothing lost
    assert kv.find_cached_prefix(hashes(tokens, 2), 7) == [0, 1, 2]
    assert kv.allocate("c", 2) == [2]  # evicts the third cached block
    assert kv.find_cached_prefix(hashes(tokens, 2), 7) == [0, 1]
    assert kv.block_hashes[2] is None and len(kv.cached_blocks) == 2


def test_salted_requests_do_not_share() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    tokens = list(range(9))
    kv.allocate("a", 9)
    kv.cache_full_blocks("a", hashes(tokens, salt=b"alice"), 9, tokens)
    assert kv.find_cached_prefix(hashes(tokens, salt=b"bob"), 9) == []
    assert kv.find_cached_prefix(hashes(tokens, salt=b"alice"), 9) == [0, 1]


def test_duplicate_content_is_registered_once() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    tokens = list(range(5))
    kv.allocate("a", 5)
    kv.allocate("b", 5)  # computed concurrently, before a's blocks were cached
    kv.cache_full_blocks("a", hashes(tokens), 5, tokens)
    kv.cache_full_blocks("b", hashes(tokens), 5, tokens)
    assert kv.cached_blocks == {hashes(tokens)[0]: 0}
    assert kv.block_hashes[2] is None


def test_reset_prefix_cache_forgets_everything_but_keeps_owners() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=4)
    tokens = list(range(9))
    kv.allocate("a", 9)
    kv.cache_full_blocks("a", hashes(tokens), 9, tokens)
    kv.reset_prefix_cache()
    assert kv.find_cached_prefix(hashes(tokens), 9) == []
    assert kv.blocks_of("a") == [0, 1, 2] and kv.num_used_blocks == 3
    kv.free("a")
    assert list(kv.free_queue) == [3, 4, 5, 2, 1, 0]


def test_prefix_caching_off_never_hits() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=4, enable_prefix_caching=False)
    tokens = list(range(9))
    kv.allocate("a", 9)
    kv.cache_full_blocks("a", hashes(tokens), 9, tokens)
    assert kv.cached_blocks == {}
    assert kv.find_cached_prefix(hashes(tokens), 9) == []
