"""Prefill -> decode KV hand-off over TCP (``--kv-transfer tcp``), worker side.

The prefill worker's ``KVSender``: told to send a transfer (``KVSend``), it copies the
blocks out of its caches at the start of its next step (so they can be freed and reused
at once) and a thread streams them to the decode worker while the step runs: one
ZeroMQ multipart message, a header (transfer id, block count, bytes, XXH3-64 checksum)
then one frame per layer, sent without a copy out of a reused staging buffer
(``worker/kv_staging.py`` says what the copies cost and why).

The decode worker's ``KVReceiver`` binds a PULL socket; its thread checks each transfer
against what the engine said would land (``KVReceive``: block ids and their generations)
and its checksum, then writes it into those blocks. A transfer can arrive before the
engine's word (it is then held, bounded) or after the engine cancelled it (it is
dropped); a cancel and a write never race (one lock). Frames are received straight into
a reused staging buffer, checked, and copied into the blocks. Results go back to the
engine with the worker's next step, or at once when it is idle.

(With ``--kv-transfer shm`` nothing here runs: both pools map the same KV memory.)
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import torch
import zmq

from common.messages import KVReceive, KVSend, KVTransferResult
from worker.kv_reshard import KVLayout, gather_heads, heads_for
from worker.kv_staging import StagingPool, checksum, copy_in, copy_out, row_bytes
from worker.parallel import TensorParallel

Secure = Callable[[zmq.Socket[Any]], None]  # makes a socket a Curve server or client

logger = logging.getLogger(__name__)

_EARLY_LIMIT = 64  # transfers held while waiting for the engine's KVReceive
_CANCELLED_LIMIT = 4096  # cancelled ids remembered (their bytes may still come)


class _Cancelled:
    """Transfer ids whose bytes are to be dropped, the most recent ``_CANCELLED_LIMIT``."""

    def __init__(self) -> None:
        self._ids: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()  # the step loop adds, a transfer thread takes

    def add(self, transfer_id: str) -> None:
        with self._lock:
            self._ids[transfer_id] = None
            while len(self._ids) > _CANCELLED_LIMIT:
                self._ids.popitem(last=False)

    def take(self, transfer_id: str) -> bool:
        """Whether it was cancelled (forgetting it: its bytes came)."""
        with self._lock:
            return self._ids.pop(transfer_id, 0) is None

    def __contains__(self, transfer_id: str) -> bool:
        with self._lock:
            return transfer_id in self._ids


NOTIFY_ADDRESS = "inproc://kv-transfer-results"


class _Header(msgspec.Struct, array_like=True):
    transfer_id: str
    num_blocks: int
    num_bytes: int
    checksum: int  # XXH3-64 of the frames


def _block_rows(cache: torch.Tensor) -> torch.Tensor:
    """One layer's cache as ``[2, num_blocks, kv_heads * block_size * dim]`` (a view)."""
    return cache.flatten(2)


def gather_blocks(caches: list[torch.Tensor], blocks: list[int]) -> torch.Tensor:
    """``[layers, 2, len(blocks), kv_heads * block_size * dim]``: one contiguous copy, on
    the caches' device (a GPU's blocks go to the host only once resharded, for the wire)."""
    first = _block_rows(caches[0])
    index = torch.tensor(blocks, dtype=torch.long, device=first.device)
    out = first.new_empty((len(caches), 2, len(blocks), first.shape[2]))
    for layer, cache in enumerate(caches):
        torch.index_select(_block_rows(cache), 1, index, out=out[layer])
    return out


@dataclass(frozen=True)
class Reshard:
    """Tensor-parallel pools on either side: this prefill rank's place, and how each
    pool lays the KV heads out (``worker/kv_reshard.py``)."""

    tp: TensorParallel
    source: KVLayout
    dest: KVLayout


