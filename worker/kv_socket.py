"""The TCP hand-off's wire without ZeroMQ, where no CurveZMQ keys are configured.

ZeroMQ copies a large message through its own buffers on both sides: on the Zen 5 host
a bare PUSH/PULL moved a 4k-token request's KV (90 MiB) at 1.5 GB/s where a bare socket
moved it at 3.9 (``bench.kv_transfer``). So, unencrypted, each transfer is one framed
write on a plain TCP connection: a 4-byte length, the MessagePack header, then the
layers' bytes, written straight from the staging buffer (``sendall``: the kernel has
them when it returns, so the buffer is free at once) and read straight into the
receiver's staging buffer (``recv_into``). A receiver advertises ``kvtcp://host:port``
(ZeroMQ's advertise ``tcp://``), so a sender always speaks the wire its receiver binds.
With keys, the hand-off stays on ZeroMQ: CurveZMQ encrypts it.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Callable
from typing import Any

import msgspec
import torch

logger = logging.getLogger(__name__)

SCHEME = "kvtcp://"
_MAX_HEADER = 1 << 16
_SOCKET_BUFFER = 8 << 20  # fewer wake-ups per transfer on either side
_SEND_TIMEOUT_S = 30.0


def split_address(address: str) -> tuple[str, int]:
    host, port = address.removeprefix(SCHEME).removeprefix("tcp://").rsplit(":", 1)
    return host.strip("[]"), int(port)


def recv_exactly(sock: socket.socket, view: memoryview) -> bool:
    """Fill ``view`` from the socket; False if the peer closed first."""
    got = 0
    while got < view.nbytes:
        n = sock.recv_into(view[got:])
        if n == 0:
            return False
        got += n
    return True


class SocketSender:
    """One connection per destination, kept; a failed one is dropped and redialled."""

    def __init__(self) -> None:
        self._sockets: dict[str, socket.socket] = {}

    def send(self, destination: str, header: bytes, frames: list[memoryview]) -> None:
        """Write one transfer; raises OSError if it cannot. A kept connection that turns
        out closed (the receiver restarted) is redialled once before giving up."""
        for attempt in (1, 2):
            fresh = destination not in self._sockets
            sock = self._sockets.get(destination) or self._dial(destination)
            try:
                sock.sendall(len(header).to_bytes(4, "big") + header)
                for frame in frames:
                    sock.sendall(frame)
                return
            except OSError:
                self._sockets.pop(destination, None)
                sock.close()
                if fresh or attempt == 2:
                    raise

    def _dial(self, destination: str) -> socket.socket:
        sock = socket.create_connection(split_address(destination), timeout=10)
        # A receiver that stops reading fails the transfer (within a lease), not the thread.
        sock.settimeout(_SEND_TIMEOUT_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCKET_BUFFER)
        self._sockets[destination] = sock
        return sock

    def close(self) -> None:
        for sock in self._sockets.values():
            sock.close()
        self._sockets.clear()


# A header's bytes -> (the header, or None if it cannot be read; the buffer its bytes go
# into, or None and why they cannot be placed).
Stage = Callable[[bytes], tuple[Any, torch.Tensor | None, str | None]]
Arrived = Callable[[Any, torch.Tensor | None, str | None], None]


class SocketListener:
    """Accepts senders' connections; a thread per connection reads transfers: the header
    (``decode``), then its bytes into the buffer ``stage`` gives for it, then ``arrived``.
    A header that cannot be read, or sizes that cannot be staged, end the connection
    (the sender redials for its next transfer)."""

    def __init__(
        self,
        bind_host: str,
        port: int,
        stage: Stage,
        arrived: Arrived,
    ) -> None:
        self._stage = stage
        self._arrived = arrived
        self._server = socket.create_server((bind_host, port), family=_family(bind_host))
        self._server.settimeout(0.1)
        self.port = int(self._server.getsockname()[1])
        self._stop = threading.Event()
        self._connections: list[socket.socket] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept, name="kv-listener", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._server.close()
        with self._lock:
            for conn in self._connections:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
                conn.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCKET_BUFFER)
            with self._lock:
                self._connections.append(conn)
            threading.Thread(
                target=self._read, args=(conn,), name="kv-connection", daemon=True
            ).start()

    def _read(self, conn: socket.socket) -> None:
        length = bytearray(4)
        try:
            while not self._stop.is_set():
                if not recv_exactly(conn, memoryview(length)):
                    return
                size = int.from_bytes(length, "big")
                if not 0 < size <= _MAX_HEADER:
                    logger.warning("closed a KV connection: a header of %d bytes", size)
                    return
                head = bytearray(size)
                if not recv_exactly(conn, memoryview(head)):
                    return
                header, staged, error = self._stage(bytes(head))
                if header is None:
                    logger.warning("closed a KV connection: an undecodable header")
                    return
                if staged is None:  # its bytes cannot be placed: the stream is lost
                    self._arrived(header, None, error)
                    return
                if not recv_exactly(conn, staged.reshape(-1).numpy().data):
                    self._arrived(header, staged, "the sender closed mid-transfer")
                    return
                self._arrived(header, staged, None)
        except (OSError, msgspec.DecodeError) as e:
            logger.warning("closed a KV connection: %s", e)
        finally:
            with self._lock:
                if conn in self._connections:
                    self._connections.remove(conn)
            conn.close()


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET
