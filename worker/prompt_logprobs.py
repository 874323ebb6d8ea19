"""Prompt logprobs (vLLM's ``prompt_logprobs``; completions' ``echo`` with ``logprobs``):
the log-probability of every prompt token after the first, under the raw logits of the
position before it, with the ``k`` most likely tokens there.

They come from the prefill itself: the hidden state of each prompt position the step
computes is turned into logits (in slices, so a long chunk never holds a
``[tokens, vocab]`` float32 matrix at once), and the next prompt token's logprob is read
off. A chunked prompt gets its positions chunk by chunk. The scheduler never serves such
a request from the prefix cache (a cached position has no hidden state to read), as vLLM
does not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from common.messages import TokenLogprobs

_SLICE_ROWS = 256  # rows of logits at a time


@dataclass(frozen=True)
class PromptSpan:
    """One request's prompt positions in a step: batch rows ``first_row`` on, predicting
    ``targets`` (the prompt tokens after them), with ``k`` top logprobs each."""

    request_id: str
    first_row: int
    targets: list[int]
    k: int


def prompt_span(
    request_id: str,
    token_ids: list[int],
    num_prompt_tokens: int,
    start: int,
    end: int,
    first_row: int,
    k: int | None,
) -> PromptSpan | None:
    """The span of a request scheduled for positions ``start:end`` (batch rows from
    ``first_row``), if it asked for prompt logprobs and the step computes prompt
    positions that predict prompt tokens (the last prompt position predicts the first
    output token, which the sampler reports)."""
    stop = min(end, num_prompt_tokens - 1)
    if k is None or stop <= start:
        return None
    return PromptSpan(request_id, first_row, token_ids[start + 1 : stop + 1], k)


def compute_prompt_logprobs(
    hidden: torch.Tensor,
    spans: list[PromptSpan],
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
) -> dict[str, list[TokenLogprobs]]:
    """Each span's logprobs, in order. Every tensor-parallel rank calls this with the same
    spans (``compute_logits`` gathers the vocabulary shards)."""
    out: dict[str, list[TokenLogprobs]] = {}
    for span in spans:
        entries: list[TokenLogprobs] = []
        for lo in range(0, len(span.targets), _SLICE_ROWS):
            targets = span.targets[lo : lo + _SLICE_ROWS]
            rows = hidden[span.first_row + lo : span.first_row + lo + len(targets)]
            logprobs = torch.log_softmax(compute_logits(rows).float(), dim=-1)
            index = torch.tensor(targets, dtype=torch.long, device=logprobs.device)
            own_t = logprobs.gather(1, index[:, None])
            ranks = (logprobs > own_t).sum(dim=-1).add(1).tolist()
            own = own_t.squeeze(1).tolist()
            if span.k:
                values, ids = logprobs.topk(span.k, dim=-1)
                top_ids, top_values = ids.tolist(), values.tolist()
            else:
                top_ids = top_values = [[] for _ in targets]
            entries += [
                TokenLogprobs(lp, i, v, r)
                for lp, i, v, r in zip(own, top_ids, top_values, ranks, strict=True)
            ]
        out[span.request_id] = entries
    return out
