"""Async scheduling (``--async-scheduling``): the scheduler plans step N+1 while the
workers still run step N. A ``FakePool`` plays the worker (it appends what it samples,
as a real one does), so each test checks what the next step asks of a worker that has
not yet told the engine its last token: positions, blocks, placeholders, and when
blocks are freed."""

from __future__ import annotations

import pytest

from common.config import CacheConfig, SchedulerConfig, TandemConfig
from common.messages import (
    EngineRequest,
    FinishReason,
    ModelInfo,
    PoolRole,
    RequestOutput,
    SamplingParams,
    SchedulerOutput,
)
from engine_core.core import EngineCore
from engine_core.kv_cache import KVCacheManager
from engine_core.request import Request
from engine_core.scheduler import Scheduler
from tests.unit.clock import ManualClock
from tests.unit.fake_pools import BLOCK, FakePool, token_for

EOS = 2
MODEL = ModelInfo(max_model_len=256, vocab_size=1000, eos_token_ids=[EOS])


def make(num_blocks: int = 32, budget: int = 64, max_model_len: int = 256) -> Scheduler:
    model = ModelInfo(max_model_len=max_model_len, vocab_size=1000, eos_token_ids=[EOS])
    config = SchedulerConfig(max_num_batched_tokens=budget, async_scheduling=True)
    return Scheduler(config, KVCacheManager(num_blocks, BLOCK, False), model, ManualClock())


def req(rid: str, prompt_len: int, max_tokens: int = 8) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return Request(rid, b"client", list(range(10, 10 + prompt_len)), params, 0.0)


def begin(
    scheduler: Scheduler, num_blocks: int = 32
) -> tuple[Scheduler, FakePool, list[SchedulerOutput]]:
    """The scheduler, a worker that holds two steps, and the steps sent to it."""
    return scheduler, FakePool(PoolRole.UNIFIED, num_blocks, max_in_flight=2), []


def finish_oldest(s: Scheduler, pool: FakePool, sent: list[SchedulerOutput]) -> list[RequestOutput]:
    """The worker completes the oldest step it was given; the scheduler takes its result."""
    result = pool.poll().result
    assert result is not None
    outputs = s.update_from_output(sent.pop(0), result)
    return [o for outs in outputs.values() for o in outs]


def submit(s: Scheduler, pool: FakePool, sent: list[SchedulerOutput]) -> SchedulerOutput:
    step = s.schedule()
    pool.submit(step)
    sent.append(step)
    return step


def test_the_next_step_decodes_the_token_still_being_sampled() -> None:
    s, pool, sent = begin(make())
    s.add_request(req("a", 6))
    first = submit(s, pool, sent)
    assert first.num_scheduled_tokens == {"a": 6}
    assert first.new_requests[0].block_ids == [0, 1]
    second = submit(s, pool, sent)  # step 1 not done: its token is a placeholder
    assert second.num_scheduled_tokens == {"a": 1}
    assert [
        (c.request_id, c.new_block_ids, c.num_computed_tokens) for c in second.cached_requests
    ] == [("a", [], 6)]
    a = s.requests["a"]
    assert (a.num_computed_tokens, a.num_scheduled_ahead, a.num_output_placeholders) == (0, 7, 2)
    (out,) = finish_oldest(s, pool, sent)
    assert out.new_token_ids == [token_for("a", 6)]
    assert (a.num_computed_tokens, a.num_scheduled_ahead, a.num_output_placeholders) == (6, 1, 1)
    third = submit(s, pool, sent)  # position 7, the token step 2 is sampling
    assert [(c.new_block_ids, c.num_computed_tokens) for c in third.cached_requests] == [([], 7)]
    (out,) = finish_oldest(s, pool, sent)
    assert out.new_token_ids == [token_for("a", 7)]
    fourth = submit(s, pool, sent)  # position 8 starts a third block
    assert [(c.new_block_ids, c.num_computed_tokens) for c in fourth.cached_requests] == [([2], 8)]
    (out,) = finish_oldest(s, pool, sent)
    assert out.new_token_ids == [token_for("a", 8)]
    (out,) = finish_oldest(s, pool, sent)
    assert a.token_ids[6:] == [token_for("a", p) for p in (6, 7, 8, 9)]
    assert (a.num_computed_tokens, a.num_scheduled_ahead, a.num_output_placeholders) == (9, 0, 0)


def test_chunks_of_a_long_prompt_are_scheduled_ahead_then_its_first_decode() -> None:
    s, pool, sent = begin(make(budget=8))
    s.add_request(req("long", 12))
    assert submit(s, pool, sent).num_scheduled_tokens == {"long": 8}
    second = submit(s, pool, sent)
    assert second.num_scheduled_tokens == {"long": 4}
    assert second.cached_requests[0].num_computed_tokens == 8
    assert finish_oldest(s, pool, sent) == []  # a partial prefill samples nothing
    third = submit(s, pool, sent)  # the first decode, of the token step 2 samples
    assert third.num_scheduled_tokens == {"long": 1}
    assert third.cached_requests[0].num_computed_tokens == 12
    (first_token,) = finish_oldest(s, pool, sent)
    (second_token,) = finish_oldest(s, pool, sent)
    assert first_token.new_token_ids + second_token.new_token_ids == [
        token_for("long", 12),
        token_for("long", 13),
    ]


