"""Greedy outputs of the embedded real models through the HTTP server (float32) equal
transformers' generate on the same GGUF weights, one request at a time and all at once;
and all at once with ``--quantization gguf`` (SmolLM2's given as its ``*.gguf`` file);
and both models served by one ``tandem serve`` (the model router), streamed at once, as
each model served alone (slow)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from common.model_files import EMBEDDED_MODELS, find_embedded_gguf, resolve_model_dir
from tests.parity.ties import assert_greedy_parity, our_logprobs_fn
from tests.stack import CPU_WORKERS, TandemStack, completion

PROMPTS = {
    "smollm2-135m-instruct": [
        "The capital of France is",
        "def fibonacci(n):",
        "Here is a short poem about the sea:\n",
        "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n",
    ],
    "gemma-3-270m": [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time, in a small village by the sea,",
        "The three primary colours are",
    ],
}
MAX_TOKENS = 64


# Gemma's leg (~2.5 minutes: transformers dequantizes its GGUF in numpy, then generates)
# is under slow; the fast suite keeps Gemma's GGUF logits parity (test_gguf_models.py) and
# the tiny random Gemma 3 checkpoints (test_family_logits.py).
@pytest.fixture(
    scope="module",
    params=[
        "smollm2-135m-instruct",
        pytest.param("gemma-3-270m", marks=pytest.mark.slow),
    ],
)
def model_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def served_url(model_name: str, server: TandemStack) -> Iterator[str]:
    if model_name == "smollm2-135m-instruct":
        yield server.url  # the shared float32 stack
        return
    with TandemStack("--model", model_name, "--dtype", "float32") as stack:
        yield stack.url


@pytest.fixture(scope="module")
def gguf_served_url(model_name: str) -> Iterator[str]:
    """The projections kept in the GGUF's blocks; SmolLM2 served from its GGUF file as
    a user's local ``*.gguf`` would be."""
    model = model_name
    if model_name == "smollm2-135m-instruct":
        model = str(find_embedded_gguf(EMBEDDED_MODELS[model_name]))
    flags: tuple[str, ...] = ("--model", model, "--served-model-name", model_name)
    flags += ("--quantization", "gguf", "--gguf-activations", "float")  # float: exact parity
    with TandemStack(*flags, "--dtype", "float32", env=CPU_WORKERS) as stack:
        yield stack.url


@pytest.fixture(scope="module")
def reference(model_name: str) -> tuple[Any, PreTrainedModel]:
    """transformers on the GGUF's weights as transformers itself dequantized them: the
    model directory, which common/gguf_convert.py saved from transformers' own load of the
    GGUF, without dequantizing the GGUF in numpy again here. (Our GGUF block loader is held
    to the same weights by test_gguf_models.py.)"""
    directory = str(resolve_model_dir(model_name))
    tok = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    return tok, model.eval()


@pytest.fixture(scope="module")
def expected(
    model_name: str, reference: tuple[Any, PreTrainedModel]
) -> list[tuple[list[int], list[int]]]:
    tok, model = reference
    out = []
    for text in PROMPTS[model_name]:
        ids = tok(text, return_tensors="pt").input_ids
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)  # type: ignore[operator]
        out.append((ids[0].tolist(), gen[0, ids.shape[1] :].tolist()))
    return out


@pytest.fixture(scope="module")
def logprob_fns(model_name: str, reference: tuple[Any, PreTrainedModel]) -> tuple[Any, Any]:
    _, ref_model = reference

    @torch.no_grad()
    def ref_fn(ids: list[int]) -> torch.Tensor:
        return torch.log_softmax(ref_model(torch.tensor([ids])).logits[0, -1], -1)

    return our_logprobs_fn(resolve_model_dir(model_name)), ref_fn


def served(url: str, model: str, prompt: list[int]) -> list[int]:
    out = completion(
        url, prompt, model=model, max_tokens=MAX_TOKENS, temperature=0, return_token_ids=True
    )
    ids: list[int] = out["choices"][0]["token_ids"]
    return ids


