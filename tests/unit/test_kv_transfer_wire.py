"""The TCP hand-off's bytes: block runs, copies out of and into the caches, and a real
sender and receiver over loopback (landing exactly, damage refused, early arrivals)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import msgspec
import pytest
import torch
import zmq

from common.messages import KVReceive, KVSend, KVStreamHeader, KVTransferResult
from worker.kv_receiver import KVReceiver
from worker.kv_socket import split_address
from worker.kv_staging import StagingPool, block_runs, checksum, copy_in, copy_out, row_bytes
from worker.kv_transfer import KVSender

LAYERS, BLOCKS, HEADS, BLOCK, DIM = 3, 40, 2, 4, 8


def caches(dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (2, BLOCKS, HEADS, BLOCK, DIM)
    return [torch.randn(shape, generator=g).to(dtype) for _ in range(LAYERS)]


def test_block_runs_coalesce_consecutive_ids() -> None:
    assert block_runs([4, 5, 6, 9, 10, 2]) == [(4, 0, 3), (9, 3, 2), (2, 5, 1)]
    assert block_runs([]) == []
    assert block_runs([7]) == [(7, 0, 1)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "blocks",
    [list(range(5, 17)), [3, 1, 2, 30, 31], list(range(BLOCKS - 1, -1, -2))],  # 20 runs
    ids=["one run", "a few runs", "scattered"],
)
def test_copies_out_and_in_move_exactly_the_blocks(dtype: torch.dtype, blocks: list[int]) -> None:
    src = caches(dtype)
    staged = torch.empty(LAYERS * 2 * len(blocks) * row_bytes(src[0]), dtype=torch.uint8)
    staged = staged.view(LAYERS, 2, len(blocks), -1)
    copy_out(src, blocks, staged)
    dst = [torch.zeros_like(c) for c in src]
    targets = [(b * 7) % BLOCKS for b in range(len(blocks))]  # elsewhere, in another order
    copy_in(dst, staged, targets)
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(d[:, targets], s[:, blocks])
        others = [b for b in range(BLOCKS) if b not in targets]
        assert not d[:, others].any()


def test_the_staging_pool_reuses_the_smallest_buffer_that_fits() -> None:
    pool = StagingPool()
    big, small = pool.take(1000), pool.take(100)
    pool.give(big)
    pool.give(small[:10])  # a view: its whole allocation comes back
    again = pool.take(50)
    assert again.untyped_storage().data_ptr() == small.untyped_storage().data_ptr()
    assert again.numel() == 50
    assert pool.take(900).untyped_storage().data_ptr() == big.untyped_storage().data_ptr()
    held = [pool.take(size) for size in (300, 10, 600)]
    for buffer in held:  # several of different sizes free at once
        pool.give(buffer)
    taken = [pool.take(size) for size in (500, 5, 200)]
    assert [t.untyped_storage().nbytes() for t in taken] == [600, 10, 300]


Wire = tuple[
    KVSender, KVReceiver, list[torch.Tensor], list[torch.Tensor], zmq.Context[zmq.Socket[bytes]]
]


@pytest.fixture(params=[True, False], ids=["socket", "zmq"])
def wire(request: pytest.FixtureRequest) -> Iterator[Wire]:
    """A sender and a receiver on a plain socket (no keys), or on ZeroMQ (the wire
    CurveZMQ encrypts)."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    src, dst = caches(seed=1), [torch.zeros_like(c) for c in caches()]
    receiver = KVReceiver(ctx, dst, "tcp://127.0.0.1:0", raw=request.param)
    sender = KVSender(ctx, BLOCK)
    try:
        yield sender, receiver, src, dst, ctx
    finally:
        sender.close()
        receiver.close()
        ctx.term()


def result_of(receiver: KVReceiver, timeout_s: float = 10.0) -> KVTransferResult:
    deadline = time.monotonic() + timeout_s
    while not (results := receiver.take_results()):
        assert time.monotonic() < deadline, "no result"
        time.sleep(0.005)
    (result,) = results
    return result


