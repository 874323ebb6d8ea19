"""A worker started apart notices its engine's socket going away (real ZeroMQ sockets)."""

from __future__ import annotations

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
    ctx: zmq.Context[Any] = zmq.Context()
    engine = ctx.socket(zmq.ROUTER)
    port = engine.bind_to_random_port("tcp://127.0.0.1")
    engine.close(linger=0)  # not listening yet: the worker keeps trying, nothing is lost
    worker = ctx.socket(zmq.DEALER)
    enable_heartbeats(worker)
    link = EngineLink(worker)
    worker.connect(f"tcp://127.0.0.1:{port}")
    assert not wait_until_lost(link, 0.5)
    engine = ctx.socket(zmq.ROUTER)
    engine.bind(f"tcp://127.0.0.1:{port}")
    worker.send(b"ready")
    assert engine.poll(5000) and engine.recv_multipart()[1] == b"ready"
    assert not link.lost()  # connected and answering
    engine.close(linger=0)  # the engine process is gone
    assert wait_until_lost(link, 5.0)
    link.close()
    worker.close(linger=0)
    ctx.term()
