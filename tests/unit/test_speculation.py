"""Speculative decoding on the engine side: n-gram proposals, the flag's parsing, the
scheduler's drafts and their roll-back, with exact block ids."""

from __future__ import annotations

import json

import pytest

from common.config import SchedulerConfig
from common.messages import FinishReason, ModelInfo, ModelRunnerOutput, SamplingParams
from common.speculative_config import parse_speculative_config
from engine_core.kv_cache import KVCacheManager, hash_block
from engine_core.request import Request
from engine_core.scheduler import Scheduler
from engine_core.speculation import DraftRecord, NgramProposer
from tests.unit.clock import ManualClock

EOS = 2
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}


def test_ngram_proposes_what_followed_the_latest_earlier_occurrence() -> None:
    proposer = NgramProposer(2, 3)
    tokens = [5, 6, 7, 8, 9, 1, 5, 6, 7, 3, 4, 5, 6, 7]
    # The last 3 (5 6 7) occurred at 0 (then 8 9 1) and at 6 (then 3 4 5): the latest wins.
    assert proposer.propose(tokens, 3) == [3, 4, 5]
    assert proposer.propose(tokens, 1) == [3]
    assert proposer.propose(tokens, 0) == []
    # Only 2 tokens match (9 1 ... 9 1): the window shrinks to prompt_lookup_min.
    assert proposer.propose([9, 1, 4, 4, 8, 9, 1], 2) == [4, 4]
    assert proposer.propose([1, 2, 3, 4], 3) == []  # nothing repeats
    assert NgramProposer(3, 3).propose([9, 1, 4, 9, 1], 2) == []  # shorter than min


def test_ngram_ignores_a_byte_match_across_token_boundaries() -> None:
    # Little-endian int32: 1 = 01 00 00 00, 256 = 00 01 00 00, found at byte 3 of [1, 1].
    assert NgramProposer(1, 1).propose([1, 1, 9, 256], 2) == []
    assert NgramProposer(1, 1).propose([256, 1, 1, 9, 256], 2) == [1, 1]


def test_speculative_config_as_vllm_spells_it() -> None:
    config = parse_speculative_config(json.dumps(NGRAM))
    assert (config.num_speculative_tokens, config.prompt_lookup_min) == (3, 2)
    assert config.prompt_lookup_max == 2  # a missing bound takes the other's value
    both_missing = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 2}')
    assert (both_missing.prompt_lookup_min, both_missing.prompt_lookup_max) == (5, 5)
    old = parse_speculative_config('{"model": "[ngram]", "num_speculative_tokens": 2}')
    assert old.method == "ngram"
    assert not parse_speculative_config(None).enabled


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"method": "draft_model", "model": "x", "num_speculative_tokens": 2}, "not served yet"),
        ({"method": "ngram"}, "num_speculative_tokens must be an integer in [1, 16]"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "in [1, 16], got 0"),
        ({"method": "ngram", "num_speculative_tokens": True}, "must be an integer"),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 4,
                "prompt_lookup_max": 2,
            },
            "prompt_lookup_min <= prompt_lookup_max, got 4 and 2",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1},
            "unknown field lookahead",
        ),
        ({"num_speculative_tokens": 2}, 'needs "method"'),
        ({"method": "beam", "num_speculative_tokens": 2}, "unknown method 'beam'"),
    ],
)
def test_bad_speculative_config_is_refused_naming_the_problem(
    body: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match="--speculative-config") as caught:
        SchedulerConfig(speculative_config=json.dumps(body))
    assert message in str(caught.value)


def test_a_request_whose_drafts_keep_failing_backs_off_and_tries_again() -> None:
    record = DraftRecord()
    record.observe(4, 0)  # smoothed 0.5: still drafting
    assert record.ready()
    record.observe(4, 0)  # 0.25: below the bar, waits one step
    assert not record.ready() and record.ready()
    record.observe(4, 0)  # the retry fails too: waits twice as long
    assert [record.ready() for _ in range(3)] == [False, False, True]
    record.observe(4, 4)  # all accepted: the next wait starts from one step again
    record.observe(4, 0)
    record.observe(4, 0)
    assert [record.ready() for _ in range(2)] == [False, True]


