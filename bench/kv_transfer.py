"""What a prefill -> decode hand-off costs, per request of 1k and 4k tokens.

1. The bytes alone, in-process, SmolLM2's KV layout (30 layers, 3 KV heads of 64, bf16):
   a plain memcpy of one request's KV, and the TCP path end to end (copy the blocks out,
   XXH3 checksum, over loopback, check, write into the receiver's blocks), in GB/s: on
   a plain socket (the wire without keys) and on ZeroMQ (the wire CurveZMQ encrypts),
   sender and receiver each with its own ZeroMQ context (as in two processes); and the
   wire alone (the same bytes over a bare ZeroMQ PUSH/PULL and a bare TCP socket), the
   ceiling the hand-off runs under on this host.
   ``shm`` between pools of equal widths moves no bytes at all: its cost is bookkeeping.
   Between a prefill pool at TP 2 and a decode pool at TP 1 it re-shards: the decode
   rank copies the heads out of both prefill ranks' shared-memory caches (``KVPuller``).
2. The hand-off as a client sees it, through real servers (split pools, one thread each):
   the gap between a request's first token (sampled by the prefill pool) and its second
   (the decode pool's first step), minus the decode pool's steady inter-token time.

    .venv/bin/python -m bench.kv_transfer [--tokens 1024 4096] [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import tempfile
import threading
import time
from typing import Any

import httpx
import torch
import zmq

from bench.harness import print_table, stream, tandem_server, write_results
from common.curve import CurveKeys, generate_keys
from common.messages import KVReceive, KVSend
from common.shm import new_service_id, segment_name, segments_of, unlink_segment
from worker.kv_memory import SharedCaches
from worker.kv_receiver import KVReceiver
from worker.kv_reshard import KVLayout, KVPuller, prefill_segment
from worker.kv_transfer import KVSender

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16
DTYPE = torch.bfloat16


def caches(num_blocks: int) -> list[torch.Tensor]:
    shape = (2, num_blocks, KV_HEADS, BLOCK, HEAD_DIM)  # worker/attention.py's layout
    return [torch.randn(shape).to(DTYPE) for _ in range(LAYERS)]


def kv_bytes(tokens: int) -> int:
    return LAYERS * 2 * tokens * KV_HEADS * HEAD_DIM * DTYPE.itemsize


def memcpy_s(tokens: int, repeats: int) -> float:
    src = torch.empty(kv_bytes(tokens), dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def tcp_s(tokens: int, repeats: int, raw: bool = False, curve: bool = False) -> float:
    """Sender copy-out + wire + receiver check and write, until the receiver reports.
    ``raw``: the wire without keys (a plain socket), else ZeroMQ: unencrypted, or
    encrypted with CurveZMQ (``curve``, the wire between hosts)."""
    blocks = -(-tokens // BLOCK)
    ctx: zmq.Context[Any] = zmq.Context()
    sender_ctx: zmq.Context[Any] = zmq.Context()  # its own I/O thread, as in another process
    src, dst = caches(blocks), [c.clone().zero_() for c in caches(blocks)]
    keys_dir = tempfile.TemporaryDirectory()
    keys = CurveKeys(str(generate_keys(keys_dir.name))) if curve else None
    auth = keys.start_authenticator(ctx) if keys else None
    receiver = KVReceiver(
        ctx, dst, "tcp://127.0.0.1:0", secure=keys.make_server if keys else None, raw=raw
    )
    sender = KVSender(sender_ctx, BLOCK, keys.make_client if keys else None)
    ids = list(range(blocks))
    times = []
    try:
        for i in range(repeats):
            transfer_id = f"bench-{i}"
            receiver.expect(KVReceive(transfer_id, ids, [1] * blocks))
            start = time.perf_counter()
            sender.send(KVSend(transfer_id, ids, [receiver.address]), src)
            while not (results := receiver.take_results()):
                time.sleep(0.0002)
            times.append(time.perf_counter() - start)
            assert results[0].ok, results[0].error
        assert all(torch.equal(a, b) for a, b in zip(src, dst, strict=True))
    finally:
        sender.close()
        receiver.close()
        if auth is not None:
            auth.stop()
        ctx.term()
        sender_ctx.term()
        keys_dir.cleanup()
    return statistics.median(times)


def wire_s(tokens: int, repeats: int) -> tuple[float, float]:
    """The same bytes, one frame per layer, over a bare ZeroMQ PUSH/PULL (received into
    one buffer) and over a bare TCP socket: the loopback's ceiling for the hand-off."""
    size = kv_bytes(tokens)
    per = size // LAYERS
    frames = [torch.ones(per, dtype=torch.uint8).numpy().data for _ in range(LAYERS)]
    into = torch.empty(size, dtype=torch.uint8).numpy()
    contexts: list[zmq.Context[Any]] = [zmq.Context(), zmq.Context()]
    pull = contexts[0].socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = contexts[1].socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{port}")
    zmq_times = []
    for _ in range(repeats + 1):  # the first connects
        start = time.perf_counter()
        push.send_multipart([b"h", *frames], copy=False)
        pull.recv()
        for layer in range(LAYERS):
            pull.recv_into(into[layer * per : (layer + 1) * per].data)
        zmq_times.append(time.perf_counter() - start)
    push.close(linger=0)
    pull.close(linger=0)
    for ctx in contexts:
        ctx.term()
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    conn, _ = server.accept()
    socket_times = []
    view = into.data

    def write_all() -> None:
        for frame in frames:
            client.sendall(frame)

    for _ in range(repeats + 1):
        start = time.perf_counter()
        writer = threading.Thread(target=write_all)
        writer.start()
        got = 0
        while got < size:
            got += conn.recv_into(view[got:], size - got)
        writer.join()
        socket_times.append(time.perf_counter() - start)
    for sock in (client, conn, server):
        sock.close()
    return statistics.median(zmq_times[1:]), statistics.median(socket_times[1:])


