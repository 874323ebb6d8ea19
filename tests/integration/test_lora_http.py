"""LoRA adapters served over HTTP by the real stack (a tiny random Llama with SmolLM2's
tokenizer, float32, random PEFT adapters made here by ``peft``): a batch mixing four
adapters and the base model gives each request the greedy tokens of transformers + peft
with its adapter (ties as ARCHITECTURE.md defines them), with ``--max-loras 2`` swapping
adapters through the two slots; the prefix cache never crosses adapters; adapters load
and unload while a stream on another runs unchanged; bad adapters get a 400 naming the
problem and the server serves on."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from tests.parity.families import build_servable
from tests.parity.ties import assert_greedy_parity
from tests.stack import CPU_WORKERS, TandemStack

MODEL = "tiny-llama"
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS: dict[str, dict[str, Any]] = {
    "all": {"r": 8, "lora_alpha": 16, "target_modules": ALL},
    "qv": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
    "mlp": {"r": 16, "lora_alpha": 8, "target_modules": ["gate_proj", "up_proj", "down_proj"]},
    "rs": {"r": 8, "lora_alpha": 4, "use_rslora": True, "target_modules": ["o_proj", "k_proj"]},
    "late": {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "down_proj"]},
}
STATIC = ("all", "qv", "mlp", "rs")  # served from the start; "late" is loaded at run time
MAX_TOKENS = 8


def save_adapter(base: Path, out: Path, seed: int, **lora: Any) -> Path:
    """A random PEFT LoRA of ``base`` (B not zero: it changes the outputs)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, **lora))
    with torch.no_grad():  # PEFT's random init is small next to these weights: make it show
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(20.0)
    peft_model.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    return build_servable("llama", tmp_path_factory.mktemp("tiny-llama"), smollm2_dir)


@pytest.fixture(scope="module")
def adapters(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: save_adapter(checkpoint, root / name, seed, **lora)
        for seed, (name, lora) in enumerate(ADAPTERS.items())
    }


@pytest.fixture(scope="module")
def stack(checkpoint: Path, adapters: dict[str, Path]) -> Iterator[TandemStack]:
    flags = ["--model", str(checkpoint), "--served-model-name", MODEL, "--dtype", "float32"]
    flags += ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "16"]
    flags += ["--allow-runtime-lora-updating", "--lora-modules"]
    flags += [f"{name}={adapters[name]}" for name in STATIC]
    with TandemStack(*flags) as s:
        yield s


