"""The engine's side of LoRA: the flags, the registry every API server mirrors, the
``--max-loras`` slots, the scheduler that never runs more adapters in a step than are
resident, and the prefix cache keyed by adapter."""

from __future__ import annotations

import pytest

from common.cli_args import parse_config
from common.config import ModelConfig, SchedulerConfig
from common.lora_config import LoRAModule, parse_lora_module
from common.messages import LoRARequest, ModelInfo, ModelRunnerOutput, SamplingParams
from engine_core.kv_cache import KVCacheManager
from engine_core.lora_registry import LoRARegistry
from engine_core.lora_slots import LoRASlots
from engine_core.request import Request
from engine_core.scheduler import Scheduler
from tests.unit.clock import ManualClock

A, B, C = (LoRARequest(name, i, f"/adapters/{name}") for i, name in enumerate("abc", 1))


def test_lora_modules_take_both_of_vllms_forms() -> None:
    assert parse_lora_module("sql=/a/sql") == LoRAModule("sql", "/a/sql")
    assert parse_lora_module('{"name": "x", "path": "/p", "base_model_name": "m"}') == (
        LoRAModule("x", "/p", "m")
    )
    for bad, why in (
        ("sql", "name=path"),
        ("=/a", "name=path"),
        ('{"name": "x"}', "'name' and 'path'"),
        ('{"name": "x", "path": "/p", "rank": 2}', "unknown field rank"),
        ("{nope", "not JSON"),
    ):
        with pytest.raises(ValueError, match=why):
            parse_lora_module(bad)


def test_the_flags_round_trip_and_are_checked() -> None:
    modules = ["--lora-modules", "a=/x", '{"name": "b", "path": "/y"}']
    limits = ["--max-loras", "2", "--max-cpu-loras", "3", "--max-lora-rank", "8"]
    config = parse_config(["--enable-lora", *modules, *limits])
    m = config.model
    assert [a.name for a in m.lora_adapters] == ["a", "b"]
    assert (m.max_loras, m.max_lora_rank, m.worker_lora_capacity, m.step_max_loras) == (2, 8, 3, 2)
    assert parse_config(config.to_cli_args()) == config
    assert parse_config([]).model.step_max_loras == 0  # LoRA off
    for flags, why in (
        ({"lora_modules": ("a=/x",)}, "needs --enable-lora"),
        ({"enable_lora": True, "lora_modules": ("a=/x", "a=/y")}, "twice"),
        ({"enable_lora": True, "max_loras": 4, "max_cpu_loras": 2}, "at least --max-loras"),
        ({"enable_lora": True, "max_loras": 0}, "at least 1"),
        ({"enable_lora": True, "max_lora_rank": 0}, "--max-lora-rank"),
    ):
        with pytest.raises(ValueError, match=why):
            ModelConfig(**flags)


def test_the_registry_gives_each_load_a_new_id_and_the_first_load_wins() -> None:
    registry = LoRARegistry([LoRAModule("a", "/x")])
    assert registry.adapters == [LoRARequest("a", 1, "/x")]
    assert registry.load("a", "/other") is None  # taken: kept as it is
    assert registry.load("b", "/y") == LoRARequest("b", 2, "/y")
    assert registry.unload("a") and not registry.unload("a")
    assert registry.load("a", "/z") == LoRARequest("a", 3, "/z")  # a new load, a new id
    assert [r.name for r in registry.adapters] == ["b", "a"]


def test_slots_swap_out_only_an_adapter_nothing_runs_on() -> None:
    slots = LoRASlots(2)
    assert slots.admit(None, [A, B])  # the base model never waits
    assert slots.admit(A, []) and slots.admit(B, [A])
    assert slots.num_swaps_total == 2
    assert not slots.admit(C, [A, B])  # both slots busy
    assert slots.admit(A, [A, B])  # resident: free, and now the most recent
    assert slots.admit(C, [A, None])  # B is idle: swapped out
    assert slots.resident == ["a", "c"] and slots.num_swaps_total == 3


def _scheduler(max_loras: int, prefix_caching: bool = True) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
        KVCacheManager(64, 4, prefix_caching),
        ModelInfo(max_model_len=256, vocab_size=100, eos_token_ids=[2]),
        clock=ManualClock(),
        max_loras=max_loras,
    )


def _request(rid: str, lora: LoRARequest | None, prompt: list[int] | None = None) -> Request:
    params = SamplingParams(max_tokens=3, temperature=0.0)
    return Request(rid, b"c", prompt or list(range(10, 18)), params, 0.0, lora=lora)


def _finish_step(s: Scheduler) -> dict[str, str | None]:
    """One step, every request sampling a token; the adapter of each scheduled one."""
    out = s.schedule()
    ids = list(out.num_scheduled_tokens)
    loras = {r: (lora.name if (lora := s.requests[r].lora) else None) for r in ids}
    s.update_from_output(out, ModelRunnerOutput(out.step_id, ids, [50] * len(ids)))
    return loras


def test_a_step_never_runs_more_adapters_than_max_loras() -> None:
    s = _scheduler(max_loras=2)
    for rid, lora in (("a1", A), ("b1", B), ("c1", C), ("base", None), ("a2", A), ("c2", C)):
        s.add_request(_request(rid, lora))
    first = s.schedule()
    # a1 and b1 take the two slots; c1 and c2 wait, the requests behind them go first (as
    # vLLM): the base model's and a2 (its adapter is resident).
    assert list(first.num_scheduled_tokens) == ["a1", "b1", "base", "a2"]
    assert [d.lora for d in first.new_requests] == [A, B, None, A]
    assert [r.request_id for r in s.waiting] == ["c1", "c2"]  # in their order
    ids = list(first.num_scheduled_tokens)
    s.update_from_output(first, ModelRunnerOutput(first.step_id, ids, [50] * len(ids)))
    assert s.stats().lora_running == {"a": 2, "b": 1}
    assert s.stats().lora_waiting == {"c": 2}
    seen: set[str] = set()
    for _ in range(12):
        scheduled = _finish_step(s)
        assert len({name for name in scheduled.values() if name}) <= 2
        seen |= set(scheduled)
        if not s.has_work():
            break
    assert {"c1", "c2"} <= seen and not s.has_work()  # everyone served
    # a, b; then c in the place of b (the least recently used: a2's admission used a).
    assert s.stats().lora_swaps_total == 3 and s.stats().max_loras == 2


def test_two_adapters_never_share_a_cached_prefix() -> None:
    s = _scheduler(max_loras=2)
    prompt = list(range(10, 22))  # three full blocks of 4
    requests = [_request(rid, lora, prompt) for rid, lora in
                (("a", A), ("a-again", A), ("b", B), ("base", None))]  # fmt: skip
    for request in requests:
        s.add_request(request)
        while s.has_work():
            _finish_step(s)
    cached = {r.request_id: r.num_cached_tokens for r in requests}
    assert cached == {"a": 0, "a-again": 8, "b": 0, "base": 0}
