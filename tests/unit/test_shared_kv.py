"""Split pools over shared memory: both pools' KV tensors are the same segment's memory,
a hand-off copies nothing and decodes as a unified pool would, and segments no running
engine claims are removed while claimed ones, mapped ones and other users' are left
alone."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from common.config import CacheConfig
from common.messages import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput
from common.shm import (
    SHM_DIR,
    ServiceLock,
    attach_segment,
    map_segment,
    new_service_id,
    remove_stale,
    segment_name,
    unlink_segment,
)
from tests.parity.families import build
from worker.model_runner import ModelRunner

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)
CACHE = CacheConfig(block_size=4, num_kv_blocks=16)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llama")
    build("llama", path)
    return path


@pytest.fixture
def segment() -> Iterator[str]:
    name = segment_name(new_service_id(), "kv")
    yield name
    unlink_segment(name)


def runner(checkpoint: Path, segment: str | None) -> ModelRunner:
    return ModelRunner(checkpoint, torch.float32, CPU, CACHE, None, "torch", segment)


def step(step_id: int, token_ids: list[int], computed: int, n: int) -> SchedulerOutput:
    new = NewRequestData("r", token_ids, GREEDY, [0, 1, 2, 3], computed, 10)
    return SchedulerOutput(step_id, [new], [], {"r": n}, [])


def test_a_hand_off_through_shared_memory_copies_nothing(checkpoint: Path, segment: str) -> None:
    prefill, decode = runner(checkpoint, segment), runner(checkpoint, segment)
    assert (SHM_DIR / segment).stat().st_mode & 0o777 == 0o600  # never world-writable
    assert decode.shared is not None
    start, end = decode.shared.address_range()
    for cache in decode.kv_caches:  # the decode worker's KV is the segment's memory
        assert start <= cache.data_ptr() and cache.data_ptr() + cache.nbytes <= end
    prefill.kv_caches[1][0, 7, 0, 0, 0] = 42.0  # one write, seen through the other mapping
    assert decode.kv_caches[1][0, 7, 0, 0, 0] == 42.0
    prefill.kv_caches[1].zero_()

    prompt = [3, 17, 5, 99, 23, 8, 64, 2, 41, 7]
    first = prefill.execute(step(1, prompt, 0, len(prompt))).sampled_token_ids[0]
    # The decode pool takes the request with the prefill pool's block ids: no KV moves.
    second = decode.execute(step(1, [*prompt, first], len(prompt), 1)).sampled_token_ids[0]

    alone = runner(checkpoint, None)  # a unified pool, its own memory
    assert alone.shared is None
    unified_first = alone.execute(step(1, prompt, 0, len(prompt))).sampled_token_ids[0]
    decode_step = SchedulerOutput(2, [], [CachedRequestData("r", [], 10)], {"r": 1}, [])
    unified_second = alone.execute(decode_step).sampled_token_ids[0]
    assert (first, second) == (unified_first, unified_second)


def test_stale_segments_are_removed_and_claimed_ones_kept(tmp_path: Path) -> None:
    live_dir, dead_dir = tmp_path / "tandem-live", tmp_path / "tandem-dead"
    live_dir.mkdir()
    dead_dir.mkdir()
    live_id, dead_id, orphan_id = new_service_id(), new_service_id(), new_service_id()
    claim = ServiceLock(str(live_dir), live_id)  # a running engine's claim
    (dead_dir / "service-id").write_text(dead_id)  # a crashed engine's: nobody holds it
    names = [segment_name(i, "kv") for i in (live_id, dead_id, orphan_id)]
    for name in names:
        fd = os.open(SHM_DIR / name, os.O_CREAT | os.O_RDWR, 0o600)
        os.ftruncate(fd, 4096)
        os.close(fd)
    try:
        removed = remove_stale(str(tmp_path))  # (and leftovers of earlier runs here)
        assert names[0] not in removed and set(names[1:]) <= set(removed)
        assert (SHM_DIR / names[0]).exists() and not dead_dir.exists()
    finally:
        claim.release()  # unlinks the live service's segments too
    assert not any((SHM_DIR / n).exists() for n in names)


def test_a_mapped_segment_is_never_taken_for_stale(tmp_path: Path) -> None:
    """A segment no engine here claims (its engine keeps its runtime directory under
    another XDG_RUNTIME_DIR, or crashed while its workers run on) stays while a process
    has it mapped, and goes once none has."""
    name = segment_name(new_service_id(), "kv")
    segment = attach_segment(name, 4096)  # a worker's mapping of it
    try:
        assert name not in remove_stale(str(tmp_path))  # (others' leftovers may go)
        assert (SHM_DIR / name).exists()
        again = map_segment(name)  # a second mapping (the re-sharding worker's) counts too
        segment.close()
        assert name not in remove_stale(str(tmp_path)) and (SHM_DIR / name).exists()
        again.close()
        assert name in remove_stale(str(tmp_path))
        assert not (SHM_DIR / name).exists()
    finally:
        segment.close()
        unlink_segment(name)


def test_another_users_segment_is_left_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another user's 0600 segment cannot be opened (root here could, so the refusal is
    the one the kernel gives a user): it is neither removed nor an error at start."""
    name = segment_name(new_service_id(), "kv")
    fd = os.open(SHM_DIR / name, os.O_CREAT | os.O_RDWR, 0o600)
    os.ftruncate(fd, 4096)
    os.close(fd)
    real_open = os.open

    def refuse_theirs(path: object, flags: int, *args: int) -> int:
        if str(path) == str(SHM_DIR / name):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", refuse_theirs)
    try:
        assert name not in remove_stale(str(tmp_path))
        assert (SHM_DIR / name).exists()
    finally:
        monkeypatch.undo()
        unlink_segment(name)


def test_a_segment_created_but_not_yet_sized_is_waited_for() -> None:
    """Two workers of a split pair race to create the KV segment: the loser may open it in
    the instant between the winner's ``shm_open`` and its ``ftruncate`` (an empty file,
    which ``mmap`` refuses). The loser waits for the full size instead of failing."""
    name = segment_name(new_service_id(), "kv")
    fd = os.open(SHM_DIR / name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)  # unsized
    sized = threading.Timer(0.3, os.ftruncate, (fd, 8192))
    sized.start()
    try:
        segment = attach_segment(name, 8192, timeout_s=10.0)
        assert segment.size >= 8192
        segment.close()
    finally:
        sized.join()
        os.close(fd)
        unlink_segment(name)