def test_one_after_another(
    served_url: str, model_name: str, expected: list[Any], logprob_fns: tuple[Any, Any]
) -> None:
    for prompt, ref in expected:
        assert_greedy_parity(prompt, served(served_url, model_name, prompt), ref, *logprob_fns)


def test_all_at_once(
    served_url: str, model_name: str, expected: list[Any], logprob_fns: tuple[Any, Any]
) -> None:
    answers = all_at_once(served_url, model_name, expected)
    for (prompt, ref), ours in zip(expected, answers, strict=True):
        assert_greedy_parity(prompt, ours, ref, *logprob_fns)


def test_gguf_blocks_all_at_once(
    gguf_served_url: str, model_name: str, expected: list[Any], logprob_fns: tuple[Any, Any]
) -> None:
    answers = all_at_once(gguf_served_url, model_name, expected)
    for (prompt, ref), ours in zip(expected, answers, strict=True):
        assert_greedy_parity(prompt, ours, ref, *logprob_fns)


def all_at_once(served_url: str, model_name: str, expected: list[Any]) -> list[list[int]]:
    async def send_all() -> list[list[int]]:
        async with httpx.AsyncClient(timeout=120) as client:

            async def one(prompt: list[int]) -> list[int]:
                body = {
                    "model": model_name,
                    "prompt": prompt,
                    "max_tokens": MAX_TOKENS,
                    "temperature": 0,
                    "return_token_ids": True,
                }
                r = await client.post(f"{served_url}/v1/completions", json=body)
                assert r.status_code == 200, r.text
                return list(r.json()["choices"][0]["token_ids"])

            return list(await asyncio.gather(*(one(p) for p, _ in expected)))

    answers = asyncio.run(send_all())
    assert len(answers) == len(expected)
    return answers


@pytest.fixture(scope="module")
def router_url() -> Iterator[str]:
    """Both embedded models behind one ``tandem serve`` (no --models-max: both loaded)."""
    flags = [a for m in PROMPTS for a in ("--model", m)]
    with TandemStack(*flags, "--dtype", "float32", "--max-num-seqs", "32") as stack:
        deadline = time.monotonic() + 300  # /health is 200 once one model is loaded
        while time.monotonic() < deadline and loaded(stack.url) != set(PROMPTS):
            time.sleep(0.5)
        assert loaded(stack.url) == set(PROMPTS)
        yield stack.url


def loaded(url: str) -> set[str]:
    states = httpx.get(f"{url}/readyz", timeout=10).json()["models"]
    return {m for m, state in states.items() if state == "loaded"}


@pytest.mark.slow
def test_both_models_behind_one_server_stream_at_once_as_each_served_alone(
    router_url: str,
    served_url: str,
    model_name: str,
    expected: list[Any],
    logprob_fns: tuple[Any, Any],
) -> None:
    """Every prompt of both models streamed at once through the router: this model's
    token ids equal transformers' and those of the model served alone (all at once)."""
    # this model's prompts as transformers' token ids, the other's as text
    jobs: list[tuple[str, str | list[int]]] = [(model_name, prompt) for prompt, _ in expected]
    jobs += [(m, text) for m, texts in PROMPTS.items() if m != model_name for text in texts]
    together = streamed_at_once(router_url, jobs)
    ours = [ids for (m, _), ids in zip(jobs, together, strict=True) if m == model_name]
    assert ours == all_at_once(served_url, model_name, expected)
    for (prompt, ref), ids in zip(expected, ours, strict=True):
        assert_greedy_parity(prompt, ids, ref, *logprob_fns)


def streamed_at_once(url: str, jobs: list[tuple[str, str | list[int]]]) -> list[list[int]]:
    """Each (model, prompt)'s greedy token ids, every stream open at once."""

    async def one(client: httpx.AsyncClient, model: str, prompt: str | list[int]) -> list[int]:
        body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
        body |= {"stream": True, "return_token_ids": True}
        ids: list[int] = []
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    ids += json.loads(line[6:])["choices"][0].get("token_ids") or []
        return ids

    async def run() -> list[list[int]]:
        async with httpx.AsyncClient(timeout=600) as client:
            return list(await asyncio.gather(*(one(client, m, t) for m, t in jobs)))

    return asyncio.run(run())
