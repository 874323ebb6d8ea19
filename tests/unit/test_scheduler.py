from __future__ import annotations

from common.config import SchedulerConfig
from common.messages import (
    ErrorKind,
    FinishReason,
    ModelInfo,
    ModelRunnerOutput,
    SamplingParams,
    SchedulerOutput,
)
from engine_core.kv_cache import KVCacheManager
from engine_core.request import Request
from engine_core.scheduler import Scheduler
from tests.unit.clock import ManualClock

EOS = 2


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    budget: int = 32,
    max_model_len: int = 256,
    prefix_caching: bool = True,
    clock: ManualClock | None = None,
    **config: object,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, **config),  # type: ignore[arg-type]
        KVCacheManager(num_blocks, block_size, prefix_caching),
        ModelInfo(max_model_len=max_model_len, vocab_size=100, eos_token_ids=[EOS]),
        clock=clock or ManualClock(),
    )


def req(
    rid: str,
    prompt_len: int,
    max_tokens: int = 4,
    arrival: float = 0.0,
    priority: int = 0,
    first: int = 10,
    **params: object,
) -> Request:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, **params)  # type: ignore[arg-type]
    return Request(rid, b"client", list(range(first, first + prompt_len)), sp, arrival, priority)


def run_step(
    s: Scheduler, tokens: dict[str, int] | None = None
) -> tuple[SchedulerOutput, dict[str, FinishReason | None]]:
    """Schedule, then pretend the worker sampled ``tokens[rid]`` (default 50) for every
    request whose scheduled tokens reach its end."""
    out = s.schedule()
    ids, sampled = [], []
    for rid, n in out.num_scheduled_tokens.items():
        r = s.requests[rid]
        if r.num_computed_tokens + n == r.num_tokens:
            ids.append(rid)
            sampled.append((tokens or {}).get(rid, 50))
    results = s.update_from_output(out, ModelRunnerOutput(out.step_id, ids, sampled))
    return out, {o.request_id: o.finish_reason for outs in results.values() for o in outs}


def test_new_request_is_sent_whole_then_as_diffs() -> None:
    s = make_scheduler()
    s.add_request(req("a", 6))
    out, finished = run_step(s)
    assert [n.request_id for n in out.new_requests] == ["a"]
    assert out.new_requests[0].block_ids == [0, 1]
    assert out.num_scheduled_tokens == {"a": 6}
    assert finished == {"a": None}
    out, _ = run_step(s)  # decode: token 7 lands in block 1
    assert out.new_requests == []
    assert [
        (c.request_id, c.new_block_ids, c.num_computed_tokens) for c in out.cached_requests
    ] == [("a", [], 6)]
    assert out.num_scheduled_tokens == {"a": 1}
    out, _ = run_step(s)  # token 8 still in block 1; token 9 needs block 2
    out, _ = run_step(s)
    assert out.cached_requests[0].new_block_ids == [2]


def test_long_prompt_is_chunked_within_budget_while_others_decode() -> None:
    s = make_scheduler(budget=8)
    s.add_request(req("short", 3, max_tokens=10))
    run_step(s)
    s.add_request(req("long", 20))
    out, finished = run_step(s)
    assert out.num_scheduled_tokens == {"short": 1, "long": 7}
    assert "long" not in finished  # partial prefill samples nothing
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {"short": 1, "long": 7}
    out, finished = run_step(s)
    assert out.num_scheduled_tokens == {"short": 1, "long": 6}
    assert finished["long"] is None  # prefill complete: first token sampled
    assert s.requests["long"].num_computed_tokens == 20


def test_max_num_seqs_and_budget_are_respected() -> None:
    s = make_scheduler(max_num_seqs=2, budget=10)
    for i in range(4):
        s.add_request(req(f"r{i}", 4))
    out, _ = run_step(s)
    assert list(out.num_scheduled_tokens) == ["r0", "r1"]
    assert len(s.running) == 2 and len(s.waiting) == 2


