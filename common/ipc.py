"""Typed ZeroMQ sockets carrying the MessagePack structs of ``common/messages.py``.

Sockets are not thread-safe: each one is created and used by a single thread. The
engine binds, clients connect. Frames that fail to decode raise ``msgspec.DecodeError``
for the caller to count and drop; they never crash a process.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import msgspec
import zmq

T = TypeVar("T")


class Codec(Generic[T]):
    """Encodes any wire struct; decodes only ``T`` (a struct or a tagged union)."""

    def __init__(self, decode_type: type[T] | object) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder: msgspec.msgpack.Decoder[T] = msgspec.msgpack.Decoder(decode_type)

    def encode(self, message: msgspec.Struct) -> bytes:
        return self._encoder.encode(message)

    def decode(self, frame: bytes | memoryview) -> T:
        return self._decoder.decode(frame)


def make_socket(
    ctx: zmq.Context[Any],
    kind: int,
    address: str,
    *,
    bind: bool,
    identity: bytes | None = None,
    max_message_bytes: int | None = None,
    secure: Callable[[zmq.Socket[Any]], None] | None = None,
) -> zmq.Socket[bytes]:
    """A socket that never drops messages on a full queue and closes without lingering;
    with ``max_message_bytes``, a peer sending a larger frame is disconnected; ``secure``
    makes it a CurveZMQ server or client (``common/curve.py``) before it binds/connects."""
    sock = ctx.socket(kind)
    if secure is not None:
        secure(sock)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    if max_message_bytes is not None:
        sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if bind:
        sock.bind(address)
    else:
        sock.connect(address)
    return sock


def max_request_frame_bytes(max_body_bytes: int) -> int:
    """The largest ``EngineRequest`` frame an API server can produce from a body of at most
    ``max_body_bytes`` (every token id of a body costs at most 16 bytes on the wire),
    plus room for the rest; the engine's input socket refuses larger ones
    (``ZMQ_MAXMSGSIZE``: the sender's connection is dropped)."""
    return 16 * max_body_bytes + (1 << 20)


def make_runtime_dir() -> str:
    """A private (0700) directory for ``ipc://`` socket files."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    if not os.access(base, os.W_OK):
        base = tempfile.gettempdir()
    return tempfile.mkdtemp(prefix="tandem-", dir=base)


def ipc_address(runtime_dir: str, name: str) -> str:
    return f"ipc://{os.path.join(runtime_dir, name + '.sock')}"


def free_tcp_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now (for a rendezvous address handed to children)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
