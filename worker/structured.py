"""Structured outputs in the worker: a grammar matcher per constrained request, and the
token bitmask of a step's sampled rows.

Grammars are compiled by llguidance (``common/grammar.py`` says why that engine) over
the model's tokenizer, once per distinct spec (an LRU cache), and a matcher is made per
request from the compiled grammar. A matcher is advanced by every token the request
samples; after a preemption it is rebuilt and replays the tokens generated so far. When
the grammar is complete the mask allows only the model's EOS tokens, so the request
stops there.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import llguidance
import torch

from common.grammar import grammar_text
from common.messages import StructuredOutput

logger = logging.getLogger(__name__)

_CACHED_GRAMMARS = 256


class GrammarMatcher:
    """One request's position in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher, request_id: str) -> None:
        self._matcher = matcher
        self._request_id = request_id

    def advance(self, token_id: int) -> None:
        if not self._matcher.consume_token(token_id):
            # Only possible when every token was masked (e.g. min_tokens banning the EOS
            # a finished grammar asks for); the request goes on unconstrained.
            logger.warning(
                "[%s] token %d left its grammar: %s",
                self._request_id,
                token_id,
                self._matcher.get_error(),
            )

    @property
    def llg(self) -> llguidance.LLMatcher:
        return self._matcher


class StructuredOutputs:
    """Compiled grammars and the bitmask of a step; the tokenizer is loaded on first use
    (about a second), so workers that never see a constrained request never pay it."""

    def __init__(self, model_dir: Path, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._model_dir = model_dir
        self._vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._grammars: OrderedDict[tuple[int, str], str] = OrderedDict()
        self._executor = llguidance.LLExecutor()

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            # Both pull in transformers (~0.9 s): only a worker that is sent a grammar pays.
            import llguidance.hf
            from transformers import AutoTokenizer

            hf: Any = AutoTokenizer.from_pretrained(str(self._model_dir))
            self._tokenizer = llguidance.hf.from_tokenizer(
                hf, n_vocab=self._vocab_size, eos_token=self._eos or None
            )
        return self._tokenizer

    def _grammar(self, structured: StructuredOutput) -> str:
        key = (int(structured.kind), structured.spec)
        grammar = self._grammars.get(key)
        if grammar is None:
            grammar = grammar_text(structured)
            self._grammars[key] = grammar
            if len(self._grammars) > _CACHED_GRAMMARS:
                self._grammars.popitem(last=False)
        else:
            self._grammars.move_to_end(key)
        return grammar

    def matcher(
        self, structured: StructuredOutput, request_id: str, generated: Sequence[int] = ()
    ) -> GrammarMatcher:
        """A matcher at the start of the grammar, advanced through ``generated``."""
        llg = llguidance.LLMatcher(self._llg_tokenizer(), self._grammar(structured))
        error = llg.get_error()
        if error:
            raise ValueError(f"the structured-output spec does not compile: {error}")
        matcher = GrammarMatcher(llg, request_id)
        for token in generated:
            matcher.advance(token)
        return matcher

    def bitmask(self, matchers: Sequence[GrammarMatcher | None]) -> torch.Tensor | None:
        """``[rows, ceil(vocab / 32)]`` int32, a bit per allowed token; all bits set on
        unconstrained rows. None when no row is constrained."""
        rows = [(m.llg, i) for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return None
        words = (self._vocab_size + 31) // 32
        mask = torch.full((len(matchers), words), -1, dtype=torch.int32)
        # llguidance writes each row's bits straight into the tensor's memory.
        if len(rows) == 1:
            matcher, row = rows[0]
            matcher.unsafe_compute_mask_ptr(mask[row].data_ptr(), words * 4)
        else:
            self._executor.unsafe_compute_mask_ptr(rows, mask.data_ptr(), words * 4, len(matchers))
        return mask


_BITS = torch.arange(32, dtype=torch.int32)


def apply_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Disallowed tokens' logits (a clear bit, or past the mask) to -inf, in place, by
    PyTorch ops (the native kernel ``apply_token_bitmask_`` does it in one pass)."""
    rows, vocab = logits.shape
    bits = (bitmask.to(logits.device).unsqueeze(-1) >> _BITS.to(logits.device)) & 1
    allowed = bits.view(rows, -1)[:, :vocab].bool()
    if allowed.shape[1] < vocab:
        logits[:, allowed.shape[1] :] = float("-inf")
        logits = logits[:, : allowed.shape[1]]
    logits.masked_fill_(~allowed, float("-inf"))
