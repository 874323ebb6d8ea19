"""The side channel between instances' engines: a pull is acked by the thread itself,
delivered to the step loop, and answered back to the peer that sent it; a bad frame or
an address ZeroMQ refuses costs that message only, never the thread."""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import zmq

from common.messages import KVPull, KVPullAck, KVPullAnswer, PeerMessage
from engine_core.kv_side_channel import KVSideChannel
from tests.stack import free_port

PULL = KVPull("lease", "engine", "t1", 0, [1, 2], [b"h1", b"h2"], ["kvtcp://127.0.0.1:9"], 16)


def wait(inbox: queue.Queue[tuple[bytes, PeerMessage]]) -> tuple[bytes, PeerMessage]:
    return inbox.get(timeout=5)


@pytest.fixture
def channels() -> Iterator[tuple[KVSideChannel, KVSideChannel, Any, Any, str]]:
    """A producer's channel (bound) and a consumer's (dealers only), each in its own
    context as in two processes, with what each delivered."""
    contexts: list[zmq.Context[Any]] = [zmq.Context(), zmq.Context()]
    address = f"tcp://127.0.0.1:{free_port()}"
    got: list[queue.Queue[tuple[bytes, PeerMessage]]] = [queue.Queue(), queue.Queue()]
    producer = KVSideChannel(contexts[0], address, lambda p, m: got[0].put((p, m)))
    consumer = KVSideChannel(contexts[1], None, lambda p, m: got[1].put((p, m)))
    try:
        yield producer, consumer, got[0], got[1], address
    finally:
        producer.close()
        consumer.close()
        for ctx in contexts:
            ctx.term()


def test_a_pull_is_acked_at_once_delivered_and_answered(
    channels: tuple[KVSideChannel, KVSideChannel, Any, Any, str],
) -> None:
    producer, consumer, at_producer, at_consumer, address = channels
    consumer.send(address, PULL)
    peer, message = wait(at_producer)
    assert message == PULL
    assert wait(at_consumer) == (b"", KVPullAck("t1"))  # from the producer's thread
    producer.send(peer, KVPullAnswer("t1", True))
    assert wait(at_consumer) == (b"", KVPullAnswer("t1", True))


def test_bad_frames_and_refused_addresses_cost_one_message(
    channels: tuple[KVSideChannel, KVSideChannel, Any, Any, str],
) -> None:
    producer, consumer, at_producer, at_consumer, address = channels
    ctx: zmq.Context[Any] = zmq.Context()
    rogue = ctx.socket(zmq.DEALER)
    rogue.connect(address)
    rogue.send_multipart([b"one", b"two"])  # three frames at the ROUTER
    rogue.send(b"\xc1 not msgpack")
    consumer.send("tcp://-bad-host:1", PULL)  # ZeroMQ refuses the address
    time.sleep(0.3)
    assert producer.num_malformed_frames == 2
    consumer.send(address, PULL)  # both threads still serve
    assert wait(at_producer)[1] == PULL
    assert wait(at_consumer)[1] == KVPullAck("t1")
    rogue.close(linger=0)
    ctx.term()
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(PULL), type=KVPull) == PULL
