"""A worker started by its own command (``--external-workers``) watches its connection to
the engine: when the engine goes away (its process exits, or its host stops answering
ZeroMQ's heartbeats) the worker exits non-zero, so that its supervisor (compose,
Kubernetes) restarts it to join the engine that replaces the old one. A worker the
engine started itself dies with its parent instead (``die_with_parent``)."""

from __future__ import annotations

from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

HEARTBEAT_IVL_MS = 1000  # ZMTP pings on an idle connection...
HEARTBEAT_TIMEOUT_MS = 5000  # ...and how long without an answer counts as gone


def enable_heartbeats(sock: zmq.Socket[Any]) -> None:
    """Before connecting: notice a silent peer (a vanished host leaves no FIN behind)."""
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)


class EngineLink:
    """Connection events of the worker's engine socket. ``lost()`` is true once a
    connection that was up has gone down (never before the first connect: an engine not
    yet started is waited for)."""

    def __init__(self, sock: zmq.Socket[Any]) -> None:
        self.events = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._sock = sock
        self._was_connected = False

    def lost(self) -> bool:
        while self.events.poll(0):
            event = recv_monitor_message(self.events)["event"]
            if event == zmq.EVENT_CONNECTED:
                self._was_connected = True
            elif event == zmq.EVENT_DISCONNECTED and self._was_connected:
                return True
        return False

    def close(self) -> None:
        self._sock.disable_monitor()
        self.events.close()
