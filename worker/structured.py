"""Structured outputs in the worker: a grammar matcher per constrained request, and the
grammar rows of a step (whether each accepts a token, and its mask).

Grammars are compiled by llguidance (``common/grammar.py`` says why that engine) over
the model's tokenizer, once per distinct spec (an LRU cache), and a matcher is made per
request from the compiled grammar. A matcher is advanced by every token the request
samples; after a preemption it is rebuilt and replays the tokens generated so far. When
the grammar is complete the mask allows only the model's EOS tokens, so the request
stops there. The sampler asks a step's grammars whether they accept its picks and masks
only the rows that do not (``worker/sampler.py`` says why that is exact).
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
    """Compiled grammars and the grammars of a step; the tokenizer is loaded on first use
    (about a second), so workers that never see a constrained request never pay it."""

    def __init__(self, model_dir: Path, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._model_dir = model_dir
        self._vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._grammars: OrderedDict[tuple[int, str], str] = OrderedDict()

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

    def step(self, matchers: Sequence[GrammarMatcher | None]) -> StepGrammars:
        """The grammars of a step's rows (None where a row is unconstrained)."""
        return StepGrammars(matchers, (self._vocab_size + 31) // 32, self._eos)


class StepGrammars:
    """One step's constrained rows, as the sampler's ``Constraint``. Masks are computed on
    the calling thread, row by row: llguidance's parallel executor measured no faster on
    a 2-core host, and its idle workers spun on the cores the forward's threads need
    (structured streams +40% a token at 32 rows with it, +24% without; bench.structured)."""

    def __init__(
        self, matchers: Sequence[GrammarMatcher | None], words: int, eos: Sequence[int]
    ) -> None:
        self._matchers = matchers
        self._words = words
        self._eos = frozenset(eos)
        self._rows = [i for i, m in enumerate(matchers) if m is not None]

    @property
    def rows(self) -> Sequence[int]:
        return self._rows

    def _llg(self, row: int) -> llguidance.LLMatcher:
        matcher = self._matchers[row]
        if matcher is None:
            raise ValueError(f"row {row} has no grammar")
        return matcher.llg

    def accepts(self, row: int, token: int) -> bool:
        """Whether the mask would allow ``token``, without computing it. Two cases where
        the matcher's own check differs from its mask: where the grammar forces text, the
        mask allows only the forced text's first token (not every token spelling a
        prefix of it), and at the end the mask allows EOS, which the check refuses."""
        llg = self._llg(row)
        if token in self._eos:
            return llg.is_accepting()
        forced = llg.compute_ff_tokens()
        if forced:
            return token == forced[0]
        return llg.validate_tokens([token]) == 1

    def bitmask(self, rows: Sequence[int]) -> torch.Tensor:
        mask = torch.empty((len(rows), self._words), dtype=torch.int32)
        # llguidance writes each row's bits straight into the tensor's memory.
        for i, row in enumerate(rows):
            self._llg(row).unsafe_compute_mask_ptr(mask[i].data_ptr(), self._words * 4)
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
