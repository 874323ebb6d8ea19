"""The W8A8 kernels (``worker/csrc/int8_linear.cpp``) against an integer reference of the
same arithmetic, on every ISA path this build holds (a native build on an AMX host:
portable, AVX2, AVX-VNNI, AVX512-VNNI, AMX-INT8; the x86-64-v3 build, run by
``test_the_avx2_build_passes_these_tests``: portable and AVX2):

- the activations' quantization exactly as torch computes it (127 / max|x| in float32, one
  product, round half to even, zeros past the inputs);
- the int32 products exactly ``xq @ wq^T`` in int64, over random shapes (hypothesis);
- the float epilogue ``float(acc) * (s_x * s_w) + b`` within ``EPILOGUE_ULPS`` of torch's.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.avx2_build import assert_passes_on_the_avx2_build
from tests.cpu import cpu_has
from worker.native import kernel_arch, load_native_kernels

kernels = load_native_kernels()
ISAS = kernels.int8_linear_isas()
PORTABLE, AVX2, AVX_VNNI, AVX512_VNNI, AMX_INT8 = 0, 1, 2, 3, 4
# The epilogue's products may be reassociated by the compiler (-fassociative-math): two
# roundings apart at most.
EPILOGUE_ULPS = 2


def reference_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    top = x.float().abs().amax(dim=1)
    inv = torch.where(top > 0, torch.tensor(127.0) / top, torch.zeros_like(top))
    q = (x.float() * inv[:, None]).round().clamp(-127, 127).to(torch.int8)
    padded = -(-x.shape[1] // 4) * 4
    return torch.nn.functional.pad(q, (0, padded - x.shape[1])), top / 127.0


def weights(out_features: int, in_features: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-127, 128, (out_features, in_features), generator=gen, dtype=torch.int8)


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance in float32 steps (same-sign values; zeros compare as equal)."""
    a32, b32 = a.float().contiguous(), b.float().contiguous()
    far = (a32.view(torch.int32).long() - b32.view(torch.int32).long()).abs()
    return int(torch.where((a32 == 0) & (b32 == 0), 0, far).max())


