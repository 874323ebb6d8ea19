"""The paged KV block manager: a pool of fixed-size blocks with reference counts.

Pure bookkeeping (no tensors): the workers hold the KV tensors, indexed by the block
ids handed out here. A request's blocks cover its tokens in order; a block is in use
while its reference count is positive and sits in the free queue otherwise.
"""

from __future__ import annotations

from collections import deque


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need at least one block of one token, got {num_blocks} x {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_queue: deque[int] = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks
        self.req_to_blocks: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def blocks_of(self, request_id: str) -> list[int]:
        return self.req_to_blocks.get(request_id, [])

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks_needed(self, request_id: str, num_total_tokens: int) -> int:
        return max(0, self.num_blocks_for(num_total_tokens) - len(self.blocks_of(request_id)))

    def can_allocate(self, request_id: str, num_total_tokens: int) -> bool:
        """Whether the request's blocks can grow to hold ``num_total_tokens`` tokens."""
        return self.num_new_blocks_needed(request_id, num_total_tokens) <= len(self.free_queue)

    def allocate(self, request_id: str, num_total_tokens: int) -> list[int]:
        """Grow the request's blocks to hold ``num_total_tokens``; returns the new ids."""
        needed = self.num_new_blocks_needed(request_id, num_total_tokens)
        if needed > len(self.free_queue):
            raise RuntimeError(
                f"allocate({request_id}) needs {needed} blocks, {len(self.free_queue)} free"
            )
        new_blocks = [self.free_queue.popleft() for _ in range(needed)]
        for block in new_blocks:
            self.ref_counts[block] += 1
        self.req_to_blocks.setdefault(request_id, []).extend(new_blocks)
        return new_blocks

    def free(self, request_id: str) -> None:
        """Drop the request's references. Blocks return to the free queue tail, last
        block first, so that a request's earliest blocks stay longest (for prefix reuse)."""
        blocks = self.req_to_blocks.pop(request_id, [])
        for block in reversed(blocks):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] < 0:
                raise RuntimeError(f"block {block} freed twice")
            if self.ref_counts[block] == 0:
                self.free_queue.append(block)
