"""KV events: what the KV manager records, their wire form (decoded with vLLM's own struct
definitions), the ZeroMQ publisher's live stream and replay, and the flag's parsing."""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from common.config import TandemConfig
from common.kv_events_config import KVEventsConfig, parse_kv_events_config
from common.messages import LoRARequest
from engine_core.kv_cache import KVCacheManager, extend_block_hashes
from engine_core.kv_event_publisher import END_SEQ, KVEventStreams
from engine_core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventLog,
    external_hash,
)
from engine_core.request import lora_cache_key
from tests.stack import free_port_range
from tests.unit import vllm_kv_event_structs as vllm


def hashes(tokens: list[int], block_size: int = 4) -> list[bytes]:
    out: list[bytes] = []
    extend_block_hashes(out, tokens, block_size, b"")
    return out


def manager(num_blocks: int = 8) -> KVCacheManager:
    return KVCacheManager(num_blocks, 4, True, KVEventLog(4))


def test_newly_cached_blocks_are_announced_once_chained_to_their_parent() -> None:
    kv = manager()
    tokens = list(range(100, 110))  # 2 full blocks + 2 tokens
    h = hashes(tokens)
    kv.allocate("a", 10)
    kv.cache_full_blocks("a", h, 5, tokens)  # one block computed
    kv.cache_full_blocks("a", h, 10, tokens)  # the second
    kv.cache_full_blocks("a", h, 10, tokens)  # nothing new
    assert kv.events.take() == [
        BlockStored(
            [external_hash(h[0])],
            None,
            tokens[0:4],
            4,
            None,
            "GPU",
            None,
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        ),
        BlockStored(
            [external_hash(h[1])],
            external_hash(h[0]),
            tokens[4:8],
            4,
            None,
            "GPU",
            None,
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        ),
    ]
    assert kv.events.take() == []


def test_an_adapters_blocks_carry_its_lora_id_and_name() -> None:
    """As vLLM's events do, so a router's index tells adapters' blocks apart; the hashes
    themselves differ too (the adapter is hashed in, ``engine_core/request.py``)."""
    kv = manager()
    tokens = list(range(100, 108))
    sql = LoRARequest("sql", 7, "/adapters/sql")
    salted: list[bytes] = []
    extend_block_hashes(salted, tokens, 4, lora_cache_key(sql))
    assert not set(salted) & set(hashes(tokens))
    kv.allocate("a", 8)
    kv.cache_full_blocks("a", salted, 8, tokens, sql)
    (stored,) = kv.events.take()
    assert isinstance(stored, BlockStored)
    assert (stored.lora_id, stored.lora_name) == (7, "sql")
    payload = msgspec.msgpack.encode(KVEventBatch(ts=1.0, events=[stored]))
    theirs = msgspec.msgpack.Decoder(vllm.KVEventBatch).decode(payload).events[0]
    assert isinstance(theirs, vllm.BlockStored)
    assert (theirs.lora_id, theirs.lora_name) == (7, "sql")


def test_a_prefix_hit_announces_only_the_blocks_after_it() -> None:
    kv = manager()
    a = list(range(12))
    kv.allocate("a", 12)
    kv.cache_full_blocks("a", hashes(a), 12, a)
    kv.events.take()
    b = [*a[:8], 50, 51, 52, 53, 54]
    hb = hashes(b)
    hits = kv.find_cached_prefix(hb, len(b))
    assert hits == kv.blocks_of("a")[:2]
    kv.allocate("b", len(b), hits)
    kv.cache_full_blocks("b", hb, len(b), b)
    (event,) = kv.events.take()
    assert isinstance(event, BlockStored)
    assert event.block_hashes == [external_hash(hb[2])]
    assert event.parent_block_hash == external_hash(hb[1])
    assert event.token_ids == [50, 51, 52, 53]


def test_duplicate_content_splits_a_run_and_is_not_announced_twice() -> None:
    kv = manager()
    tokens = list(range(8))
    kv.allocate("a", 8)
    kv.cache_full_blocks("a", hashes(tokens), 8, tokens)
    kv.allocate("b", 12)  # same 8 tokens computed again (no lookup), then 4 more
    longer = [*tokens, 9, 9, 9, 9]
    kv.events.take()
    kv.cache_full_blocks("b", hashes(longer), 12, longer)
    (event,) = kv.events.take()
    assert isinstance(event, BlockStored)
    assert event.token_ids == [9, 9, 9, 9]
    assert event.parent_block_hash == external_hash(hashes(longer)[1])


def test_eviction_and_reset_are_announced() -> None:
    kv = manager(num_blocks=2)
    tokens = list(range(8))
    h = hashes(tokens)
    kv.allocate("a", 8)
    kv.cache_full_blocks("a", h, 8, tokens)
    kv.free("a")
    kv.events.take()
    kv.allocate("b", 4)  # takes the free queue's head: "a"'s last block, evicted
    assert kv.events.take() == [BlockRemoved([external_hash(h[1])], "GPU", group_idx=0)]
    kv.reset_prefix_cache()
    assert kv.events.take() == [AllBlocksCleared()]


def test_events_off_record_nothing() -> None:
    kv = KVCacheManager(8, 4)
    tokens = list(range(8))
    kv.allocate("a", 8)
    kv.cache_full_blocks("a", hashes(tokens), 8, tokens)
    kv.reset_prefix_cache()
    assert kv.events.take() == []


