"""Greedy outputs through the HTTP server (float32) equal transformers' generate on the
GGUF weights, one request at a time and all at once."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from common.model_files import EMBEDDED_MODELS, find_embedded_gguf
from tests.parity.ties import assert_greedy_parity
from tests.stack import TandemStack, completion
from worker.attention import build_metadata
from worker.models.loader import load_model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Here is a short poem about the sea:\n",
    "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n",
]
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def reference() -> tuple[Any, PreTrainedModel]:
    gguf = find_embedded_gguf(EMBEDDED_MODELS["smollm2-135m-instruct"])
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    return tok, model.eval()


@pytest.fixture(scope="module")
def expected(reference: tuple[Any, PreTrainedModel]) -> list[tuple[list[int], list[int]]]:
    tok, model = reference
    out = []
    for text in PROMPTS:
        ids = tok(text, return_tensors="pt").input_ids
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)  # type: ignore[operator]
        out.append((ids[0].tolist(), gen[0, ids.shape[1] :].tolist()))
    return out


@pytest.fixture(scope="module")
def logprob_fns(reference: tuple[Any, PreTrainedModel], smollm2_dir: Path) -> tuple[Any, Any]:
    _, ref_model = reference
    ours = load_model(smollm2_dir, torch.float32, torch.device("cpu"))

    @torch.no_grad()
    def ref_fn(ids: list[int]) -> torch.Tensor:
        return torch.log_softmax(ref_model(torch.tensor([ids])).logits[0, -1], -1)

    @torch.no_grad()
    def ours_fn(ids: list[int]) -> torch.Tensor:
        blocks = list(range(len(ids) // 16 + 1))
        caches = [
            torch.zeros(ours.kv_cache_shape(len(blocks) * 16)) for _ in range(ours.num_layers)
        ]
        meta = build_metadata([blocks], [0], [len(ids)], 16, torch.device("cpu"))
        hidden = ours(torch.tensor(ids), torch.arange(len(ids)), caches, meta)
        return torch.log_softmax(ours.compute_logits(hidden[-1:])[0], -1)

    return ours_fn, ref_fn


def served(url: str, prompt: list[int]) -> list[int]:
    out = completion(url, prompt, max_tokens=MAX_TOKENS, temperature=0, return_token_ids=True)
    ids: list[int] = out["choices"][0]["token_ids"]
    return ids


def test_one_after_another(
    server: TandemStack, expected: list[Any], logprob_fns: tuple[Any, Any]
) -> None:
    for prompt, ref in expected:
        assert_greedy_parity(prompt, served(server.url, prompt), ref, *logprob_fns)


def test_all_at_once(
    server: TandemStack, expected: list[Any], logprob_fns: tuple[Any, Any]
) -> None:
    async def send_all() -> list[list[int]]:
        async with httpx.AsyncClient(timeout=120) as client:

            async def one(prompt: list[int]) -> list[int]:
                body = {
                    "model": "smollm2-135m-instruct",
                    "prompt": prompt,
                    "max_tokens": MAX_TOKENS,
                    "temperature": 0,
                    "return_token_ids": True,
                }
                r = await client.post(f"{server.url}/v1/completions", json=body)
                assert r.status_code == 200, r.text
                return list(r.json()["choices"][0]["token_ids"])

            return list(await asyncio.gather(*(one(p) for p, _ in expected)))

    for (prompt, ref), ours in zip(expected, asyncio.run(send_all()), strict=True):
        assert_greedy_parity(prompt, ours, ref, *logprob_fns)
