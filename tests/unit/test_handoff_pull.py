"""``ShmCopyHandoff`` (split pools of different widths over ``shm``) in ``EngineCore``
with fake pools: the decode side is told which prefill blocks to copy, the prefill
side's blocks stay until every decode rank has copied them, and a hand-off ended while
a decode step may be reading them frees them only once that step is over."""

from __future__ import annotations

from common.config import CacheConfig, SchedulerConfig, TandemConfig
from common.messages import FinishReason, KVReceive, KVTransferResult, PoolRole
from common.pool_config import DisaggConfig
from engine_core.core import EngineCore
from engine_core.handoff_pull import ShmCopyHandoff
from tests.unit.clock import ManualClock
from tests.unit.fake_pools import BLOCK, FakePool
from tests.unit.test_engine_core import (
    Outputs,
    assert_all_free,
    expected_tokens,
    finished,
    outcomes,
    request,
    run,
    tokens,
)


def make(
    prefill_tp: int, decode_tp: int, decode_polls: int = 1, land_polls: int = 1
) -> tuple[EngineCore, FakePool, FakePool]:
    config = TandemConfig(
        cache=CacheConfig(block_size=BLOCK, num_kv_blocks=16),
        # One step in flight: the cases below step through exactly when a decode step
        # that may read the copied blocks runs and ends.
        scheduler=SchedulerConfig(
            max_num_seqs=8, max_num_batched_tokens=64, async_scheduling=False
        ),
        disagg=DisaggConfig(
            prefill_workers=1,
            decode_workers=1,
            kv_transfer="shm",
            prefill_tp=prefill_tp,
            decode_tp=decode_tp,
            disagg_min_prompt_tokens=0,
        ),
    )
    prefill = FakePool(PoolRole.PREFILL, 16)
    decode = FakePool(PoolRole.DECODE, 16, decode_polls, land_polls)
    core = EngineCore(
        config, {PoolRole.PREFILL: prefill, PoolRole.DECODE: decode}, ManualClock(1000.0)
    )
    core.start()
    return core, prefill, decode


def test_equal_widths_share_one_block_pool_and_different_widths_copy() -> None:
    core, _, _ = make(2, 2)
    assert not isinstance(core.handoff, ShmCopyHandoff)  # one manager: zero-copy
    assert core.slots[PoolRole.PREFILL].scheduler.kv is core.slots[PoolRole.DECODE].scheduler.kv
    core, _, _ = make(2, 1)
    assert isinstance(core.handoff, ShmCopyHandoff)
    assert core.slots[PoolRole.PREFILL].scheduler.kv is not core.slots[PoolRole.DECODE].scheduler.kv


def test_the_decode_side_copies_the_prefill_blocks_itself() -> None:
    core, prefill, decode = make(2, 1)
    outputs: Outputs = {}
    core.add_request(request("a", list(range(1, 10)), max_tokens=3))  # 9 tokens: 3 blocks
    run(core, outputs, finished(outputs, "a"))
    assert not any(s.kv_sends for s in prefill.steps)  # the prefill pool sends nothing
    receives = [r for s in decode.steps for r in s.kv_receives]
    assert receives == [KVReceive("a#0", [0, 1, 2], [1, 1, 1], src_block_ids=[0, 1, 2])]
    assert tokens(outputs, "a") == expected_tokens("a", 9, 3)
    assert outcomes(core) == {"done": 1}
    assert_all_free(core)


def test_a_hand_off_lands_once_every_decode_rank_has_its_heads() -> None:
    core, _, decode = make(1, 2, land_polls=10_000)  # the fake never lands it
    outputs: Outputs = {}
    core.add_request(request("a", list(range(1, 6)), max_tokens=2))
    run(core, outputs, lambda: any(s.kv_receives for s in decode.steps))
    handoff = core.handoff
    assert isinstance(handoff, ShmCopyHandoff)
    prefill_kv = core.slots[PoolRole.PREFILL].scheduler.kv
    assert (
        core.slots[PoolRole.DECODE].side.on_result(KVTransferResult("a#0", True, None, 100)) == {}
    )
    assert "a" in handoff.in_flight and prefill_kv.blocks_of("a") == [0, 1]  # rank 1 to come
    assert (
        core.slots[PoolRole.DECODE].side.on_result(KVTransferResult("a#0", True, None, 100)) == {}
    )
    assert "a" not in handoff.in_flight and prefill_kv.num_free_blocks == prefill_kv.num_blocks
    run(core, outputs, finished(outputs, "a"))
    assert tokens(outputs, "a") == expected_tokens("a", 5, 2)
    stats = core.transfer_stats()
    assert stats is not None and stats.outcomes["done"] == 1 and stats.num_bytes_total == 200
    assert_all_free(core)


def test_an_abort_while_a_decode_step_may_read_the_blocks_frees_them_after_it() -> None:
    core, _, decode = make(2, 1, decode_polls=3, land_polls=10_000)
    outputs: Outputs = {}
    core.add_request(request("a", list(range(1, 10)), max_tokens=3))
    run(core, outputs, lambda: any(s.kv_receives for s in decode.steps))
    assert decode.busy  # the step carrying the copy order is running
    outputs.setdefault("a", []).extend(core.abort(["a"]).get(b"client", []))
    assert outputs["a"][-1].finish_reason == FinishReason.ABORT
    prefill_kv = core.slots[PoolRole.PREFILL].scheduler.kv
    assert prefill_kv.num_free_blocks == prefill_kv.num_blocks - 3  # still being read
    assert "a" not in prefill_kv.req_to_blocks  # the id is free for a new request
    run(core, outputs, lambda: not decode.busy)
    assert prefill_kv.num_free_blocks == prefill_kv.num_blocks
    run(core, outputs, lambda: not core.has_work())
    assert outcomes(core) == {"aborted": 1}
    assert_all_free(core)
