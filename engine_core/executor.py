"""Worker pools: start worker processes, broadcast each step, gather the result.

The engine core addresses workers only through a ``WorkerPool`` (today one pool,
``unified``; split prefill/decode pools plug in beside it). Each pool binds one ROUTER
socket; worker ``r`` connects with identity ``worker-<r>``. A dead or failed worker
raises ``WorkerDied`` naming it, within ``_POLL_S`` of its death.
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import time

import zmq

from common.config import TandemConfig
from common.ipc import Codec, ipc_address, make_socket
from common.messages import (
    ModelRunnerOutput,
    SchedulerOutput,
    Shutdown,
    WorkerFailed,
    WorkerMessage,
    WorkerReady,
)
from common.process import start_module, stop_process, worker_env

logger = logging.getLogger(__name__)

_POLL_S = 0.1


class WorkerDied(RuntimeError):
    """A worker process exited or reported a failure; the message names it."""


class WorkerPool:
    def __init__(
        self, name: str, config: TandemConfig, runtime_dir: str, num_workers: int = 1
    ) -> None:
        self.name = name
        self._ctx = zmq.Context()
        self._address = ipc_address(runtime_dir, f"pool-{name}")
        self._sock = make_socket(self._ctx, zmq.ROUTER, self._address, bind=True)
        self._codec: Codec[WorkerMessage] = Codec(WorkerMessage)
        self._procs: dict[bytes, subprocess.Popen[bytes]] = {}
        for rank in range(num_workers):
            args = [*config.to_cli_args(), "--rank", str(rank), "--worker-address", self._address]
            proc = start_module("worker", args, env=worker_env())
            self._procs[f"worker-{rank}".encode()] = proc
            logger.info("pool %s: started worker-%d (pid %d)", name, rank, proc.pid)

    def wait_ready(self) -> WorkerReady:
        """Block until every worker has loaded and warmed up; returns the handshake of
        the worker with the fewest KV blocks (the pool can use no more)."""
        readies: dict[bytes, WorkerReady] = {}
        while len(readies) < len(self._procs):
            identity, message = self._recv()
            if not isinstance(message, WorkerReady):
                raise WorkerDied(
                    f"{identity.decode()} sent {type(message).__name__} before it was ready"
                )
            readies[identity] = message
        return min(readies.values(), key=lambda r: r.num_kv_blocks)

    def execute(self, step: SchedulerOutput) -> ModelRunnerOutput:
        """Send the step to every worker; rank 0's answer is the result."""
        frame = self._codec.encode(step)
        for identity in self._procs:
            self._sock.send_multipart([identity, frame])
        results: dict[bytes, ModelRunnerOutput] = {}
        while len(results) < len(self._procs):
            identity, message = self._recv()
            if not isinstance(message, ModelRunnerOutput):
                raise WorkerDied(f"{identity.decode()} sent {type(message).__name__} during a step")
            results[identity] = message
        return results[b"worker-0"]

    def check_alive(self) -> None:
        for identity, proc in self._procs.items():
            code = proc.poll()
            if code is not None:
                raise WorkerDied(
                    f"{identity.decode()} (pid {proc.pid}) died: {_describe_exit(code)}"
                )

    def _recv(self) -> tuple[bytes, WorkerMessage]:
        while not self._sock.poll(int(_POLL_S * 1000)):
            self.check_alive()
        identity, frame = self._sock.recv_multipart()
        message = self._codec.decode(frame)
        if isinstance(message, WorkerFailed):
            raise WorkerDied(f"{identity.decode()} failed: {message.error}")
        return identity, message

    def shutdown(self) -> None:
        for identity, proc in self._procs.items():
            if proc.poll() is None:
                with contextlib.suppress(zmq.ZMQError):
                    self._sock.send_multipart(
                        [identity, self._codec.encode(Shutdown())], zmq.NOBLOCK
                    )
        deadline = time.monotonic() + 5.0
        for proc in self._procs.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                stop_process(proc)
        self._sock.close()
        self._ctx.term()


def _describe_exit(code: int) -> str:
    return f"killed by signal {-code}" if code < 0 else f"exit code {code}"
