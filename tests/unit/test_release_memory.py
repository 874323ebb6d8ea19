"""``release_free_memory``: what a worker frees below a live allocation (the load's read
buffers, float projections replaced by packed weights or GGUF blocks, a step's
temporaries) stays in its RSS until the heap is trimmed."""

from __future__ import annotations

import psutil

from common.process import release_free_memory


def test_freed_heap_pages_go_back_to_the_system() -> None:
    me = psutil.Process()
    chunks = [bytearray(64 * 1024) for _ in range(3200)]  # 200 MiB of heap, not mmap
    pin = bytearray(64 * 1024)  # above them: free() alone cannot shrink the heap
    del chunks
    held = me.memory_info().rss
    release_free_memory()
    released = held - me.memory_info().rss
    assert released > 150 * 2**20, f"only {released / 2**20:.0f} MiB returned"
    del pin
