"""GGUF projections with 8-bit activations (``worker/csrc/gguf_q8.cpp``,
``--gguf-activations q8``) against a reference of the same arithmetic: the activations'
quantization exactly as torch computes it (per block of 32: ``127 / max|x|`` in float32,
rounded to nearest, ties to even), and each product equal to the float64 product of
gguf-py's dequantized weights with those quantized activations, within the float32
epilogue's rounding, for every block type, over random shapes (hypothesis); the
QuantLinear routing and the ``auto`` choice; again on the x86-64-v3 build (AVX2)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import dequantize
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.avx2_build import assert_passes_on_the_avx2_build
from tests.unit.test_gguf_linear import FORMATS, random_blocks
from worker.models.gguf_weights import GgufWeight
from worker.models.quant_linear import QuantLinear
from worker.models.quantizers import q8_activations
from worker.native import NativeKernels, load_native_kernels
from worker.ops import NativeOps

# The epilogue's float32 rounding, relative to sum |w a| over a row: a scale product and a
# multiply-add a sub-block, then one add a sub-block into the row's sums (K / 32 at most).
EPS = float(np.finfo(np.float32).eps)


@pytest.fixture(scope="module")
def kernels() -> NativeKernels:
    return load_native_kernels()


def quantize_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [rows, in], d float32 [rows, in / 32]): torch's arithmetic, block by block."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1)
    # tensor / tensor: a true division (127.0 / amax would multiply by a reciprocal)
    inverse = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inverse[..., None]).to(torch.int8)
    return q.reshape(x.shape), amax / 127.0


def expected(
    blocks: np.ndarray, qtype: Q, q: torch.Tensor, d: torch.Tensor
) -> tuple[np.ndarray, np.ndarray]:
    """float64 products of the dequantized weights with the quantized activations, and
    sum |w a| per output (the rounding's scale)."""
    w = dequantize(blocks, qtype).astype(np.float64)  # [out, in]
    a = (q.double().reshape(q.shape[0], -1, 32) * d.double()[..., None]).reshape(q.shape)
    an = a.numpy()
    return an @ w.T, np.abs(an) @ np.abs(w).T


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activations_quantize_as_torch_computes(kernels: NativeKernels, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x = torch.randn(5, 256) * torch.logspace(-3, 3, 5)[:, None]
    x[1, 32:64] = 0.0  # an all-zero block: q 0, d 0
    x[2, 64:96] = 0.5  # every value at the maximum: q 127
    x[3, 0] = 1e-30  # a tiny maximum
    x = x.to(dtype)
    q, d = kernels.gguf_quantize_q8(x)
    ref_q, ref_d = quantize_reference(x)
    assert q.dtype == torch.int8 and d.dtype == torch.float32
    assert torch.equal(q, ref_q)
    assert torch.equal(d, ref_d)
    assert int(q.abs().max()) == 127 and torch.equal(q[1, 32:64], torch.zeros(32, dtype=torch.int8))


def check_linear(
    kernels: NativeKernels, qtype: Q, rows: int, out: int, in_features: int, seed: int
) -> None:
    blocks = random_blocks(qtype, out, in_features, seed)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=gen) * 3.0
    bias = torch.randn(out, generator=gen)
    ours = kernels.gguf_linear(x, torch.from_numpy(blocks), int(qtype), bias, None, False, True)
    q, d = quantize_reference(x)
    ref, scale = expected(blocks, qtype, q, d)
    bound = (in_features / 32 + 4) * EPS * scale + EPS * np.abs(bias.numpy())
    err = np.abs(ours.numpy() - bias.numpy() - ref)
    assert ours.shape == (rows, out) and ours.dtype == torch.float32
    assert np.all(err <= bound), f"worst {float((err / bound).max()):.2f}x the bound"


@pytest.mark.parametrize("qtype", list(FORMATS), ids=lambda q: q.name)
def test_every_block_type_against_the_reference(kernels: NativeKernels, qtype: Q) -> None:
    for rows in (1, 2, 3, 8, 11):  # the tiles: 1-2 rows with two sets of sums, 3-8, a tail
        check_linear(kernels, qtype, rows, 37, 512, seed=rows)


@settings(max_examples=30, deadline=None)
@given(
    qtype=st.sampled_from(list(FORMATS)),
    rows=st.integers(1, 20),
    out=st.integers(1, 40),
    blocks=st.integers(1, 6),
    seed=st.integers(0, 2**16),
)
def test_random_shapes_against_the_reference(
    kernels: NativeKernels, qtype: Q, rows: int, out: int, blocks: int, seed: int
) -> None:
    check_linear(kernels, qtype, rows, out, blocks * FORMATS[qtype][0], seed)


def test_bfloat16_rows_are_quantized_as_their_float32_values(kernels: NativeKernels) -> None:
    blocks = torch.from_numpy(random_blocks(Q.Q4_1, 24, 256))
    x = torch.randn(3, 256).to(torch.bfloat16)
    bf16 = kernels.gguf_linear(x, blocks, int(Q.Q4_1), None, None, False, True)
    f32 = kernels.gguf_linear(x.float(), blocks, int(Q.Q4_1), None, None, False, True)
    assert torch.equal(bf16, f32)
    rounded = kernels.gguf_linear(x, blocks, int(Q.Q4_1), None, None, True, True)
    assert rounded.dtype == torch.bfloat16 and torch.equal(rounded, f32.to(torch.bfloat16))


def test_a_non_finite_block_makes_its_row_nan_only(kernels: NativeKernels) -> None:
    blocks = torch.from_numpy(random_blocks(Q.Q8_0, 8, 64))
    x = torch.randn(2, 64)
    x[1, 40] = math.inf
    y = kernels.gguf_linear(x, blocks, int(Q.Q8_0), None, None, False, True)
    assert torch.isfinite(y[0]).all() and torch.isnan(y[1]).all()


def test_quant_linear_takes_every_row_count_to_the_q8_kernel(kernels: NativeKernels) -> None:
    """With 8-bit activations a prefill chunk runs the same kernel as a decode step (the
    quality bench.quality measures is what is served)."""
    blocks = random_blocks(Q.Q4_1, 48, 128)
    part = GgufWeight("w", int(Q.Q4_1), "Q4_1", torch.from_numpy(blocks), 128)
    linear = QuantLinear([part], None, kernels, q8_activations=True)
    exact = QuantLinear([part], None, kernels)
    for rows in (1, 40, 300):
        x = torch.randn(rows, 128)
        want = kernels.gguf_linear(x, part.data, int(Q.Q4_1), None, None, False, True)
        assert torch.equal(linear(x), want)
        assert not torch.equal(exact(x), want)  # the float path differs: q8 was taken


def test_auto_is_q8_exactly_where_the_cpu_has_no_bfloat16_dot(kernels: NativeKernels) -> None:
    ops = NativeOps(kernels)
    has_bf16_dot = kernels.gguf_has_bf16_rows(int(Q.Q4_1), 1)
    assert q8_activations("auto", ops) is (not has_bf16_dot)
    assert q8_activations("q8", ops) and not q8_activations("float", ops)


def test_avx2_build() -> None:
    assert_passes_on_the_avx2_build(__file__)
