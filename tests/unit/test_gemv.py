"""The AVX512-BF16 GEMV against float32 matmul rounded once to bfloat16, on whichever
CPU runs the suite: where the kernels were built without AVX512-BF16 it must say so, and
the linears must keep oneDNN for every batch size. ``PackedLinear`` sends 1-4 rows to the
GEMV and everything else to oneDNN."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from worker.models.packed_linear import GEMV_MAX_ROWS, PackedLinear
from worker.native import kernel_arch, load_native_kernels
from worker.ops import NativeOps, TorchOps


def cpu_has_avx512_bf16() -> bool:
    flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if "flags" in line)
    return "avx512_bf16" in flags.split()


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    out = x.float() @ w.float().T
    return (out if b is None else out + b.float()).to(torch.bfloat16)


def test_built_exactly_where_the_cpu_has_avx512_bf16() -> None:
    kernels = load_native_kernels()
    if kernel_arch() == "native":
        assert kernels.has_bf16_gemv() == cpu_has_avx512_bf16()
    ops = NativeOps(kernels)
    assert (ops.small_batch_linear is not None) == kernels.has_bf16_gemv()
    assert TorchOps().small_batch_linear is None


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize(("out_features", "in_features"), [(960, 576), (37, 70), (4, 1536)])
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
    ours, ref = kernels.bf16_gemv(x, w, b), reference(x, w, b)
    assert ours.shape == (rows, out_features) and ours.dtype == torch.bfloat16
    # One rounding of a float32 sum; only the order of the float32 additions differs, so
    # a result is the reference's or its bfloat16 neighbour, and almost always equal.
    ulp = torch.finfo(torch.bfloat16).eps * ref.float().abs().clamp_min(1e-3)
    assert ((ours.float() - ref.float()).abs() <= ulp).all()
    assert (ours == ref).float().mean() >= 0.97


def test_refuses_what_it_cannot_take() -> None:
    kernels = load_native_kernels()
    built = kernels.has_bf16_gemv()  # without AVX512-BF16 every call is refused, first

    def refused(why: str) -> Any:
        return pytest.raises(RuntimeError, match=why if built else "AVX512-BF16")

    w = torch.ones(8, 64, dtype=torch.bfloat16)
    with refused("1 to 4 rows"):
        kernels.bf16_gemv(torch.ones(5, 64, dtype=torch.bfloat16), w, None)
    with refused("bfloat16"):
        kernels.bf16_gemv(torch.ones(1, 64), w.float(), None)
    with refused(r"\[M, K\]"):
        kernels.bf16_gemv(torch.ones(1, 32, dtype=torch.bfloat16), w, None)
    with refused("bias"):
        bias = torch.ones(7, dtype=torch.bfloat16)
        kernels.bf16_gemv(torch.ones(1, 64, dtype=torch.bfloat16), w, bias)


def test_packed_linear_routes_small_batches_to_the_gemv() -> None:
    calls: list[int] = []

    def fake_gemv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        calls.append(x.shape[0])
        return nn.functional.linear(x, w, b)

    torch.manual_seed(0)
    linear = nn.Linear(64, 48).to(torch.bfloat16)
    packed = PackedLinear(linear, fake_gemv)
    for rows in (0, 1, 3, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1, 32):
        x = torch.randn(rows, 64, dtype=torch.bfloat16)
        assert torch.equal(packed(x), nn.functional.linear(x, linear.weight, linear.bias))
    assert calls == [1, 3, GEMV_MAX_ROWS]  # 0 rows and more than 4 stay on oneDNN
    x3 = torch.randn(1, 2, 64, dtype=torch.bfloat16)  # [batch, seq, in] flattens to 2 rows
    assert packed(x3).shape == (1, 2, 48) and calls[-1] == 2
    assert PackedLinear(linear).weight is None  # no GEMV: no second copy of the weight
