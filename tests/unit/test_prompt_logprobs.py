"""Prompt logprobs in the worker (which positions of a step predict which prompt tokens,
and their values, in slices) and in the scheduler (gathered chunk by chunk onto the first
output; never served from the prefix cache)."""

from __future__ import annotations

import pytest
import torch

from common.messages import ModelRunnerOutput, TokenLogprobs
from tests.unit.test_scheduler import make_scheduler, req, run_step
from worker import prompt_logprobs
from worker.prompt_logprobs import PromptSpan, compute_prompt_logprobs, prompt_span


def test_a_span_covers_the_positions_that_predict_prompt_tokens() -> None:
    tokens = [5, 6, 7, 8, 9, 42]  # a prompt of 5, then one output token
    assert prompt_span("r", tokens, 5, 0, 3, 10, 2) == PromptSpan("r", 10, [6, 7, 8], 2)
    # the last chunk: position 4 predicts the first output token, the sampler's
    assert prompt_span("r", tokens, 5, 3, 5, 0, 2) == PromptSpan("r", 0, [9], 2)
    assert prompt_span("r", tokens, 5, 5, 6, 0, 2) is None  # a decode step
    assert prompt_span("r", tokens, 5, 0, 5, 0, None) is None  # not asked


def test_values_match_a_log_softmax_of_the_logits_slice_by_slice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(prompt_logprobs, "_SLICE_ROWS", 2)
    torch.manual_seed(0)
    hidden, weight = torch.randn(7, 4), torch.randn(4, 11)
    spans = [PromptSpan("a", 1, [3, 0, 10, 7, 2], 3), PromptSpan("b", 6, [4], 0)]
    got = compute_prompt_logprobs(hidden, spans, lambda rows: rows @ weight)
    full = (hidden @ weight).log_softmax(-1)
    for span in spans:
        for i, (target, entry) in enumerate(zip(span.targets, got[span.request_id], strict=True)):
            row = full[span.first_row + i]
            assert entry.logprob == pytest.approx(float(row[target]), abs=1e-6)
            assert entry.rank == int((row > row[target]).sum()) + 1
            assert entry.top_token_ids == row.topk(span.k).indices.tolist()
    assert got["b"][0].top_token_ids == []


def test_the_scheduler_gathers_them_and_never_serves_the_prompt_from_cache() -> None:
    s = make_scheduler(budget=8)
    s.add_request(req("warm", 12, max_tokens=1))
    while s.requests:
        run_step(s)
    s.add_request(req("r", 12, max_tokens=1, prompt_logprobs=1))
    out = s.schedule()
    (new,) = out.new_requests
    assert new.num_computed_tokens == 0  # the warm prompt's blocks are not taken
    entries = [TokenLogprobs(-1.0 * i, [], []) for i in range(7)]
    result = ModelRunnerOutput(out.step_id, [], [], prompt_logprobs={"r": entries})
    assert s.update_from_output(out, result) == {}
    out = s.schedule()  # the last 4 tokens: 4 more entries, and the first token
    rest = [TokenLogprobs(-10.0 - i, [], []) for i in range(4)]
    result = ModelRunnerOutput(out.step_id, ["r"], [50], prompt_logprobs={"r": rest})
    (first,) = s.update_from_output(out, result)[b"client"]
    assert first.prompt_logprobs == entries + rest  # one per prompt token after the first
