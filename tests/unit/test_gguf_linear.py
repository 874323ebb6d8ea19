"""The GGUF kernels (``worker/csrc/gguf_linear.cpp``, ``gguf_bf16_dot.cpp``) against
gguf-py, the dequantizer transformers loads GGUF files with: every supported block type
dequantized bit for bit alike (through the stored path and through the in-register paths
of the fused linear, float32 rows and bfloat16 rows; to bfloat16, rounded once as
``Tensor.to`` rounds), the fused linear against a float64 matmul for both row dtypes,
``QuantLinear``'s two paths against each other, and clear refusals; again on the x86-64-v3
build (the AVX2 dot products, ``gguf_dot_avx2.h``), whatever this host has."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import dequantize

from tests.avx2_build import assert_passes_on_the_avx2_build
from tests.cpu import cpu_has
from worker.models.gguf_weights import GgufWeight
from worker.models.quant_linear import FUSED_MAX_ROWS, QuantLinear
from worker.native import NativeKernels, kernel_arch, load_native_kernels

# type: (weights per block, bytes per block, byte offsets of its float16 scales)
FORMATS = {
    Q.Q4_0: (32, 18, [0]),
    Q.Q4_1: (32, 20, [0, 2]),
    Q.Q5_0: (32, 22, [0]),
    Q.Q5_1: (32, 24, [0, 2]),
    Q.Q8_0: (32, 34, [0]),
    Q.Q4_K: (256, 144, [0, 2]),
    Q.Q5_K: (256, 176, [0, 2]),
    Q.Q6_K: (256, 210, [208]),
}


@pytest.fixture(scope="module")
def kernels() -> NativeKernels:
    return load_native_kernels()


def random_blocks(qtype: Q, rows: int, in_features: int, seed: int = 0) -> np.ndarray:
    """Random bytes in every quant field, finite float16 scales (some negative, as the
    minimum of Q4_1/Q5_1 is)."""
    weights, nbytes, scales = FORMATS[qtype]
    rng = np.random.default_rng(seed + int(qtype))
    blocks = rng.integers(0, 256, (rows, in_features // weights, nbytes), dtype=np.uint8)
    for offset in scales:
        values = rng.uniform(-0.05, 0.05, (rows, in_features // weights)).astype(np.float16)
        blocks[..., offset : offset + 2] = values.view(np.uint8).reshape(*values.shape, 2)
    return blocks.reshape(rows, -1)


def reference(blocks: np.ndarray, qtype: Q) -> np.ndarray:
    out: np.ndarray = dequantize(blocks, qtype)
    return out


@pytest.mark.parametrize("qtype", list(FORMATS), ids=lambda q: q.name)
def test_dequantize_equals_gguf_py_bit_for_bit(kernels: NativeKernels, qtype: Q) -> None:
    in_features = 512
    blocks = random_blocks(qtype, 37, in_features)
    ours = kernels.gguf_dequantize(torch.from_numpy(blocks), int(qtype), in_features).numpy()
    ref = reference(blocks, qtype)
    assert ours.shape == ref.shape == (37, in_features)
    assert np.array_equal(ours.view(np.uint32), ref.view(np.uint32))
    bf16 = kernels.gguf_dequantize(torch.from_numpy(blocks), int(qtype), in_features, True)
    assert bf16.dtype == torch.bfloat16
    assert torch.equal(bf16, torch.from_numpy(ref).to(torch.bfloat16))  # rounded once


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qtype", list(FORMATS), ids=lambda q: q.name)
def test_fused_linear_reads_each_weight_exactly(
    kernels: NativeKernels, qtype: Q, dtype: torch.dtype
) -> None:
    """One-hot rows pick single weights: the fused kernel's own dequantization (in
    registers for the 32-weight types; for bfloat16 rows, quants looked up as bfloat16
    and Q8_0's bytes split into nibbles) must give gguf-py's values exactly, many rows at
    once and one at a time."""
    in_features = 256
    blocks = random_blocks(qtype, 13, in_features, seed=1)
    columns = [0, 1, 15, 16, 17, 31, 32, 100, 255]
    x = torch.zeros(len(columns), in_features, dtype=dtype)
    x[range(len(columns)), columns] = 1.0
    out = kernels.gguf_linear(x, torch.from_numpy(blocks), int(qtype), None)
    ref = torch.from_numpy(reference(blocks, qtype))[:, columns].T
    assert out.dtype == torch.float32
    assert torch.equal(out, ref.contiguous())
    for i in range(len(columns)):  # one row: the decode step's own kernels
        one = kernels.gguf_linear(
            x[i : i + 1].contiguous(), torch.from_numpy(blocks), int(qtype), None
        )
        assert torch.equal(one, ref[i : i + 1].contiguous()), columns[i]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 17, 33])
@pytest.mark.parametrize(
    "qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q6_K], ids=lambda q: q.name
)
def test_fused_linear_against_float64(
    kernels: NativeKernels, qtype: Q, rows: int, dtype: torch.dtype
) -> None:
    """Every product is exact in both row dtypes (a bfloat16 row times a quant fits
    float32), so only the float32 sums' roundings separate the kernel from float64."""
    in_features, out_features = 512, 43  # an odd count: tails of every row tile
    blocks = random_blocks(qtype, out_features, in_features, seed=rows)
    weight = torch.from_numpy(reference(blocks, qtype)).double()
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    bias = torch.randn(out_features, generator=gen)
    out = kernels.gguf_linear(x, torch.from_numpy(blocks), int(qtype), bias)
    ref = x.double() @ weight.T + bias.double()
    assert out.dtype == torch.float32 and out.shape == (rows, out_features)
    scale = (x.double().abs() @ weight.abs().T).max().item()
    assert (out.double() - ref).abs().max().item() <= 1e-6 * scale


