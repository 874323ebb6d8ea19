"""The benchmark's peer plumbing that needs no peer installed: pausing a server's whole
process tree between its points, and the venv lookups answering None when nothing is
built."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from bench.peers import openvino_peer, vllm_server


def _states(pid: int) -> set[str]:
    root = psutil.Process(pid)
    return {p.status() for p in [root, *root.children(recursive=True)]}


def _wait_for(pid: int, wanted: set[str]) -> set[str]:
    deadline = time.monotonic() + 5
    while (states := _states(pid)) != wanted and time.monotonic() < deadline:
        time.sleep(0.02)
    return states


def test_pause_stops_the_whole_tree_and_resume_lets_it_go_on() -> None:
    # A parent that keeps a child: both must stop, not only the process we hold.
    proc = subprocess.Popen(["bash", "-c", "sleep 30 & wait"])
    try:
        deadline = time.monotonic() + 5
        while not psutil.Process(proc.pid).children() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(psutil.Process(proc.pid).children()) == 1
        vllm_server.pause(proc.pid)
        assert _wait_for(proc.pid, {psutil.STATUS_STOPPED}) == {psutil.STATUS_STOPPED}
        vllm_server.resume(proc.pid)
        assert psutil.STATUS_STOPPED not in _wait_for(proc.pid, {psutil.STATUS_SLEEPING})
    finally:
        vllm_server.resume(proc.pid)
        proc.kill()
        proc.wait()
    vllm_server.pause(proc.pid)  # a server already gone: nothing to do, no error


def test_peers_not_built_are_reported_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path))
    assert vllm_server.venv() is None
    assert openvino_peer.python() is None and openvino_peer.model_dir() is None
    with pytest.raises(FileNotFoundError, match="make bench-peers"):
        openvino_peer.run([[1, 2]], 4, [1])
    with pytest.raises(FileNotFoundError, match="make bench-peers"), vllm_server.vllm_server(4):
        pass


def test_openmp_registrations_of_ended_processes_are_removed(tmp_path: Path) -> None:
    ended = subprocess.Popen(["true"])
    ended.wait()
    alive = psutil.Process().pid
    since = time.time() - 1
    names = {
        "ended": f"__KMP_REGISTERED_LIB_{ended.pid}_0",
        "alive": f"__KMP_REGISTERED_LIB_{alive}_0",
        "older": f"__KMP_REGISTERED_LIB_{ended.pid + 1}_0",  # before the server started
        "other": "libpod_lock",
    }
    for name in names.values():
        (tmp_path / name).write_bytes(b"x")
    older = tmp_path / names["older"]
    os.utime(older, (since - 60, since - 60))
    removed = vllm_server.remove_openmp_registrations(since, shm=tmp_path)
    assert removed == [tmp_path / names["ended"]]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [names["alive"], names["older"], names["other"]]
    )
    assert vllm_server.remove_openmp_registrations(since, shm=tmp_path) == []
