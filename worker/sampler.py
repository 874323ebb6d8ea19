"""Vectorized sampling over the batch.

Order, as in vLLM: log-probabilities of the raw logits (what ``logprobs`` reports) ->
token filters (``min_tokens`` bans, ``allowed_token_ids``, the structured-output
grammar) and ``logit_bias`` -> repetition / presence / frequency penalties -> greedy
rows take the argmax -> temperature
-> min-p, top-k, top-p masks -> a random draw. A draw inverts the row's cumulative
distribution at one uniform number (``_draw``), so a seeded request takes that number
from its own generator and its samples do not depend on the rest of the batch.

A grammar's mask is computed only where it is needed, as llama.cpp's sampler does: a
constrained row first picks from its unmasked logits, and only when its grammar rejects
that token is the row masked and picked again. Exact: a greedy row's argmax, when
allowed, is the masked argmax too (masking removes tokens, ties go to the lowest id
either way); a sampled row draws from p and keeps an allowed token, else draws from p
restricted to the allowed set A, so a token x of A comes out with p(x) + (1 - p(A))
p(x) / p(A) = p(x) / p(A), the masked distribution. Rows that truncate (top-k, top-p,
min-p) would truncate a different set unmasked, so they are masked first. A mask costs
~0.2 ms a row on SmolLM2's 49,152 tokens; checking a token, microseconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

import torch

from common.messages import SamplingParams, TokenLogprobs
from worker.ops import Ops, TorchOps


class Constraint(Protocol):
    """The grammars of a step's constrained rows (``worker/structured.py``)."""

    @property
    def rows(self) -> Sequence[int]:
        """The constrained rows, ascending."""
        ...

    def accepts(self, row: int, token: int) -> bool:
        """Whether ``row``'s grammar may take ``token`` next."""
        ...

    def bitmask(self, rows: Sequence[int]) -> torch.Tensor:
        """``[len(rows), ceil(vocab / 32)]`` int32, a bit per token ``rows`` may take."""
        ...


def _per_row(field: str, dtype: torch.dtype = torch.float32) -> cached_property[torch.Tensor]:
    """A ``SamplingBatch`` column: each row's ``SamplingParams`` field, as a tensor made
    when first read."""

    def column(batch: SamplingBatch) -> torch.Tensor:
        return torch.tensor(
            [getattr(p, field) for p in batch.params], dtype=dtype, device=batch.device
        )

    return cached_property(column)


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling parameters of one step, as tensors. The per-row columns are made
    when first read: a greedy step without penalties reads none of them (seven tensors
    less a step: ~0.05 ms of a one-row decode step, over caches the weights just swept)."""

    params: tuple[SamplingParams, ...]
    device: torch.device
    output_counts: torch.Tensor | None  # [n, vocab]: how often each token was generated
    seen_mask: torch.Tensor | None  # [n, vocab]: in the prompt or the output
    generators: tuple[torch.Generator | None, ...]
    num_logprobs: tuple[int | None, ...]  # per row: top-k logprobs wanted (None = none)
    all_greedy: bool
    banned: tuple[tuple[int, tuple[int, ...]], ...] = ()  # (row, token ids) not to sample now
    allowed: tuple[tuple[int, tuple[int, ...]], ...] = ()  # (row, the only ids it may sample)
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # rows, ids, values
    constraint: Constraint | None = None  # structured outputs' grammars

    # [n] each, made when first read
    temperature = _per_row("temperature")  # 0 = greedy
    top_k = _per_row("top_k", torch.long)  # 0 = off
    top_p = _per_row("top_p")
    min_p = _per_row("min_p")  # 0 = off
    repetition_penalty = _per_row("repetition_penalty")  # 1 = off
    presence_penalty = _per_row("presence_penalty")
    frequency_penalty = _per_row("frequency_penalty")

    @staticmethod
    def build(
        params: list[SamplingParams],
        generators: Sequence[torch.Generator | None],
        device: torch.device,
        token_ids: list[list[int]] | None = None,
        num_prompt_tokens: list[int] | None = None,
        vocab_size: int = 0,
        eos_token_ids: Sequence[int] = (),
        constraint: Constraint | None = None,
    ) -> SamplingBatch:
        """``token_ids`` / ``num_prompt_tokens`` (each row's tokens so far and how many are
        prompt) are needed when some row uses a penalty or ``min_tokens``."""

        def column(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        counts = seen = None
        if any(_has_penalty(p) for p in params):
            if token_ids is None or num_prompt_tokens is None or vocab_size <= 0:
                raise ValueError(
                    "penalties need each row's token ids, prompt length and the vocabulary size"
                )
            counts, seen = _token_counts(token_ids, num_prompt_tokens, vocab_size, device)
        banned: list[tuple[int, tuple[int, ...]]] = []
        for row, p in enumerate(params):
            if p.min_tokens > 0:
                if token_ids is None or num_prompt_tokens is None:
                    raise ValueError("min_tokens needs each row's token ids and prompt length")
                if len(token_ids[row]) - num_prompt_tokens[row] < p.min_tokens:
                    banned.append((row, tuple({*eos_token_ids, *p.stop_token_ids})))
        allowed = tuple(
            (row, tuple(p.allowed_token_ids))
            for row, p in enumerate(params)
            if p.allowed_token_ids is not None
        )
        bias_entries = [
            (row, token, value)
            for row, p in enumerate(params)
            for token, value in (p.logit_bias or {}).items()
            if 0 <= token < vocab_size or vocab_size <= 0
        ]
        bias = None
        if bias_entries:
            rows, ids, values = zip(*bias_entries, strict=True)
            bias = (
                torch.tensor(rows, dtype=torch.long, device=device),
                torch.tensor(ids, dtype=torch.long, device=device),
                column(list(values)),
            )
        return SamplingBatch(
            params=tuple(params),
            device=device,
            banned=tuple(banned),
            allowed=allowed,
            bias=bias,
            constraint=constraint if constraint is not None and constraint.rows else None,
            output_counts=counts,
            seen_mask=seen,
            generators=tuple(generators),
            num_logprobs=tuple(p.logprobs for p in params),
            all_greedy=all(p.greedy for p in params),
        )


def _has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _token_counts(
    token_ids: list[list[int]], num_prompt: list[int], vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Output-token counts and the prompt-or-output mask, by scatter over padded rows."""
    width = max(1, max(len(t) for t in token_ids))
    ids = torch.zeros(len(token_ids), width, dtype=torch.long)
    is_output = torch.zeros(len(token_ids), width)
    is_any = torch.zeros(len(token_ids), width)
    for row, (tokens, prompt_len) in enumerate(zip(token_ids, num_prompt, strict=True)):
        ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        is_output[row, prompt_len : len(tokens)] = 1.0
        is_any[row, : len(tokens)] = 1.0
    ids, is_output, is_any = ids.to(device), is_output.to(device), is_any.to(device)
    counts = torch.zeros(len(token_ids), vocab, device=device).scatter_add_(1, ids, is_output)
    seen = torch.zeros(len(token_ids), vocab, device=device).scatter_add_(1, ids, is_any) > 0
    return counts, seen


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # empty when no row asked