def make(num_blocks: int = 32, max_model_len: int = 256, **spec: object) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=64, speculative_config=json.dumps(NGRAM | spec))
    kv = KVCacheManager(num_blocks, 4, enable_prefix_caching=True)
    model = ModelInfo(max_model_len=max_model_len, vocab_size=100, eos_token_ids=[EOS])
    return Scheduler(config, kv, model, clock=ManualClock())


def add(s: Scheduler, prompt: list[int], max_tokens: int = 20, **params: object) -> Request:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, **params)  # type: ignore[arg-type]
    request = Request("a", b"c", prompt, sp, 0.0)
    assert s.add_request(request) is None
    return request


# 10 11 12 13 10 11 12: the last two (11 12) were followed by 13 10 11.
PROMPT = [10, 11, 12, 13, 10, 11, 12, 14, 10, 11]


def prefill(s: Scheduler, first: int = 12) -> None:
    out = s.schedule()
    assert out.draft_token_ids == {}  # a prefill samples plainly
    s.update_from_output(out, ModelRunnerOutput(out.step_id, ["a"], [first]))


def test_a_decode_carries_drafts_and_rolls_back_what_was_rejected() -> None:
    s = make()
    request = add(s, PROMPT)
    prefill(s)  # tokens: PROMPT + [12] = 11 tokens in blocks 0, 1, 2
    assert s.kv.blocks_of("a") == [0, 1, 2]
    out = s.schedule()
    assert out.draft_token_ids == {"a": [14, 10, 11]}  # after the latest "11 12"
    assert out.num_scheduled_tokens == {"a": 4}  # its token 12, then three drafts
    assert s.kv.blocks_of("a") == [0, 1, 2, 3]  # room for 14 tokens
    assert out.cached_requests[0].num_kept_blocks == 3
    # The target chose 99 where the first draft said 14: nothing accepted.
    outputs = s.update_from_output(
        out, ModelRunnerOutput(out.step_id, ["a"], [99], num_accepted_drafts={"a": 0})
    )
    assert outputs[b"c"][0].new_token_ids == [99]
    assert request.token_ids == [*PROMPT, 12, 99]
    assert request.num_computed_tokens == 11  # 99 is computed next
    assert s.kv.blocks_of("a") == [0, 1, 2]  # 12 tokens: block 3 went back
    assert list(s.kv.free_queue)[-1] == 3
    assert s.kv.block_hashes[2] is None  # its last token is not computed yet
    out = s.schedule()  # "12 99" never occurred before: no drafts
    assert out.draft_token_ids == {} and out.cached_requests[0].num_kept_blocks == 3
    s.update_from_output(out, ModelRunnerOutput(out.step_id, ["a"], [10]))
    out = s.schedule()  # "99 10" neither; tokens: ... 12 99 10
    s.update_from_output(out, ModelRunnerOutput(out.step_id, ["a"], [11]))
    out = s.schedule()  # "10 11" was last followed by 12 99 10
    assert out.draft_token_ids == {"a": [12, 99, 10]}
    assert out.num_scheduled_tokens == {"a": 4}
    # 14 tokens held blocks 0 1 2 and 4 (block 3 went to the free queue's tail); 17 take 5.
    assert out.cached_requests[0].new_block_ids == [5]
    assert s.kv.blocks_of("a") == [0, 1, 2, 4, 5]
    # 12 accepted, then the target's 77: 16 tokens, 15 computed.
    outputs = s.update_from_output(
        out, ModelRunnerOutput(out.step_id, ["a"], [77], num_accepted_drafts={"a": 1})
    )
    assert outputs[b"c"][0].new_token_ids == [12, 77]
    assert request.num_computed_tokens == 15
    assert s.kv.blocks_of("a") == [0, 1, 2, 4]  # 16 tokens fill 4 blocks; 5 went back
    assert list(s.kv.free_queue)[-2:] == [3, 5]
    # Cached hashes cover verified, computed tokens only: blocks 0-2 (tokens 0-11).
    tokens = request.token_ids
    expected, parent = [], None
    for start in (0, 4, 8):
        parent = hash_block(parent, tokens[start : start + 4])
        expected.append(parent)
    assert [s.kv.block_hashes[b] for b in (0, 1, 2)] == expected
    assert s.kv.block_hashes[4] is None and s.kv.block_hashes[5] is None
    stats = s.stats()
    assert (stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens) == (2, 6)
    assert stats.spec_decode_num_accepted_tokens == 1
    assert stats.spec_decode_num_accepted_tokens_per_pos == [1, 0, 0]


