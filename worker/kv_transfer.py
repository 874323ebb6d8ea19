"""Prefill -> decode KV hand-off over TCP (``--kv-transfer tcp``, and between a fleet's
instances), the protocol and the prefill side.

The prefill worker's ``KVSender``: told to send a transfer (``KVSend``), it copies the
blocks out of its caches at the start of its next step (so they can be freed and reused
at once) and a thread streams them to the decode worker while the step runs: a header
(transfer id, block count, bytes, XXH3-64 checksum) then one frame per layer, out of a
reused staging buffer (``worker/kv_staging.py`` says what the copies cost and why). The
wire is the one the receiver advertises: a plain socket (``kvtcp://``, no keys:
``worker/kv_socket.py``) or a ZeroMQ multipart message sent without a copy (``tcp://``,
CurveZMQ-encrypted with keys). The decode side is ``worker/kv_receiver.py``.

(With ``--kv-transfer shm`` nothing here runs: both pools map the same KV memory.)
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import msgspec
import torch
import zmq

from common.messages import KVSend, KVStreamHeader, KVTransferResult
from worker.kv_reshard import KVLayout, gather_heads, heads_for
from worker.kv_socket import SCHEME, SocketSender
from worker.kv_staging import StagingPool, checksum, copy_out, row_bytes
from worker.parallel import TensorParallel

Secure = Callable[[zmq.Socket[Any]], None]  # makes a socket a Curve server or client

logger = logging.getLogger(__name__)

_EARLY_LIMIT = 64  # transfers held while waiting for the engine's KVReceive
_CANCELLED_LIMIT = 4096  # cancelled ids remembered (their bytes may still come)


class CancelledIds:
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
_SENT = zmq.MessageTracker()  # a send that holds nothing (done)


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
    dest: KVLayout  # the decode side's, unless a send names another number of ranks

    def dest_for(self, num_ranks: int) -> KVLayout:
        """The decode side's layout over ``num_ranks`` ranks (a fleet's decode instance
        may run another tensor-parallel size than the one configured here)."""
        return (
            self.dest if self.dest.tp_size == num_ranks else replace(self.dest, tp_size=num_ranks)
        )

    def needed(self, num_ranks: int) -> bool:
        """Whether the heads move at all: not between two pools of one rank each."""
        return self.source.tp_size > 1 or num_ranks > 1


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
        self._cancelled = CancelledIds()
        self._thread = threading.Thread(target=self._run, name="kv-sender", daemon=True)
        self._thread.start()

    def send(self, order: KVSend, caches: list[torch.Tensor]) -> None:
        """Copy the order's blocks now; the bytes leave from the sender thread. With
        tensor parallelism every prefill rank calls this in the same step (a collective)
        and rank 0 sends each decode rank its heads. An order that cannot be carried out
        (no destination, block ids outside the cache) fails its transfer, not the worker."""
        num_blocks = caches[0].shape[1]
        if not order.destinations or not all(0 <= b < num_blocks for b in order.block_ids):
            why = f"no destination, or block ids outside the cache's {num_blocks}"
            self._failures.put(KVTransferResult(order.transfer_id, False, why))
            return
        reshard = self._reshard
        ranks = len(order.destinations)
        if (reshard is None or not reshard.needed(ranks)) and caches[0].device.type == "cpu":
            n = len(order.block_ids)
            staged = self._staging.take(len(caches) * 2 * n * row_bytes(caches[0]))
            staged = staged.view(len(caches), 2, n, -1)
            copy_out(caches, order.block_ids, staged)
            self._work.put((order.transfer_id, [(order.destinations[0], staged)], True))
            return
        payload = gather_blocks(caches, order.block_ids)
        if reshard is None or not reshard.needed(ranks):  # a GPU's blocks: to the host once
            self._work.put((order.transfer_id, [(order.destinations[0], payload.cpu())], False))
            return
        full = gather_heads(payload, reshard.tp, reshard.source, self._block_size)
        if full is None:
            return  # rank 0 sends
        dest = reshard.dest_for(ranks)
        pieces = [
            (address, heads_for(full, dest.heads(rank)).cpu())
            for rank, address in enumerate(order.destinations)
        ]
        self._work.put((order.transfer_id, pieces, False))

    def cancel(self, transfer_id: str) -> None:
        self._cancelled.add(transfer_id)  # not yet sent: skipped

    def take_failures(self) -> list[KVTransferResult]:
        return drain(self._failures)

    def close(self) -> None:
        self._work.put(None)
        self._thread.join(timeout=5)

    def _run(self) -> None:
        sockets: dict[str, zmq.Socket[bytes]] = {}
        raw = SocketSender()  # receivers without keys (worker/kv_socket.py)
        # Staging buffers the sockets still hold (zero-copy frames), until on the wire.
        on_wire: list[tuple[zmq.MessageTracker, torch.Tensor]] = []
        while (item := self._work.get()) is not None:
            transfer_id, pieces, staged = item
            if self._cancelled.take(transfer_id):
                continue
            for destination, payload in pieces:
                tracker = self._send(sockets, raw, transfer_id, destination, payload)
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
        raw.close()

    def _send(
        self,
        sockets: dict[str, zmq.Socket[bytes]],
        raw: SocketSender,
        transfer_id: str,
        destination: str,
        payload: torch.Tensor,
    ) -> zmq.MessageTracker | None:
        """Stream one decode rank's part: what tells when the socket lets go of its
        frames, or None if it failed (the transfer has)."""
        try:
            if destination.startswith(SCHEME):
                if self._secure is not None:
                    raise ValueError("the receiver takes KV unencrypted; this sender has keys")
                frames = [memoryview(layer.numpy().data) for layer in _as_bytes(payload)]
                num_bytes = sum(f.nbytes for f in frames)
                header = KVStreamHeader(transfer_id, payload.shape[2], num_bytes, checksum(frames))
                raw.send(destination, msgspec.msgpack.encode(header), frames)
                return _SENT
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
            header = KVStreamHeader(transfer_id, payload.shape[2], num_bytes, checksum(frames))
            return sock.send_multipart(
                [msgspec.msgpack.encode(header), *frames], copy=False, track=True
            )
        except Exception as e:  # a broken destination fails this transfer, not the worker
            logger.warning("KV transfer %s to %s failed: %s", transfer_id, destination, e)
            self._failures.put(KVTransferResult(transfer_id, False, f"send failed: {e}"))
            return None


def drain(results: queue.Queue[KVTransferResult]) -> list[KVTransferResult]:
    """Every result a thread has queued so far."""
    out = []
    while not results.empty():
        out.append(results.get_nowait())
    return out


def _as_bytes(payload: torch.Tensor) -> list[torch.Tensor]:
    """Each layer's slice as a contiguous byte tensor (bfloat16 has no numpy dtype)."""
    return [layer.contiguous().view(torch.uint8).reshape(-1) for layer in payload]
