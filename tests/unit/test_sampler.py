"""The sampler, checked statistically with fixed seeds: each parameter changes the
distribution as documented, and a seeded request samples the same alone or in a batch."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch

from common.messages import SamplingParams
from worker.native import load_native_kernels
from worker.ops import NativeOps, TorchOps
from worker.sampler import SamplingBatch, _draw, sample

N = 20000
PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])


def draw(
    logits: torch.Tensor,
    n: int = N,
    seen: list[int] | None = None,
    outputs: list[int] | None = None,
    **params: float,
) -> torch.Tensor:
    """Empirical distribution of ``n`` draws from one row of logits."""
    torch.manual_seed(1234)
    p = SamplingParams(**params)  # type: ignore[arg-type]
    prompt = seen or []
    output = outputs or []
    batch = SamplingBatch.build(
        [p] * n,
        [None] * n,
        torch.device("cpu"),
        token_ids=[prompt + output] * n,
        num_prompt_tokens=[len(prompt)] * n,
        vocab_size=logits.shape[-1],
    )
    tokens = torch.tensor(sample(logits.expand(n, -1).contiguous(), batch).token_ids)
    return torch.bincount(tokens, minlength=logits.shape[-1]).float() / n


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().sum() / 2)


def entropy(p: torch.Tensor) -> float:
    return float(-(p[p > 0] * p[p > 0].log()).sum())


def test_greedy_is_argmax() -> None:
    x = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    batch = SamplingBatch.build(
        [SamplingParams(temperature=0.0)] * 4, [None] * 4, torch.device("cpu")
    )
    assert sample(x, batch).token_ids == x.argmax(-1).tolist()


def test_greedy_reads_bf16_logits_as_they_are_with_native_ops() -> None:
    """The plain greedy step takes the argmax of the bfloat16 logits (no float32 copy):
    the same tokens as over their float32 values, with either ops, logprobs in float32."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 49152, generator=gen).to(torch.bfloat16)
    x[2, 100:] = x[2].max()  # a tie: the first maximum
    params = [SamplingParams(temperature=0.0)] * 4 + [SamplingParams(temperature=0.0, logprobs=2)]
    batch = SamplingBatch.build(params, [None] * 5, torch.device("cpu"))
    expected = x.float().argmax(-1).tolist()
    for ops in (TorchOps(), NativeOps(load_native_kernels())):
        out = sample(x, batch, ops)
        assert out.token_ids == expected and out.token_ids[2] == int(x[2].float().argmax())
        last = out.logprobs[4]
        assert last is not None and out.logprobs[:4] == [None] * 4
        reference = torch.log_softmax(x[4].float(), -1)
        assert last.logprob == pytest.approx(float(reference.max()), abs=1e-5)
        assert last.top_token_ids == reference.topk(2).indices.tolist()


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_draws_follow_softmax_at_temperature(temperature: float) -> None:
    logits = PROBS.log()
    expected = torch.softmax(logits / temperature, -1)
    assert tv(draw(logits, temperature=temperature), expected) < 0.02


def test_temperature_raises_entropy() -> None:
    logits = PROBS.log()
    h = [entropy(draw(logits, temperature=t)) for t in (0.3, 1.0, 3.0)]
    assert h[0] < h[1] < h[2]


def test_top_k_keeps_exactly_the_k_most_likely() -> None:
    got = draw(PROBS.log(), top_k=2)
    assert got[2:].sum() == 0
    assert tv(got, torch.tensor([0.625, 0.375, 0, 0])) < 0.02


def test_top_p_keeps_the_smallest_nucleus() -> None:
    got = draw(PROBS.log(), top_p=0.7)  # 0.5 < 0.7 <= 0.8: tokens 0 and 1
    assert got[2:].sum() == 0 and tv(got, torch.tensor([0.625, 0.375, 0, 0])) < 0.02
    got = draw(PROBS.log(), top_p=0.85)
    assert got[3] == 0 and got[2] > 0.1


def test_min_p_drops_tokens_below_a_fraction_of_the_best() -> None:
    got = draw(PROBS.log(), min_p=0.2)  # threshold 0.1: token 3 (0.05) goes
    assert got[3] == 0 and tv(got, torch.tensor([0.5, 0.3, 0.15, 0]) / 0.95) < 0.02


