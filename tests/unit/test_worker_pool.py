"""``WorkerPool`` naming the rank that failed: a rank killed mid-collective breaks its
peers' reads as its sockets close, and a peer's failure report can reach the engine
before the killed rank's exit is visible. The pool's processes are fakes here (their exit
codes on a timer); the report comes over the pool's real socket. And a worker that does
not exit after its shutdown (a real process that ignores it) is killed, its stacks
logged first."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from common.config import TandemConfig
from common.ipc import Codec
from common.messages import (
    ModelRunnerOutput,
    PoolRole,
    SchedulerOutput,
    WorkerFailed,
    WorkerHeartbeat,
    WorkerMessage,
)
from common.pool_config import DisaggConfig, PoolSpec
from engine_core.executor import PEER_DEATH_GRACE_S, WorkerDied, WorkerPool


class FakeProc:
    """A process whose exit (SIGKILL) becomes visible ``dies_after`` seconds from now."""

    def __init__(self, pid: int, dies_after: float | None) -> None:
        self.pid = pid
        self._dies_at = None if dies_after is None else time.monotonic() + dies_after

    def poll(self) -> int | None:
        return -9 if self._dies_at is not None and time.monotonic() >= self._dies_at else None


def failure_reported(tmp_path: Path, rank1_dies_after: float | None) -> tuple[str, float]:
    """Rank 0 reports a failure; returns what the pool raises and how long that took."""
    config = TandemConfig(disagg=DisaggConfig(external_workers=True))
    pool = WorkerPool(PoolSpec(PoolRole.UNIFIED, 1, 2, ""), config, str(tmp_path))
    pool._procs = {  # as if the pool had started both ranks
        b"worker-0": FakeProc(100, None),  # type: ignore[dict-item]
        b"worker-1": FakeProc(101, rank1_dies_after),  # type: ignore[dict-item]
    }
    ctx = zmq.Context()
    rank0 = ctx.socket(zmq.DEALER)
    rank0.setsockopt(zmq.IDENTITY, b"worker-0")
    rank0.connect(pool.address)
    try:
        error = "Read error [127.0.0.1]:47531: Connection reset by peer"
        rank0.send(Codec(WorkerMessage).encode(WorkerFailed(rank=0, error=error)))
        deadline = time.monotonic() + 10
        while not pool.sock.poll(10):
            assert time.monotonic() < deadline, "the report never arrived"
        started = time.monotonic()
        with pytest.raises(WorkerDied) as died:
            pool.poll()
        return str(died.value), time.monotonic() - started
    finally:
        rank0.close(linger=0)
        ctx.term()
        pool._procs = {}
        pool.shutdown()


def test_a_peers_report_names_the_rank_whose_death_shows_a_moment_later(tmp_path: Path) -> None:
    why, took = failure_reported(tmp_path, rank1_dies_after=0.05)
    assert why == "worker-1 (pid 101) died: killed by signal 9"
    assert took < PEER_DEATH_GRACE_S + 0.5


def test_a_report_with_no_death_beside_it_names_the_reporter(tmp_path: Path) -> None:
    why, took = failure_reported(tmp_path, rank1_dies_after=None)
    assert why.startswith("worker-0 failed: Read error")
    assert PEER_DEATH_GRACE_S <= took < PEER_DEATH_GRACE_S + 0.5


# A worker stuck where Shutdown cannot reach it: SIGTERM ignored, stacks on SIGUSR1.
STUCK_WORKER = """
import faulthandler, signal, sys, time
faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("up", flush=True)
while True:
    time.sleep(0.05)
"""


def test_a_worker_still_running_after_its_shutdown_is_killed_after_its_stacks(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = TandemConfig(disagg=DisaggConfig(external_workers=True))
    pool = WorkerPool(PoolSpec(PoolRole.UNIFIED, 1, 1, ""), config, str(tmp_path))
    stuck = subprocess.Popen(
        [sys.executable, "-c", STUCK_WORKER], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert stuck.stdout is not None and stuck.stdout.readline() == b"up\n"
    pool._procs = {b"worker-0": stuck}  # as if the pool had started it
    started = time.monotonic()
    pool.shutdown()
    took = time.monotonic() - started
    assert stuck.returncode == -9  # killed, not left behind
    assert 5.0 <= took < 10.0  # its 5 s, the stacks' moment; not the 10 s of a SIGTERM
    _, stacks = stuck.communicate(timeout=10)
    assert b"Current thread" in stacks and b"<string>" in stacks  # where it was
    assert f"worker-0 (pid {stuck.pid}) still running 5 s after its shutdown" in caplog.text


def test_the_pool_sums_the_threads_each_rank_last_stepped_on(tmp_path: Path) -> None:
    """Each rank's answer says the threads its step ran on; an answer that says nothing
    (0) keeps that rank's last figure."""
    config = TandemConfig(disagg=DisaggConfig(external_workers=True))
    pool = WorkerPool(PoolSpec(PoolRole.UNIFIED, 1, 2, ""), config, str(tmp_path))
    ctx = zmq.Context()
    ranks = []
    for rank in range(2):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, f"worker-{rank}".encode())
        sock.connect(pool.address)
        ranks.append(sock)
    codec: Codec[WorkerMessage] = Codec(WorkerMessage)
    try:
        # A ROUTER drops frames to peers it has not heard from: each rank speaks first.
        for rank, sock in enumerate(ranks):
            sock.send(codec.encode(WorkerHeartbeat(rank)))
        deadline = time.monotonic() + 10
        while len(pool._silences) < 2:  # the ranks' heartbeats, taken and ignored
            assert time.monotonic() < deadline, "the ranks never connected"
            pool.sock.poll(10)
            pool.poll()
        assert pool.num_threads == 0
        for step_id, threads in ((1, (2, 2)), (2, (1, 0))):
            pool.submit(SchedulerOutput(step_id, [], [], {}, []))
            for sock, n in zip(ranks, threads, strict=True):
                sock.recv()  # the step
                sock.send(codec.encode(ModelRunnerOutput(step_id, [], [], num_threads=n)))
            deadline = time.monotonic() + 10
            while pool.poll().result is None:
                assert time.monotonic() < deadline, "the answers never arrived"
                time.sleep(0.01)
            if step_id == 1:
                assert pool.num_threads == 4
        assert pool.num_threads == 3  # rank 0 gave a core up; rank 1 said nothing new
    finally:
        for sock in ranks:
            sock.close(linger=0)
        ctx.term()
        pool.shutdown()
