"""The AVX512-BF16 GEMV (and past 4 rows its AMX kernel) against float32 matmul rounded
once to bfloat16, on whichever CPU runs the suite: where the kernels were built without
AVX512-BF16 it must say so, and the linears must keep oneDNN for every batch size; without
AMX it takes 1-2 rows (bf16_gemm the rest: test_bf16_gemm), with AMX up to 32 of weights
whose shape fits the tiles (and 4 of others).
``PackedLinear`` sends the rows the GEMV takes to it and everything else to oneDNN."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from tests.cpu import cpu_has, needs_onednn_bf16
from tests.unit.bf16_matmul import reference, within_one_rounding
from worker.native import kernel_arch, load_native_kernels
from worker.ops import NativeOps, TorchOps
from worker.packed_linear import Gemv, PackedLinear


def test_built_exactly_where_the_cpu_has_avx512_bf16() -> None:
    kernels = load_native_kernels()
    native = kernel_arch() == "native"
    if native:
        assert kernels.has_bf16_gemv() == cpu_has("avx512_bf16")
    amx = native and cpu_has("amx_bf16")  # the portable levels leave AMX out
    gemv_rows = (32 if amx else 4) if kernels.has_bf16_gemv() else 0
    assert kernels.bf16_gemv_max_rows(960, 576) == gemv_rows
    # AMX tiles: outputs in pairs of 16-output blocks, inputs in steps of 32
    assert kernels.bf16_gemv_max_rows(976, 576) == min(gemv_rows, 4)
    assert kernels.bf16_gemv_max_rows(960, 592) == min(gemv_rows, 4)
    ops = NativeOps(kernels)
    # where the GEMM packs (no AMX) it takes one row too: no GEMV is picked there
    gemv_picked = kernels.has_bf16_gemv() and not kernels.bf16_gemm_packs()
    assert (ops.small_batch_linear is not None) == gemv_picked
    assert TorchOps().small_batch_linear is None


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 16, 17, 32])
@pytest.mark.parametrize(
    ("out_features", "in_features"), [(960, 576), (37, 70), (4, 1536), (96, 64)]
)
@pytest.mark.parametrize("bias", [False, True])
def test_matches_float32_matmul(rows: int, out_features: int, in_features: int, bias: bool) -> None:
    kernels = load_native_kernels()
    if not kernels.has_bf16_gemv():  # refused: test_refuses_what_it_cannot_take
        assert NativeOps(kernels).small_batch_linear is None
        return
    gen = torch.Generator().manual_seed(rows * 1000 + out_features + in_features)
    x = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
    w = (torch.randn(out_features, in_features, generator=gen) * 0.05).to(torch.bfloat16)
    b = torch.randn(out_features, generator=gen).to(torch.bfloat16) if bias else None
    if rows > kernels.bf16_gemv_max_rows(out_features, in_features):
        with pytest.raises(RuntimeError, match=f"got {rows}"):
            kernels.bf16_gemv(x, w, b)
        return
    ours, ref = kernels.bf16_gemv(x, w, b), reference(x, w, b)
    assert ours.shape == (rows, out_features) and ours.dtype == torch.bfloat16
    assert within_one_rounding(ours, ref)
    assert (ours == ref).float().mean() >= 0.97  # and almost always equal


def test_a_row_comes_out_the_same_whatever_the_batch() -> None:
    """Past 4 rows (AMX) an output depends only on its own row of x: a sequence's
    tokens do not change with who else is in the step."""
    kernels = load_native_kernels()
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(32, 576, generator=gen).to(torch.bfloat16)
    w = (torch.randn(960, 576, generator=gen) * 0.05).to(torch.bfloat16)
    b = torch.randn(960, generator=gen).to(torch.bfloat16)
    max_rows = kernels.bf16_gemv_max_rows(960, 576)
    if max_rows < 32:  # no AMX: 5 rows and more are refused (test_matches_float32_matmul)
        assert max_rows in (0, 4)
        return
    whole = kernels.bf16_gemv(x, w, b)
    for rows in (5, 9, 16, 17, 31):
        assert torch.equal(kernels.bf16_gemv(x[:rows].contiguous(), w, b), whole[:rows])
    assert torch.equal(kernels.bf16_gemv(x[7:19].contiguous(), w, b), whole[7:19])


def test_refuses_what_it_cannot_take() -> None:
    kernels = load_native_kernels()
    built = kernels.has_bf16_gemv()  # without AVX512-BF16 every call is refused, first

    def refused(why: str) -> Any:
        return pytest.raises(RuntimeError, match=why if built else "AVX512-BF16")

    w = torch.ones(8, 64, dtype=torch.bfloat16)
    with refused(r"1 to 4 rows of a \[8, 64\] weight, got 5"):  # 8 outputs: no AMX tiles
        kernels.bf16_gemv(torch.ones(5, 64, dtype=torch.bfloat16), w, None)
    with refused("got 33"):
        big = torch.ones(64, 64, dtype=torch.bfloat16)
        kernels.bf16_gemv(torch.ones(33, 64, dtype=torch.bfloat16), big, None)
    with refused("bfloat16"):
        kernels.bf16_gemv(torch.ones(1, 64), w.float(), None)
    with refused(r"\[M, K\]"):
        kernels.bf16_gemv(torch.ones(1, 32, dtype=torch.bfloat16), w, None)
    with refused("bias"):
        bias = torch.ones(7, dtype=torch.bfloat16)
        kernels.bf16_gemv(torch.ones(1, 64, dtype=torch.bfloat16), w, bias)


@needs_onednn_bf16
@pytest.mark.parametrize("gemv_rows", [4, 32])
def test_packed_linear_routes_small_batches_to_the_gemv(gemv_rows: int) -> None:
    calls: list[int] = []
    shapes: list[tuple[int, int]] = []

    def fake_gemv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        calls.append(x.shape[0])
        return nn.functional.linear(x, w, b)

    def max_rows(out_features: int, in_features: int) -> int:
        shapes.append((out_features, in_features))
        return gemv_rows

    torch.manual_seed(0)
    linear = nn.Linear(64, 48).to(torch.bfloat16)
    packed = PackedLinear(linear, Gemv(fake_gemv, max_rows))
    assert shapes == [(48, 64)]  # asked once, for this weight's shape
    for rows in (0, 1, 3, 4, 5, 32, 33):
        x = torch.randn(rows, 64, dtype=torch.bfloat16)
        assert torch.equal(packed(x), nn.functional.linear(x, linear.weight, linear.bias))
    # 0 rows and more than the GEMV takes stay on oneDNN
    assert calls == [r for r in (1, 3, 4, 5, 32) if r <= gemv_rows]
    x3 = torch.randn(1, 2, 64, dtype=torch.bfloat16)  # [batch, seq, in] flattens to 2 rows
    assert packed(x3).shape == (1, 2, 48) and calls[-1] == 2
    assert PackedLinear(linear).weight is None  # no GEMV: no second copy of the weight
    assert PackedLinear(linear, Gemv(fake_gemv, lambda o, i: 0)).weight is None