def reshard_pull_s(tokens: int, repeats: int) -> float:
    """A decode rank at TP 1 copying one request's blocks out of two prefill ranks'
    shared-memory caches (SmolLM2's 3 KV heads lie 1 + 2 over them)."""
    blocks = -(-tokens // BLOCK)
    service = new_service_id()
    source = KVLayout(HEADS, KV_HEADS, HEAD_DIM, 2)
    try:
        for rank in range(2):
            shape = (2, blocks, source.heads(rank).kv_count, BLOCK, HEAD_DIM)
            shared = SharedCaches(
                segment_name(service, prefill_segment(rank)), shape, LAYERS, DTYPE
            )
            for cache in shared.caches:
                cache.copy_(torch.randn(shape))
        dst = [c.zero_() for c in caches(blocks)]
        mine = KVLayout(HEADS, KV_HEADS, HEAD_DIM, 1).heads(0)
        puller = KVPuller(service, source, mine, dst, BLOCK)
        ids = list(range(blocks))
        times = []
        for i in range(repeats):
            start = time.perf_counter()
            puller.pull(KVReceive(f"bench-{i}", ids, [1] * blocks, src_block_ids=ids))
            times.append(time.perf_counter() - start)
            assert puller.take_results()[0].ok
        puller.close()
    finally:
        for name in segments_of(service):
            unlink_segment(name)
    return statistics.median(times)


async def handoff_gap(url: str, tokens: int, repeats: int) -> tuple[float, float]:
    """Median first->second token gap and steady ITL for prompts of ``tokens`` tokens."""
    gaps, steady = [], []
    async with httpx.AsyncClient(timeout=600) as client:
        await stream(client, url, {"prompt": "warm up", "max_tokens": 4})
        for i in range(repeats):
            prompt = [1000 + (7 * j + 131 * i) % 40000 for j in range(tokens)]  # no cache hits
            body = {"prompt": prompt, "max_tokens": 10, "ignore_eos": True, "temperature": 0}
            timing = await stream(client, url, body)
            gaps.append(timing.itls_s[0])
            steady += timing.itls_s[2:]
    return statistics.median(gaps), statistics.median(steady)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-servers", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows, results = [], []
    for tokens in args.tokens:
        size = kv_bytes(tokens)
        copy, wire = memcpy_s(tokens, args.repeats), tcp_s(tokens, args.repeats)
        raw = tcp_s(tokens, args.repeats, raw=True)
        curved = tcp_s(tokens, args.repeats, curve=True)
        pull = reshard_pull_s(tokens, args.repeats)
        bare_zmq, bare_socket = wire_s(tokens, args.repeats)
        results.append(
            {
                "tokens": tokens,
                "bytes": size,
                "memcpy_s": copy,
                "tcp_s": wire,
                "tcp_raw_s": raw,
                "tcp_curve_s": curved,
                "pull_s": pull,
                "bare_zmq_s": bare_zmq,
                "bare_socket_s": bare_socket,
            }
        )
        rows.append(
            [
                tokens, f"{size / 2**20:.1f}", f"{1000 * copy:.2f}", f"{size / copy / 1e9:.1f}",
                f"{1000 * raw:.1f}", f"{size / raw / 1e9:.2f}",
                f"{1000 * wire:.1f}", f"{size / wire / 1e9:.2f}",
                f"{1000 * curved:.1f}", f"{size / curved / 1e9:.2f}", "0 bytes moved",
                f"{1000 * pull:.1f}", f"{size / pull / 1e9:.2f}",
                f"{size / bare_zmq / 1e9:.2f}", f"{size / bare_socket / 1e9:.2f}",
            ]
        )  # fmt: skip
    print(f"\nKV bytes of one request (SmolLM2 layout, {DTYPE}), {args.repeats} repeats, medians\n")
    header = ["tokens", "MiB", "memcpy ms", "memcpy GB/s", "tcp socket ms", "GB/s"]
    header += ["tcp zmq ms", "GB/s", "tcp zmq+curve ms", "GB/s", "shm"]
    ceiling = ["bare zmq GB/s", "bare socket GB/s"]
    print_table([*header, "shm TP2->1 ms", "shm TP2->1 GB/s", *ceiling], rows)
    served: dict[str, Any] = {}
    if not args.skip_servers:
        split = (
            "--prefill-workers",
            "1",
            "--decode-workers",
            "1",
            "--disagg-min-prompt-tokens",
            "0",
        )
        setups = {
            "unified (2 threads)": (),
            "split shm (1+1)": (*split, "--kv-transfer", "shm"),
            "split tcp (1+1)": (*split, "--kv-transfer", "tcp"),
        }
        rows = []
        for name, flags in setups.items():
            with tandem_server(*flags, "--max-model-len", "8192") as url:
                for tokens in args.tokens:
                    gap, steady = asyncio.run(handoff_gap(url, tokens, args.repeats))
                    served[f"{name} {tokens}"] = {"gap_s": gap, "steady_itl_s": steady}
                    rows.append(
                        [
                            name,
                            tokens,
                            f"{1000 * gap:.1f}",
                            f"{1000 * steady:.1f}",
                            f"{1000 * (gap - steady):.1f}",
                        ]
                    )
        print("\nfirst -> second token as a client sees it (medians, ms)\n")
        print_table(["setup", "tokens", "gap", "steady ITL", "hand-off cost"], rows)
    path = write_results("kv_transfer", {"args": vars(args), "bytes": results, "served": served})
    print(f"\n(JSON: {path})")


if __name__ == "__main__":
    main()