def test_stop_on_eos_stop_token_and_max_tokens() -> None:
    s = make_scheduler()
    s.add_request(req("eos", 3))
    s.add_request(req("stoptok", 3, stop_token_ids=[77]))
    s.add_request(req("ignore", 3, max_tokens=2, ignore_eos=True))
    _, finished = run_step(s, {"eos": EOS, "stoptok": 77, "ignore": EOS})
    assert finished == {"eos": FinishReason.STOP, "stoptok": FinishReason.STOP, "ignore": None}
    out, finished = run_step(s, {"ignore": EOS})
    assert sorted(out.finished_request_ids) == ["eos", "stoptok"]  # workers drop them
    assert finished == {"ignore": FinishReason.LENGTH}
    assert s.kv.num_used_blocks == 0 and not s.requests
    assert s.schedule().finished_request_ids == ["ignore"]


def test_context_length_ends_generation() -> None:
    s = make_scheduler(max_model_len=8)
    s.add_request(req("a", 6, max_tokens=100))
    run_step(s)
    _, finished = run_step(s)
    assert finished == {"a": FinishReason.LENGTH}
    assert s.kv.num_used_blocks == 0


def test_abort_frees_blocks_and_is_idempotent() -> None:
    s = make_scheduler()
    s.add_request(req("a", 6))
    s.add_request(req("b", 6))
    run_step(s)
    outs = s.abort_requests(["a", "a", "unknown"])
    assert [(o.request_id, o.finish_reason) for o in outs[b"client"]] == [("a", FinishReason.ABORT)]
    assert s.kv.blocks_of("a") == []
    assert s.schedule().finished_request_ids == ["a"]


def test_preemption_frees_the_latest_request_and_resumes_it_whole() -> None:
    s = make_scheduler(num_blocks=4, block_size=4, budget=64, prefix_caching=False)
    s.add_request(req("old", 4, max_tokens=8))
    s.add_request(req("new", 4, max_tokens=8))
    run_step(s)  # each holds one full block, plus their first sampled token
    out, _ = run_step(s)  # both need a second block: 4 blocks in use
    assert s.kv.num_used_blocks == 4
    for _ in range(3):
        run_step(s)
    out, _ = run_step(s)  # old needs a third block: new is preempted
    assert out.num_scheduled_tokens == {"old": 1}
    assert s.num_preemptions_total == 1
    assert [r.request_id for r in s.waiting] == ["new"]
    assert s.kv.blocks_of("new") == []
    num_new_tokens = s.requests["new"].num_tokens
    out, finished = run_step(s)
    while "old" in s.requests:
        assert out.new_requests == []  # no room for new until old is done
        out, finished = run_step(s)
    assert finished == {"old": FinishReason.LENGTH}
    out, _ = run_step(s)  # new resumes: its prompt and generated tokens recomputed
    assert [(n.request_id, len(n.token_ids), n.num_computed_tokens) for n in out.new_requests] == [
        ("new", num_new_tokens, 0)
    ]
    assert out.num_scheduled_tokens == {"new": num_new_tokens}


def test_unschedulable_prompt_is_rejected() -> None:
    s = make_scheduler(num_blocks=2, block_size=4, max_model_len=100)
    error = s.add_request(req("huge", 20))
    assert error is not None and error.finish_reason == FinishReason.ERROR
    assert "KV blocks" in (error.error or "")
    error = make_scheduler(max_model_len=10).add_request(req("long", 10))
    assert error is not None and "10 tokens" in (error.error or "")


def test_long_prefill_cap_leaves_room_for_others() -> None:
    s = make_scheduler(budget=32, long_prefill_token_threshold=8)
    s.add_request(req("a", 20))
    s.add_request(req("b", 20, first=40))
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {"a": 8, "b": 8}


def test_without_chunked_prefill_a_prompt_runs_whole() -> None:
    # Without chunking the step budget grows to the context length (24), as in vLLM.
    s = make_scheduler(budget=8, max_model_len=24, enable_chunked_prefill=False)
    s.add_request(req("a", 6))
    s.add_request(req("b", 20, first=40))
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {"a": 6}  # b does not fit in the 18 left
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {"a": 1, "b": 20}  # whole, never chunked