def test_a_request_its_steps_in_flight_end_is_not_scheduled_again() -> None:
    s, pool, sent = begin(make(max_model_len=9))
    s.add_request(req("two", 4, max_tokens=2))
    s.add_request(req("ctx", 7, max_tokens=100))  # the context ends it after 2 tokens
    submit(s, pool, sent)
    assert submit(s, pool, sent).num_scheduled_tokens == {"two": 1, "ctx": 1}
    finish_oldest(s, pool, sent)
    # Each has its last token in flight: the next step schedules neither.
    assert s.schedule().num_scheduled_tokens == {}
    outs = finish_oldest(s, pool, sent)
    assert {o.request_id: o.finish_reason for o in outs} == {
        "two": FinishReason.LENGTH,
        "ctx": FinishReason.LENGTH,
    }
    assert s.kv.num_used_blocks == 0 and not s.requests


def test_an_eos_frees_the_blocks_only_after_the_step_already_sent() -> None:
    s, pool, sent = begin(make())
    s.add_request(req("a", 6))
    submit(s, pool, sent)
    submit(s, pool, sent)  # decodes the first token, whatever it is
    result = pool.poll().result
    assert result is not None
    result.sampled_token_ids = [EOS]
    (out,) = s.update_from_output(sent.pop(0), result)[b"client"]
    assert out.finish_reason == FinishReason.STOP
    assert s.kv.blocks_of("a") == [0, 1]  # step 2 still writes into them
    assert finish_oldest(s, pool, sent) == []  # its token is dropped
    assert s.kv.num_used_blocks == 0
    assert s.schedule().finished_request_ids == ["a"]


def test_an_abort_frees_the_blocks_after_the_last_step_holding_them() -> None:
    s, pool, sent = begin(make())
    s.add_request(req("a", 6))
    submit(s, pool, sent)
    submit(s, pool, sent)
    assert s.abort_requests(["a"])[b"client"][0].finish_reason == FinishReason.ABORT
    assert s.kv.num_used_blocks == 2
    assert finish_oldest(s, pool, sent) == []
    assert s.kv.num_used_blocks == 2  # the second step is still writing
    assert finish_oldest(s, pool, sent) == []
    assert s.kv.num_used_blocks == 0


def test_scheduling_ahead_never_preempts_it_waits_for_the_steps_in_flight() -> None:
    s, pool, sent = begin(make(num_blocks=4), 4)
    s.add_request(req("old", 4, max_tokens=8))
    s.add_request(req("new", 4, max_tokens=8))
    submit(s, pool, sent)  # a block each; their decodes need a second
    assert submit(s, pool, sent).num_scheduled_tokens == {"old": 1, "new": 1}
    assert s.kv.num_used_blocks == 4
    finish_oldest(s, pool, sent)
    for _ in range(3):  # positions 5 to 7 still fit in the second blocks
        submit(s, pool, sent)
        finish_oldest(s, pool, sent)
    stalled = s.schedule()  # position 8 needs a third block: none is free
    assert stalled.num_scheduled_tokens == {} and not s.can_schedule_ahead
    assert s.num_preemptions_total == 0
    finish_oldest(s, pool, sent)
    after = s.schedule()  # nothing in flight: now it preempts the latest
    assert after.num_scheduled_tokens == {"old": 1} and s.can_schedule_ahead
    assert s.num_preemptions_total == 1 and after.finished_request_ids == ["new"]


# ---------------------------------------------------------------- EngineCore


def engine(async_scheduling: bool, num_blocks: int = 64) -> tuple[EngineCore, FakePool]:
    config = TandemConfig(
        cache=CacheConfig(block_size=BLOCK, num_kv_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_batched_tokens=16, async_scheduling=async_scheduling),
    )
    pool = FakePool(PoolRole.UNIFIED, num_blocks, step_polls=2, max_in_flight=2)
    core = EngineCore(config, {PoolRole.UNIFIED: pool}, ManualClock())
    core.start()
    return core, pool


def serve(core: EngineCore, prompts: dict[str, int]) -> dict[str, list[int]]:
    for i, (rid, n) in enumerate(prompts.items()):
        params = SamplingParams(max_tokens=5 + i, temperature=0.0)
        core.add_request(EngineRequest(rid, b"c", list(range(1, n + 1)), params, 0.0))
    tokens: dict[str, list[int]] = {}
    done: set[str] = set()
    for _ in range(500):
        for out in core.step().outputs.get(b"c", []):
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                done.add(out.request_id)
        if done == set(prompts):
            return tokens
    raise AssertionError(f"not done: {tokens}")


@pytest.mark.parametrize("num_blocks", [64, 9], ids=["roomy", "preempting"])
def test_engine_core_keeps_two_steps_in_flight_and_outputs_the_same(num_blocks: int) -> None:
    prompts = {"a": 3, "b": 21, "c": 9, "d": 1}
    sync_core, sync_pool = engine(False, num_blocks)
    expected = serve(sync_core, prompts)
    core, pool = engine(True, num_blocks)
    assert serve(core, prompts) == expected
    assert expected == {
        rid: [token_for(rid, n + i) for i in range(5 + k)]
        for k, (rid, n) in enumerate(prompts.items())
    }
    assert (sync_pool.most_in_flight, pool.most_in_flight) == (1, 2)
    preemptions = core.stats().num_preemptions_total
    assert (preemptions > 0) == (num_blocks == 9), preemptions
    assert len(pool.steps) < len(sync_pool.steps) + 4  # no step wasted on waiting
    kv = core.slots[PoolRole.UNIFIED].scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks and not core.num_requests
    while core.has_work():  # the last finished ids reach the workers
        core.step()
    assert not pool.busy
