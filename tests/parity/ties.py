"""Greedy parity as ../shared/ARCHITECTURE.md defines it: identical token ids, except
that the first differing position may be a numerical tie -- each side's token within
the other's top-2, with a logprob gap under 1e-3. Nothing after it is compared."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

TIE_GAP = 1e-3

LogprobsFn = Callable[[list[int]], torch.Tensor]  # token ids -> next-token logprobs


def is_tie(logprobs: torch.Tensor, own: int, other: int) -> bool:
    top2 = logprobs.topk(2).indices.tolist()
    return other in top2 and own in top2 and abs(float(logprobs[own] - logprobs[other])) < TIE_GAP


def assert_greedy_parity(
    prompt: list[int], ours: list[int], ref: list[int], ours_fn: LogprobsFn, ref_fn: LogprobsFn
) -> None:
    for i, (a, b) in enumerate(zip(ours, ref, strict=False)):
        if a == b:
            continue
        prefix = prompt + ref[:i]
        assert is_tie(ours_fn(prefix), a, b) and is_tie(ref_fn(prefix), b, a), (
            f"greedy outputs diverge at token {i} ({a} vs {b}) without a numerical tie"
        )
        return
    assert len(ours) == len(ref), (
        f"lengths differ: {len(ours)} vs {len(ref)}\nours={ours}\nref={ref}"
    )


def our_logprobs_fn(model_dir: Path) -> LogprobsFn:
    """Next-token logprobs from Tandem's own model in float32, one prefill per call."""
    from worker.attention import build_metadata
    from worker.models.loader import load_model

    model = load_model(model_dir, torch.float32, torch.device("cpu"))

    @torch.no_grad()
    def fn(ids: list[int]) -> torch.Tensor:
        blocks = list(range(len(ids) // 16 + 1))
        caches = [
            torch.zeros(model.kv_cache_shape(len(blocks), 16)) for _ in range(model.num_layers)
        ]
        meta = build_metadata([blocks], [0], [len(ids)], 16, torch.device("cpu"))
        hidden = model(torch.tensor(ids), torch.arange(len(ids)), caches, meta)
        return torch.log_softmax(model.compute_logits(hidden[-1:])[0], -1)

    return fn
