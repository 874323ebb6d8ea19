"""The bfloat16 GEMM (``worker/csrc/bf16_gemm.cpp``: AVX512-BF16, or AVX2 and FMA) against
float32 matmul rounded once to bfloat16, on whichever CPU runs the suite, and again on the
x86-64-v3 build (its AVX2 tiles): built wherever there is AVX2 and FMA, chosen over oneDNN
exactly where there is no AMX, an output row independent of the rest of the batch, and bad
arguments refused. ``PackedLinear`` over its packing routes past the GEMV's rows to it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.avx2_build import assert_passes_on_the_avx2_build
from tests.cpu import cpu_has
from tests.unit.bf16_matmul import reference, within_one_rounding
from worker.native import kernel_arch, load_native_kernels
from worker.ops import NativeOps, TorchOps
from worker.packed_linear import BF16_GEMM_CODE, ONEDNN, Gemv, PackedLinear

kernels = load_native_kernels()
# Below AVX2 and FMA (the CPU, or an x86-64-v2 kernel build) there is no product to check;
# what such a build must do instead, refuse, is checked by test_refuses_what_it_cannot_take.
needs_gemm = pytest.mark.skipif(
    not kernels.has_bf16_gemm(), reason="no AVX2 and FMA on this CPU or kernel build level"
)


def operands(
    rows: int, out_features: int, in_features: int, bias: bool, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(seed + rows * 1000 + out_features + in_features)
    x = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
    w = (torch.randn(out_features, in_features, generator=gen) * 0.05).to(torch.bfloat16)
    b = torch.randn(out_features, generator=gen).to(torch.bfloat16) if bias else None
    return x, w, b


def test_built_wherever_there_is_avx2_and_chosen_where_there_is_no_amx() -> None:
    arch = kernel_arch()
    if arch == "native":
        assert kernels.has_bf16_gemm() == (cpu_has("avx2") and cpu_has("fma"))
        assert kernels.has_bf16_gemv() == cpu_has("avx512_bf16")
        assert kernels.has_amx_linear() == cpu_has("amx_bf16")
    else:  # the portable levels: v3 and v4 have AVX2 and FMA, none has AVX512-BF16
        assert kernels.has_bf16_gemm() == (arch in ("x86-64-v3", "x86-64-v4"))
        assert not kernels.has_bf16_gemv()
    assert kernels.has_bf16_gemv() <= kernels.has_bf16_gemm()  # the GEMV only with the GEMM
    # the AVX2 tiles (no GEMV built) pack only where the CPU has no AVX512-BF16 for oneDNN
    avx2_tiles = kernels.has_bf16_gemm() and not kernels.has_bf16_gemv()
    packs = (
        kernels.has_bf16_gemm()
        and not kernels.has_amx_linear()
        and not (avx2_tiles and cpu_has("avx512_bf16"))
    )
    assert kernels.bf16_gemm_packs() == packs
    packing = NativeOps(kernels).packing
    assert (packing.code == BF16_GEMM_CODE) == packs
    assert packing is ONEDNN or packs
    assert TorchOps().packing is ONEDNN


@needs_gemm
# AVX512-BF16: 14 (one tile of the most rows), 15 (14 and 1), 29 (14, 8, 7), 32 (14, 9, 9);
# AVX2: 1 (one row over both blocks), 5 (one tile), 6 (5 and 1), 11 (5, 3, 3)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 9, 11, 14, 15, 29, 32, 33, 200])
@pytest.mark.parametrize(
    ("out_features", "in_features"),
    # whole groups of 32 outputs; a last group of 1 block; outputs past the last whole
    # block; an odd input count
    [(960, 576), (96, 64), (37, 70), (4, 1536), (50, 33)],
)
@pytest.mark.parametrize("bias", [False, True])
def test_matches_float32_matmul(rows: int, out_features: int, in_features: int, bias: bool) -> None:
    x, w, b = operands(rows, out_features, in_features, bias)
    ours = kernels.bf16_gemm(x, kernels.bf16_gemm_pack(w), b)
    ref = reference(x, w, b)
    assert ours.shape == (rows, out_features) and ours.dtype == torch.bfloat16
    assert within_one_rounding(ours, ref)
    assert (ours == ref).float().mean() >= 0.97  # and almost always equal


@needs_gemm
def test_a_row_comes_out_the_same_whatever_the_batch() -> None:
    """A sequence's tokens do not change with who else is in the step, nor with which
    tile, of which height (1 to 14 rows), its row falls in."""
    x, w, b = operands(40, 960, 576, True, seed=7)
    packed = kernels.bf16_gemm_pack(w)
    whole = kernels.bf16_gemm(x, packed, b)  # tiles of 14, 13, 13
    for rows in range(1, 40):
        assert torch.equal(kernels.bf16_gemm(x[:rows], packed, b), whole[:rows])
    assert torch.equal(kernels.bf16_gemm(x[7:19], packed, b), whole[7:19])
    assert kernels.bf16_gemm(x[:0], packed, b).shape == (0, 960)


def test_refuses_what_it_cannot_take() -> None:
    w = torch.ones(48, 64, dtype=torch.bfloat16)
    packed = kernels.bf16_gemm_pack(w)  # the layout needs no AVX2; the product does
    if not kernels.has_bf16_gemm():
        with pytest.raises(RuntimeError, match="no bf16 GEMM"):
            kernels.bf16_gemm(torch.ones(2, 64, dtype=torch.bfloat16), packed, None)
        return
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernels.bf16_gemm(torch.ones(2, 64), packed, None)
    with pytest.raises(RuntimeError, match=r"does not hold \[48, 96\]"):
        kernels.bf16_gemm(torch.ones(2, 96, dtype=torch.bfloat16), packed, None)
    with pytest.raises(RuntimeError, match=r"bias must be \[48\]"):
        kernels.bf16_gemm(torch.ones(2, 64, dtype=torch.bfloat16), packed, torch.ones(47))
    with pytest.raises(RuntimeError, match="bf16_gemm_pack"):
        kernels.bf16_gemm(torch.ones(2, 64, dtype=torch.bfloat16), w.float(), None)
    with pytest.raises(RuntimeError, match="empty"):
        kernels.bf16_gemm_pack(torch.ones(0, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernels.bf16_gemm_pack(torch.ones(8, 64))


@needs_gemm
def test_packed_linear_sends_the_rows_past_the_gemv_to_it() -> None:
    packing = NativeOps(kernels).packing
    if packing is ONEDNN:  # AMX (test_gemv), or a portable build on an AVX512-BF16 CPU
        assert kernels.has_amx_linear() or cpu_has("avx512_bf16")
        return
    calls: list[int] = []

    def fake_gemv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        calls.append(x.shape[0])
        return nn.functional.linear(x, w, b)

    torch.manual_seed(0)
    linear = nn.Linear(70, 100).to(torch.bfloat16)
    packed = PackedLinear(linear, Gemv(fake_gemv, lambda o, i: 2), packing)
    assert packed.packing is packing and packed.weight is not None
    for rows in (1, 2, 3, 8, 40):
        x = torch.randn(rows, 70, dtype=torch.bfloat16)
        assert within_one_rounding(packed(x), reference(x, linear.weight, linear.bias))
    assert calls == [1, 2]  # the GEMV's rows; every other batch on the GEMM
    x3 = torch.randn(2, 3, 70, dtype=torch.bfloat16)  # [batch, seq, in] flattens to 6 rows
    assert torch.equal(packed(x3), packed(x3.reshape(6, 70)).reshape(2, 3, 100))


def layout(w: torch.Tensor) -> torch.Tensor:
    """bf16_gemm_pack's layout from its definition in bf16_gemm.cpp, element by element:
    packed[g][kp][b][16][2] = W[16 (2 g + b) + i][2 kp + j], zeros past out and in."""
    out, inp = w.shape
    blocks, pairs = -(-out // 16), -(-inp // 2)
    padded = torch.zeros(blocks * 16, pairs * 2, dtype=w.dtype)
    padded[:out, :inp] = w
    groups = []
    for first in range(0, blocks, 2):
        group = padded[first * 16 : (first + 2) * 16]  # [16 b + i, 2 kp + j]
        count = group.shape[0] // 16
        groups.append(group.reshape(count, 16, pairs, 2).permute(2, 0, 1, 3).reshape(-1))
    return torch.cat(groups)


@pytest.mark.parametrize(
    ("out_features", "in_features"),
    # whole groups; a last group of one block; a block of 1 to 15 outputs; odd inputs
    [(64, 8), (48, 6), (37, 70), (75, 33), (1, 2), (17, 1), (5, 3)],
)
def test_the_packed_layout_is_the_documented_one(out_features: int, in_features: int) -> None:
    """On every CPU: the layout is a plain copy (gathers with AVX512-BF16, a loop without),
    and bf16_gemm_pack_group lays out weights made on the fly (gguf_bf16_matmul) as it."""
    w = torch.randn(out_features, in_features).to(torch.bfloat16)
    packed = kernels.bf16_gemm_pack(w).reshape(-1)
    expected = layout(w)
    assert torch.equal(packed[: len(expected)].view(torch.int16), expected.view(torch.int16))
    assert not packed[len(expected) :].view(torch.int16).any()  # the zeros past the layout


def test_the_avx2_build_passes_these_tests() -> None:
    """This file again on the x86-64-v3 build: the AVX2 tiles, whatever this host has."""
    assert_passes_on_the_avx2_build(__file__)
