"""Local KV caches: one zeroed mapping, 2 MiB aligned, advised to use transparent huge
pages (the VMA's ``hg`` flag), each layer its own contiguous view of it."""

from __future__ import annotations

import torch

from tests.unit.smaps import mapping_of, thp_available
from worker.huge_pages import HUGE_PAGE
from worker.kv_memory import local_caches


def test_layers_are_zeroed_disjoint_views_of_one_aligned_mapping() -> None:
    shape = (2, 40, 3, 16, 64)  # [2, blocks, kv_heads, block_size, dim]
    caches = local_caches(shape, 3, torch.bfloat16, torch.device("cpu"))
    per_layer = 2 * 40 * 3 * 16 * 64 * 2
    assert [c.shape for c in caches] == [torch.Size(shape)] * 3
    assert all(c.is_contiguous() and not c.any() for c in caches)
    assert caches[0].data_ptr() % HUGE_PAGE == 0
    assert [c.data_ptr() - caches[0].data_ptr() for c in caches] == [0, per_layer, 2 * per_layer]
    caches[1].fill_(1)
    assert not caches[0].any() and not caches[2].any()
    if thp_available():
        assert "hg" in mapping_of(caches[0].data_ptr()).vm_flags
