from __future__ import annotations

import torch

from common.messages import SamplingParams
from worker.sampler import SamplingBatch, sample


def batch(params: list[SamplingParams], seeded: bool = True) -> SamplingBatch:
    gens: list[torch.Generator | None] = []
    for i, p in enumerate(params):
        gens.append(
            torch.Generator().manual_seed(p.seed if p.seed is not None else i) if seeded else None
        )
    return SamplingBatch.build(params, gens, torch.device("cpu"))


def logits(rows: int, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax() -> None:
    x = logits(4)
    assert torch.equal(sample(x, batch([SamplingParams(temperature=0.0)] * 4)), x.argmax(-1))


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    x = logits(3)
    params = [
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=1.0, top_p=1e-6),
        SamplingParams(temperature=0.0),
    ]
    for _ in range(5):
        assert torch.equal(sample(x, batch(params, seeded=False)), x.argmax(-1))


def test_top_k_keeps_samples_within_the_k_best() -> None:
    x = logits(1, seed=3).expand(400, -1).contiguous()
    out = sample(x, batch([SamplingParams(temperature=2.0, top_k=3)] * 400, seeded=False))
    allowed = set(x[0].topk(3).indices.tolist())
    seen = set(out.tolist())
    assert seen <= allowed and len(seen) == 3


def test_seeded_row_ignores_its_batch_neighbours() -> None:
    p = SamplingParams(temperature=1.0, seed=42)
    x = logits(8, seed=5)
    alone = sample(x[:1], batch([p]))
    crowd = sample(x, batch([p] + [SamplingParams(temperature=1.0, seed=s) for s in range(7)]))
    assert alone[0] == crowd[0]
