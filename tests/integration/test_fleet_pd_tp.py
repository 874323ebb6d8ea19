"""Prefill and decode instances of different tensor-parallel sizes: a pull re-shards the
KV heads as the in-engine hand-off does (the prefill instance's rank 0 gathers every
head and sends each decode rank its own), and the decode instance still computes only
each prompt's last partial block. Legs sent as vllm-router sends them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.test_fleet_pd import BLOCK, metric, prompts
from tests.parity.ties import LogprobsFn, assert_greedy_parity, our_logprobs_fn
from tests.stack import TandemStack, free_port, started_together

MODEL = "smollm2-135m-instruct"
MAX_TOKENS = 10


def instance(role: str, tp: int) -> TandemStack:
    transfer: dict[str, Any] = {"kv_role": role}
    if role == "kv_producer":
        transfer["kv_port"] = free_port()
    flags = ["--dtype", "float32", "--worker-threads", "1", "--kv-cache-gb", "0.2"]
    return TandemStack(
        *flags, "--tensor-parallel-size", str(tp), "--kv-transfer-config", json.dumps(transfer)
    )


@pytest.fixture(scope="module")
def instances(smollm2_dir: Path) -> Iterator[dict[str, TandemStack]]:
    stacks = {
        "p_tp2": instance("kv_producer", 2),
        "d_tp1": instance("kv_consumer", 1),
        "p_tp1": instance("kv_producer", 1),
        "d_tp2": instance("kv_consumer", 2),
    }
    with started_together(stacks):
        yield stacks


def complete(stack: TandemStack, prompt: list[int], **extra: Any) -> dict[str, Any]:
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "return_token_ids": True,
        **extra,
    }
    r = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    reply: dict[str, Any] = r.json()
    return reply


@pytest.mark.parametrize("pair", [("p_tp2", "d_tp1"), ("p_tp1", "d_tp2")], ids=["2to1", "1to2"])
def test_a_pull_between_tensor_parallel_sizes_reshards_and_keeps_the_tokens(
    instances: dict[str, TandemStack], pair: tuple[str, str], smollm2_dir: Path
) -> None:
    producer, consumer = (instances[name] for name in pair)
    fn: LogprobsFn = our_logprobs_fn(smollm2_dir)
    batch = [p for p in prompts() if 100 <= len(p) <= 700][:2]
    computed_before = metric(consumer.url, "prefix_cache_queries_total") - metric(
        consumer.url, "prefix_cache_hits_total"
    )
    for prompt in batch:
        reference = complete(instances["p_tp1"], prompt)["choices"][0]["token_ids"]
        first = complete(
            producer, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True}
        )
        params = first["kv_transfer_params"]
        assert params["tp_size"] == (2 if pair[0] == "p_tp2" else 1)
        ours = complete(consumer, prompt, kv_transfer_params=params)["choices"][0]["token_ids"]
        assert_greedy_parity(prompt, ours, reference, fn, fn)
    computed = (
        metric(consumer.url, "prefix_cache_queries_total")
        - metric(consumer.url, "prefix_cache_hits_total")
        - computed_before
    )
    assert computed == sum(len(p) - BLOCK * ((len(p) - 1) // BLOCK) for p in batch)
    assert metric(consumer.url, "kv_transfers_total", 'outcome="done"') >= len(batch)
    assert metric(producer.url, "kv_cache_usage_perc") == 0.0
    assert metric(consumer.url, "kv_cache_usage_perc") == 0.0
