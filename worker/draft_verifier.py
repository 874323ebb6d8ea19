"""Speculative decoding on the worker: the rows a request with drafts samples, and how
many of its drafts those samples accept.

A request with k drafts samples k + 1 rows in one step: row j is the target's own choice
after the request's tokens and its first j drafts, so penalties, ``min_tokens`` and a
seed (seeded by position) see exactly the tokens they would see without speculation.
Draft j is accepted while every row before it chose its draft; the request's new tokens
are the accepted drafts and the choice of the first row that disagreed (or of the last
row, when all were accepted).

Drafts proposed by lookup are single tokens, not distributions: drawing the target's own
sample and comparing it is then exactly rejection sampling (accept the draft d with
probability p(d); on a rejection the token comes from p without d, renormalised). The
outputs keep the target's distribution, and a seeded request's text is the same with
speculation on and off.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SampleRow:
    """One row to sample: whose, after which tokens, with which generator."""

    request_id: str
    token_ids: list[int]
    generator: torch.Generator | None


def rows_for(
    request_id: str,
    token_ids: list[int],
    drafts: Sequence[int],
    generators: list[torch.Generator | None],
) -> list[SampleRow]:
    """The request's rows: one plain row, or one per draft plus one. ``generators``
    (one per row; [None] for an unseeded request) grows to the rows needed."""
    rows = [SampleRow(request_id, token_ids, generators[0])]
    for j in range(1, len(drafts) + 1):
        if len(generators) <= j:
            own = generators[0]
            generators.append(None if own is None else torch.Generator(device=own.device))
        rows.append(SampleRow(request_id, [*token_ids, *drafts[:j]], generators[j]))
    return rows


def num_accepted(samples: Sequence[int], drafts: Sequence[int]) -> int:
    """How many leading drafts the rows' samples chose (``samples``: one per row)."""
    for j, draft in enumerate(drafts):
        if samples[j] != draft:
            return j
    return len(drafts)
