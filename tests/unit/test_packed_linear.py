"""oneDNN-prepacked bfloat16 linears give exactly what F.linear gives, at every batch
size the engine produces, and the loader packs every projection."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.cpu import ONEDNN_BF16, needs_onednn_bf16
from worker.packed_linear import PackedLinear, can_pack, pack_linears


def test_packs_exactly_where_onednn_computes_in_bfloat16() -> None:
    assert can_pack(torch.bfloat16, torch.device("cpu")) == ONEDNN_BF16
    assert not can_pack(torch.float32, torch.device("cpu"))  # float32 stays on F.linear
    if not ONEDNN_BF16:  # what the loader would otherwise have hit at load time
        with pytest.raises(RuntimeError, match="bf16 path needs"):
            torch.ops.mkldnn._reorder_linear_weight(torch.ones(4, 4, dtype=torch.bfloat16), 1)


@needs_onednn_bf16
@pytest.mark.parametrize("bias", [False, True])
def test_packed_equals_plain(bias: bool) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(576, 960, bias=bias).to(torch.bfloat16)
    packed = PackedLinear(linear)
    for rows in (1, 3, 8, 32, 33, 300):
        x = torch.randn(rows, 576, dtype=torch.bfloat16)
        assert torch.equal(packed(x), nn.functional.linear(x, linear.weight, linear.bias))
    x3 = torch.randn(2, 5, 576, dtype=torch.bfloat16)
    assert torch.equal(packed(x3), linear(x3))


@needs_onednn_bf16
def test_pack_linears_replaces_every_linear() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 4)))
    model = model.to(torch.bfloat16)
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    before = model(x)
    assert pack_linears(model) == 2
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert torch.equal(model(x), before)