def test_repetition_penalty_discourages_seen_tokens() -> None:
    logits = torch.ones(8)
    got = draw(logits, seen=[0, 1], repetition_penalty=2.0)  # seen logits 1 -> 0.5
    weights = torch.tensor([math.exp(0.5)] * 2 + [math.e] * 6)
    assert tv(got, weights / weights.sum()) < 0.02


def test_repetition_penalty_pushes_negative_logits_down() -> None:
    logits = torch.tensor([-1.0, -1.5])
    assert (
        draw(logits, n=1, seen=[0], temperature=0.0, repetition_penalty=2.0).argmax() == 1
    )  # -1 -> -2


def test_frequency_and_presence_penalties_scale_with_output_counts() -> None:
    logits = torch.zeros(6)
    outputs = [0, 0, 0, 1]  # token 0 three times, token 1 once; prompt tokens do not count
    got = draw(logits, seen=[2, 2], outputs=outputs, frequency_penalty=0.5, presence_penalty=0.25)
    weights = torch.tensor([math.exp(-1.75), math.exp(-0.75), 1, 1, 1, 1])
    assert tv(got, weights / weights.sum()) < 0.02


def test_seed_gives_the_same_tokens_alone_or_in_a_batch_of_8() -> None:
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(3))
    for seed in range(20):
        params = SamplingParams(temperature=1.0, top_p=0.95, seed=seed)
        alone = sample(
            logits[:1],
            SamplingBatch.build(
                [params], [torch.Generator().manual_seed(seed)], torch.device("cpu")
            ),
        )
        others = [SamplingParams(temperature=0.8, seed=100 + i) for i in range(7)]
        gens = [torch.Generator().manual_seed(seed)] + [
            torch.Generator().manual_seed(100 + i) for i in range(7)
        ]
        crowd = sample(logits, SamplingBatch.build([params, *others], gens, torch.device("cpu")))
        assert alone.token_ids[0] == crowd.token_ids[0]


def test_logprobs_are_of_the_raw_distribution() -> None:
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(5))
    params = [
        SamplingParams(temperature=1.5, logprobs=3),
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(),
    ]
    out = sample(logits, SamplingBatch.build(params, [None] * 3, torch.device("cpu")))
    reference = torch.log_softmax(logits, -1)
    first, second, third = out.logprobs
    assert first is not None and second is not None and third is None
    assert first.logprob == pytest.approx(float(reference[0, out.token_ids[0]]), abs=1e-5)
    assert first.top_token_ids == reference[0].topk(3).indices.tolist()
    assert first.top_logprobs == pytest.approx(reference[0].topk(3).values.tolist(), abs=1e-5)
    assert second.top_token_ids == [] and out.token_ids[1] == int(logits[1].argmax())
    assert second.logprob == pytest.approx(float(reference[1].max()), abs=1e-5)


def test_penalties_without_history_are_refused() -> None:
    with pytest.raises(ValueError, match="penalties need"):
        SamplingBatch.build([SamplingParams(presence_penalty=1.0)], [None], torch.device("cpu"))


def test_min_tokens_bans_eos_and_stop_tokens_until_reached() -> None:
    logits = torch.tensor([[0.0, 5.0, 9.0, 1.0]])  # EOS (2) and stop token 1 are the likeliest
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[1])

    def pick(num_output: int) -> int:
        batch = SamplingBatch.build(
            [params],
            [None],
            torch.device("cpu"),
            token_ids=[[7] * (4 + num_output)],
            num_prompt_tokens=[4],
            vocab_size=4,
            eos_token_ids=[2],
        )
        return sample(logits, batch).token_ids[0]

    assert pick(0) == 3 and pick(2) == 3  # neither EOS nor the stop token before 3 outputs
    assert pick(3) == 2


def test_logit_bias_moves_the_distribution_as_added_logits() -> None:
    logits = PROBS.log()
    biased = draw(logits, n=5000, logit_bias={3: math.log(10.0)})  # type: ignore[arg-type]
    expected = PROBS * torch.tensor([1.0, 1.0, 1.0, 10.0])
    assert tv(biased, expected / expected.sum()) < 0.03
    banned = draw(logits, n=2000, logit_bias={0: -100.0})  # type: ignore[arg-type]
    assert banned[0] == 0.0


def test_allowed_token_ids_are_the_only_ones_sampled() -> None:
    dist = draw(PROBS.log(), n=5000, allowed_token_ids=[1, 3])  # type: ignore[arg-type]
    assert dist[0] == 0.0 and dist[2] == 0.0
    assert tv(dist, torch.tensor([0.0, 0.3, 0.0, 0.05]) / 0.35) < 0.03
    greedy = SamplingBatch.build(
        [SamplingParams(temperature=0.0, allowed_token_ids=[2])], [None], torch.device("cpu")
    )
    assert sample(PROBS.log()[None], greedy).token_ids == [2]