def sample(logits: torch.Tensor, batch: SamplingBatch, ops: Ops | None = None) -> SamplerOutput:
    """``logits``: [n, vocab] -> one token per row (and logprobs where asked). ``ops``
    applies the structured-output bitmask (the worker's ops; PyTorch's by default)."""
    ops = ops or TorchOps()
    constraint = batch.constraint
    filtered = bool(batch.banned or batch.allowed or batch.bias is not None)
    filtered = filtered or constraint is not None
    if filtered or batch.output_counts is not None or not batch.all_greedy:
        # A plain greedy step skips this copy: its argmax reads the logits as they are
        # (bf16 values compare as their float32 conversions do).
        logits = logits.float()
    raw = logits
    if filtered:
        logits = _filter(logits.clone(), batch)
    masked_first: list[int] = []
    if constraint is not None:
        masked_first = [r for r in constraint.rows if _truncates(batch.params[r])]
        if masked_first:
            _mask_rows(logits, masked_first, constraint, ops)
    if batch.output_counts is not None:
        logits = _apply_penalties(logits, batch)  # elementwise: a masked -inf stays -inf
    tokens = ops.argmax(logits)
    if not batch.all_greedy:
        greedy = batch.temperature == 0
        temperature = torch.where(greedy, torch.ones_like(batch.temperature), batch.temperature)
        scaled = _mask_outside_top_k_top_p_min_p(logits / temperature[:, None], batch)
        probs = torch.softmax(scaled, dim=-1)
        uniform = _uniforms(probs.shape[0], batch.generators, probs.device)
        tokens = torch.where(greedy, tokens, _draw(probs, uniform))
    token_list: list[int] = tokens.tolist()
    if constraint is not None:
        rejected = [
            r
            for r in constraint.rows
            if r not in masked_first and not constraint.accepts(r, token_list[r])
        ]
        if rejected:
            again = _mask_rows(logits, rejected, constraint, ops)
            picked = _pick_untruncated(again, batch, rejected, ops)
            tokens[rejected] = picked
            for r, token in zip(rejected, picked.tolist(), strict=True):
                token_list[r] = token
    return SamplerOutput(token_list, _logprobs(raw, tokens, batch.num_logprobs))


def _truncates(p: SamplingParams) -> bool:
    return not p.greedy and (p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0)


