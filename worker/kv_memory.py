"""Where a worker's KV caches live: one tensor per layer, in the layout
``worker/attention.py`` gives (``[2, num_blocks, kv_heads, block_size, head_dim]``).

Local memory (a unified pool, or either side of ``--kv-transfer tcp``), or one POSIX
shared-memory segment holding every layer (``--kv-transfer shm``) that the prefill and
the decode workers both map: the tensors are views of the mapping itself, so a block the
prefill worker writes is the block the decode worker reads, with no copy in between.

Local CPU caches ask for transparent huge pages (``madvise``, honoured where
``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always`` or ``madvise``): decode
attention walks every sequence's blocks, scattered over the whole cache, and with 4 KiB
pages nearly every block costs a TLB miss (``docs/benchmarks.md``, "Decode attention").
"""

from __future__ import annotations

import math
from multiprocessing import shared_memory

import torch

from common.shm import attach_segment
from worker.huge_pages import huge_page_memory


def local_caches(
    layer_shape: tuple[int, ...], num_layers: int, dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    # Every page is written now (zero_): untouched pages would only become resident as
    # blocks are first used, so the worker's memory would creep up for hours and an
    # oversized --kv-cache-gb would fail late, not here.
    if device.type != "cpu":
        return [
            torch.empty(layer_shape, dtype=dtype, device=device).zero_() for _ in range(num_layers)
        ]
    per_layer = math.prod(layer_shape)
    flat = huge_page_memory(per_layer * num_layers * dtype.itemsize).view(dtype).zero_()
    return [flat[i * per_layer : (i + 1) * per_layer].view(layer_shape) for i in range(num_layers)]


class SharedCaches:
    """Every layer's KV cache as views of one shared-memory segment (CPU only)."""

    def __init__(
        self, name: str, layer_shape: tuple[int, ...], num_layers: int, dtype: torch.dtype
    ) -> None:
        per_layer = math.prod(layer_shape)
        self.num_bytes = per_layer * num_layers * dtype.itemsize
        self.segment: shared_memory.SharedMemory = attach_segment(name, self.num_bytes)
        flat = torch.frombuffer(self.segment.buf, dtype=dtype, count=per_layer * num_layers)
        self.caches = [
            flat[i * per_layer : (i + 1) * per_layer].view(layer_shape) for i in range(num_layers)
        ]

    def address_range(self) -> tuple[int, int]:
        """The mapping's first and one-past-last addresses (to show tensors live in it)."""
        start = self.caches[0].data_ptr()
        return start, start + self.num_bytes