def test_a_stop_token_inside_the_accepted_drafts_ends_the_request_there() -> None:
    s = make()
    request = add(s, PROMPT, stop_token_ids=[10])
    prefill(s)
    out = s.schedule()
    assert out.draft_token_ids == {"a": [14, 10, 11]}
    outputs = s.update_from_output(
        out, ModelRunnerOutput(out.step_id, ["a"], [50], num_accepted_drafts={"a": 3})
    )
    (output,) = outputs[b"c"]
    assert output.new_token_ids == [14, 10] and output.finish_reason == FinishReason.STOP
    assert request.token_ids[-2:] == [14, 10]
    assert s.kv.num_used_blocks == 0 and not s.requests


def test_drafts_stop_short_of_max_tokens_and_the_context() -> None:
    s = make()
    add(s, PROMPT, max_tokens=3)
    prefill(s)  # one output token: two to go, so one draft at most
    out = s.schedule()
    assert out.draft_token_ids == {"a": [14]}
    s2 = make(max_model_len=13)  # 11 tokens now: the context leaves room for one more
    add(s2, PROMPT)
    prefill(s2)
    assert s2.schedule().draft_token_ids == {"a": [14]}


def test_drafts_never_preempt_and_skip_requests_that_cannot_take_them() -> None:
    s = make(num_blocks=3)  # 12 slots: the 11 tokens fit, drafts would need a fourth block
    add(s, PROMPT)
    prefill(s)
    out = s.schedule()
    assert out.draft_token_ids == {} and out.num_scheduled_tokens == {"a": 1}
    assert s.num_preemptions_total == 0
    s = make()
    add(s, PROMPT, logprobs=2)  # logprobs advance one token a step
    prefill(s)
    assert s.schedule().draft_token_ids == {}


def test_a_busy_step_drafts_nothing() -> None:
    s = make(disable_by_batch_size=1)
    for rid in ("a", "b"):
        sp = SamplingParams(max_tokens=20, temperature=0.0)
        assert s.add_request(Request(rid, b"c", list(PROMPT), sp, 0.0)) is None
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput(out.step_id, ["a", "b"], [12, 12]))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 1, "b": 1} and out.draft_token_ids == {}
    assert s.can_schedule_ahead  # without drafts, async scheduling plans ahead as before


def test_no_step_is_planned_ahead_of_one_verifying_drafts() -> None:
    # a drafts while b is admitted in the same step: two running is past the batch size
    # that drafts, yet the next step must wait for a's verification (where it starts).
    s = make(disable_by_batch_size=1)
    add(s, PROMPT)
    prefill(s)
    sp = SamplingParams(max_tokens=20, temperature=0.0)
    assert s.add_request(Request("b", b"c", [40, 41, 42], sp, 1.0)) is None
    out = s.schedule()
    assert out.draft_token_ids == {"a": [14, 10, 11]} and "b" in out.num_scheduled_tokens
    assert not s.can_schedule_ahead
    s.update_from_output(
        out, ModelRunnerOutput(out.step_id, ["a", "b"], [99, 7], num_accepted_drafts={"a": 0})
    )
    assert s.can_schedule_ahead
