"""Vectorized sampling: greedy, temperature, top-k, top-p and per-request seeds.

Random draws use the exponential-race trick (``argmax(p / E)`` with ``E ~ Exp(1)``
equals a draw from ``p``), so a seeded request draws its noise from its own generator
and its samples do not depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.messages import SamplingParams


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling parameters of one step, as tensors."""

    temperature: torch.Tensor  # [n]; 0 = greedy
    top_k: torch.Tensor  # [n] long; 0 = off
    top_p: torch.Tensor  # [n]
    generators: tuple[torch.Generator | None, ...]
    all_greedy: bool

    @staticmethod
    def build(
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        device: torch.device,
    ) -> SamplingBatch:
        return SamplingBatch(
            temperature=torch.tensor(
                [p.temperature for p in params], dtype=torch.float32, device=device
            ),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.long, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            generators=tuple(generators),
            all_greedy=all(p.greedy for p in params),
        )


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """``logits``: [n, vocab] -> sampled token ids [n]."""
    logits = logits.float()
    greedy_ids = logits.argmax(dim=-1)
    if batch.all_greedy:
        return greedy_ids
    greedy = batch.temperature == 0
    temperature = torch.where(greedy, torch.ones_like(batch.temperature), batch.temperature)
    logits = _apply_top_k_top_p(logits / temperature[:, None], batch.top_k, batch.top_p)
    probs = torch.softmax(logits, dim=-1)
    noise = torch.empty_like(probs).exponential_()
    for row, generator in enumerate(batch.generators):
        if generator is not None:  # seeded rows redraw from their own stream
            noise[row].exponential_(generator=generator)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(greedy, greedy_ids, sampled)


def _apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k and outside its top-p nucleus."""
    if bool((top_k == 0).all()) and bool((top_p >= 1.0).all()):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    remove = ranks >= k[:, None]
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass
    # before it already reaches top_p (the first token is always kept).
    mass_before = probs.cumsum(dim=-1) - probs
    remove = mass_before >= top_p[:, None]
    remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
