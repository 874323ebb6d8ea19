"""Publishes KV event batches over ZeroMQ, as vLLM's ``ZmqEventPublisher`` does.

The step loop hands each step's events to ``publish`` (a queue put, never a socket
call); a thread sends them. Live stream: a PUB socket, each batch three frames
``[topic, seq (8 bytes, big-endian), msgpack(KVEventBatch)]``, ``seq`` counting from 0.
Replay: a ROUTER socket; a client sends ``[b"", start_seq]`` and gets every buffered
batch from ``start_seq`` on as ``[b"", topic, seq, payload]``, then the end marker
``[b"", b"", seq -1, b""]``. A router that missed batches (it started late, or a
high-water mark dropped some) asks for them there instead of forgetting the instance.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence

import msgspec
import zmq

from common.config_checks import is_private_address
from common.kv_events_config import KVEventsConfig
from engine_core.kv_cache import KVCacheManager
from engine_core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_POLL_S = 0.05

Event = BlockStored | BlockRemoved | AllBlocksCleared


def _open(sock: zmq.Socket[bytes], address: str) -> None:
    """Bind a wildcard, loopback or local-transport address; connect any other (to a
    proxy). vLLM's rule, with loopback added: a router on this host connects to it."""
    if "*" in address or "::" in address or is_private_address(address):  # ipc:// too
        sock.bind(address)
    else:
        sock.connect(address)


class ZmqEventPublisher:
    def __init__(
        self, ctx: zmq.Context[zmq.Socket[bytes]], config: KVEventsConfig, rank: int = 0
    ) -> None:
        self.config = config
        self.rank = rank  # the batches' data_parallel_rank: the pool's index
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self.num_dropped = 0  # batches the full queue refused
        if not is_private_address(config.endpoint):
            logger.warning(
                "KV events (prompts' token ids, unencrypted) published on %s", config.endpoint
            )
        self._pub = ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        _open(self._pub, config.endpoint)
        self._replay: zmq.Socket[bytes] | None = None
        if config.replay_endpoint:
            self._replay = ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.SNDHWM, 2 * (config.buffer_steps + 1))
            self._replay.bind(config.replay_endpoint)
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[Event]) -> None:
        try:
            self._queue.put_nowait(KVEventBatch(ts=time.time(), events=events))
        except queue.Full:
            self.num_dropped += 1  # a router resynchronises through replay

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        topic = self.config.topic.encode()
        seq = 0
        while True:
            self._serve_replay(topic)
            try:
                batch = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if batch is None:
                return
            batch.data_parallel_rank = self.rank
            payload = encoder.encode(batch)
            seq_bytes = seq.to_bytes(8, "big")
            self._pub.send_multipart((topic, seq_bytes, payload), copy=False)
            self._buffer.append((seq, payload))
            seq += 1

    def _serve_replay(self, topic: bytes) -> None:
        if self._replay is None:
            return
        while self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                logger.warning("kv-events replay: a malformed request of %d frames", len(frames))
                continue
            client, start = frames[0], int.from_bytes(frames[2], "big")
            for seq, payload in list(self._buffer):
                if seq >= start:
                    self._replay.send_multipart(
                        (client, b"", topic, seq.to_bytes(8, "big"), payload)
                    )
            self._replay.send_multipart((client, b"", b"", END_SEQ, b""))


class KVEventStreams:
    """One publisher per KV manager (pool), fed by the step loop after every step; none
    when events are off (the managers then record none either: ``topology.py``)."""

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        config: KVEventsConfig,
        managers: Sequence[KVCacheManager],
    ) -> None:
        self._streams: list[tuple[KVCacheManager, ZmqEventPublisher]] = [
            (kv, ZmqEventPublisher(ctx, config.for_pool(i), rank=i))
            for i, kv in enumerate(managers if config.enabled else [])
        ]

    def flush(self) -> None:
        for kv, publisher in self._streams:
            events = kv.events.take()
            if events:
                publisher.publish(events)

    def close(self) -> None:
        for _, publisher in self._streams:
            publisher.close()
        self._streams = []
