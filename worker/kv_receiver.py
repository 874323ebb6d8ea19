"""The decode worker's end of the TCP hand-off: ``KVReceiver`` (``worker/kv_transfer.py``
has the protocol and the sender).

It binds a plain TCP socket (no keys: ``worker/kv_socket.py``) or a ZeroMQ PULL socket
(CurveZMQ with ``--curve-keys``); a thread checks each transfer against what the engine
said would land (``KVReceive``: its number of blocks) and its checksum, then writes it
into those blocks (the engine holds them for the transfer, and checks their generations
when it is told they landed). A transfer can arrive before the engine's word (it is then
held, bounded) or after the engine cancelled it (it is dropped); a cancel and a write
never race (one lock). Results go back to the engine with the worker's next step, or at
once when it is idle (a wake-up on ``NOTIFY_ADDRESS``).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections import OrderedDict

import msgspec
import torch
import zmq

from common.messages import KVReceive, KVStreamHeader, KVTransferResult
from worker.kv_socket import SCHEME, SocketListener, split_address
from worker.kv_staging import StagingPool, checksum, copy_in, row_bytes
from worker.kv_transfer import NOTIFY_ADDRESS, CancelledIds, Secure, drain

logger = logging.getLogger(__name__)

# Transfers held while waiting for the engine's KVReceive: at most this many, and this
# many bytes (a burst during a long step; beyond either, the oldest goes).
_EARLY_LIMIT = 256
_EARLY_BYTES = 1 << 30


class KVReceiver:
    """Takes transfers on its socket and writes them into the expected blocks."""

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        caches: list[torch.Tensor],
        bind_address: str,
        advertise_host: str = "",
        secure: Secure | None = None,
        raw: bool = False,
    ) -> None:
        """``raw``: take transfers on a plain TCP socket (``worker/kv_socket.py``), for
        a hand-off without keys; else on a ZeroMQ PULL socket (a Curve server with
        ``secure``)."""
        self._ctx = ctx
        self._caches = caches
        self._lock = threading.Lock()
        self._expected: dict[str, KVReceive] = {}
        # Transfers here before the engine's word: header, staged bytes (None: malformed), why.
        self._early: OrderedDict[str, tuple[KVStreamHeader, torch.Tensor | None, str | None]] = (
            OrderedDict()
        )
        self._staging = StagingPool()
        self._row_bytes = row_bytes(caches[0])
        self._cancelled = CancelledIds()
        self._results: queue.Queue[KVTransferResult] = queue.Queue()
        self._notify = ctx.socket(zmq.PUSH)
        self._notify.bind(NOTIFY_ADDRESS)
        self._stop = threading.Event()
        self._listener: SocketListener | None = None
        self._sock: zmq.Socket[bytes] | None = None
        if raw:
            bind_host, bind_port = split_address(bind_address)
            self._listener = SocketListener(bind_host, bind_port, self._stage, self._arrived)
            host, port = bind_host, str(self._listener.port)
            self.address = f"{SCHEME}{advertise_host or host}:{port}"
            return
        self._sock = ctx.socket(zmq.PULL)
        if secure is not None:  # a Curve server: its context runs the authenticator
            secure(self._sock)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.bind(bind_address)
        endpoint = str(self._sock.getsockopt_string(zmq.LAST_ENDPOINT))
        host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
        self.address = f"tcp://{advertise_host or host}:{port}"
        self._thread = threading.Thread(
            target=self._run, args=(self._sock,), name="kv-receiver", daemon=True
        )
        self._thread.start()

    def expect(self, order: KVReceive) -> None:
        """The engine says this transfer lands in these blocks; it may already be here."""
        with self._lock:
            if order.transfer_id in self._cancelled:
                return
            early = self._early.pop(order.transfer_id, None)
            if early is None:
                self._expected[order.transfer_id] = order
                return
            self._land(order, *early)

    def cancel(self, transfer_id: str) -> None:
        """Drop the transfer, whenever its bytes come. Returns once no write is under way."""
        with self._lock:
            self._expected.pop(transfer_id, None)
            early = self._early.pop(transfer_id, None)
            if early is not None:
                self._give(early[1])
            self._cancelled.add(transfer_id)

    def take_results(self) -> list[KVTransferResult]:
        return drain(self._results)

    def close(self) -> None:
        self._stop.set()
        if self._listener is not None:
            self._listener.close()
        if self._sock is not None:
            self._thread.join(timeout=5)
            self._sock.close()
        with self._lock:
            self._notify.close()

    def _stage(self, head: bytes) -> tuple[KVStreamHeader | None, torch.Tensor | None, str | None]:
        """A raw connection's header: the buffer its bytes go straight into, or why not."""
        try:
            header = msgspec.msgpack.decode(head, type=KVStreamHeader)
        except msgspec.DecodeError:
            return None, None, None
        layers, row = len(self._caches), self._row_bytes
        # Never more blocks than this cache holds: a header alone must not size a buffer.
        too_many = header.num_blocks > self._caches[0].shape[1]
        if (
            too_many
            or header.num_blocks < 1
            or header.num_bytes != layers * 2 * header.num_blocks * row
        ):
            why = f"{header.num_bytes} bytes for {header.num_blocks} blocks x {layers} layers"
            return header, None, why
        staged = self._staging.take(header.num_bytes).view(layers, 2, header.num_blocks, row)
        return header, staged, None

    def _run(self, sock: zmq.Socket[bytes]) -> None:
        decoder = msgspec.msgpack.Decoder(KVStreamHeader)
        while not self._stop.is_set():
            if not sock.poll(100):
                continue
            head = sock.recv()
            try:
                header = decoder.decode(head)
            except msgspec.DecodeError:
                self._drain(sock)
                logger.warning("dropped an undecodable KV transfer frame")
                continue
            staged, error = self._receive(sock, header)
            self._arrived(header, staged, error)

    def _arrived(
        self, header: KVStreamHeader, staged: torch.Tensor | None, error: str | None
    ) -> None:
        """A transfer's bytes are here (or why they are not usable): land it if expected,
        hold it if not yet, drop it if cancelled."""
        if error is not None and staged is not None:
            self._staging.give(staged)
            staged = None
        with self._lock:
            if self._cancelled.take(header.transfer_id):
                self._give(staged)
                return
            order = self._expected.pop(header.transfer_id, None)
            if order is None:
                self._early[header.transfer_id] = (header, staged, error)
                while len(self._early) > _EARLY_LIMIT or (
                    len(self._early) > 1 and self._early_bytes() > _EARLY_BYTES  # keep the newest
                ):
                    dropped, (_, held, _) = self._early.popitem(last=False)
                    self._give(held)
                    logger.warning("dropped KV transfer %s: never expected", dropped)
                return
            self._land(order, header, staged, error)

    def _receive(
        self, sock: zmq.Socket[bytes], header: KVStreamHeader
    ) -> tuple[torch.Tensor | None, str | None]:
        """The header's layer frames, straight into a staging buffer ``[layers, 2,
        blocks, row]``; or None and why, when they are not the sizes it announced."""
        layers, row = len(self._caches), self._row_bytes
        per_layer = 2 * header.num_blocks * row
        too_many = header.num_blocks > self._caches[0].shape[1]
        if too_many or header.num_blocks < 1 or header.num_bytes != layers * per_layer:
            self._drain(sock)
            return (
                None,
                f"{header.num_bytes} bytes for {header.num_blocks} blocks x {layers} layers",
            )
        staged = self._staging.take(header.num_bytes).view(layers, 2, header.num_blocks, row)
        flat = staged.view(layers, -1)
        for layer in range(layers):
            got = sock.recv_into(flat[layer].numpy().data) if self._more(sock) else 0
            if got != per_layer:
                self._drain(sock)
                self._staging.give(staged)
                return None, f"layer {layer}: {got} bytes, not {per_layer}"
        if self._more(sock):
            self._drain(sock)
            self._staging.give(staged)
            return None, f"more frames than {layers} layers"
        return staged, None

    def _more(self, sock: zmq.Socket[bytes]) -> bool:
        return bool(sock.getsockopt(zmq.RCVMORE))

    def _drain(self, sock: zmq.Socket[bytes]) -> None:
        while self._more(sock):
            sock.recv()

    def _early_bytes(self) -> int:
        return sum(h.num_bytes for h, staged, _ in self._early.values() if staged is not None)

    def _give(self, staged: torch.Tensor | None) -> None:
        if staged is not None:
            self._staging.give(staged)

    def _land(
        self,
        order: KVReceive,
        header: KVStreamHeader,
        staged: torch.Tensor | None,
        error: str | None,
    ) -> None:
        """Check and write one transfer (the lock is held)."""
        if error is None and header.num_blocks != len(order.block_ids):
            error = f"{header.num_blocks} blocks came for {len(order.block_ids)}"
        if error is None and staged is not None:
            views = [memoryview(layer.reshape(-1).numpy().data) for layer in staged]
            if checksum(views) != header.checksum:
                error = "checksum mismatch: the KV arrived damaged"
            else:
                copy_in(self._caches, staged, order.block_ids)
        self._give(staged)
        self._results.put(
            KVTransferResult(order.transfer_id, error is None, error, header.num_bytes)
        )
        with contextlib.suppress(zmq.Again):  # only a wake-up call: none listening is fine
            self._notify.send(b"", zmq.NOBLOCK)
