"""``KVSideChannel``: the sockets between instances' engines, on a thread of their own.

A prefill instance binds a ROUTER at ``kv_ip:kv_port``; a decode instance connects a
DEALER to each prefill instance it pulls from (the address its ``kv_transfer_params``
name). The thread answers every pull with a ``KVPullAck`` itself, at once, so a decode
instance learns within its ack timeout whether the prefill instance is alive even while
that instance's step loop runs a long step; everything else goes to the step loop
(``deliver``) and comes back from it through ``send``, never a socket call on the loop.
Undecodable frames are dropped and counted. CurveZMQ secures both ends with
``--curve-keys``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from common.messages import KVPull, KVPullAck, PeerMessage

logger = logging.getLogger(__name__)

Secure = Callable[[zmq.Socket[Any]], None]
Deliver = Callable[[bytes, PeerMessage], None]

_OUT_ADDRESS = "inproc://kv-side-channel-out"
_REPLY, _SEND = b"r", b"s"
_MAX_PEERS = 256  # prefill instances a decode instance keeps a connection to


class KVSideChannel:
    def __init__(
        self,
        ctx: zmq.Context[Any],
        bind_address: str | None,
        deliver: Deliver,
        secure_server: Secure | None = None,
        secure_client: Secure | None = None,
    ) -> None:
        self._ctx = ctx
        self._deliver = deliver
        self._secure_client = secure_client
        self._encoder = msgspec.msgpack.Encoder()
        self.num_malformed_frames = 0
        self._router: zmq.Socket[bytes] | None = None
        if bind_address is not None:
            self._router = ctx.socket(zmq.ROUTER)
            if secure_server is not None:
                secure_server(self._router)
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.bind(bind_address)
        self._out_pull: zmq.Socket[bytes] = ctx.socket(zmq.PULL)
        self._out_pull.bind(_OUT_ADDRESS)
        self._out: zmq.Socket[bytes] = ctx.socket(zmq.PUSH)  # the step loop's end
        self._out.connect(_OUT_ADDRESS)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-side-channel", daemon=True)
        self._thread.start()

    def send(self, to: bytes | str, message: PeerMessage) -> None:
        """From the step loop: answer a peer (its identity) or send to an address. Never
        blocks the loop: a message the thread cannot take is dropped (its pull's ack
        timeout, or the lease's expiry, ends what it was about)."""
        kind, target = (_REPLY, to) if isinstance(to, bytes) else (_SEND, to.encode())
        try:
            self._out.send_multipart([kind, target, self._encoder.encode(message)], zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("side channel busy: a message for %r was dropped", to)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._out.close(linger=0)

    def _run(self) -> None:
        decoder: msgspec.msgpack.Decoder[PeerMessage] = msgspec.msgpack.Decoder(PeerMessage)
        encoder = msgspec.msgpack.Encoder()  # this thread's own (send() uses the other)
        dealers: dict[str, zmq.Socket[bytes]] = {}
        poller = zmq.Poller()
        poller.register(self._out_pull, zmq.POLLIN)
        if self._router is not None:
            poller.register(self._router, zmq.POLLIN)
        while not self._stop.is_set():
            for sock, _ in poller.poll(100):
                # One bad frame or address costs that message, never the thread.
                try:
                    if sock is self._out_pull:
                        kind, target, frame = self._out_pull.recv_multipart()
                        self._forward(kind, target, frame, dealers, poller)
                    elif sock is self._router and self._router is not None:
                        parts = self._router.recv_multipart()
                        if len(parts) == 2:
                            self._take(parts[0], parts[1], decoder, encoder)
                        else:
                            self.num_malformed_frames += 1
                    else:
                        self._take(b"", sock.recv(), decoder, encoder)
                except (zmq.ZMQError, ValueError) as e:
                    logger.warning("side channel: %s", e)
        for sock in (*dealers.values(), self._router, self._out_pull):
            if sock is not None:
                sock.close(linger=0)

    def _forward(
        self,
        kind: bytes,
        target: bytes,
        frame: bytes,
        dealers: dict[str, zmq.Socket[bytes]],
        poller: zmq.Poller,
    ) -> None:
        if kind == _REPLY:
            if self._router is not None:
                self._router.send_multipart([target, frame])
            return
        address = target.decode()
        sock = dealers.pop(address, None)
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            if self._secure_client is not None:
                self._secure_client(sock)
            sock.setsockopt(zmq.LINGER, 0)
            try:
                sock.connect(address)
            except zmq.ZMQError:
                sock.close()
                raise
            poller.register(sock, zmq.POLLIN)
            while len(dealers) >= _MAX_PEERS:  # the least recently used goes
                oldest = dealers.pop(next(iter(dealers)))
                poller.unregister(oldest)
                oldest.close()
        dealers[address] = sock  # most recently used last
        try:
            sock.send(frame, zmq.NOBLOCK)
        except zmq.Again:  # never reached: the pull's ack timeout ends it
            logger.warning("side channel to %s is full: a message was dropped", address)

    def _take(
        self,
        identity: bytes,
        frame: bytes,
        decoder: msgspec.msgpack.Decoder[Any],
        encoder: msgspec.msgpack.Encoder,
    ) -> None:
        try:
            message = decoder.decode(frame)
        except msgspec.DecodeError as e:
            self.num_malformed_frames += 1
            logger.warning("dropped a malformed side-channel frame: %s", e)
            return
        if isinstance(message, KVPull) and self._router is not None:
            ack = encoder.encode(KVPullAck(message.transfer_id))
            self._router.send_multipart([identity, ack])
        self._deliver(identity, message)