class Reference:
    """transformers + peft: greedy tokens and next-token logprobs per adapter."""

    def __init__(self, checkpoint: Path, adapters: dict[str, Path]) -> None:
        self.checkpoint, self.adapters = checkpoint, adapters
        self._models: dict[str | None, Any] = {}

    def model(self, adapter: str | None) -> Any:
        if adapter not in self._models:
            base: Any = AutoModelForCausalLM.from_pretrained(self.checkpoint, dtype=torch.float32)
            model = (
                base if adapter is None else PeftModel.from_pretrained(base, self.adapters[adapter])
            )
            self._models[adapter] = model.eval()
        return self._models[adapter]

    @torch.inference_mode()
    def greedy(self, adapter: str | None, prompt: list[int], n: int = MAX_TOKENS) -> list[int]:
        ids = torch.tensor([prompt])
        out = self.model(adapter).generate(
            ids, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        return [int(t) for t in out[0, len(prompt) :]]

    def logprobs_fn(self, adapter: str | None) -> Any:
        @torch.inference_mode()
        def fn(ids: list[int]) -> torch.Tensor:
            return torch.log_softmax(self.model(adapter)(torch.tensor([ids])).logits[0, -1], -1)

        return fn


@pytest.fixture(scope="module")
def reference(checkpoint: Path, adapters: dict[str, Path]) -> Reference:
    return Reference(checkpoint, adapters)


def prompt(i: int, length: int = 12) -> list[int]:
    return [(97 * i + 31 * k) % 4000 + 100 for k in range(length)]


async def complete(
    client: httpx.AsyncClient, model: str, ids: list[int], **extra: Any
) -> dict[str, Any]:
    body = {"model": model, "prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0}
    r = await client.post("/v1/completions", json={**body, "ignore_eos": True, **extra})
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_a_mixed_batch_of_four_adapters_and_the_base_model_matches_peft(
    stack: TandemStack, reference: Reference
) -> None:
    models = [*STATIC, None]
    jobs = [(models[i % len(models)], prompt(i)) for i in range(16)]

    async def run() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(base_url=stack.url, timeout=120) as client:
            return await asyncio.gather(
                *(complete(client, m or MODEL, ids, return_token_ids=True) for m, ids in jobs)
            )

    answers = asyncio.run(run())
    for (adapter, ids), answer in zip(jobs, answers, strict=True):
        assert answer["model"] == (adapter or MODEL)
        ours = answer["choices"][0]["token_ids"]
        ref = reference.greedy(adapter, ids)
        fn = reference.logprobs_fn(adapter)
        assert_greedy_parity(ids, ours, ref, fn, fn)
    # The adapters change the outputs: the same prompt differs between them.
    same = prompt(0)
    outs = {m: tuple(reference.greedy(m, same)) for m in models}
    assert len(set(outs.values())) == len(models)
    metrics = httpx.get(f"{stack.url}/metrics").text
    swaps = next(
        line for line in metrics.splitlines() if line.startswith("tandem:lora_swaps_total")
    )
    assert float(swaps.split()[-1]) >= 4  # four adapters through two slots
    assert 'tandem:lora_requests_info{max_lora="2"' in metrics
    for name in STATIC:
        assert f'tandem:lora_requests_total{{lora_name="{name}",model_name="{MODEL}"}}' in metrics


def test_models_lists_the_adapters_with_their_parent(stack: TandemStack) -> None:
    cards = httpx.get(f"{stack.url}/v1/models").json()["data"]
    assert cards[0]["id"] == MODEL and "parent" not in cards[0]
    by_id = {c["id"]: c for c in cards[1:]}
    assert set(STATIC) <= set(by_id)
    assert all(by_id[name]["parent"] == MODEL for name in STATIC)


def test_the_prefix_cache_never_crosses_adapters(stack: TandemStack) -> None:
    ids = prompt(99, length=40)  # two full blocks of 16

    async def run() -> list[int]:
        cached = []
        async with httpx.AsyncClient(base_url=stack.url, timeout=120) as client:
            for model in ("all", "all", "qv", MODEL, "qv"):
                answer = await complete(client, model, ids)
                cached.append(answer["usage"]["prompt_tokens_details"]["cached_tokens"])
        return cached

    assert asyncio.run(run()) == [0, 32, 0, 0, 32]


def test_adapters_load_and_unload_while_a_stream_runs(
    stack: TandemStack, reference: Reference, adapters: dict[str, Path]
) -> None:
    ids = prompt(7)
    long = 48

    async def run() -> tuple[list[int], list[int]]:
        async with httpx.AsyncClient(base_url=stack.url, timeout=120) as client:
            body = {"model": "all", "prompt": ids, "max_tokens": long, "temperature": 0}
            body |= {"ignore_eos": True, "stream": True, "return_token_ids": True}
            streamed: list[int] = []
            async with client.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                lines = r.aiter_lines()
                changed = False
                async for line in lines:
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    streamed += json.loads(line[6:])["choices"][0].get("token_ids", [])
                    if not changed and streamed:  # mid-stream: load one, unload another
                        changed = True
                        load = {"lora_name": "late", "lora_path": str(adapters["late"])}
                        assert (
                            await client.post("/v1/load_lora_adapter", json=load)
                        ).status_code == 200
                        gone = await client.post(
                            "/v1/unload_lora_adapter", json={"lora_name": "rs"}
                        )
                        assert gone.status_code == 200
            late = await complete(client, "late", ids, return_token_ids=True)
            return streamed, late["choices"][0]["token_ids"]

    streamed, late = asyncio.run(run())
    fn = reference.logprobs_fn("all")
    assert_greedy_parity(ids, streamed, reference.greedy("all", ids, long), fn, fn)
    late_fn = reference.logprobs_fn("late")
    assert_greedy_parity(ids, late, reference.greedy("late", ids), late_fn, late_fn)
    gone = httpx.post(f"{stack.url}/v1/completions", json={"model": "rs", "prompt": ids})
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "model"
    again = httpx.post(f"{stack.url}/v1/unload_lora_adapter", json={"lora_name": "rs"})
    assert again.status_code == 404
    twice = {"lora_name": "late", "lora_path": str(adapters["late"])}
    assert httpx.post(f"{stack.url}/v1/load_lora_adapter", json=twice).status_code == 400
    # Loaded back from its files, "rs" is a new adapter; the KV of the old one is not reused.
    back = {"lora_name": "rs", "lora_path": str(adapters["rs"])}
    assert httpx.post(f"{stack.url}/v1/load_lora_adapter", json=back).status_code == 200
    assert "rs" in {c["id"] for c in httpx.get(f"{stack.url}/v1/models").json()["data"]}


def test_bad_adapters_are_refused_by_name_and_the_server_serves_on(
    stack: TandemStack, checkpoint: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    big = save_adapter(
        checkpoint, tmp_path / "big", 9, r=32, lora_alpha=32, target_modules=["q_proj"]
    )
    embed = save_adapter(
        checkpoint, tmp_path / "embed", 9, r=4, lora_alpha=8, target_modules=["embed_tokens"]
    )
    corrupt = Path(shutil.copytree(adapters["qv"], tmp_path / "corrupt"))
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    for path, why in (
        (big, "rank"),
        (embed, "embed_tokens"),
        (corrupt, "safetensors"),
        (tmp_path / "missing", "does not exist"),
    ):
        body = {"lora_name": path.name, "lora_path": str(path)}
        r = httpx.post(f"{stack.url}/v1/load_lora_adapter", json=body)
        assert r.status_code == 400, r.text
        assert why in r.json()["error"]["message"], r.text
    ids = prompt(3)
    answer = httpx.post(
        f"{stack.url}/v1/completions",
        json={"model": "qv", "prompt": ids, "max_tokens": 4, "temperature": 0},
        timeout=60,
    )
    assert answer.status_code == 200
    unknown = httpx.post(f"{stack.url}/v1/completions", json={"model": "nope", "prompt": ids})
    assert unknown.status_code == 404 and "'qv'" in unknown.json()["error"]["message"]


TOPOLOGIES = {
    "tp2": ["--tensor-parallel-size", "2"],
    # The hand-off names the adapter: the decode pool (two ranks, each its shard of A/B)
    # continues each request on its own adapter.
    "split-tcp-decode-tp2": [
        *("--prefill-workers", "1", "--decode-workers", "1", "--kv-transfer", "tcp"),
        *("--decode-tp", "2", "--disagg-min-prompt-tokens", "0"),
    ],
}


@pytest.mark.parametrize("topology", sorted(TOPOLOGIES))
def test_split_pools_and_tensor_parallelism_match_peft(
    topology: str, checkpoint: Path, adapters: dict[str, Path], reference: Reference
) -> None:
    flags = ["--model", str(checkpoint), "--served-model-name", MODEL, "--dtype", "float32"]
    flags += ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "16", "--lora-modules"]
    flags += [f"{name}={adapters[name]}" for name in ("all", "rs")]
    jobs = [(("all", "rs", None)[i % 3], prompt(40 + i)) for i in range(6)]

    async def run(url: str) -> list[dict[str, Any]]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            return await asyncio.gather(
                *(complete(client, m or MODEL, ids, return_token_ids=True) for m, ids in jobs)
            )

    with TandemStack(*flags, *TOPOLOGIES[topology], env=CPU_WORKERS) as stack:
        answers = asyncio.run(run(stack.url))
        # Every prompt is handed off (--disagg-min-prompt-tokens 0); the counters reach
        # /stats with the engine's heartbeat, so wait for all of them.
        stats = stack.stats_when(
            lambda s: "pools" not in s or sum(s["kv_transfers"]["outcomes"].values()) >= len(jobs)
        )
    for (adapter, ids), answer in zip(jobs, answers, strict=True):
        fn = reference.logprobs_fn(adapter)
        ours = answer["choices"][0]["token_ids"]
        assert_greedy_parity(ids, ours, reference.greedy(adapter, ids), fn, fn)
    if "pools" in stats:
        assert stats["kv_transfers"]["outcomes"]["done"] == len(jobs), stats["kv_transfers"]


def test_runtime_changes_need_the_opt_in_and_with_keys_an_admin_key(
    checkpoint: Path, adapters: dict[str, Path]
) -> None:
    flags = ["--model", str(checkpoint), "--served-model-name", MODEL, "--dtype", "float32"]
    flags += ["--enable-lora", "--api-key", "user-key"]
    load = {"lora_name": "qv", "lora_path": str(adapters["qv"])}
    user, admin = {"Authorization": "Bearer user-key"}, {"Authorization": "Bearer admin-key"}
    env = {**CPU_WORKERS, "TANDEM_ADMIN_API_KEYS": "admin-key"}
    with TandemStack(*flags, env=env) as stack:  # no --allow-runtime-lora-updating
        off = httpx.post(f"{stack.url}/v1/load_lora_adapter", json=load, headers=admin)
        assert off.status_code == 403 and "--allow-runtime-lora-updating" in off.text
    with TandemStack(*flags, "--allow-runtime-lora-updating", env=env) as stack:
        url = stack.url
        assert httpx.post(f"{url}/v1/load_lora_adapter", json=load).status_code == 401
        refused = httpx.post(f"{url}/v1/load_lora_adapter", json=load, headers=user)
        assert refused.status_code == 403 and "admin" in refused.json()["error"]["message"]
        assert refused.json()["error"]["type"] == "permission_error"
        assert (
            httpx.post(f"{url}/v1/load_lora_adapter", json=load, headers=admin).status_code == 200
        )
        body = {"model": "qv", "prompt": prompt(1), "max_tokens": 4, "temperature": 0}
        for key in (user, admin):  # an admin key passes wherever an API key does
            assert httpx.post(f"{url}/v1/completions", json=body, headers=key).status_code == 200
        gone = {"lora_name": "qv"}
        assert (
            httpx.post(f"{url}/v1/unload_lora_adapter", json=gone, headers=user).status_code == 403
        )
        assert (
            httpx.post(f"{url}/v1/unload_lora_adapter", json=gone, headers=admin).status_code == 200
        )
