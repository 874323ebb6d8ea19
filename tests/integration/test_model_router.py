"""Several base models behind one ``tandem serve`` (``--model A --model B``): each request
is routed by its ``model`` to that model's own service, whose greedy tokens equal
transformers'; with ``--models-max 1`` alternating and concurrent requests swap the models
in and out and every one completes. The embedded models' case (both loaded, concurrent
streams equal to each served alone and to transformers) is
tests/parity/test_real_models_http.py's (slow)."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.integration.test_fleet import metric
from tests.parity.families import build_servable
from tests.parity.ties import assert_greedy_parity, our_logprobs_fn
from tests.stack import TandemStack

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> list[Path]:
    """Two tiny random models of different families, each in a folder of its name."""
    root = tmp_path_factory.mktemp("models")
    return [build_servable(f, root / f"tiny-{f}", smollm2_dir) for f in ("llama", "qwen3")]


def prompt(i: int) -> list[int]:
    return [(53 * i + 17 * k) % 3000 + 200 for k in range(10)]


class Reference:
    """transformers' greedy tokens and next-token logprobs, and Tandem's own model's
    logprobs (for ties), per checkpoint."""

    def __init__(self, checkpoint: Path) -> None:
        self.model: Any = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
        self.model.eval()
        self.ours = our_logprobs_fn(checkpoint)

    @torch.inference_mode()
    def greedy(self, ids: list[int]) -> list[int]:
        out = self.model.generate(
            torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None
        )
        return [int(t) for t in out[0, len(ids) :]]

    @torch.inference_mode()
    def logprobs(self, ids: list[int]) -> torch.Tensor:
        return torch.log_softmax(self.model(torch.tensor([ids])).logits[0, -1], -1)

    def check(self, ids: list[int], answer: dict[str, Any]) -> None:
        ours = answer["choices"][0]["token_ids"]
        assert_greedy_parity(ids, ours, self.greedy(ids), self.ours, self.logprobs)


AUTH = {"Authorization": "Bearer k1"}


async def greedy(client: httpx.AsyncClient, model: str, ids: list[int]) -> dict[str, Any]:
    body = {"model": model, "prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0}
    body |= {"ignore_eos": True, "return_token_ids": True}
    r = await client.post("/v1/completions", json=body, headers=AUTH)
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_models_max_1_swaps_the_models_and_every_request_completes_with_their_tokens(
    checkpoints: list[Path], tmp_path: Path
) -> None:
    names = [c.name for c in checkpoints]
    audit_log = tmp_path / "audit.jsonl"  # the router's lines and each service's, one file
    flags = [a for c in checkpoints for a in ("--model", str(c))]
    flags += ["--models-max", "1", "--dtype", "float32", "--api-key", "k1"]
    flags += ["--audit-log", str(audit_log)]
    with TandemStack(*flags) as stack:
        models = httpx.get(f"{stack.url}/v1/models", headers=AUTH, timeout=10).json()["data"]
        assert [(m["id"], m["status"]["value"]) for m in models] == [
            (names[0], "loaded"),
            (names[1], "unloaded"),
        ]
        refused_without_loading(stack, names)
        order = [0, 1, 0, 1]  # one after another: each request swaps the model in
        jobs = [*((m, prompt(i)) for i, m in enumerate(order))]
        jobs += [(i % 2, prompt(10 + i)) for i in range(6)]

        async def run() -> list[dict[str, Any]]:
            async with httpx.AsyncClient(base_url=stack.url, timeout=300) as client:
                alternating = [await greedy(client, names[m], ids) for m, ids in jobs[:4]]
                # all at once: those of one model wait while the other's run, none fails
                together = await asyncio.gather(
                    *(greedy(client, names[m], ids) for m, ids in jobs[4:])
                )
                return [*alternating, *together]

        answers = asyncio.run(run())
        references = [Reference(c) for c in checkpoints]
        for (m, ids), answer in zip(jobs, answers, strict=True):
            assert answer["model"] == names[m]
            references[m].check(ids, answer)
        text = httpx.get(f"{stack.url}/metrics", timeout=10).text
        loads = [_series(text, "tandem:model_loads_total", n) for n in names]
        unloads = [_series(text, "tandem:model_unloads_total", n) for n in names]
        assert loads[0] >= 3 and loads[1] >= 2, loads  # loaded at start, then once per swap
        assert sum(unloads) == sum(loads) - 1, (loads, unloads)  # one loaded at a time
        assert metric(stack.url, "tandem:model_loaded") == 1.0
        # SIGTERM drains the router and each model's service; nothing is left behind
        assert stack.stop() == 0
    # One audit line per request: the router's for those it refused itself, the serving
    # model's service's for those it passed on (never both).
    lines = [json.loads(line) for line in audit_log.read_text().splitlines()]
    assert Counter((line["route"], line["status"]) for line in lines) == {
        ("/v1/completions", 404): 1,
        ("/v1/messages", 404): 1,
        ("/v1/completions", 401): 1,
        ("/v1/completions", 400): 2,
        ("/v1/completions", 200): len(jobs),
    }
    served = Counter(line["model"] for line in lines if line["status"] == 200)
    assert served == Counter(names[m] for m, _ in jobs)
    assert len({line["request_id"] for line in lines if line["status"] == 200}) == len(jobs)


def _series(text: str, name: str, model: str) -> float:
    line = next(x for x in text.splitlines() if x.startswith(f'{name}{{model_name="{model}"}}'))
    return float(line.rsplit(" ", 1)[1])


def refused_without_loading(stack: TandemStack, names: list[str]) -> None:
    """An unknown model: 404 in each API flavour's error body; no key: 401 before any
    routing, so the unloaded model stays unloaded."""
    r = httpx.post(
        f"{stack.url}/v1/completions", json={"model": "nope", "prompt": "x"}, headers=AUTH
    )
    assert (r.status_code, r.json()["error"]["code"]) == (404, "model_not_found")
    body = {"model": "nope", "max_tokens": 2, "messages": []}
    r = httpx.post(f"{stack.url}/v1/messages", json=body, headers=AUTH)
    assert (r.status_code, r.json()["type"], r.json()["error"]["type"]) == (
        404,
        "error",
        "not_found_error",
    )
    body = {"model": names[1], "prompt": "x", "max_tokens": 1}
    assert httpx.post(f"{stack.url}/v1/completions", json=body).status_code == 401
    # malformed: refused by the router itself, not by loading a model to say so
    r = httpx.post(f"{stack.url}/v1/completions", content=b"{not json", headers=AUTH)
    assert (r.status_code, r.json()["error"]["type"]) == (400, "invalid_request_error")
    r = httpx.post(f"{stack.url}/v1/completions", json={"model": 5, "prompt": "x"}, headers=AUTH)
    assert (r.status_code, r.json()["error"]["param"]) == (400, "model")
    states = httpx.get(f"{stack.url}/readyz", timeout=10).json()["models"]
    assert states == {names[0]: "loaded", names[1]: "unloaded"}
