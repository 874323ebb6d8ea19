"""What the engine checks of every request it is sent.

API servers validate requests before they send them, but the engine's input socket
takes frames from whoever can reach it: msgspec guarantees each field's type, these
checks its meaning (token ids inside the vocabulary, finite sampling values in range, a
structured-output spec that compiles), so that no frame can make a worker index outside
its tensors or sample from NaN. A failed check refuses the request (``ErrorKind.INVALID``).
"""

from __future__ import annotations

import math

from common.grammar import GrammarError, check_structured_output
from common.messages import EngineRequest, ModelInfo, SamplingParams

MAX_LOGPROBS = 20


def _finite(*values: float) -> bool:
    return all(math.isfinite(v) for v in values)


def sampling_error(p: SamplingParams, vocab_size: int) -> str | None:
    if p.max_tokens < 1:
        return f"max_tokens must be at least 1, got {p.max_tokens}"
    if not _finite(
        p.temperature,
        p.top_p,
        p.min_p,
        p.repetition_penalty,
        p.presence_penalty,
        p.frequency_penalty,
    ):
        return "sampling parameters must be finite numbers"
    if p.temperature < 0 or not 0 < p.top_p <= 1 or not 0 <= p.min_p <= 1:
        return "temperature must be >= 0, top_p in (0, 1] and min_p in [0, 1]"
    if p.top_k < 0 or p.repetition_penalty <= 0:
        return "top_k must be >= 0 and repetition_penalty > 0"
    if p.logprobs is not None and not 0 <= p.logprobs <= MAX_LOGPROBS:
        return f"logprobs must be in [0, {MAX_LOGPROBS}]"
    if not 0 <= p.min_tokens <= p.max_tokens:
        return f"min_tokens must be in [0, max_tokens], got {p.min_tokens}"
    for name, ids in (
        ("logit_bias", list(p.logit_bias or {})),
        ("allowed_token_ids", p.allowed_token_ids or []),
    ):
        if any(not 0 <= t < vocab_size for t in ids):
            return f"{name} has a token id outside the vocabulary (size {vocab_size})"
    if p.logit_bias and not _finite(*p.logit_bias.values()):
        return "logit_bias values must be finite"
    if p.allowed_token_ids is not None and not p.allowed_token_ids:
        return "allowed_token_ids must not be empty"
    if p.structured is not None:
        try:
            check_structured_output(p.structured)
        except GrammarError as e:
            return f"the structured-output spec does not compile: {e}"
    return None


def request_error(request: EngineRequest, model: ModelInfo) -> str | None:
    """Why this request can never be served as sent, or None."""
    bad = next((t for t in request.prompt_token_ids if not 0 <= t < model.vocab_size), None)
    if bad is not None:
        return f"token id {bad} is outside the vocabulary (size {model.vocab_size})"
    if not math.isfinite(request.arrival_time):
        return "arrival_time must be a finite number"
    return sampling_error(request.sampling_params, model.vocab_size)