def test_the_wire_form_is_vllms() -> None:
    """Decoded by vLLM's own struct definitions; the raw shape as a router reads it."""
    kv = manager(num_blocks=2)
    tokens = list(range(8))
    kv.allocate("a", 8)
    kv.cache_full_blocks("a", hashes(tokens), 8, tokens)
    kv.free("a")
    kv.allocate("b", 4)
    kv.reset_prefix_cache()
    payload = msgspec.msgpack.encode(
        KVEventBatch(ts=12.5, events=kv.events.take(), data_parallel_rank=0)
    )
    theirs = msgspec.msgpack.Decoder(vllm.KVEventBatch).decode(payload)
    assert [type(e).__name__ for e in theirs.events] == [
        "BlockStored",
        "BlockRemoved",
        "AllBlocksCleared",
    ]
    stored = theirs.events[0]
    assert isinstance(stored, vllm.BlockStored)
    assert stored.token_ids == tokens and stored.block_size == 4 and stored.medium == "GPU"
    assert stored.block_hashes == [external_hash(h) for h in hashes(tokens)]
    assert theirs.ts == 12.5 and theirs.data_parallel_rank == 0
    raw = msgspec.msgpack.decode(payload)
    assert isinstance(raw, list) and len(raw) == 3  # [ts, events, rank]
    assert raw[1][0]["type"] == "BlockStored"
    # vLLM's fields without a default are always sent, as nil when unset
    assert {"lora_id", "medium", "lora_name"} <= set(raw[1][0])
    assert raw[1][2] == {"type": "AllBlocksCleared"}
    # and vLLM's classes encode the same events to the same MessagePack values
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(theirs)) == raw


def test_block_hashes_go_out_as_unsigned_64_bit_ints() -> None:
    assert external_hash(b"\xff" * 16) == 2**64 - 1
    assert external_hash(bytes(8) + (5).to_bytes(8, "big")) == 5


def _recv(sock: zmq.Socket[bytes], timeout_ms: int = 5000) -> list[bytes]:
    assert sock.poll(timeout_ms), "nothing arrived"
    return sock.recv_multipart()


def test_publisher_streams_batches_and_replays_them() -> None:
    ctx = zmq.Context()
    port = free_port_range(2)
    config = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"tcp://127.0.0.1:{port}",
        replay_endpoint=f"tcp://127.0.0.1:{port + 1}",
        topic="kv",
    )
    kv = manager()
    streams = KVEventStreams(ctx, config, [kv])
    sub = ctx.socket(zmq.SUB)
    sub.connect(config.endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    try:
        time.sleep(0.3)  # a SUB's subscription must reach the PUB first
        tokens = list(range(8))
        kv.allocate("a", 8)
        for n in (4, 8):
            kv.cache_full_blocks("a", hashes(tokens), n, tokens)
            streams.flush()
        streams.flush()  # no events: no batch
        frames = [_recv(sub), _recv(sub)]
        assert [f[0] for f in frames] == [b"kv", b"kv"]
        assert [int.from_bytes(f[1], "big") for f in frames] == [0, 1]
        batches = [msgspec.msgpack.Decoder(vllm.KVEventBatch).decode(f[2]) for f in frames]
        stored = [b.events[0] for b in batches]
        assert all(isinstance(e, vllm.BlockStored) for e in stored)
        assert [getattr(e, "token_ids", None) for e in stored] == [tokens[:4], tokens[4:]]
        assert not sub.poll(300)

        replay = ctx.socket(zmq.DEALER)
        replay.connect(config.replay_endpoint or "")
        replay.send_multipart([b"", (1).to_bytes(8, "big")])
        first = _recv(replay)
        assert first[:3] == [b"", b"kv", (1).to_bytes(8, "big")] and first[3] == frames[1][2]
        assert _recv(replay) == [b"", b"", END_SEQ, b""]
        replay.close(linger=0)
    finally:
        sub.close(linger=0)
        streams.close()
        ctx.term()


def test_split_pools_publish_on_consecutive_ports_as_ranks() -> None:
    config = parse_kv_events_config(
        '{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:5557", '
        '"replay_endpoint": "tcp://127.0.0.1:6557"}'
    )
    decode = config.for_pool(1)
    assert (decode.endpoint, decode.replay_endpoint) == (
        "tcp://127.0.0.1:5558",
        "tcp://127.0.0.1:6558",
    )
    assert config.for_pool(0) == config


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            '{"enable_kv_cache_events": true, "endpont": "tcp://127.0.0.1:1"}',
            "unknown field endpont",
        ),
        ("{not json", "is not JSON"),
        ('{"publisher": "kafka"}', "publisher must be 'zmq' or 'null'"),
        ('{"buffer_steps": 0}', "buffer_steps must be a positive integer"),
        ('{"endpoint": "http://x:1"}', "endpoint must be a tcp://"),
    ],
)
def test_bad_configs_are_refused_naming_the_problem(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_kv_events_config(text)


def test_vllms_default_endpoint_is_taken_as_it_is() -> None:
    """``tcp://*:5557`` (vLLM's default) binds every interface, as in vLLM: a router on
    another host subscribes there (with a warning in the log: token ids go unencrypted)."""
    from common.config import CacheConfig

    cache = CacheConfig(kv_events_config='{"enable_kv_cache_events": true}')
    events = TandemConfig(cache=cache).cache.kv_events
    assert events.enabled and events.endpoint == "tcp://*:5557"
    off = CacheConfig(kv_events_config='{"enable_kv_cache_events": false}')
    assert not TandemConfig(cache=off).cache.kv_events.enabled
