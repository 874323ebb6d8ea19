"""The CUDA path (PyTorch ops: SDPA, paged gathers, the sampler) against transformers and
against the CPU path, on tiny random checkpoints of every family in float32. Marked
``gpu``: these run where a CUDA device is (conftest skips them, saying why, elsewhere)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from common.config import CacheConfig
from common.messages import (
    CachedRequestData,
    NewRequestData,
    SamplingParams,
    SchedulerOutput,
)
from tests.parity.families import FAMILIES, build
from worker.attention import build_metadata
from worker.model_runner import ModelRunner
from worker.models.loader import load_model
from worker.ops import TorchOps

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
BLOCK = 4


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, PreTrainedModel]:
    path = tmp_path_factory.mktemp(request.param)
    return path, build(request.param, path)


def test_logits_on_cuda_match_transformers(family: tuple[Path, PreTrainedModel]) -> None:
    checkpoint, reference = family
    torch.backends.cuda.matmul.allow_tf32 = False
    model = load_model(checkpoint, torch.float32, CUDA, TorchOps())
    caches = [
        torch.zeros(model.kv_cache_shape(64, BLOCK), device=CUDA) for _ in range(model.num_layers)
    ]
    gen = torch.Generator().manual_seed(3)
    a = torch.randint(0, 128, (13,), generator=gen).tolist()
    b = torch.randint(0, 128, (21,), generator=gen).tolist()

    def run(seqs: list[tuple[list[int], list[int], int, int]]) -> list[torch.Tensor]:
        ids, pos = [], []
        for tokens, _, start, n in seqs:
            ids += tokens[start : start + n]
            pos += list(range(start, start + n))
        meta = build_metadata(
            [s[1] for s in seqs], [s[2] for s in seqs], [s[3] for s in seqs], BLOCK, CUDA
        )
        with torch.inference_mode():
            hidden = model(
                torch.tensor(ids, device=CUDA), torch.tensor(pos, device=CUDA), caches, meta
            )
            logits = model.compute_logits(hidden)
        return [x.cpu() for x in torch.split(logits, [s[3] for s in seqs])]

    # Prefill a in two chunks and b whole, then decode both: scattered blocks.
    blocks_a, blocks_b = [9, 2, 30, 4, 17], [5, 40, 11, 22, 8, 33]
    run([(a, blocks_a, 0, 8)])
    out_a, out_b = run([(a, blocks_a, 8, 5), (b, blocks_b, 0, 21)])
    with torch.no_grad():
        ref_a = reference(torch.tensor([a])).logits[0]
        ref_b = reference(torch.tensor([b])).logits[0]
    assert (out_a - ref_a[8:]).abs().max() < 1e-4
    assert (out_b - ref_b).abs().max() < 1e-4
    a2, b2 = [*a, 7], [*b, 9]
    dec_a, dec_b = run([(a2, blocks_a, 13, 1), (b2, blocks_b, 21, 1)])
    with torch.no_grad():
        assert (dec_a[0] - reference(torch.tensor([a2])).logits[0, -1]).abs().max() < 1e-4
        assert (dec_b[0] - reference(torch.tensor([b2])).logits[0, -1]).abs().max() < 1e-4


def test_model_runner_on_cuda_samples_as_on_cpu(family: tuple[Path, PreTrainedModel]) -> None:
    checkpoint, _ = family
    cache = CacheConfig(block_size=BLOCK, num_kv_blocks=32)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, repetition_penalty=1.3)
    prompt = [5, 17, 33, 2, 90, 64, 8]

    def tokens(device: torch.device, params: SamplingParams) -> list[int]:
        runner = ModelRunner(checkpoint, torch.float32, device, cache, None, "torch")
        new = NewRequestData("r", prompt, params, list(range(8)), 0, len(prompt))
        out = runner.execute(SchedulerOutput(1, [new], [], {"r": len(prompt)}, []))
        got = list(out.sampled_token_ids)
        for step in range(2, 8):
            computed = len(prompt) + len(got) - 1
            out = runner.execute(
                SchedulerOutput(step, [], [CachedRequestData("r", [], computed)], {"r": 1}, [])
            )
            got += out.sampled_token_ids
        return got

    # Greedy with a penalty: the sampler's CUDA path (penalties, masks) picks as the CPU's.
    assert tokens(CUDA, greedy) == tokens(torch.device("cpu"), greedy)
