"""A split fleet as a user starts one: ``tandem fleet --prefill 2 --decode 2`` (prefill
instances lending KV, decode instances pulling it over the TCP KV stream) behind the real
vllm-router in its ``--vllm-pd-disaggregation`` mode. Its greedy tokens are one unified
instance's; its decode instances compute no prompt token beyond each prompt's last
partial block (their prefix-cache counters); and nothing stays held afterwards."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.parity.ties import LogprobsFn, assert_greedy_parity, our_logprobs_fn
from tests.stack import TandemStack, free_port_range, greedy_token_ids

MODEL = "smollm2-135m-instruct"
BLOCK = 16
LENGTHS = [5, 17, 40, 64, 100, 160, 250, 333, 480, 640, 800, 1000, 1250, 1500, 1750, 2000]
MAX_TOKENS = 12
COMMON = ("--dtype", "float32", "--worker-threads", "1", "--kv-cache-gb", "0.5")
TEXT = (
    "The lighthouse keeper climbed the spiral stairs each evening at dusk, counting the "
    "steps aloud. Ships passed far out on the grey water, and gulls argued over the rocks. "
    "In the village below, the baker lit his ovens long before dawn, and the smell of bread "
    "drifted up the hill. Winter storms came from the north; summer brought fog and "
    "tourists. {n} "
)


def prompts() -> list[list[int]]:
    from transformers import AutoTokenizer

    from common.model_files import resolve_model_dir

    tok = AutoTokenizer.from_pretrained(str(resolve_model_dir(MODEL)))
    ids: list[int] = tok.encode("".join(TEXT.format(n=n) for n in range(60)))
    assert len(ids) > 2 * max(LENGTHS)
    # Each prompt starts somewhere else, so none is another's prefix.
    return [ids[7 * i : 7 * i + n] for i, n in enumerate(LENGTHS)]


def run_all(url: str, batch: list[list[int]]) -> list[list[int]]:
    return greedy_token_ids(url, batch, MAX_TOKENS)


def metric(url: str, name: str, labels: str = "") -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    prefix = f"tandem:{name}{{"
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(prefix) and labels in line
    )


@pytest.fixture(scope="module")
def fleet(smollm2_dir: Path) -> Iterator[tuple[TandemStack, list[str], list[str]]]:
    base, events, side = free_port_range(4), free_port_range(8), free_port_range(2)
    stack = TandemStack(
        "--prefill",
        "2",
        "--decode",
        "2",
        "--policy",
        "round_robin",
        "--instance-base-port",
        str(base),
        "--kv-events-base-port",
        str(events),
        "--kv-side-channel-base-port",
        str(side),
        *COMMON,
        command="fleet",
    )
    urls = [f"http://127.0.0.1:{base + i}" for i in range(4)]
    with stack:
        yield stack, urls[:2], urls[2:]


@pytest.fixture(scope="module")
def reference(smollm2_dir: Path) -> Iterator[list[list[int]]]:
    with TandemStack(*COMMON) as stack:
        yield run_all(stack.url, prompts())


@pytest.fixture(scope="module")
def logprobs_fn(smollm2_dir: Path) -> LogprobsFn:
    return our_logprobs_fn(smollm2_dir)


def test_2p2d_gives_one_instances_greedy_tokens_and_decodes_compute_only_the_tails(
    fleet: tuple[TandemStack, list[str], list[str]],
    reference: list[list[int]],
    logprobs_fn: LogprobsFn,
) -> None:
    router, prefills, decodes = fleet
    batch = prompts()
    outputs = run_all(router.url, batch)
    for prompt, ours, ref in zip(batch, outputs, reference, strict=True):
        assert len(ours) == MAX_TOKENS
        assert_greedy_parity(prompt, ours, ref, logprobs_fn, logprobs_fn)
    # Both roles' instances took part (round robin over each role).
    assert all(metric(u, "request_success_total") > 0 for u in prefills + decodes)
    # Prompt tokens the decode instances computed: only each prompt's last partial block
    # (the block holding the last token is always computed, to sample from its logits).
    computed = sum(
        metric(u, "prefix_cache_queries_total") - metric(u, "prefix_cache_hits_total")
        for u in decodes
    )
    assert computed == sum(n - BLOCK * ((n - 1) // BLOCK) for n in LENGTHS)
    with_full_blocks = sum(1 for n in LENGTHS if n > BLOCK)
    pulled = sum(metric(u, "kv_transfers_total", 'outcome="done"') for u in decodes)
    local = sum(metric(u, "kv_transfers_total", 'outcome="local_prefill"') for u in decodes)
    assert (pulled, local) == (with_full_blocks, len(LENGTHS) - with_full_blocks)
    lent = sum(metric(u, "kv_transfers_total", 'outcome="lease_pulled"') for u in prefills)
    assert lent == with_full_blocks
    assert sum(metric(u, "kv_transfer_bytes_total") for u in decodes) > 0
    # Nothing held: every lease ended, every pulled block given back.
    for url in prefills + decodes:
        assert metric(url, "kv_cache_usage_perc") == 0.0, url
