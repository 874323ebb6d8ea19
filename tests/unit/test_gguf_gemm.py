"""The GGUF GEMM for many bfloat16 rows (``worker/csrc/gguf_gemm.cpp``): quants repacked
once into bf16_gemm's layout (K-quants by their sub-blocks), every product exact, each
block's scales (and min) applied per lane. Checked against gguf-py's dequantization
(one-hot rows pick single weights, which must come out exactly), against a float64
matmul, for a row's independence of the other rows of its call, through ``QuantLinear``,
and where it exists."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from tests.cpu import cpu_has
from tests.unit.test_gguf_linear import random_blocks, reference
from worker.models.gguf_weights import GgufWeight
from worker.models.quant_linear import FUSED_MAX_ROWS, GEMM_MAX_ROWS, QuantLinear
from worker.native import NativeKernels, kernel_arch, load_native_kernels

BLOCK_32 = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0]
K_QUANTS = [Q.Q4_K, Q.Q5_K, Q.Q6_K]
EVERY_FORMAT = BLOCK_32 + K_QUANTS


@pytest.fixture(scope="module")
def kernels() -> NativeKernels:
    return load_native_kernels()


def has_gemm() -> bool:
    """AVX512-BF16 in a native build (the portable levels leave it out)."""
    return kernel_arch() == "native" and cpu_has("avx512_bf16") and cpu_has("avx512bw")


def test_the_gemm_exists_for_every_format_where_the_cpu_has_avx512_bf16(
    kernels: NativeKernels,
) -> None:
    packs = [kernels.gguf_gemm_packs(int(q)) for q in EVERY_FORMAT]
    assert packs == [has_gemm()] * len(EVERY_FORMAT)


# The GEMM is compiled only for CPUs with AVX512-BF16 (a native build: the portable levels
# leave it out); where it is absent, the test above asserts so and the old paths serve.
needs_gemm = pytest.mark.skipif(
    not has_gemm(),
    reason="the GGUF GEMM exists only on CPUs with AVX512-BF16 in a native build; "
    "test_the_gemm_exists_… checks it is absent here",
)


def packed(
    kernels: NativeKernels, qtype: Q, blocks: torch.Tensor, in_features: int
) -> torch.Tensor:
    return kernels.gguf_gemm_pack(blocks, int(qtype), in_features)


@needs_gemm
@pytest.mark.parametrize("qtype", EVERY_FORMAT, ids=lambda q: q.name)
def test_the_gemm_reads_each_weight_exactly(kernels: NativeKernels, qtype: Q) -> None:
    """One-hot rows: each output is one weight, scale times quant (plus min), exactly.
    The columns fall in both halves of Q6_K's 16-weight sub-blocks and in several of the
    K-quants' 32-weight ones."""
    in_features, out_features = 256, 43  # 43: a group of 32 and a padded one
    blocks = torch.from_numpy(random_blocks(qtype, out_features, in_features, seed=3))
    columns = [0, 1, 15, 16, 17, 31, 32, 100, 255]
    x = torch.zeros(len(columns), in_features, dtype=torch.bfloat16)
    x[range(len(columns)), columns] = 1.0
    out = kernels.gguf_linear(x, blocks, int(qtype), None, packed(kernels, qtype, blocks, 256))
    ref = torch.from_numpy(reference(blocks.numpy(), qtype))[:, columns].T
    assert out.dtype == torch.float32
    assert torch.equal(out, ref.contiguous())


@needs_gemm
@pytest.mark.parametrize("rows", [1, 3, 5, 12, 13, 25, 33])
@pytest.mark.parametrize("qtype", EVERY_FORMAT, ids=lambda q: q.name)
def test_the_gemm_against_float64(kernels: NativeKernels, qtype: Q, rows: int) -> None:
    """Exact products: only the float32 sums' roundings separate it from float64. Row
    counts past one tile of 12 and uneven splits (13: 7 + 6; 25: 9 + 8 + 8); one row goes
    to the GEMM only for the K-quants (the others read the file's blocks there)."""
    in_features, out_features = 512, 75
    blocks = torch.from_numpy(random_blocks(qtype, out_features, in_features, seed=rows))
    weight = torch.from_numpy(reference(blocks.numpy(), qtype)).double()
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
    bias = torch.randn(out_features, generator=gen)
    out = kernels.gguf_linear(
        x, blocks, int(qtype), bias, packed(kernels, qtype, blocks, in_features)
    )
    ref = x.double() @ weight.T + bias.double()
    assert out.dtype == torch.float32 and out.shape == (rows, out_features)
    scale = (x.double().abs() @ weight.abs().T).max().item()
    assert (out.double() - ref).abs().max().item() <= 1e-6 * scale


@needs_gemm
def test_a_rows_result_does_not_depend_on_the_other_rows(kernels: NativeKernels) -> None:
    """Each output's sums run in K order whatever the tile: bit-identical in any call."""
    in_features, out_features = 384, 64
    blocks = torch.from_numpy(random_blocks(Q.Q4_1, out_features, in_features, seed=7))
    gemm = packed(kernels, Q.Q4_1, blocks, in_features)
    x = torch.randn(32, in_features).to(torch.bfloat16)
    whole = kernels.gguf_linear(x, blocks, int(Q.Q4_1), None, gemm)
    for first, count in [(0, 3), (5, 7), (17, 15), (29, 3)]:
        part = kernels.gguf_linear(x[first : first + count], blocks, int(Q.Q4_1), None, gemm)
        assert torch.equal(part, whole[first : first + count]), (first, count)


