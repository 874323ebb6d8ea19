"""The paged KV block manager: a pool of fixed-size blocks with reference counts and a
prefix cache.

Pure bookkeeping (no tensors): the workers hold the KV tensors, indexed by the block
ids handed out here. A request's blocks cover its tokens in order.

Prefix caching: once a block is full and computed, it is registered under a chained
hash (parent block's hash + its token ids + extra keys such as a cache salt). A later
request whose leading blocks hash the same reuses them instead of recomputing. A block
whose reference count drops to zero goes to the tail of the free queue but keeps its
hash, so it can still be hit until it reaches the head and is reallocated (LRU).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

from common.messages import LoRARequest
from engine_core.kv_events import KVEventSink, NoKVEvents

BlockHash = bytes


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra: bytes = b"") -> BlockHash:
    """Collision-resistant chained hash of one full block (128-bit BLAKE2b): a collision
    would silently serve another prompt's KV."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"\0" * 16)
    h.update(array("q", token_ids).tobytes())
    h.update(extra)
    return h.digest()


def extend_block_hashes(
    hashes: list[BlockHash], token_ids: Sequence[int], block_size: int, extra: bytes
) -> None:
    """Append the hashes of ``token_ids``' full blocks not hashed yet."""
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        hashes.append(
            hash_block(hashes[-1] if hashes else None, token_ids[start : start + block_size], extra)
        )


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        events: KVEventSink | None = None,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need at least one block of one token, got {num_blocks} x {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Blocks entering and leaving the prefix cache, for a router's index (kv_events).
        self.events: KVEventSink = events or NoKVEvents()
        # Free blocks, least recently freed first; OrderedDict for O(1) removal of a hit.
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[BlockHash | None] = [None] * num_blocks
        self.cached_blocks: dict[BlockHash, int] = {}
        self.req_to_blocks: dict[str, list[int]] = {}
        # Bumped each time a block is taken for new content, so a reference held from
        # before (a KV transfer that outlived its request) is seen to be stale.
        self.generations = [0] * num_blocks
        self._num_registered: dict[str, int] = {}  # leading blocks of a request already cached
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0  # tokens found

    # ------------------------------------------------------------------ figures

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        """Blocks with a positive reference count; cached-only blocks count as free."""
        return self.num_blocks - len(self.free_queue)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def blocks_of(self, request_id: str) -> list[int]:
        return self.req_to_blocks.get(request_id, [])

    def generations_of(self, block_ids: Sequence[int]) -> list[int]:
        return [self.generations[b] for b in block_ids]

    def is_current(self, block_ids: Sequence[int], generations: Sequence[int]) -> bool:
        """Whether every block still holds the content it held at these generations."""
        return all(self.generations[b] == g for b, g in zip(block_ids, generations, strict=True))

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------------ prefix lookup

    def find_cached_prefix(self, block_hashes: Sequence[BlockHash], num_tokens: int) -> list[int]:
        """Block ids of the longest cached prefix of a request with ``num_tokens`` tokens.
        The block holding the last token is never a hit: that token is always computed,
        so its logits can be sampled, and shared blocks are never written."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        for block_hash in block_hashes[: (num_tokens - 1) // self.block_size]:
            block = self.cached_blocks.get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens

    # ------------------------------------------------------------------ allocate / free

    def num_new_blocks_needed(
        self, request_id: str, num_total_tokens: int, num_hits: int = 0
    ) -> int:
        return max(
            0, self.num_blocks_for(num_total_tokens) - len(self.blocks_of(request_id)) - num_hits
        )

    def can_allocate(
        self, request_id: str, num_total_tokens: int, hits: Sequence[int] = ()
    ) -> bool:
        """Whether the request's blocks (after taking ``hits``) can hold ``num_total_tokens``."""
        revived = sum(1 for b in hits if self.ref_counts[b] == 0)  # hits that leave the free queue
        needed = self.num_new_blocks_needed(request_id, num_total_tokens, len(hits))
        return needed <= len(self.free_queue) - revived

    def allocate(
        self, request_id: str, num_total_tokens: int, hits: Sequence[int] = ()
    ) -> list[int]:
        """Take the prefix ``hits`` (first allocation only) and grow the request's blocks
        to hold ``num_total_tokens``. Returns the newly allocated (non-hit) block ids."""
        if not self.can_allocate(request_id, num_total_tokens, hits):
            raise RuntimeError(
                f"allocate({request_id}) needs more blocks than the {len(self.free_queue)} free"
            )
        blocks = self.req_to_blocks.setdefault(request_id, [])
        if hits:
            if blocks:
                raise RuntimeError(f"prefix hits for {request_id}, which already holds blocks")
            for block in hits:
                if self.ref_counts[block] == 0:
                    del self.free_queue[block]
                self.ref_counts[block] += 1
            blocks.extend(hits)
            self._num_registered[request_id] = len(hits)
        new_blocks = []
        for _ in range(self.num_new_blocks_needed(request_id, num_total_tokens)):
            block, _ = self.free_queue.popitem(last=False)
            self._forget_hash(block)  # evicted from the prefix cache
            self.ref_counts[block] = 1
            self.generations[block] += 1
            new_blocks.append(block)
        blocks.extend(new_blocks)
        return new_blocks

    def cache_full_blocks(
        self,
        request_id: str,
        block_hashes: Sequence[BlockHash],
        num_computed_tokens: int,
        token_ids: Sequence[int],
        lora: LoRARequest | None = None,
    ) -> None:
        """Register the request's blocks that are now full and computed (``token_ids``:
        the request's tokens, and ``lora``: its adapter, which the stored-block events
        carry)."""
        if not self.enable_prefix_caching:
            return
        blocks = self.req_to_blocks.get(request_id, [])
        num_full = min(num_computed_tokens // self.block_size, len(block_hashes), len(blocks))
        run_start: int | None = None  # first block of the run of new registrations
        for i in range(self._num_registered.get(request_id, 0), num_full):
            block, block_hash = blocks[i], block_hashes[i]
            if self.block_hashes[block] is None and block_hash not in self.cached_blocks:
                self.block_hashes[block] = block_hash
                self.cached_blocks[block_hash] = block
                run_start = i if run_start is None else run_start
            elif run_start is not None:
                self._announce(block_hashes, run_start, i, token_ids, lora)
                run_start = None
        if run_start is not None:
            self._announce(block_hashes, run_start, num_full, token_ids, lora)
        self._num_registered[request_id] = max(num_full, self._num_registered.get(request_id, 0))

    def _announce(
        self,
        block_hashes: Sequence[BlockHash],
        start: int,
        end: int,
        token_ids: Sequence[int],
        lora: LoRARequest | None,
    ) -> None:
        """One stored-block event for blocks ``start:end`` of a request, chained to the
        block before them."""
        size = self.block_size
        self.events.stored(
            block_hashes[start:end],
            block_hashes[start - 1] if start else None,
            token_ids[start * size : end * size],
            lora,
        )

    def free(self, request_id: str) -> None:
        """Drop the request's references. Blocks return to the free queue tail, last
        block first, so a request's earliest blocks (the likeliest shared prefix) are
        evicted last."""
        blocks = self.req_to_blocks.pop(request_id, [])
        self._num_registered.pop(request_id, None)
        for block in reversed(blocks):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] < 0:
                raise RuntimeError(f"block {block} freed twice")
            if self.ref_counts[block] == 0:
                self.free_queue[block] = None

    def truncate(self, request_id: str, num_tokens: int) -> list[int]:
        """Give back the request's blocks past the ones holding its first ``num_tokens``
        tokens (slots of a speculative step's rejected drafts); returns them. They hold
        no cached hash: only blocks of verified, computed tokens are registered."""
        blocks = self.req_to_blocks.get(request_id, [])
        keep = self.num_blocks_for(num_tokens)
        dropped = blocks[keep:]
        del blocks[keep:]
        for block in reversed(dropped):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_queue[block] = None
        return dropped

    def lend(self, request_id: str, owner: str, num_blocks: int) -> list[int]:
        """Give ``owner`` references of its own to the request's first ``num_blocks``
        blocks (a lease: they outlive the request, which frees its own as usual); returns
        them. ``free(owner)`` gives them back."""
        if owner in self.req_to_blocks:
            raise ValueError(f"{owner} already holds blocks")
        blocks = self.blocks_of(request_id)[:num_blocks]
        for block in blocks:
            self.ref_counts[block] += 1
        self.req_to_blocks[owner] = list(blocks)
        return list(blocks)

    def rename(self, request_id: str, new_id: str) -> None:
        """Hand the request's block references to another owner id (blocks a worker may
        still be reading after the request has gone)."""
        if new_id in self.req_to_blocks:
            raise ValueError(f"{new_id} already holds blocks")
        self.req_to_blocks[new_id] = self.req_to_blocks.pop(request_id, [])
        if request_id in self._num_registered:
            self._num_registered[new_id] = self._num_registered.pop(request_id)

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash; blocks in use stay with their requests."""
        self.cached_blocks.clear()
        self.block_hashes = [None] * self.num_blocks
        self.events.cleared()
        for request_id in self._num_registered:
            self._num_registered[request_id] = len(self.req_to_blocks.get(request_id, []))

    def _forget_hash(self, block: int) -> None:
        block_hash = self.block_hashes[block]
        if block_hash is not None:
            self.block_hashes[block] = None
            if self.cached_blocks.get(block_hash) == block:
                del self.cached_blocks[block_hash]
                self.events.removed(block_hash)
