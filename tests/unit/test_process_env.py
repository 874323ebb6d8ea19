"""The environments the launcher gives its children: one thread for the processes that do
no tensor math, the user's thread settings back for workers, and malloc on huge pages in
workers unless the user's ``GLIBC_TUNABLES`` decides."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from common.process import small_thread_env, worker_env
from tests.unit.smaps import thp_available


def test_a_worker_gets_the_users_threads_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    engine = small_thread_env()
    assert engine["OMP_NUM_THREADS"] == "1" and engine["MKL_NUM_THREADS"] == "1"
    monkeypatch.setattr(os, "environ", engine)  # as the engine core starts its workers
    worker = worker_env()
    assert worker["OMP_NUM_THREADS"] == "2" and "MKL_NUM_THREADS" not in worker


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (None, "glibc.malloc.hugetlb=1"),
        ("glibc.malloc.arena_max=2", "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"),
        ("glibc.malloc.hugetlb=0", "glibc.malloc.hugetlb=0"),  # the user's word stands
    ],
)
def test_workers_malloc_on_huge_pages_unless_told_otherwise(
    monkeypatch: pytest.MonkeyPatch, given: str | None, expected: str
) -> None:
    if given is None:
        monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    else:
        monkeypatch.setenv("GLIBC_TUNABLES", given)
    assert worker_env()["GLIBC_TUNABLES"] == expected


CHILD = """
import torch
from tests.unit.smaps import mapping_of
t = torch.ones(64 << 20, dtype=torch.uint8)  # a large malloc, as oneDNN's packed weights
print(" ".join(mapping_of(t.data_ptr()).vm_flags))
"""


def test_a_large_allocation_in_a_worker_is_advised_huge(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)

    def flags(env: dict[str, str]) -> list[str]:
        out = subprocess.run(
            [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True
        )
        return out.stdout.split()

    assert "hg" not in flags(small_thread_env())  # glibc's default: not advised
    version = os.confstr("CS_GNU_LIBC_VERSION") or "other 0"  # "glibc 2.36"
    name, number = version.split()
    if thp_available() and name == "glibc" and tuple(map(int, number.split("."))) >= (2, 35):
        assert "hg" in flags(worker_env())
