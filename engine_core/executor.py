"""Worker pools: the engine's side of its workers' sockets.

A ``WorkerPool`` binds one ROUTER socket; its worker ``r`` connects with identity
``worker-<r>`` (and, from a thread beside its step loop, ``heartbeat-<r>``). The engine
``submit``s a step to every worker of the pool and ``poll``s without blocking; rank 0's
answer is the step's result once every rank has answered, so a pool keeps a batch in
flight and never makes the engine wait for it. With async scheduling it keeps two: the
second waits in the workers' sockets, and they answer in order. Between steps a decode
worker may report KV transfers that landed (``KVTransferStatus``).

Workers are started by the pool (``python -m worker --pool P --rank R --worker-address
A``, the same command a container runs) or, with ``--external-workers``, started apart
and found when they connect. A dead worker raises ``WorkerDied`` naming it: noticed by
its process exiting, or (external) by its heartbeat stopping for ``HEARTBEAT_TIMEOUT_S`` of
the engine's own running time (``common.silence``: a pause of the whole machine is not a
death).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import subprocess
import time
from collections import deque
from dataclasses import dataclass, field

import msgspec
import zmq

from common.config import TandemConfig
from common.curve import CurveKeys
from common.ipc import Codec, free_tcp_port, ipc_address, make_socket
from common.messages import (
    KVTransferResult,
    KVTransferStatus,
    ModelRunnerOutput,
    PoolRole,
    SchedulerOutput,
    Shutdown,
    WorkerFailed,
    WorkerHeartbeat,
    WorkerMessage,
    WorkerReady,
)
from common.pool_config import PoolSpec
from common.process import start_module, worker_env
from common.silence import Silence

logger = logging.getLogger(__name__)

POLL_S = 0.1
HEARTBEAT_TIMEOUT_S = 3.0
# At most this much of the time between two liveness checks counts as a worker's silence
# (the worker's heartbeat interval): the checks come every POLL_S or sooner while the
# engine runs, so a longer gap is this process not running.
MAX_SILENCE_GAP_S = 0.5
# How long a rank's failure report waits for a sibling's death to show: a rank killed
# mid-collective breaks its peers' reads as its sockets close, and its exit becomes visible
# (waitpid) a moment later, so a peer's report can arrive first and would name the wrong rank.
PEER_DEATH_GRACE_S = 0.3
# How long a started worker has to exit after its Shutdown message (it normally takes
# well under a second), and to write its stacks before it is killed.
_SHUTDOWN_WAIT_S = 5.0
_STACKS_WAIT_S = 0.5


class WorkerDied(RuntimeError):
    """A worker process exited or reported a failure; the message names it."""


@dataclass
class PoolEvents:
    """What one ``poll`` found: the in-flight step's result, if it is complete, and KV
    transfers that ended on this pool's side."""

    result: ModelRunnerOutput | None = None
    transfers: list[KVTransferResult] = field(default_factory=list)


