"""RoPE's per-position table: a step's cos and sin looked up equal, bit for bit, the same
positions computed alone (what transformers computes for them), whichever positions a
step holds and however far the table has grown."""

from __future__ import annotations

import pytest
import torch

from worker.models.layers import RopeSpec, RotaryEmbedding

SPECS = {
    "default": RopeSpec(theta=10000.0),
    "linear": RopeSpec(theta=1e6, scaling="linear", factor=8.0),
    "llama3": RopeSpec(theta=500000.0, scaling="llama3", factor=8.0),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", sorted(SPECS))
def test_table_lookups_equal_positions_computed_alone(kind: str, dtype: torch.dtype) -> None:
    rope = RotaryEmbedding(64, SPECS[kind])
    generator = torch.Generator().manual_seed(0)
    steps = [
        torch.tensor([0]),
        torch.randint(0, 1024, (37,), generator=generator),  # a prefill's worth, unsorted
        torch.tensor([1023, 5, 700]),
        torch.tensor([5000, 3, 4095]),  # past the first table: it grows
        torch.tensor([70_000]),
    ]
    for positions in steps:
        cos, sin = rope(positions, dtype, int(positions.max()) + 1)
        for row, position in enumerate(positions.tolist()):
            alone_cos, alone_sin = rope._compute(torch.tensor([position]), dtype)
            assert torch.equal(cos[row : row + 1], alone_cos), (kind, position)
            assert torch.equal(sin[row : row + 1], alone_sin), (kind, position)
        assert cos.dtype == sin.dtype == dtype and cos.is_contiguous() and sin.is_contiguous()


def test_the_table_grows_to_a_power_of_two_past_the_step_and_only_when_needed() -> None:
    rope = RotaryEmbedding(16, SPECS["default"])
    rope(torch.tensor([3]), torch.float32, 4)
    first = rope._tables[torch.float32][0]
    assert first.shape == (1024, 16)
    rope(torch.tensor([1023]), torch.float32, 1024)
    assert rope._tables[torch.float32][0] is first
    rope(torch.tensor([1024]), torch.float32, 1025)
    assert rope._tables[torch.float32][0].shape == (2048, 16)