def part(qtype: Q, rows: int, in_features: int, seed: int) -> GgufWeight:
    blocks = random_blocks(qtype, rows, in_features, seed)
    return GgufWeight(f"w{seed}", int(qtype), qtype.name, torch.from_numpy(blocks), in_features)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quant_linear_paths_agree_and_mixed_types_concatenate(
    kernels: NativeKernels, dtype: torch.dtype
) -> None:
    """A fused q/k/v of three parts, two block types: the fused kernel (decode rows) and
    the dense matmul over the dequantized weight (prefill rows) give the same outputs."""
    parts = [part(Q.Q4_K, 64, 256, 1), part(Q.Q4_K, 32, 256, 2), part(Q.Q6_K, 32, 256, 3)]
    bias = torch.randn(128)
    layer = QuantLinear(parts, bias, kernels)
    assert [s.type for s in layer.segments] == [int(Q.Q4_K), int(Q.Q6_K)]
    assert (layer.out_features, layer.in_features) == (128, 256)
    weight = torch.cat([torch.from_numpy(reference(p.data.numpy(), Q(p.type))) for p in parts])
    assert torch.equal(layer.dequantized(), weight)
    x = torch.randn(FUSED_MAX_ROWS + 8, 256).to(dtype)
    small = layer(x[:FUSED_MAX_ROWS])  # the fused kernel
    large = layer(x)  # dequantized, one matmul
    assert small.dtype == large.dtype == dtype
    expected = x.double() @ weight.double().T + bias.double()
    # Per output, bounded by the magnitudes summed: float32 sums, or bfloat16's roundings
    # of the inputs, the dequantized weight (prefill rows) and the output.
    bound = (x.double().abs() @ weight.double().abs().T + bias.double().abs()) * (
        1e-6 if dtype == torch.float32 else 2e-2
    )
    assert ((small.double() - expected[:FUSED_MAX_ROWS]).abs() <= bound[:FUSED_MAX_ROWS]).all()
    assert ((large.double() - expected).abs() <= bound).all()


def test_bfloat16_rows_take_their_own_path_exactly_where_the_cpu_has_avx512_bf16(
    kernels: NativeKernels,
) -> None:
    """Not a silent conversion to float32 on a CPU that has the instructions: the 4- and
    5-bit 32-weight formats have a bfloat16-row kernel there for 1-2 rows; Q8_0 and the
    256-weight K-quants nowhere (measured slower than converting the rows)."""
    # The portable levels (x86-64-v4 at most) leave AVX512-BF16 out.
    native = kernel_arch() == "native"
    bf16 = native and cpu_has("avx512_bf16") and cpu_has("avx512vl") and cpu_has("avx512bw")
    for qtype in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1):
        assert [kernels.gguf_has_bf16_rows(int(qtype), rows) for rows in (1, 2, 3)] == [
            bf16,
            bf16,
            False,  # past 2 rows, dequantizing once for every row costs less
        ], qtype.name
    for qtype in (Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K):
        assert not kernels.gguf_has_bf16_rows(int(qtype), 1), qtype.name


def test_refusals_name_the_problem(kernels: NativeKernels) -> None:
    blocks = torch.from_numpy(random_blocks(Q.Q4_1, 4, 64))
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="type 99 has no kernel"):
        kernels.gguf_linear(x, blocks, 99, None)
    with pytest.raises(RuntimeError, match="takes 40 bytes, got"):
        kernels.gguf_linear(x, blocks[:, :30].contiguous(), int(Q.Q4_1), None)
    with pytest.raises(RuntimeError, match="not a multiple of the block's 32"):
        kernels.gguf_linear(torch.randn(2, 48), blocks, int(Q.Q4_1), None)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernels.gguf_linear(x.to(torch.float16), blocks, int(Q.Q4_1), None)
    with pytest.raises(RuntimeError, match="bias"):
        kernels.gguf_linear(x, blocks, int(Q.Q4_1), torch.randn(3))


def test_the_avx2_build_passes_these_tests() -> None:
    """This file again on the x86-64-v3 build: the AVX2 dot products, whatever this host has."""
    assert_passes_on_the_avx2_build(__file__)