class WorkerPool:
    def __init__(self, spec: PoolSpec, config: TandemConfig, runtime_dir: str) -> None:
        self.role = spec.role
        self.name = str(spec.role)
        num_workers = spec.workers
        self._ctx = zmq.Context()
        self.address = spec.address or ipc_address(runtime_dir, f"pool-{self.name}")
        # With --curve-keys the pool's socket is a Curve server like the engine's own:
        # only workers holding the deployment's client key get a step (or send one back).
        keys = CurveKeys(config.addresses.curve_keys) if config.addresses.curve_keys else None
        self._auth = keys.start_authenticator(self._ctx) if keys else None
        self._sock = make_socket(
            self._ctx,
            zmq.ROUTER,
            self.address,
            bind=True,
            secure=keys.make_server if keys else None,
        )
        self._codec: Codec[WorkerMessage] = Codec(WorkerMessage)
        self._identities = [f"worker-{rank}".encode() for rank in range(num_workers)]
        self._procs: dict[bytes, subprocess.Popen[bytes]] = {}
        self._external = config.disagg.external_workers
        self._silences: dict[int, Silence] = {}  # external workers', by rank
        # Steps sent and not yet answered by every rank, oldest first; their answers.
        self._max_in_flight = config.scheduler.max_steps_in_flight
        self._in_flight: deque[SchedulerOutput] = deque()
        self._results: dict[int, dict[bytes, ModelRunnerOutput]] = {}
        # Tensor parallelism: ranks > 0 do not sample; they learn rank 0's tokens here
        # (with async scheduling, from rank 0 itself: the next step leaves too early).
        self._relays_samples = spec.tp > 1 and not config.scheduler.async_scheduling
        self.kv_addresses: list[str] = []  # per rank, where a decode worker takes KV (tcp)
        self._threads: dict[bytes, int] = {}  # per rank, the CPU threads of its latest step
        self._last_sampled: dict[str, int] = {}
        if self._external:
            logger.info(
                "pool %s: waiting for %d worker(s) at %s", self.name, num_workers, self.address
            )
            return
        env = worker_env()
        group = (
            ["--tp-init-address", f"tcp://127.0.0.1:{free_tcp_port()}"] if num_workers > 1 else []
        )
        for rank, identity in enumerate(self._identities):
            args = [
                *config.to_cli_args(),
                "--pool",
                self.name,
                "--rank",
                str(rank),
                "--worker-address",
                self.address,
                *group,
            ]
            proc = start_module("worker", args, env=env)
            self._procs[identity] = proc
            logger.info("pool %s: started worker-%d (pid %d)", self.name, rank, proc.pid)

    @property
    def sock(self) -> zmq.Socket[bytes]:
        """For the engine's poller: readable when a worker has sent something."""
        return self._sock

    @property
    def busy(self) -> bool:
        return bool(self._in_flight)

    @property
    def num_threads(self) -> int:
        """CPU threads the pool's workers ran their latest steps on, summed over ranks."""
        return sum(self._threads.values())

    def wait_ready(self) -> WorkerReady:
        """Block until every worker has loaded and warmed up; returns the handshake of
        the worker with the fewest KV blocks (the pool can use no more)."""
        readies: dict[bytes, WorkerReady] = {}
        while len(readies) < len(self._identities):
            identity, message = self._recv(block=True)
            if isinstance(message, WorkerHeartbeat):
                continue
            if not isinstance(message, WorkerReady) or identity not in self._identities:
                raise WorkerDied(
                    f"{self._who(identity)} sent {type(message).__name__} before it was ready"
                )
            if message.pool != self.role:
                raise WorkerDied(
                    f"{self._who(identity)} is a {message.pool} worker but connected to the "
                    f"{self.name} pool's address"
                )
            readies[identity] = message
        self.kv_addresses = [readies[identity].kv_address for identity in self._identities]
        return min(readies.values(), key=lambda r: r.num_kv_blocks)

    def submit(self, step: SchedulerOutput) -> None:
        """Send the step to every worker; its result comes from ``poll``."""
        if len(self._in_flight) >= self._max_in_flight:
            raise RuntimeError(
                f"pool {self.name} already has {len(self._in_flight)} step(s) in flight"
            )
        if self._relays_samples:
            step = msgspec.structs.replace(step, prev_sampled=self._last_sampled)
        frame = self._codec.encode(step)
        for identity in self._identities:
            self._sock.send_multipart([identity, frame])
        self._in_flight.append(step)
        self._results[step.step_id] = {}

    def poll(self) -> PoolEvents:
        """Everything the workers sent since the last poll, without waiting; the oldest
        step's result once every rank has answered it (a later one on the next poll)."""
        events = PoolEvents()
        while self._sock.poll(0):
            identity, message = self._recv(block=False)
            if isinstance(message, ModelRunnerOutput):
                answers = self._results.get(message.step_id)
                if answers is None:
                    raise WorkerDied(f"{self._who(identity)} answered a step it was not given")
                answers[identity] = message
                if message.num_threads:
                    self._threads[identity] = message.num_threads
            elif isinstance(message, KVTransferStatus):
                events.transfers += message.results
            elif not isinstance(message, WorkerHeartbeat):
                raise WorkerDied(f"{self._who(identity)} sent {type(message).__name__} mid-run")
        oldest = self._in_flight[0].step_id if self._in_flight else None
        if oldest is not None and len(self._results[oldest]) == len(self._identities):
            answers = self._results.pop(oldest)
            events.result = answers[self._identities[0]]
            for identity in self._identities:  # each decode rank lands its own KV heads
                events.transfers += answers[identity].kv_results
            if self._relays_samples:
                result = events.result
                self._last_sampled = dict(
                    zip(result.request_ids, result.sampled_token_ids, strict=True)
                )
            self._in_flight.popleft()
        return events

    def check_alive(self) -> None:
        for identity, proc in self._procs.items():
            code = proc.poll()
            if code is not None:
                raise WorkerDied(
                    f"{self._who(identity)} (pid {proc.pid}) died: {_describe_exit(code)}"
                )
        if self._external:
            for rank, silence in self._silences.items():
                if silence.look() > HEARTBEAT_TIMEOUT_S:
                    raise WorkerDied(
                        f"{self.name} worker-{rank} stopped answering (no heartbeat for "
                        f"{HEARTBEAT_TIMEOUT_S:.0f} s)"
                    )

    def _check_alive_for(self, seconds: float) -> None:
        """``check_alive`` until ``seconds`` pass (only where this pool started several
        processes: a lone worker has no sibling to blame)."""
        deadline = time.monotonic() + (seconds if len(self._procs) > 1 else 0.0)
        self.check_alive()
        while time.monotonic() < deadline:
            time.sleep(0.01)
            self.check_alive()

    def _who(self, identity: bytes) -> str:
        name = identity.decode(errors="replace")
        return name if self.role == PoolRole.UNIFIED else f"{self.name} {name}"

    def _recv(self, block: bool) -> tuple[bytes, WorkerMessage]:
        while block and not self._sock.poll(int(POLL_S * 1000)):
            self.check_alive()
        identity, frame = self._sock.recv_multipart()
        message = self._codec.decode(frame)
        if isinstance(message, WorkerHeartbeat):
            self._silences.setdefault(message.rank, Silence(MAX_SILENCE_GAP_S)).heard()
        if isinstance(message, WorkerFailed):
            # A rank that died mid-collective breaks its peers' step: name the dead one.
            self._check_alive_for(PEER_DEATH_GRACE_S)
            raise WorkerDied(f"{self._who(identity)} failed: {message.error}")
        return identity, message

    def shutdown(self) -> None:
        for identity in self._identities:
            if identity not in self._procs or self._procs[identity].poll() is None:
                with contextlib.suppress(zmq.ZMQError):
                    self._sock.send_multipart(
                        [identity, self._codec.encode(Shutdown())], zmq.NOBLOCK
                    )
        deadline = time.monotonic() + _SHUTDOWN_WAIT_S
        for identity, proc in self._procs.items():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._kill_stuck(identity, proc)
        self._sock.close()
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()

    def _kill_stuck(self, identity: bytes, proc: subprocess.Popen[bytes]) -> None:
        """A worker still running after its ``Shutdown``: it missed the message or hangs
        on its way out. SIGTERM would only start its own drain deadline (longer than the
        launcher waits for this engine), so it is killed, after writing its Python stacks
        to the log (SIGUSR1, ``common/logs.py``) to show where it was."""
        logger.warning(
            "%s (pid %d) still running %.0f s after its shutdown; its stacks follow, then it "
            "is killed",
            self._who(identity),
            proc.pid,
            _SHUTDOWN_WAIT_S,
        )
        proc.send_signal(signal.SIGUSR1)  # Popen's: a no-op once it has exited
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(_STACKS_WAIT_S)  # the dump's moment, unless it exits meanwhile
        proc.kill()
        proc.wait()


def _describe_exit(code: int) -> str:
    return f"killed by signal {-code}" if code < 0 else f"exit code {code}"