@needs_gemm
def test_quant_linear_of_a_bfloat16_model_repacks_and_its_paths_agree(
    kernels: NativeKernels,
) -> None:
    """A fused projection of Q4_1 and Q8_0 parts (SmolLM2's types): each segment holds a
    repacked copy; 1-2 rows, 3 to GEMM_MAX_ROWS (the GEMM) and more (the dense matmul over
    the weight dequantized) agree within bfloat16's roundings."""
    parts = [
        GgufWeight(f"w{i}", int(q), q.name, torch.from_numpy(random_blocks(q, n, 256, i)), 256)
        for i, (q, n) in enumerate([(Q.Q4_1, 64), (Q.Q8_0, 32)])
    ]
    layer = QuantLinear(parts, None, kernels, bfloat16_rows=True)
    assert all(s.gemm is not None for s in layer.segments)
    assert len(layer.block_tensors()) == 4  # the blocks and their repacked copies
    assert layer.fused_max_rows == GEMM_MAX_ROWS
    float32_layer = QuantLinear(parts, None, kernels)
    assert all(s.gemm is None for s in float32_layer.segments)
    assert float32_layer.fused_max_rows == FUSED_MAX_ROWS
    weight = layer.dequantized().double()
    x = torch.randn(GEMM_MAX_ROWS + 8, 256).to(torch.bfloat16)
    expected = x.double() @ weight.T
    bound = (x.double().abs() @ weight.abs().T) * 2e-2  # the bfloat16 output's rounding
    for rows in (x[:2], x[:FUSED_MAX_ROWS], x[:GEMM_MAX_ROWS], x):
        out = layer(rows)
        assert out.dtype == torch.bfloat16
        assert ((out.double() - expected[: len(rows)]).abs() <= bound[: len(rows)]).all()


@needs_gemm
def test_a_packed_weight_of_another_shape_is_refused(kernels: NativeKernels) -> None:
    blocks = torch.from_numpy(random_blocks(Q.Q4_1, 40, 64))
    gemm = packed(kernels, Q.Q4_1, blocks, 64)
    x = torch.randn(4, 64).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="does not hold"):
        kernels.gguf_linear(x, blocks, int(Q.Q4_0), None, gemm)  # Q4_0's blocks are smaller


def test_a_format_without_the_gemm_is_refused(kernels: NativeKernels) -> None:
    """On every CPU a format with no kernel here (Q2_K), and where the build has no GEMM,
    every format."""
    blocks = torch.zeros(4, 84, dtype=torch.uint8)  # Q2_K: 84 bytes a block of 256
    with pytest.raises(RuntimeError, match="no kernel"):
        kernels.gguf_gemm_pack(blocks, int(Q.Q2_K), 256)
    if not has_gemm():
        with pytest.raises(RuntimeError, match="no kernel for type"):
            kernels.gguf_gemm_pack(
                torch.from_numpy(random_blocks(Q.Q6_K, 4, 256)), int(Q.Q6_K), 256
            )


@needs_gemm
@pytest.mark.parametrize("qtype", EVERY_FORMAT, ids=lambda q: q.name)
def test_fewer_rows_keep_the_blocks_as_they_ship(kernels: NativeKernels, qtype: Q) -> None:
    """The repacked copy is for two rows on (Q4_0/1, a nibble a quant) or three (a byte a
    quant, more than the blocks hold): fewer read the file's blocks, so their results
    are those without it, and from there on they are the GEMM's. The K-quants take it from
    one row (their blocks are unpacked a weight at a time)."""
    first = 1 if qtype in K_QUANTS else 2 if qtype in (Q.Q4_0, Q.Q4_1) else 3
    assert kernels.gguf_gemm_min_rows(int(qtype)) == first
    blocks = torch.from_numpy(random_blocks(qtype, 64, 256, seed=11))
    gemm = packed(kernels, qtype, blocks, 256)
    for rows in range(1, first + 1):
        x = torch.randn(rows, 256).to(torch.bfloat16)
        with_copy = kernels.gguf_linear(x, blocks, int(qtype), None, gemm)
        without = kernels.gguf_linear(x, blocks, int(qtype), None)
        assert torch.equal(with_copy, without) == (rows < first), rows


@pytest.mark.parametrize("qtype", EVERY_FORMAT, ids=lambda q: q.name)
def test_bfloat16_out_is_the_float32_product_rounded_once(kernels: NativeKernels, qtype: Q) -> None:
    """``bf16_out`` on every path (the blocks as they ship, the GEMM where this CPU has
    it, float32 rows), full and partial groups of 32 outputs, bias or not: bit for bit
    the float32 product rounded to bfloat16, as ``Tensor.to`` rounds it."""
    in_features, out_features = 512, 75
    blocks = torch.from_numpy(random_blocks(qtype, out_features, in_features, seed=5))
    gemm = packed(kernels, qtype, blocks, in_features) if has_gemm() else None
    gen = torch.Generator().manual_seed(int(qtype))
    bias = torch.randn(out_features, generator=gen)
    for rows in (1, 2, 3, 12, 33):
        x = torch.randn(rows, in_features, generator=gen)
        for xs, b in ((x.to(torch.bfloat16), bias), (x.to(torch.bfloat16), None), (x, bias)):
            product = kernels.gguf_linear(xs, blocks, int(qtype), b, gemm)
            rounded = kernels.gguf_linear(xs, blocks, int(qtype), b, gemm, True)
            assert product.dtype == torch.float32 and rounded.dtype == torch.bfloat16
            assert torch.equal(rounded, product.to(torch.bfloat16)), (rows, b is None)