def test_a_transfer_lands_in_the_blocks_the_engine_named(wire: Wire) -> None:
    sender, receiver, src, dst, _ = wire
    blocks, targets = [2, 3, 4, 20, 9], [30, 31, 32, 0, 5]
    for i in range(3):  # the second and third reuse the staging buffers
        receiver.expect(KVReceive(f"t{i}", targets, [1] * len(targets)))
        sender.send(KVSend(f"t{i}", blocks, [receiver.address]), src)
        result = result_of(receiver)
        assert result.ok, result.error
        assert result.num_bytes == LAYERS * 2 * len(blocks) * row_bytes(src[0])
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(d[:, targets], s[:, blocks])


def test_bytes_before_the_engines_word_are_held_then_landed(wire: Wire) -> None:
    sender, receiver, src, dst, _ = wire
    sender.send(KVSend("early", [1, 2], [receiver.address]), src)
    time.sleep(0.3)  # arrived, not yet expected
    assert receiver.take_results() == []
    receiver.expect(KVReceive("early", [10, 11], [1, 1]))
    assert result_of(receiver).ok
    assert all(torch.equal(d[:, [10, 11]], s[:, [1, 2]]) for s, d in zip(src, dst, strict=True))


def forge(
    ctx: zmq.Context[zmq.Socket[bytes]], address: str, header: KVStreamHeader, frames: list[bytes]
) -> None:
    """Send these frames as one transfer, as a broken or hostile sender might."""
    if address.startswith("kvtcp://"):
        head = msgspec.msgpack.encode(header)
        with socket.create_connection(split_address(address)) as raw:
            raw.sendall(len(head).to_bytes(4, "big") + head + b"".join(frames))
        return
    sock = ctx.socket(zmq.PUSH)
    sock.connect(address)
    sock.send_multipart([msgspec.msgpack.encode(header), *frames])
    sock.close(linger=2000)


def test_damaged_or_misshapen_bytes_are_refused_and_nothing_is_written(wire: Wire) -> None:
    _, receiver, src, dst, ctx = wire
    per_layer = 2 * 2 * row_bytes(src[0])
    frames = [bytes([layer]) * per_layer for layer in range(LAYERS)]
    good = checksum([memoryview(f) for f in frames])
    raw = receiver.address.startswith("kvtcp://")
    cases = {
        "checksum mismatch": (KVStreamHeader("bad-sum", 2, LAYERS * per_layer, good ^ 1), frames),
        # A stream has no frames: a short transfer is the sender closing mid-way.
        "the sender closed mid-transfer" if raw else "layer 2: 0 bytes": (
            KVStreamHeader("short", 2, LAYERS * per_layer, good),
            frames[:2],
        ),
        "bytes for 3 blocks": (KVStreamHeader("sizes", 3, LAYERS * per_layer, good), frames),
    }
    if not raw:
        cases["more frames than"] = (
            KVStreamHeader("long", 2, LAYERS * per_layer, good),
            [*frames, b"x"],
        )
    for why, (header, body) in cases.items():
        receiver.expect(KVReceive(header.transfer_id, [5, 6], [1, 1]))
        forge(ctx, receiver.address, header, body)
        result = result_of(receiver)
        assert not result.ok and why in (result.error or ""), (why, result.error)
    assert not any(d.any() for d in dst)


def test_a_cancelled_transfer_is_dropped_when_its_bytes_come(wire: Wire) -> None:
    sender, receiver, src, dst, _ = wire
    receiver.expect(KVReceive("gone", [7], [1]))
    receiver.cancel("gone")
    sender.send(KVSend("gone", [1], [receiver.address]), src)
    time.sleep(0.3)
    assert receiver.take_results() == []
    assert not any(d.any() for d in dst)