def test_the_paths_built_are_those_the_build_level_allows() -> None:
    assert ISAS[0] == PORTABLE and sorted(ISAS) == ISAS
    assert (AVX2 in ISAS) == cpu_has("avx2")
    if kernel_arch() == "native":
        assert (AVX512_VNNI in ISAS) == (cpu_has("avx512_vnni") and cpu_has("avx512bw"))
        assert (AVX_VNNI in ISAS) == cpu_has("avx_vnni")
        # Linux grants the tile data to any process that asks on a CPU that has it.
        assert (AMX_INT8 in ISAS) == cpu_has("amx_int8")
    elif kernel_arch() == "x86-64-v3":
        assert ISAS == [PORTABLE, AVX2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_quantize_exactly_as_torch_does(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(7, 70, generator=gen) * 3).to(dtype)
    x[3] = 0  # a zero row: scale 0, quants 0
    x[4, 5] = -x[4].abs().max() * 2  # the largest magnitude negative: -127
    q, scales = kernels.int8_quantize_rows(x)
    ref_q, ref_scales = reference_quantize(x)
    assert q.shape == (7, 72) and q.dtype == torch.int8
    assert torch.equal(q, ref_q)
    assert torch.equal(scales, ref_scales)
    assert int(q[4, 5]) == -127 and not q[3].any()


def test_a_row_too_small_for_127_over_its_max_quantizes_to_zeros() -> None:
    # 127 / 1e-38 overflows float32: the vector lanes and the scalar tail (70 = 64 + 6)
    # both give zeros, not +-127 or the vector conversion's -128.
    x = torch.full((2, 70), 1e-38)
    x[1] = -1e-38
    q, scales = kernels.int8_quantize_rows(x)
    assert not q.any()
    assert torch.equal(scales, torch.full((2,), 1e-38) / 127)


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 70),
    out_features=st.integers(1, 80),
    in_features=st.integers(1, 150),
    seed=st.integers(0, 2**16),
)
def test_int32_products_are_exact_on_every_path(
    rows: int, out_features: int, in_features: int, seed: int
) -> None:
    wq = weights(out_features, in_features, seed)
    packed, sums = kernels.int8_pack(wq), wq.sum(1, dtype=torch.int32)
    gen = torch.Generator().manual_seed(seed + 1)
    xq = torch.randint(-127, 128, (rows, -(-in_features // 4) * 4), generator=gen)
    xq[:, in_features:] = 0
    xq = xq.to(torch.int8)
    expected = (xq[:, :in_features].long() @ wq.long().T).int()
    for isa in ISAS:
        assert torch.equal(kernels.int8_matmul_int32(xq, packed, sums, isa), expected), isa


@pytest.mark.parametrize("rows", [1, 15, 16, 17, 32, 33, 64, 70])
def test_whole_tiles_of_a_served_width_are_exact(rows: int) -> None:
    # 576 inputs (SmolLM2's width): nine whole K steps of 64 on the AMX path, no tail; 80
    # outputs: two panel pairs and a panel alone; rows across the 16-row tile halves, the
    # 32-row blocks and the 64-row tasks.
    wq = weights(80, 576, rows)
    packed, sums = kernels.int8_pack(wq), wq.sum(1, dtype=torch.int32)
    gen = torch.Generator().manual_seed(rows)
    xq = torch.randint(-127, 128, (rows, 576), generator=gen).to(torch.int8)
    expected = (xq.long() @ wq.long().T).int()
    for isa in ISAS:
        assert torch.equal(kernels.int8_matmul_int32(xq, packed, sums, isa), expected), isa


def test_extreme_values_neither_saturate_nor_wrap() -> None:
    # Every product +-127 * 127 or 128: AVX2's int16 pair sums at their largest (32,512),
    # the VNNI paths' unsigned offset at both ends; weights of -128 (compressed-tensors'
    # symmetric rounding makes them) against rows of both signs.
    wq = torch.full((33, 1540), 127, dtype=torch.int8)
    wq[::2] = -127
    wq[1::4] = -128
    xq = torch.full((5, 1540), -127, dtype=torch.int8)
    xq[1] = 127
    packed, sums = kernels.int8_pack(wq), wq.sum(1, dtype=torch.int32)
    expected = (xq.long() @ wq.long().T).int()
    for isa in ISAS:
        assert torch.equal(kernels.int8_matmul_int32(xq, packed, sums, isa), expected), isa


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 40),
    out_features=st.integers(1, 70),
    in_features=st.integers(1, 100),
    bias=st.booleans(),
    bfloat16=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_the_epilogue_is_the_float_steps_within_two_float32_steps(
    rows: int, out_features: int, in_features: int, bias: bool, bfloat16: bool, seed: int
) -> None:
    dtype = torch.bfloat16 if bfloat16 else torch.float32
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    wq = weights(out_features, in_features, seed)
    scales = torch.rand(out_features, generator=gen) * 0.01
    b = torch.randn(out_features, generator=gen) if bias else None
    packed, sums = kernels.int8_pack(wq), wq.sum(1, dtype=torch.int32)
    xq, x_scales = reference_quantize(x)
    acc = (xq[:, :in_features].long() @ wq.long().T).float()
    product = acc * (x_scales[:, None] * scales[None, :])
    expected = product if b is None else product + b
    # EPILOGUE_ULPS float32 steps of the largest of the terms and the result (a sum that
    # cancels is judged by its terms' size; one that grows, by its own: the last add
    # rounds in the result's steps); bfloat16: one more rounding of the result.
    size = product.abs() if b is None else torch.maximum(product.abs(), b.abs())
    size = torch.maximum(size, expected.abs())
    bound = size * EPILOGUE_ULPS * 2**-23 + 1e-30
    if bfloat16:
        bound = bound + expected.abs() * 2**-8
    for isa in ISAS:
        out = kernels.int8_linear(x, packed, sums, scales, b, isa)
        assert out.dtype == dtype and out.shape == (rows, out_features)
        assert bool(((out.float() - expected).abs() <= bound).all()), isa
        if b is None and not bfloat16:
            assert ulps(out, expected) <= EPILOGUE_ULPS, isa


def test_bad_operands_are_refused_naming_the_problem() -> None:
    wq = weights(20, 12, 0)
    packed, sums = kernels.int8_pack(wq), wq.sum(1, dtype=torch.int32)
    scales = torch.ones(20)
    with pytest.raises(RuntimeError, match="padded inputs, the rows have 16"):
        kernels.int8_linear(torch.randn(2, 16), packed, sums, scales)
    with pytest.raises(RuntimeError, match="weight_scales must be float32 \\[20\\]"):
        kernels.int8_linear(torch.randn(2, 12), packed, sums, torch.ones(3))
    with pytest.raises(RuntimeError, match="int8 \\[out, in\\]"):
        kernels.int8_pack(torch.randn(4, 4))
    with pytest.raises(RuntimeError, match="not built here"):
        kernels.int8_linear(torch.randn(2, 12), packed, sums, scales, None, 9)


def test_the_avx2_build_passes_these_tests() -> None:
    """This file again on the portable x86-64-v3 build, whatever this host has beyond it."""
    assert_passes_on_the_avx2_build(__file__)