class KVSender:
    """Copies blocks out on the step loop, streams them from a thread."""

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        block_size: int,
        secure: Secure | None = None,
        reshard: Reshard | None = None,
    ) -> None:
        self._ctx = ctx
        self._block_size = block_size
        self._secure = secure  # a Curve client (--curve-keys): the receiver admits only it
        self._reshard = reshard
        # Per transfer: (destination, its bytes), one per decode rank.
        # (``staged``: the bytes are a staging buffer, to reuse once on the wire).
        self._work: queue.Queue[tuple[str, list[tuple[str, torch.Tensor]], bool] | None] = (
            queue.Queue()
        )
        self._staging = StagingPool()  # one rank's unresharded bytes, reused once sent
        self._failures: queue.Queue[KVTransferResult] = queue.Queue()
        self._cancelled = _Cancelled()
        self._thread = threading.Thread(target=self._run, name="kv-sender", daemon=True)
        self._thread.start()

    def send(self, order: KVSend, caches: list[torch.Tensor]) -> None:
        """Copy the order's blocks now; the bytes leave from the sender thread. With
        tensor parallelism every prefill rank calls this in the same step (a collective)
        and rank 0 sends each decode rank its heads."""
        reshard = self._reshard
        if reshard is None and caches[0].device.type == "cpu":
            n = len(order.block_ids)
            staged = self._staging.take(len(caches) * 2 * n * row_bytes(caches[0]))
            staged = staged.view(len(caches), 2, n, -1)
            copy_out(caches, order.block_ids, staged)
            self._work.put((order.transfer_id, [(order.destinations[0], staged)], True))
            return
        payload = gather_blocks(caches, order.block_ids)
        if reshard is None:  # a GPU's blocks: to the host once
            self._work.put((order.transfer_id, [(order.destinations[0], payload.cpu())], False))
            return
        full = gather_heads(payload, reshard.tp, reshard.source, self._block_size)
        if full is None:
            return  # rank 0 sends
        if len(order.destinations) != reshard.dest.tp_size:
            error = f"{len(order.destinations)} destinations for {reshard.dest.tp_size} ranks"
            self._failures.put(KVTransferResult(order.transfer_id, False, error))
            return
        pieces = [
            (address, heads_for(full, reshard.dest.heads(rank)).cpu())
            for rank, address in enumerate(order.destinations)
        ]
        self._work.put((order.transfer_id, pieces, False))

    def cancel(self, transfer_id: str) -> None:
        self._cancelled.add(transfer_id)  # not yet sent: skipped

    def take_failures(self) -> list[KVTransferResult]:
        out = []
        while not self._failures.empty():
            out.append(self._failures.get_nowait())
        return out

    def close(self) -> None:
        self._work.put(None)
        self._thread.join(timeout=5)

    def _run(self) -> None:
        sockets: dict[str, zmq.Socket[bytes]] = {}
        # Staging buffers the sockets still hold (zero-copy frames), until on the wire.
        on_wire: list[tuple[zmq.MessageTracker, torch.Tensor]] = []
        while (item := self._work.get()) is not None:
            transfer_id, pieces, staged = item
            if self._cancelled.take(transfer_id):
                continue
            for destination, payload in pieces:
                tracker = self._send(sockets, transfer_id, destination, payload)
                if tracker is None:
                    break
                if staged:
                    on_wire.append((tracker, payload))
            held = []
            for tracker, buffer in on_wire:
                if tracker.done:
                    self._staging.give(buffer)
                else:
                    held.append((tracker, buffer))
            on_wire = held
        for sock in sockets.values():
            sock.close()

    def _send(
        self,
        sockets: dict[str, zmq.Socket[bytes]],
        transfer_id: str,
        destination: str,
        payload: torch.Tensor,
    ) -> zmq.MessageTracker | None:
        """Stream one decode rank's part: what tells when the socket lets go of its
        frames, or None if it failed (the transfer has)."""
        try:
            sock = sockets.get(destination)
            if sock is None:
                sock = self._ctx.socket(zmq.PUSH)
                if self._secure is not None:
                    self._secure(sock)
                sock.setsockopt(zmq.LINGER, 2000)
                sock.setsockopt(zmq.SNDHWM, 0)
                sock.connect(destination)
                sockets[destination] = sock
            frames = [memoryview(layer.numpy().data) for layer in _as_bytes(payload)]
            num_bytes = sum(f.nbytes for f in frames)
            header = _Header(transfer_id, payload.shape[2], num_bytes, checksum(frames))
            return sock.send_multipart(
                [msgspec.msgpack.encode(header), *frames], copy=False, track=True
            )
        except Exception as e:  # a broken destination fails this transfer, not the worker
            logger.warning("KV transfer %s to %s failed: %s", transfer_id, destination, e)
            self._failures.put(KVTransferResult(transfer_id, False, f"send failed: {e}"))
            return None


