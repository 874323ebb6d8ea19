"""Faults of a split fleet, with real instances (``tandem serve --kv-transfer-config``)
talking as vllm-router makes them talk: the prefill leg's answer carries the
``kv_transfer_params`` the decode leg sends. Forged or malformed params are a 400 naming
the field and read nothing; a prefill instance killed between its answer and the pull
leaves the decode side's policy to act within a second; a decode instance killed before
it pulls lets the prefill lease expire and its blocks come back."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.test_fleet_pd import metric
from tests.stack import TandemStack, free_port, started_together

MODEL = "smollm2-135m-instruct"
KEYS = ("alice-key", "mallory-key")
PROMPT = "Describe, in careful detail, how a lighthouse lens focuses light across the sea. " * 4


def instance(role: str, **transfer: Any) -> TandemStack:
    config = json.dumps({"kv_role": role, **transfer})
    flags = ["--dtype", "float32", "--worker-threads", "1", "--kv-cache-gb", "0.2"]
    keys = [a for k in KEYS for a in ("--api-key", k)]
    return TandemStack(*flags, *keys, "--kv-transfer-config", config)


@pytest.fixture(scope="module")
def instances(smollm2_dir: Path) -> Iterator[dict[str, TandemStack]]:
    stacks = {
        "p1": instance("kv_producer", kv_port=free_port()),
        "p2": instance(
            "kv_producer", kv_port=free_port(), kv_connector_extra_config={"lease_s": 2.0}
        ),
        "d_recompute": instance("kv_consumer"),
        "d_fail": instance("kv_consumer", kv_load_failure_policy="fail"),
        "p_drain": instance("kv_producer", kv_port=free_port()),
    }
    with started_together(stacks):
        yield stacks


def post(stack: TandemStack, body: dict[str, Any], key: str = KEYS[0]) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"}
    full = {"model": MODEL, "prompt": PROMPT, "temperature": 0, **body}
    return httpx.post(f"{stack.url}/v1/completions", json=full, headers=headers, timeout=120)


def prefill_leg(stack: TandemStack, key: str = KEYS[0], prompt: str = PROMPT) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    r = post(stack, body, key)
    assert r.status_code == 200, r.text
    params: dict[str, Any] = r.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] and params["remote_block_ids"]
    return params


def decode_leg(
    stack: TandemStack, params: dict[str, Any], key: str = KEYS[0], prompt: str = PROMPT
) -> httpx.Response:
    return post(stack, {"prompt": prompt, "max_tokens": 8, "kv_transfer_params": params}, key)


def usage(url: str) -> float:
    return metric(url, "kv_cache_usage_perc")


def outcome(url: str, name: str, expected: float, timeout_s: float = 5.0) -> float:
    """The outcome's count once it reaches ``expected`` (the figures come with the
    engine's heartbeat, five times a second), or what it is at the deadline."""
    deadline = time.monotonic() + timeout_s
    while (found := metric(url, "kv_transfers_total", f'outcome="{name}"')) < expected:
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    return found


def test_forged_or_malformed_params_are_a_400_naming_the_field(
    instances: dict[str, TandemStack],
) -> None:
    p1, d = instances["p1"], instances["d_recompute"]
    params = prefill_leg(p1)
    forged = [
        ({**params, "remote_engine_id": "someone-else"}, KEYS[0], "remote_engine_id"),
        (
            {**params, "remote_block_ids": [*params["remote_block_ids"][::-1], 999]},
            KEYS[0],
            "remote_block_ids",
        ),
        (params, KEYS[1], "remote_request_id"),  # another API key's lease
        ({**params, "remote_port": "x"}, KEYS[0], "remote_port"),
        ({**params, "remote_host": None}, KEYS[0], "remote_host"),
    ]
    for bad, key, field in forged:
        r = decode_leg(d, bad, key)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == f"kv_transfer_params.{field}", r.text
    other_prompt = post(
        d,
        {"prompt": "Another prompt entirely. " * 8, "max_tokens": 2, "kv_transfer_params": params},
    )
    assert other_prompt.status_code == 400
    assert other_prompt.json()["error"]["param"] == "kv_transfer_params.remote_request_id"
    streamed = post(
        p1, {"max_tokens": 1, "stream": True, "kv_transfer_params": {"do_remote_decode": True}}
    )
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "stream"
    wrong_role = decode_leg(p1, params)
    assert wrong_role.status_code == 400
    assert wrong_role.json()["error"]["param"] == "kv_transfer_params.do_remote_prefill"
    # Nothing was read: the lease is still whole for the request it was made for.
    assert metric(p1.url, "kv_transfers_total", 'outcome="lease_pulled"') == 0
    r = decode_leg(d, params)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert outcome(p1.url, "lease_pulled", 1) == 1
    assert outcome(p1.url, "pull_refused", 4) == 4
    assert usage(p1.url) == 0.0 and usage(d.url) == 0.0


def test_a_prefill_instance_killed_before_the_pull_leaves_the_policy_within_a_second(
    instances: dict[str, TandemStack],
) -> None:
    p1 = instances["p1"]
    prompt = "A different question: how do tides depend on the moon and the sun? " * 4
    params = [prefill_leg(p1, prompt=prompt), prefill_leg(p1, prompt=prompt)]
    reference = post(p1, {"prompt": prompt, "max_tokens": 8}).json()["choices"][0]["text"]
    p1.stop(signal.SIGKILL)
    for name, param in zip(("d_recompute", "d_fail"), params, strict=True):
        d = instances[name]  # neither has the prompt cached: both must pull
        started = time.monotonic()
        r = decode_leg(d, param, prompt=prompt)
        elapsed = time.monotonic() - started
        assert elapsed < 3.0, f"{name}: {elapsed:.1f} s"  # ack timeout 0.5 s, then the policy
        if name == "d_recompute":
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == reference  # computed here instead
        else:
            assert r.status_code == 503, r.text
            assert "KV pull" in r.json()["error"]["message"]
        assert outcome(d.url, "expired", 1) == 1
        assert usage(d.url) == 0.0


def test_a_decode_instance_killed_before_the_pull_lets_the_lease_expire(
    instances: dict[str, TandemStack],
) -> None:
    p2, d = instances["p2"], instances["d_recompute"]
    prefill_leg(p2)
    assert usage(p2.url) > 0.0  # the lease holds the prompt's full blocks
    d.stop(signal.SIGKILL)  # it will never pull
    assert outcome(p2.url, "lease_expired", 1, timeout_s=10) == 1, "the lease (2 s) did not expire"
    assert usage(p2.url) == 0.0


def test_a_draining_prefill_instance_waits_for_its_leases_to_be_pulled(
    instances: dict[str, TandemStack],
) -> None:
    producer, d = instances["p_drain"], instances["d_fail"]
    prompt = "While it drains, a prompt it answered is still pulled. " * 5
    params = prefill_leg(producer, prompt=prompt)
    assert producer.proc is not None
    producer.proc.send_signal(signal.SIGTERM)  # drain: no new requests, leases kept
    time.sleep(1.0)
    assert producer.proc.poll() is None  # it waits for the lease
    done_before = outcome(d.url, "done", 0)
    r = decode_leg(d, params, prompt=prompt)  # fail policy: a lost lease would be a 503
    assert r.status_code == 200, r.text
    assert outcome(d.url, "done", done_before + 1) == done_before + 1
    assert producer.proc.wait(timeout=20) == 0  # then it exits, cleanly
