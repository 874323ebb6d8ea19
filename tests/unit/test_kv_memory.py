"""Local KV caches: one zeroed mapping, 2 MiB aligned, advised to use transparent huge
pages (the VMA's ``hg`` flag), each layer its own contiguous view of it."""

from __future__ import annotations

from pathlib import Path

import torch

from worker.kv_memory import HUGE_PAGE, local_caches

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping holding ``address`` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


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
    if THP.exists() and "[never]" not in THP.read_text():
        assert "hg" in vm_flags(caches[0].data_ptr())