def _as_bytes(payload: torch.Tensor) -> list[torch.Tensor]:
    """Each layer's slice as a contiguous byte tensor (bfloat16 has no numpy dtype)."""
    return [layer.contiguous().view(torch.uint8).reshape(-1) for layer in payload]


class KVReceiver:
    """Takes transfers on a PULL socket and writes them into the expected blocks."""

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        caches: list[torch.Tensor],
        bind_address: str,
        advertise_host: str = "",
        secure: Secure | None = None,
    ) -> None:
        self._ctx = ctx
        self._caches = caches
        self._lock = threading.Lock()
        self._expected: dict[str, KVReceive] = {}
        # Transfers here before the engine's word: header, staged bytes (None: malformed), why.
        self._early: OrderedDict[str, tuple[_Header, torch.Tensor | None, str | None]] = (
            OrderedDict()
        )
        self._staging = StagingPool()
        self._row_bytes = row_bytes(caches[0])
        self._cancelled = _Cancelled()
        self._results: queue.Queue[KVTransferResult] = queue.Queue()
        self._sock = ctx.socket(zmq.PULL)
        if secure is not None:  # a Curve server: its context runs the authenticator
            secure(self._sock)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.bind(bind_address)
        endpoint = str(self._sock.getsockopt_string(zmq.LAST_ENDPOINT))
        host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
        self.address = f"tcp://{advertise_host or host}:{port}"
        self._notify = ctx.socket(zmq.PUSH)
        self._notify.bind(NOTIFY_ADDRESS)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-receiver", daemon=True)
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
        out = []
        while not self._results.empty():
            out.append(self._results.get_nowait())
        return out

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close()
        self._notify.close()

    def _run(self) -> None:
        decoder = msgspec.msgpack.Decoder(_Header)
        while not self._stop.is_set():
            if not self._sock.poll(100):
                continue
            head = self._sock.recv()
            try:
                header = decoder.decode(head)
            except msgspec.DecodeError:
                self._drain()
                logger.warning("dropped an undecodable KV transfer frame")
                continue
            staged, error = self._receive(header)
            with self._lock:
                if self._cancelled.take(header.transfer_id):
                    self._give(staged)
                    continue
                order = self._expected.pop(header.transfer_id, None)
                if order is None:
                    self._early[header.transfer_id] = (header, staged, error)
                    while len(self._early) > _EARLY_LIMIT:
                        dropped, (_, held, _) = self._early.popitem(last=False)
                        self._give(held)
                        logger.warning("dropped KV transfer %s: never expected", dropped)
                    continue
                self._land(order, header, staged, error)

    def _receive(self, header: _Header) -> tuple[torch.Tensor | None, str | None]:
        """The header's layer frames, straight into a staging buffer ``[layers, 2,
        blocks, row]``; or None and why, when they are not the sizes it announced."""
        layers, row = len(self._caches), self._row_bytes
        per_layer = 2 * header.num_blocks * row
        if header.num_blocks < 1 or header.num_bytes != layers * per_layer:
            self._drain()
            return (
                None,
                f"{header.num_bytes} bytes for {header.num_blocks} blocks x {layers} layers",
            )
        staged = self._staging.take(header.num_bytes).view(layers, 2, header.num_blocks, row)
        flat = staged.view(layers, -1)
        for layer in range(layers):
            got = self._sock.recv_into(flat[layer].numpy().data) if self._more() else 0
            if got != per_layer:
                self._drain()
                self._staging.give(staged)
                return None, f"layer {layer}: {got} bytes, not {per_layer}"
        if self._more():
            self._drain()
            self._staging.give(staged)
            return None, f"more frames than {layers} layers"
        return staged, None

    def _more(self) -> bool:
        return bool(self._sock.getsockopt(zmq.RCVMORE))

    def _drain(self) -> None:
        while self._more():
            self._sock.recv()

    def _give(self, staged: torch.Tensor | None) -> None:
        if staged is not None:
            self._staging.give(staged)

    def _land(
        self, order: KVReceive, header: _Header, staged: torch.Tensor | None, error: str | None
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