def _mask_rows(
    logits: torch.Tensor, rows: list[int], constraint: Constraint, ops: Ops
) -> torch.Tensor:
    """Mask ``rows`` of ``logits`` by their grammars, in place; return those rows."""
    picked = logits[rows]
    ops.apply_token_bitmask(picked, constraint.bitmask(rows))
    logits[rows] = picked
    return picked


def _pick_untruncated(
    logits: torch.Tensor, batch: SamplingBatch, rows: list[int], ops: Ops
) -> torch.Tensor:
    """A token for each of ``rows`` (``logits`` holds just those rows), none of which
    truncates: the argmax for greedy rows, a draw at temperature for the others."""
    tokens = ops.argmax(logits)
    temperature = batch.temperature[rows]
    greedy = temperature == 0
    if bool(greedy.all()):
        return tokens
    probs = torch.softmax(logits / torch.where(greedy, 1.0, temperature)[:, None], dim=-1)
    generators = [batch.generators[r] for r in rows]
    return torch.where(greedy, tokens, _draw(probs, _uniforms(len(rows), generators, probs.device)))


def _draw(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` [n, vocab], drawn by inverting its cumulative sum at
    the row's ``uniform`` [n, 1] number in [0, 1). One random number a row: the
    exponential race (``argmax(p / E)``, ``E ~ Exp(1)`` per token) took ~1-2 ms a row
    here for SmolLM2's 49,152 tokens, 36-59 ms a step at 32 rows (``exponential_``),
    longer than the forward. A token of probability 0 is never drawn: its cumulative sum
    equals the one before it, and the draw takes the first index whose sum exceeds the
    target, which stays below the row's total."""
    cumulative = probs.cumsum(dim=-1)
    total = cumulative[:, -1:]
    below_total = torch.nextafter(total, torch.zeros_like(total))
    target = torch.minimum(uniform * total, below_total)
    drawn = torch.searchsorted(cumulative, target, right=True).squeeze(1)
    return drawn.clamp_(max=probs.shape[1] - 1)  # in range even for a row of NaNs


def _uniforms(
    n: int, generators: Sequence[torch.Generator | None], device: torch.device
) -> torch.Tensor:
    """[n, 1] numbers in [0, 1): a seeded row's from its own generator, so its draw does
    not depend on the rest of the batch."""
    uniform = torch.rand(n, 1, device=device)
    for row, generator in enumerate(generators):
        if generator is not None:
            uniform[row] = torch.rand(1, generator=generator, device=device)
    return uniform


def _filter(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Token bans, allow-lists and logit biases, in place."""
    for row, ids in batch.banned:
        logits[row, list(ids)] = float("-inf")
    for row, allowed in batch.allowed:
        keep = logits[row, list(allowed)].clone()
        logits[row] = float("-inf")
        logits[row, list(allowed)] = keep
    if batch.bias is not None:
        rows, token_ids, values = batch.bias
        logits.index_put_((rows, token_ids), values, accumulate=True)
    return logits


def _apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    assert batch.output_counts is not None and batch.seen_mask is not None  # built together
    rep = batch.repetition_penalty[:, None]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(batch.seen_mask, penalized, logits)
    logits = logits - batch.frequency_penalty[:, None] * batch.output_counts
    return logits - batch.presence_penalty[:, None] * (batch.output_counts > 0).float()


def _mask_outside_top_k_top_p_min_p(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k, its top-p nucleus, and those
    less likely than ``min_p`` times the most likely token."""
    if bool((batch.min_p > 0).any()):
        probs = torch.softmax(logits, dim=-1)
        too_rare = probs < batch.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(too_rare, float("-inf"))
    if bool((batch.top_k == 0).all()) and bool((batch.top_p >= 1.0).all()):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(
        batch.top_k > 0, batch.top_k.clamp(max=vocab), torch.full_like(batch.top_k, vocab)
    )
    sorted_logits = sorted_logits.masked_fill(ranks >= k[:, None], float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass
    # before it already reaches top_p (the first token is always kept).
    mass_before = probs.cumsum(dim=-1) - probs
    remove = mass_before >= batch.top_p[:, None]
    remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _logprobs(
    raw: torch.Tensor, tokens: torch.Tensor, wanted: tuple[int | None, ...]
) -> list[TokenLogprobs | None]:
    if all(w is None for w in wanted):
        return []
    logprobs = torch.log_softmax(raw.float(), dim=-1)
    sampled: list[float] = logprobs.gather(1, tokens[:, None]).squeeze(1).tolist()
    k = max(w or 0 for w in wanted)
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
    out: list[TokenLogprobs | None] = []
    for row, w in enumerate(wanted):
        if w is None:
            out.append(None)
        elif w == 0 or top_ids is None or top_values is None:
            out.append(TokenLogprobs(sampled[row], [], []))
        else:
            out.append(
                TokenLogprobs(sampled[row], top_ids[row, :w].tolist(), top_values[row, :w].tolist())
            )
    return out