def test_prefix_hit_on_admission_skips_cached_tokens() -> None:
    s = make_scheduler(block_size=4)
    s.add_request(req("a", 10))
    run_step(s)
    s.add_request(req("b", 10))  # the same prompt
    out, _ = run_step(s)
    (new,) = out.new_requests
    assert (new.request_id, new.num_computed_tokens, new.block_ids[:2]) == ("b", 8, [0, 1])
    assert out.num_scheduled_tokens["b"] == 2
    stats = s.stats()
    assert (stats.prefix_cache_queries_total, stats.prefix_cache_hits_total) == (20, 8)


def test_first_output_reports_cached_prompt_tokens() -> None:
    s = make_scheduler(block_size=4)
    s.add_request(req("a", 9))
    run_step(s)
    s.add_request(req("b", 9))
    out = s.schedule()
    result = s.update_from_output(out, ModelRunnerOutput(out.step_id, ["a", "b"], [50, 50]))
    by_id = {o.request_id: o for o in result[b"client"]}
    assert by_id["b"].num_cached_tokens == 8 and by_id["a"].num_cached_tokens == 0


def test_priority_policy_orders_waiting_and_ages() -> None:
    clock = ManualClock()
    s = make_scheduler(
        max_num_seqs=1, scheduling_policy="priority", priority_aging_s=10.0, clock=clock
    )
    s.add_request(req("low", 4, arrival=0.0, priority=5, max_tokens=1))
    s.add_request(req("high", 4, arrival=1.0, priority=0, max_tokens=1, first=30))
    out, _ = run_step(s)
    assert list(out.num_scheduled_tokens) == ["high"]
    # "low" has waited 60 s (6 levels): it now beats a fresh priority-0 request.
    s.add_request(req("fresh", 4, arrival=61.0, priority=0, max_tokens=1, first=60))
    out, _ = run_step(s)
    assert list(out.num_scheduled_tokens) == ["low"]


def test_preemption_victim_is_least_urgent_then_latest() -> None:
    s = make_scheduler(
        num_blocks=6, block_size=4, budget=64, prefix_caching=False, scheduling_policy="priority"
    )
    s.add_request(req("urgent-late", 4, arrival=2.0, priority=0, max_tokens=20))
    s.add_request(req("lax-early", 4, arrival=0.0, priority=3, max_tokens=20, first=30))
    s.add_request(req("lax-late", 4, arrival=1.0, priority=3, max_tokens=20, first=50))
    run_step(s)
    while s.num_preemptions_total == 0:
        run_step(s)
    assert [r.request_id for r in s.waiting] == ["lax-late"]
    assert {r.request_id for r in s.running} == {"urgent-late", "lax-early"}


def test_static_batching_waits_then_admits_nothing_until_done() -> None:
    clock = ManualClock()
    s = make_scheduler(max_num_seqs=4, batching="static", batch_wait_timeout_s=0.5, clock=clock)
    s.add_request(req("a", 4, max_tokens=3))
    out = s.schedule()
    assert out.num_scheduled_tokens == {}  # the batch is still forming
    clock.now = 0.6
    s.add_request(req("b", 4, max_tokens=3, first=30))
    out, _ = run_step(s)
    assert sorted(out.num_scheduled_tokens) == ["a", "b"]
    s.add_request(req("c", 4, max_tokens=3, first=50))
    clock.now = 5.0
    for _ in range(2):
        out, _ = run_step(s)
        assert "c" not in out.num_scheduled_tokens  # nobody joins a running batch
    assert not s.running
    out, _ = run_step(s)
    assert list(out.num_scheduled_tokens) == ["c"]


def test_static_batch_opens_at_once_when_full() -> None:
    s = make_scheduler(max_num_seqs=2, batching="static", batch_wait_timeout_s=100.0)
    s.add_request(req("a", 4))
    s.add_request(req("b", 4, first=30))
    s.add_request(req("c", 4, first=50))
    out, _ = run_step(s)
    assert sorted(out.num_scheduled_tokens) == ["a", "b"]


def test_queue_limit_refuses_with_overloaded() -> None:
    s = make_scheduler(max_waiting_requests=2)
    assert s.add_request(req("a", 4)) is None
    assert s.add_request(req("b", 4)) is None
    refused = s.add_request(req("c", 4))
    assert refused is not None and refused.error_kind == ErrorKind.OVERLOADED
    assert "2 waiting" in (refused.error or "")
    assert "c" not in s.requests