class FixedMasks:
    """A ``Constraint`` over fixed per-row allowed sets, counting the masks it computes."""

    def __init__(self, vocab: int, allowed: dict[int, list[int]]) -> None:
        self.vocab, self.allowed = vocab, allowed
        self.masked: list[int] = []
        self.rows = sorted(allowed)

    def accepts(self, row: int, token: int) -> bool:
        return token in self.allowed[row]

    def bitmask(self, rows: Sequence[int]) -> torch.Tensor:
        self.masked += list(rows)
        mask = torch.zeros(len(rows), (self.vocab + 31) // 32, dtype=torch.int32)
        for i, row in enumerate(rows):
            for token in self.allowed[row]:
                mask[i, token // 32] |= 1 << (token % 32)
        return mask


def test_a_grammar_masks_only_the_rows_whose_pick_it_rejects() -> None:
    logits = torch.zeros(3, 70)
    logits[:, 5] = 10.0  # the favourite: row 0's grammar rejects it, row 1's takes it
    constraint = FixedMasks(70, {0: [40, 41], 1: [5, 40]})
    logits[0, 41] = 1.0
    batch = SamplingBatch.build(
        [SamplingParams(temperature=0.0)] * 3,
        [None] * 3,
        torch.device("cpu"),
        constraint=constraint,
    )
    out = sample(logits, batch)
    assert out.token_ids == [41, 5, 5]
    assert constraint.masked == [0]


def test_a_rejected_draw_redrawn_under_the_mask_is_the_masked_distribution() -> None:
    n = N
    logits = PROBS.log().expand(n, -1).contiguous()
    constraint = FixedMasks(4, {row: [1, 2] for row in range(n)})
    torch.manual_seed(99)
    batch = SamplingBatch.build(
        [SamplingParams(temperature=1.0)] * n,
        [None] * n,
        torch.device("cpu"),
        constraint=constraint,
    )
    tokens = torch.tensor(sample(logits, batch).token_ids)
    dist = torch.bincount(tokens, minlength=4).float() / n
    assert dist[0] == 0.0 and dist[3] == 0.0
    assert tv(dist, torch.tensor([0.0, 0.3, 0.15, 0.0]) / 0.45) < 0.02
    assert 0.5 < len(constraint.masked) / n < 0.6  # only the rejected draws: 1 - 0.45


def test_a_truncating_row_is_masked_before_its_draw() -> None:
    # top_k=1 after the mask keeps the best allowed token; before it, the favourite (0),
    # which the grammar rejects: masked afterwards, the draw would be from all of A.
    logits = PROBS.log()[None].repeat(200, 1)
    constraint = FixedMasks(4, {row: [1, 2] for row in range(200)})
    batch = SamplingBatch.build(
        [SamplingParams(temperature=1.0, top_k=1)] * 200,
        [None] * 200,
        torch.device("cpu"),
        constraint=constraint,
    )
    assert sample(logits, batch).token_ids == [1] * 200
    assert constraint.masked == list(range(200))  # once each, before the draw


def test_a_draw_inverts_the_cumulative_distribution_at_its_uniform() -> None:
    probs = torch.tensor([[0.5, 0.0, 0.2, 0.3, 0.0]] * 6)
    # Cumulative sums 0.5, 0.5, 0.7, 1.0, 1.0: token 1 and token 4 (probability 0) are
    # never drawn, whatever the number, even the largest float below 1.
    below_one = torch.nextafter(torch.tensor(1.0), torch.tensor(0.0)).item()
    uniform = torch.tensor([[0.0], [0.49], [0.5], [0.69], [0.7], [below_one]])
    assert _draw(probs, uniform).tolist() == [0, 0, 2, 2, 3, 3]


def test_a_row_with_all_its_mass_on_one_token_always_draws_it() -> None:
    probs = torch.zeros(3, 1000)
    probs[0, 0] = probs[1, 999] = probs[2, 417] = 1.0
    for u in (0.0, 0.5, torch.nextafter(torch.tensor(1.0), torch.tensor(0.0)).item()):
        assert _draw(probs, torch.full((3, 1), u)).tolist() == [0, 999, 417]
