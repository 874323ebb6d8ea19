"""A worker started apart notices its engine's socket going away (real ZeroMQ sockets)."""

from __future__ import annotations

import socket
import time
from typing import Any

import zmq

from worker.engine_link import EngineLink, enable_heartbeats


def wait_until_lost(link: EngineLink, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if link.lost():
            return True
        link.events.poll(100)
    return False


def test_a_vanished_engine_is_noticed_and_one_not_yet_started_is_waited_for() -> None:
    # The engine's port is held by a socket that is bound but not listening: connecting
    # is refused, as to an engine not yet started, and neither another process nor the
    # worker's own ephemeral port (a TCP self-connect, which once connected the worker
    # to itself here) can take the port until the engine binds it.
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    holder.bind(("127.0.0.1", 0))
    port = holder.getsockname()[1]
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        worker = ctx.socket(zmq.DEALER)
        enable_heartbeats(worker)
        link = EngineLink(worker)
        worker.connect(f"tcp://127.0.0.1:{port}")
        assert not wait_until_lost(link, 0.5)  # refused, retried: nothing is lost
        holder.close()
        engine = ctx.socket(zmq.ROUTER)
        engine.bind(f"tcp://127.0.0.1:{port}")
        worker.send(b"ready")
        assert engine.poll(5000) and engine.recv_multipart()[1] == b"ready"
        assert not link.lost()  # connected and answering
        engine.close(linger=0)  # the engine process is gone
        assert wait_until_lost(link, 5.0)
        link.close()
    finally:
        holder.close()
        # Closes every socket: a failed assertion must not leave a context whose
        # garbage collection blocks a later test in term().
        ctx.destroy(linger=0)
