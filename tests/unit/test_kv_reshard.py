"""Re-sharding KV between pools of different tensor-parallel widths: which rank sources
which head, the heads a decode rank is sent, and a decode rank copying its heads out of
the prefill ranks' shared-memory caches (real segments) into the blocks it was given."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from common.messages import KVReceive
from common.shm import attach_segment, new_service_id, segment_name, segments_of, unlink_segment
from worker.kv_reshard import KVLayout, KVPuller, heads_for, prefill_segment
from worker.parallel import Heads

LAYERS, BLOCK, DIM = 2, 4, 8


def test_every_kv_head_has_exactly_one_source_rank() -> None:
    smollm2 = KVLayout(9, 3, DIM, 2)  # 3 GQA groups over 2 ranks: 1 + 2 KV heads
    assert smollm2.sources() == [(0, Heads(0, 3, 0, 1)), (1, Heads(3, 6, 1, 2))]
    replicated = KVLayout(4, 1, DIM, 2)  # one KV head, held by both ranks: rank 0 gives it
    assert replicated.sources() == [(0, Heads(0, 2, 0, 1))]
    two_per_head = KVLayout(8, 2, DIM, 4)
    assert [rank for rank, _ in two_per_head.sources()] == [0, 2]
    assert KVLayout(9, 3, DIM, 1).sources() == [(0, Heads(0, 9, 0, 3))]


def test_a_decode_rank_is_sent_exactly_its_heads() -> None:
    full = torch.randn(LAYERS, 2, 3, 3, BLOCK, DIM)  # [layers, 2, blocks, heads, B, D]
    rank1 = KVLayout(9, 3, DIM, 2).heads(1)  # KV heads 1 and 2
    part = heads_for(full, rank1)
    assert part.shape == (LAYERS, 2, 3, 2 * BLOCK * DIM)
    assert torch.equal(part.view(LAYERS, 2, 3, 2, BLOCK, DIM), full[:, :, :, 1:3])


@pytest.fixture
def service() -> Iterator[str]:
    service_id = new_service_id()
    yield service_id
    for name in segments_of(service_id):
        unlink_segment(name)


def prefill_caches(
    service_id: str, layout: KVLayout, full: list[torch.Tensor], num_blocks: int
) -> None:
    """Write each prefill rank's heads of ``full`` (per layer ``[2, blocks, H, BLOCK, D]``)
    into its segment, laid out as that rank's caches are."""
    for rank in range(layout.tp_size):
        heads = layout.heads(rank)
        shape = (2, num_blocks, heads.kv_count, BLOCK, DIM)
        per_layer = 2 * num_blocks * BLOCK * heads.kv_count * DIM
        segment = attach_segment(
            segment_name(service_id, prefill_segment(rank)), per_layer * LAYERS * 4
        )
        flat = torch.frombuffer(segment.buf, dtype=torch.float32, count=per_layer * LAYERS)
        for layer in range(LAYERS):
            span = slice(heads.kv_first, heads.kv_first + heads.kv_count)
            rows = full[layer][:, :, span]
            flat[layer * per_layer : (layer + 1) * per_layer].view(shape).copy_(rows)
        del flat
        segment.close()


@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp", "heads"),
    [(2, 1, (9, 3)), (1, 2, (9, 3)), (2, 2, (4, 1)), (1, 2, (4, 1))],
    ids=["tp2-to-tp1", "tp1-to-tp2", "replicated-tp2-to-tp2", "replicated-tp1-to-tp2"],
)
def test_decode_ranks_pull_their_heads_into_the_blocks_given(
    service: str, prefill_tp: int, decode_tp: int, heads: tuple[int, int]
) -> None:
    num_heads, num_kv_heads = heads
    src_blocks, dst_blocks, num_blocks = [5, 1, 6], [0, 3, 2], 8
    full = [torch.randn(2, num_blocks, num_kv_heads, BLOCK, DIM) for _ in range(LAYERS)]
    source = KVLayout(num_heads, num_kv_heads, DIM, prefill_tp)
    prefill_caches(service, source, full, num_blocks)
    dest = KVLayout(num_heads, num_kv_heads, DIM, decode_tp)
    for rank in range(decode_tp):
        mine = dest.heads(rank)
        caches = [torch.zeros(2, 4, mine.kv_count, BLOCK, DIM) for _ in range(LAYERS)]
        puller = KVPuller(service, source, mine, caches, BLOCK)
        puller.pull(KVReceive("t#0", dst_blocks, [1, 1, 1], src_block_ids=src_blocks))
        [result] = puller.take_results()
        span = slice(mine.kv_first, mine.kv_first + mine.kv_count)
        expected_bytes = LAYERS * 2 * len(src_blocks) * BLOCK * mine.kv_count * DIM * 4
        assert (result.transfer_id, result.ok, result.num_bytes) == ("t#0", True, expected_bytes)
        for layer in range(LAYERS):
            got = caches[layer]
            for src, dst in zip(src_blocks, dst_blocks, strict=True):
                assert torch.equal(got[:, dst], full[layer][:, src, span])
            assert not got[:, 1].any()  # a block not in the order is untouched
        puller.close()
