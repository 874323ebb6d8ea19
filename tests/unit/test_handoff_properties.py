"""Property test over two pools: random arrivals, aborts, slow steps, transfer delays,
failures and expired leases. Whatever happens, no KV block of either pool leaks or is
freed twice, every request ends exactly once, and every hand-off is counted once."""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from common.config import CacheConfig, SchedulerConfig, TandemConfig
from common.messages import EngineRequest, PoolRole, RequestOutput, SamplingParams
from common.pool_config import DisaggConfig
from engine_core.core import EngineCore
from engine_core.kv_cache import KVCacheManager
from tests.unit.clock import ManualClock
from tests.unit.fake_pools import BLOCK, FakePool


def check_blocks(kv: KVCacheManager) -> None:
    refs = Counter(b for blocks in kv.req_to_blocks.values() for b in blocks)
    assert [refs.get(b, 0) for b in range(kv.num_blocks)] == kv.ref_counts
    assert sorted(kv.free_queue) == [b for b in range(kv.num_blocks) if kv.ref_counts[b] == 0]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_traffic_over_two_pools(data: st.DataObject) -> None:
    kv_transfer = data.draw(st.sampled_from(["shm", "tcp"]), label="kv_transfer")
    policy = data.draw(st.sampled_from(["fail", "recompute"]), label="policy")
    async_scheduling = data.draw(st.booleans(), label="async_scheduling")
    depth = 2 if async_scheduling else 1
    config = TandemConfig(
        cache=CacheConfig(block_size=BLOCK, num_kv_blocks=16),
        scheduler=SchedulerConfig(
            max_num_seqs=data.draw(st.integers(1, 4), label="max_num_seqs"),
            max_num_batched_tokens=data.draw(st.integers(4, 32), label="budget"),
            async_scheduling=async_scheduling,
        ),
        disagg=DisaggConfig(
            prefill_workers=1,
            decode_workers=1,
            kv_transfer=kv_transfer,  # type: ignore[arg-type]
            kv_load_failure_policy=policy,  # type: ignore[arg-type]
            kv_transfer_lease_s=5.0,
            disagg_min_prompt_tokens=data.draw(st.sampled_from([0, 6]), label="min_prompt"),
        ),
    )
    blocks = data.draw(st.integers(6, 16), label="blocks")
    prefill = FakePool(PoolRole.PREFILL, blocks, data.draw(st.integers(1, 4)), max_in_flight=depth)
    decode = FakePool(
        PoolRole.DECODE,
        blocks if kv_transfer == "shm" else data.draw(st.integers(6, 16)),
        data.draw(st.integers(1, 3)),
        data.draw(st.integers(1, 6), label="land_polls"),
        max_in_flight=depth,
    )
    clock = ManualClock()
    core = EngineCore(config, {PoolRole.PREFILL: prefill, PoolRole.DECODE: decode}, clock)
    core.start()
    ends: Counter[str] = Counter()
    after_end: list[RequestOutput] = []
    sent: list[str] = []

    def record(outputs: dict[bytes, list[RequestOutput]]) -> None:
        for out in outputs.get(b"c", []):
            if ends[out.request_id]:
                after_end.append(out)
            if out.finish_reason is not None:
                ends[out.request_id] += 1

    for i in range(data.draw(st.integers(1, 40), label="actions")):
        action = data.draw(
            st.sampled_from(["add", "add", "step", "step", "step", "abort", "fail", "time"])
        )
        if action == "add":
            rid = f"r{i}"
            prompt_len = data.draw(st.integers(1, 3 * BLOCK + 1))
            prompt = [1 + (j * 7 + i) % 50 for j in range(prompt_len)]
            params = SamplingParams(max_tokens=data.draw(st.integers(1, 6)), temperature=0)
            record(core.add_request(EngineRequest(rid, b"c", prompt, params, 0.0)))
            sent.append(rid)
        elif action == "abort" and sent:
            record(core.abort([data.draw(st.sampled_from(sent))]))
        elif action == "fail" and sent:
            decode.fail_transfers.add(f"{data.draw(st.sampled_from(sent))}#0")
        elif action == "time":
            clock.now += data.draw(st.sampled_from([1.0, 6.0]))
        else:
            for _ in range(data.draw(st.integers(1, 5))):
                record(core.step().outputs)
        for slot in core.slots.values():
            check_blocks(slot.scheduler.kv)
    record(core.abort(list(sent)))
    for _ in range(500):
        if not core.has_work() and not prefill.busy and not decode.busy:
            break
        record(core.step().outputs)
    assert not core.has_work()
    for slot in core.slots.values():
        kv = slot.scheduler.kv
        check_blocks(kv)
        assert kv.num_free_blocks == kv.num_blocks, f"{slot.role} leaked blocks"
    assert all(ends[rid] == 1 for rid in sent), ends  # every request ended, exactly once
    assert not after_end
    stats = core.transfer_stats()
    assert stats is not None
    event(f"outcomes: {sorted(k for k, v in stats.outcomes.items() if v)}")
