"""Property tests: whatever arrives, finishes, aborts or gets preempted, the scheduler
keeps its limits, never leaks or double-frees a block, and ends every request once."""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from common.config import SchedulerConfig
from common.messages import ModelInfo, ModelRunnerOutput, SamplingParams
from engine_core.kv_cache import KVCacheManager
from engine_core.request import Request
from engine_core.scheduler import Scheduler

EOS = 0
BLOCK = 4
# Short windows over a 16-token vocabulary: drafts are frequent.
SPECULATIVE = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}'


def check_block_accounting(s: Scheduler) -> None:
    kv = s.kv
    refs = Counter(b for blocks in kv.req_to_blocks.values() for b in blocks)
    for blocks in kv.req_to_blocks.values():
        assert len(set(blocks)) == len(blocks), "a request holds a block twice"
    assert [refs.get(b, 0) for b in range(kv.num_blocks)] == kv.ref_counts
    assert sorted(kv.free_queue) == [b for b in range(kv.num_blocks) if kv.ref_counts[b] == 0]
    assert set(kv.req_to_blocks) <= {r.request_id for r in s.running}
    for r in s.running:
        assert len(kv.blocks_of(r.request_id)) >= kv.num_blocks_for(r.num_computed_tokens)
    for block_hash, block in kv.cached_blocks.items():
        assert kv.block_hashes[block] == block_hash


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_traffic_keeps_every_invariant(data: st.DataObject) -> None:
    budget = data.draw(st.integers(1, 48), label="budget")
    max_seqs = data.draw(st.integers(1, 6), label="max_num_seqs")
    config = SchedulerConfig(
        max_num_seqs=max_seqs,
        max_num_batched_tokens=budget,
        long_prefill_token_threshold=data.draw(st.sampled_from([0, 3, 16])),
        scheduling_policy=data.draw(st.sampled_from(["fcfs", "priority"])),
        batching=data.draw(st.sampled_from(["continuous", "continuous", "static"])),
        batch_wait_timeout_s=0.0,
        max_waiting_requests=50,
        speculative_config=data.draw(st.sampled_from([None, SPECULATIVE]), label="speculative"),
    )
    num_blocks = data.draw(st.integers(10, 24), label="num_blocks")
    kv = KVCacheManager(num_blocks, BLOCK, data.draw(st.booleans(), label="prefix_caching"))
    s = Scheduler(config, kv, ModelInfo(max_model_len=64, vocab_size=8, eos_token_ids=[EOS]))
    prefixes = [[1, 2, 3, 4, 5, 6, 7, 1], [7, 6, 5, 4, 3, 2, 1, 7]]
    ends: Counter[str] = Counter()
    accepted: set[str] = set()

    def record(outputs: dict[bytes, list]) -> None:
        for outs in outputs.values():
            for o in outs:
                if o.finish_reason is not None:
                    ends[o.request_id] += 1

    for i in range(data.draw(st.integers(1, 60), label="num_ops")):
        op = data.draw(st.sampled_from(["add", "add", "step", "step", "step", "abort"]))
        if op == "add":
            prefix = data.draw(st.sampled_from([[], *prefixes]))
            tail = data.draw(st.lists(st.integers(1, 7), min_size=1, max_size=30))
            params = SamplingParams(max_tokens=data.draw(st.integers(1, 30)), temperature=0.0)
            rid = f"r{i}"
            refused = s.add_request(
                Request(rid, b"c", prefix + tail, params, float(i), data.draw(st.integers(0, 3)))
            )
            if refused is None:
                accepted.add(rid)
        elif op == "abort" and accepted:
            rid = data.draw(st.sampled_from(sorted(accepted)))
            record(s.abort_requests([rid]))
        elif op == "step" and s.has_work():
            step(s, data, budget, max_seqs, record)
        check_block_accounting(s)

    event(f"preempted: {min(s.num_preemptions_total, 3)}")
    event(f"drafts verified: {min(s.speculation.counters.num_drafts, 3)}")
    event(f"prefix hits: {s.kv.prefix_hits > 0}")
    record(s.abort_requests([r for r in accepted if r in s.requests]))
    while s.has_work():
        step(s, data, budget, max_seqs, record)
    check_block_accounting(s)
    assert kv.num_used_blocks == 0 and not s.requests and not s.running and not len(s.waiting)
    assert set(ends) == accepted and set(ends.values()) <= {1}, (
        f"requests not ended exactly once: {ends}"
    )


def step(s: Scheduler, data: st.DataObject, budget: int, max_seqs: int, record: object) -> None:
    out = s.schedule()
    assert out.total_num_scheduled_tokens <= max(budget, 0) or not s.config.enable_chunked_prefill
    assert len(out.num_scheduled_tokens) <= max_seqs and len(s.running) <= max_seqs
    ids, tokens, accepted = [], [], {}
    for rid, n in out.num_scheduled_tokens.items():
        r = s.requests[rid]
        drafts = out.draft_token_ids.get(rid, [])
        assert n >= 1 and r.num_computed_tokens + n - len(drafts) <= r.num_tokens
        assert not drafts or r.num_computed_tokens + n - len(drafts) == r.num_tokens
        assert len(s.kv.blocks_of(rid)) * BLOCK >= r.num_computed_tokens + n
        if r.num_computed_tokens + n - len(drafts) == r.num_tokens:
            ids.append(rid)
            tokens.append(data.draw(st.integers(0, 15)))  # 0 is EOS
            if drafts:
                accepted[rid] = data.draw(st.integers(0, len(drafts)))
    result = ModelRunnerOutput(out.step_id, ids, tokens, num_accepted_drafts=accepted)
    record(s.update_from_output(out, result))  # type: ignore[operator]
