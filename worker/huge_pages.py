"""Memory backed by transparent huge pages, for what decode steps stream: the KV caches
(``worker/kv_memory.py``) and the weights (``move_to_huge_pages``).

A batch-1 decode step reads every projection weight once, start to end, and is bound by
the memory's speed. In 4 KiB pages each page costs a TLB miss and the hardware
prefetchers restart at every page boundary; in 2 MiB pages the GEMV over SmolLM2's
projections and LM head ran 5-14% faster on an AMD EPYC (``python -m bench.gemv``,
"4 KiB pages" against the default). PyTorch's allocator gives large tensors plain
``malloc`` memory, which THP backs only where ``/sys/kernel/mm/transparent_hugepage/
enabled`` is ``always``; the common default is ``madvise``, so Tandem asks for them. Where
THP is off, the memory is ordinary pages and nothing else changes.
"""

from __future__ import annotations

import contextlib
import mmap
from collections.abc import Iterable

import torch

HUGE_PAGE = 2 << 20
# Where each moved tensor starts: a page, so no two share a cache line or a 4 KiB page.
_ALIGN = 4096
# Smaller tensors (norms, biases) are read from cache; moving them gains nothing.
MIN_BYTES = 64 << 10


def huge_page_memory(num_bytes: int) -> torch.Tensor:
    """``num_bytes`` of fresh anonymous memory (uint8), 2 MiB aligned, advised to be backed
    by transparent huge pages. The tensor keeps the mapping alive; it is unmapped with the
    last view of it."""
    mapping = mmap.mmap(-1, num_bytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(AttributeError, OSError):  # no THP here: 4 KiB pages, as before
        mapping.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)
    skip = -raw.data_ptr() % HUGE_PAGE
    return raw[skip : skip + num_bytes]


def _movable(t: torch.Tensor) -> bool:
    """A CPU tensor that is the whole of its own storage (so moving it cannot separate it
    from a view of another part), large enough to matter. oneDNN's packed weights are
    opaque (no storage) and stay where they are."""
    if t.device.type != "cpu" or t.layout != torch.strided or t.is_mkldnn:
        return False
    nbytes = t.numel() * t.element_size()
    return (
        nbytes >= MIN_BYTES
        and t.is_contiguous()
        and t.storage_offset() == 0
        and t.untyped_storage().nbytes() == nbytes
    )


def move_to_huge_pages(tensors: Iterable[torch.Tensor]) -> int:
    """Copy every movable tensor of ``tensors`` into one huge-page mapping and point it
    there (``tensor.data``: the same tensor object, so every module holding it sees the
    move). Tensors sharing a storage (a tied LM head and its embedding) share the copy.
    Must run before anything keeps raw pointers into them (``DecodeStack.build``) and
    while nothing else runs on them. Returns the bytes moved."""
    groups: dict[int, list[torch.Tensor]] = {}  # storage address -> tensors over it
    seen: set[int] = set()
    for t in tensors:
        if id(t) in seen or not _movable(t):
            continue
        seen.add(id(t))
        groups.setdefault(t.data_ptr(), []).append(t)
    if not groups:
        return 0
    sizes = [group[0].numel() * group[0].element_size() for group in groups.values()]
    offsets = [0]  # each copy's start, then the end of the last
    for size in sizes:
        offsets.append(offsets[-1] + -(-size // _ALIGN) * _ALIGN)
    arena = huge_page_memory(offsets[-1])
    for group, size, start in zip(groups.values(), sizes, offsets[:-1], strict=True):
        place = arena[start : start + size]
        place.copy_(group[0].view(-1).view(torch.uint8))
        for t in group:
            t.data = place.view(t.dtype).view(t.shape)
    return sum(sizes)
