"""``EngineCore`` in-process, with fake pools: submit-then-poll stepping, and every path a
prefill -> decode hand-off can take, with exact block ids and, at the end of every case,
every block of every pool free. Every split-pool case runs twice: one step in flight per
pool, and two (``--async-scheduling``)."""

from __future__ import annotations

import sys
from collections.abc import Callable

import pytest

from common.config import CacheConfig, SchedulerConfig, TandemConfig
from common.messages import (
    EngineRequest,
    FinishReason,
    KVReceive,
    KVSend,
    KVTransferResult,
    PoolRole,
    RequestOutput,
    SamplingParams,
)
from common.pool_config import DisaggConfig
from engine_core.core import EngineCore
from tests.unit.clock import ManualClock
from tests.unit.fake_pools import BLOCK, FakePool, token_for

ASYNC_SCHEDULING = False  # read by make(); each test runs with both values


@pytest.fixture(autouse=True, params=[False, True], ids=["sync", "async"])
def async_scheduling(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Whether ``make`` builds an engine whose pools hold two steps at once."""
    monkeypatch.setattr(sys.modules[__name__], "ASYNC_SCHEDULING", request.param)
    return bool(request.param)


def make(
    kv_transfer: str = "tcp",
    prefill_blocks: int = 16,
    decode_blocks: int = 16,
    policy: str = "fail",
    budget: int = 64,
    max_num_seqs: int = 8,
    min_prompt: int = 0,
    **pool_options: int,
) -> tuple[EngineCore, FakePool, FakePool, ManualClock]:
    # A step that ends on the poll after its submission never has a second queued behind it.
    polls = 2 if ASYNC_SCHEDULING else 1
    config = TandemConfig(
        cache=CacheConfig(block_size=BLOCK, num_kv_blocks=16),
        scheduler=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            async_scheduling=ASYNC_SCHEDULING,
        ),
        disagg=DisaggConfig(
            prefill_workers=1,
            decode_workers=1,
            kv_transfer=kv_transfer,  # type: ignore[arg-type]
            kv_load_failure_policy=policy,  # type: ignore[arg-type]
            kv_transfer_lease_s=30.0,
            disagg_min_prompt_tokens=min_prompt,
        ),
    )
    prefill = FakePool(
        PoolRole.PREFILL, prefill_blocks, pool_options.get("prefill_polls", polls), max_in_flight=2
    )
    decode = FakePool(
        PoolRole.DECODE,
        decode_blocks,
        pool_options.get("decode_polls", polls),
        pool_options.get("land_polls", 1),
        max_in_flight=2,
    )
    clock = ManualClock(1000.0)
    core = EngineCore(config, {PoolRole.PREFILL: prefill, PoolRole.DECODE: decode}, clock)
    core.start()
    return core, prefill, decode, clock


def request(request_id: str, prompt: list[int], max_tokens: int = 4) -> EngineRequest:
    return EngineRequest(
        request_id, b"client", prompt, SamplingParams(max_tokens=max_tokens, temperature=0), 0.0
    )


Outputs = dict[str, list[RequestOutput]]


def run(
    core: EngineCore, outputs: Outputs, until: Callable[[], bool], max_steps: int = 200
) -> None:
    for _ in range(max_steps):
        if until():
            return
        for out in core.step().outputs.get(b"client", []):
            outputs.setdefault(out.request_id, []).append(out)
    raise AssertionError(f"not done after {max_steps} steps: {outputs}")


def finished(outputs: Outputs, *ids: str) -> Callable[[], bool]:
    return lambda: all(outputs.get(i) and outputs[i][-1].finish_reason is not None for i in ids)


def tokens(outputs: Outputs, request_id: str) -> list[int]:
    return [t for out in outputs[request_id] for t in out.new_token_ids]


def expected_tokens(request_id: str, prompt_len: int, n: int) -> list[int]:
    return [token_for(request_id, prompt_len + i) for i in range(n)]


def assert_all_free(core: EngineCore) -> None:
    for slot in core.slots.values():
        kv = slot.scheduler.kv
        assert kv.num_free_blocks == kv.num_blocks, slot.role
        assert all(count == 0 for count in kv.ref_counts), slot.role
        assert not kv.req_to_blocks and not slot.scheduler.requests
    assert not core.num_requests


def outcomes(core: EngineCore) -> dict[str, int]:
    stats = core.transfer_stats()
    assert stats is not None
    return {k: v for k, v in stats.outcomes.items() if v}


# ---------------------------------------------------------------- stepping


def test_unified_pool_steps_submit_then_poll() -> None:
    config = TandemConfig(
        cache=CacheConfig(block_size=BLOCK, num_kv_blocks=16),
        scheduler=SchedulerConfig(async_scheduling=ASYNC_SCHEDULING),
    )
    pool = FakePool(PoolRole.UNIFIED, 16, step_polls=3, max_in_flight=2 if ASYNC_SCHEDULING else 1)
    core = EngineCore(config, {PoolRole.UNIFIED: pool})
    core.start()
    core.add_request(request("u", [5, 6, 7, 8, 9], max_tokens=3))
    first = core.step()
    assert first.progressed and pool.busy and not first.outputs  # submitted, not waited on
    second = core.step()
    if ASYNC_SCHEDULING:  # the next step is planned and sent while the first runs
        assert second.progressed and pool.most_in_flight == 2
    else:
        assert not second.progressed  # polled: not done yet
    outputs: Outputs = {}
    run(core, outputs, finished(outputs, "u"))
    assert tokens(outputs, "u") == expected_tokens("u", 5, 3)
    assert_all_free(core)


def test_pools_step_independently(async_scheduling: bool) -> None:
    """A slow prefill step (10 polls) does not hold back the decode pool's steps."""
    core, prefill, decode, _ = make("shm", prefill_polls=10)
    outputs: Outputs = {}
    core.add_request(request("d", [1, 2, 3], max_tokens=30))
    run(core, outputs, lambda: len(decode.steps) >= 1)
    core.add_request(request("p", list(range(40)), max_tokens=2))
    prefill_steps_before = len(prefill.steps)
    run(core, outputs, lambda: len(prefill.steps) > prefill_steps_before)
    decode_steps_before = len(decode.steps)
    run(core, outputs, lambda: not prefill.busy)  # one 10-poll prefill step
    assert len(decode.steps) - decode_steps_before >= 8
    run(core, outputs, finished(outputs, "d", "p"))
    assert tokens(outputs, "d") == expected_tokens("d", 3, 30)
    assert decode.most_in_flight == (2 if async_scheduling else 1)
    assert_all_free(core)


def test_stats_carry_each_pools_worker_threads_and_their_total() -> None:
    core, prefill, decode, _ = make("shm")
    assert core.stats().num_worker_threads == 0  # no step has said yet
    prefill.num_threads, decode.num_threads = 1, 3
    per_pool = core.pool_stats()
    assert {role: s.num_worker_threads for role, s in per_pool.items()} == {
        PoolRole.PREFILL: 1,
        PoolRole.DECODE: 3,
    }
    assert core.stats().num_worker_threads == 4


# ---------------------------------------------------------------- shm: block ids move


def test_shm_hand_off_moves_block_ids_and_copies_nothing() -> None:
    core, prefill, decode, _ = make("shm")
    outputs: Outputs = {}
    core.add_request(request("a", list(range(1, 9)), max_tokens=4))  # exactly 2 blocks
    run(core, outputs, finished(outputs, "a"))
    assert prefill.steps[0].new_requests[0].block_ids == [0, 1]
    handed = decode.steps[0].new_requests[0]
    assert handed.block_ids == [0, 1, 2]  # the same blocks, one more for the next token
    assert handed.num_computed_tokens == 8 and handed.token_ids[8] == token_for("a", 8)
    assert not any(s.kv_sends or s.kv_receives for s in prefill.steps + decode.steps)
    assert tokens(outputs, "a") == expected_tokens("a", 8, 4)
    assert outcomes(core) == {"done": 1}
    assert_all_free(core)


def test_shm_decode_pool_full_of_sequences_makes_hand_offs_wait() -> None:
    core, _, decode, _ = make("shm", max_num_seqs=1)
    outputs: Outputs = {}
    core.add_request(request("a", [1, 2, 3], max_tokens=5))
    core.add_request(request("b", [4, 5, 6], max_tokens=2))
    run(core, outputs, finished(outputs, "a", "b"))
    order = [n.request_id for s in decode.steps for n in s.new_requests]
    assert order == ["a", "b"]  # b decoded only once a had finished
    assert tokens(outputs, "b") == expected_tokens("b", 3, 2)
    assert_all_free(core)


# ---------------------------------------------------------------- tcp: KV streamed


def test_tcp_prompt_shorter_than_a_block() -> None:
    core, prefill, decode, _ = make("tcp")
    outputs: Outputs = {}
    core.add_request(request("a", [7, 8, 9], max_tokens=3))
    run(core, outputs, finished(outputs, "a"))
    assert prefill.steps[0].new_requests[0].block_ids == [0]
    sends = [send for s in prefill.steps for send in s.kv_sends]
    receives = [r for s in decode.steps for r in s.kv_receives]
    assert sends == [KVSend("a#0", [0], ["tcp://fake-decode:1"])]
    assert receives == [KVReceive("a#0", [0], [1])]
    assert decode.steps[1].new_requests[0].block_ids == [0]  # 3 prompt + 1 token: one block
    assert tokens(outputs, "a") == expected_tokens("a", 3, 3)
    assert outcomes(core) == {"done": 1}
    assert_all_free(core)


def test_tcp_prompt_of_exactly_n_blocks() -> None:
    core, prefill, decode, _ = make("tcp")
    outputs: Outputs = {}
    core.add_request(request("a", list(range(1, 13)), max_tokens=2))  # 3 blocks
    run(core, outputs, finished(outputs, "a"))
    assert [s.block_ids for s in prefill.steps[1].kv_sends] == [[0, 1, 2]]
    assert [(r.block_ids, r.generations) for r in decode.steps[0].kv_receives] == [
        ([0, 1, 2], [1, 1, 1])
    ]
    assert decode.steps[1].new_requests[0].block_ids == [0, 1, 2, 3]
    assert tokens(outputs, "a") == expected_tokens("a", 12, 2)
    assert_all_free(core)


def test_tcp_blocks_the_decode_pool_caches_are_not_sent_again() -> None:
    core, prefill, decode, _ = make("tcp")
    outputs: Outputs = {}
    shared = list(range(1, 9))  # two full blocks
    core.add_request(request("a", [*shared, 20, 21, 22], max_tokens=2))
    run(core, outputs, finished(outputs, "a"))
    core.add_request(request("b", [*shared, 30, 31, 32], max_tokens=2))
    run(core, outputs, finished(outputs, "b"))
    sends = [send for s in prefill.steps for send in s.kv_sends]
    assert [len(s.block_ids) for s in sends] == [3, 1]  # b: only its third block
    b_receive = [r for s in decode.steps for r in s.kv_receives if r.transfer_id.startswith("b")]
    b_new = next(n for s in decode.steps for n in s.new_requests if n.request_id == "b")
    assert b_new.block_ids[:2] == [0, 1]  # a's cached prefix blocks, taken
    assert b_receive[0].block_ids == [b_new.block_ids[2]]
    assert tokens(outputs, "b") == expected_tokens("b", 11, 2)
    assert_all_free(core)


def test_tcp_decode_pool_full_makes_the_hand_off_wait_then_run() -> None:
    core, _, decode, _ = make("tcp", decode_blocks=4)
    outputs: Outputs = {}
    core.add_request(request("a", list(range(1, 9)), max_tokens=7))  # up to 4 blocks
    run(core, outputs, lambda: bool(decode.steps))
    core.add_request(request("b", list(range(20, 28)), max_tokens=2))  # needs 2 blocks
    run(core, outputs, finished(outputs, "a", "b"))
    receives = [(i, r.transfer_id) for i, s in enumerate(decode.steps) for r in s.kv_receives]
    a_done = next(i for i, s in enumerate(decode.steps) if "a" in s.finished_request_ids)
    b_step = next(i for i, t in receives if t.startswith("b"))
    assert b_step >= a_done  # b's blocks came only once a's were free
    assert tokens(outputs, "b") == expected_tokens("b", 8, 2)
    assert_all_free(core)


def test_a_request_the_decode_pool_can_never_hold_is_refused() -> None:
    core, _, _, _ = make("tcp", decode_blocks=2)
    outputs: Outputs = {}
    core.add_request(request("big", list(range(1, 13)), max_tokens=3))  # 13 tokens: 4 blocks
    run(core, outputs, finished(outputs, "big"))
    last = outputs["big"][-1]
    assert last.finish_reason == FinishReason.ERROR and "cannot hold" in (last.error or "")
    assert outcomes(core) == {"refused": 1}
    assert_all_free(core)


def test_abort_while_prefilling() -> None:
    core, prefill, decode, _ = make("tcp", budget=8)
    outputs: Outputs = {}
    core.add_request(request("a", list(range(1, 21)), max_tokens=3))  # 20 tokens, 8 a step
    run(core, outputs, lambda: len(prefill.steps) == 1)  # the first chunk is sent
    assert prefill.steps[0].num_scheduled_tokens == {"a": 8}
    outputs.setdefault("a", []).extend(core.abort(["a"]).get(b"client", []))
    run(core, outputs, lambda: not core.has_work())
    assert outputs["a"][-1].finish_reason == FinishReason.ABORT
    assert not decode.steps and not outcomes(core)  # never reached the decode pool
    assert_all_free(core)


def test_abort_mid_transfer_frees_both_sides_and_a_late_landing_is_ignored() -> None:
    core, prefill, decode, _ = make("tcp", land_polls=50)
    outputs: Outputs = {}
    core.add_request(request("a", list(range(1, 9)), max_tokens=3))
    run(core, outputs, lambda: any(s.kv_receives for s in decode.steps))
    transfer_id = decode.steps[-1].kv_receives[0].transfer_id
    outputs.setdefault("a", []).extend(core.abort(["a"]).get(b"client", []))
    run(core, outputs, lambda: not core.has_work())
    assert outputs["a"][-1].finish_reason == FinishReason.ABORT
    assert [s.kv_cancels for s in decode.steps if s.kv_cancels] == [[transfer_id]]
    assert [s.kv_cancels for s in prefill.steps if s.kv_cancels] == [[transfer_id]]
    assert outcomes(core) == {"aborted": 1}
    late = core.slots[PoolRole.DECODE].side.on_result(KVTransferResult(transfer_id, True))
    assert late == {} and outcomes(core) == {"aborted": 1}
    assert_all_free(core)


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_lease_expiry(policy: str) -> None:
    core, _, decode, clock = make("tcp", policy=policy, land_polls=10_000)
    outputs: Outputs = {}
    core.add_request(request("a", list(range(1, 9)), max_tokens=3))
    run(core, outputs, lambda: any(s.kv_receives for s in decode.steps))
    clock.now += 31.0  # past the 30 s lease
    run(core, outputs, finished(outputs, "a"))
    assert outcomes(core) == {"expired": 1}
    if policy == "fail":
        last = outputs["a"][-1]
        assert last.finish_reason == FinishReason.ERROR and "expired" in (last.error or "")
    else:  # prefilled again in the decode pool, then decoded: every token as expected
        recomputed = next(n for s in decode.steps for n in s.new_requests if n.request_id == "a")
        assert recomputed.num_computed_tokens == 0 and len(recomputed.token_ids) == 9
        assert tokens(outputs, "a") == expected_tokens("a", 8, 3)
    assert_all_free(core)


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_transfer_failure(policy: str) -> None:
    core, _, decode, _ = make("tcp", policy=policy)
    decode.fail_transfers.add("a#0")
    outputs: Outputs = {}
    core.add_request(request("a", list(range(1, 9)), max_tokens=3))
    run(core, outputs, finished(outputs, "a"))
    assert outcomes(core) == {"failed": 1}
    if policy == "fail":  # a clear error, never tokens decoded from KV that did not land
        last = outputs["a"][-1]
        assert last.finish_reason == FinishReason.ERROR and "checksum" in (last.error or "")
        assert tokens(outputs, "a") == expected_tokens("a", 8, 1)  # only the prefill's token
    else:
        assert tokens(outputs, "a") == expected_tokens("a", 8, 3)
    assert_all_free(core)


def test_a_stale_block_reference_is_refused() -> None:
    """A landing for a transfer whose request was aborted and whose blocks were taken by
    another request never reaches the new owner."""
    core, _, decode, _ = make("tcp", decode_blocks=2, land_polls=50)
    outputs: Outputs = {}
    core.add_request(request("a", list(range(1, 8)), max_tokens=2))
    run(core, outputs, lambda: any(s.kv_receives for s in decode.steps))
    stale = decode.steps[-1].kv_receives[0]
    core.abort(["a"])
    core.add_request(request("b", list(range(50, 57)), max_tokens=2))
    run(core, outputs, lambda: len([r for s in decode.steps for r in s.kv_receives]) == 2)
    fresh = [r for s in decode.steps for r in s.kv_receives][-1]
    assert fresh.block_ids[0] in stale.block_ids  # the same block, handed out again
    kv = core.slots[PoolRole.DECODE].scheduler.kv
    assert not kv.is_current(stale.block_ids, stale.generations)
    assert kv.is_current(fresh.block_ids, fresh.generations)
    assert (
        core.slots[PoolRole.DECODE].side.on_result(KVTransferResult(stale.transfer_id, True)) == {}
    )
    run(core, outputs, finished(outputs, "b"))
    assert tokens(outputs, "b") == expected_tokens("b", 7, 2)
    assert outcomes(core) == {"aborted": 1, "done": 1}
    assert_all_free(core)


@pytest.mark.parametrize("kv_transfer", ["shm", "tcp"])
def test_short_prompts_are_prefilled_in_the_decode_pool(kv_transfer: str) -> None:
    core, prefill, _, _ = make(kv_transfer, min_prompt=6, budget=8)
    outputs: Outputs = {}
    core.add_request(request("long", list(range(1, 41)), max_tokens=2))
    core.add_request(request("short", [1, 2, 3], max_tokens=2))
    run(core, outputs, finished(outputs, "long", "short"))
    prefilled_there = {n.request_id for s in prefill.steps for n in s.new_requests}
    # tcp: short prompts always stay; shm: only because the long prompt keeps prefill busy
    assert prefilled_there == {"long"}
    assert outcomes(core) == {"done": 1, "local_prefill": 1}
    assert tokens(outputs, "short") == expected_tokens("short", 3, 2)
    assert_all_free(core)
