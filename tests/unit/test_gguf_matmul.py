"""GGUF projections of many bfloat16 rows on bf16_gemm (``worker/csrc/gguf_matmul.cpp``):
each group of 32 outputs dequantized for the call, bit for bit the unfused composition
``bf16_gemm(x, bf16_gemm_pack(gguf_dequantize(w, bfloat16)), b)`` for every format, where
bf16_gemm takes a bfloat16 model's projections; ``QuantLinear`` sends its rows past the
fused ones there (per segment, the bias split between them); refused elsewhere and for
what it cannot take."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from tests.unit.test_gguf_linear import FORMATS, random_blocks
from worker.models.gguf_weights import GgufWeight
from worker.models.quant_linear import GEMM_MAX_ROWS, QuantLinear
from worker.native import load_native_kernels

kernels = load_native_kernels()
needs_bf16_gemm = pytest.mark.skipif(
    not kernels.bf16_gemm_packs(),
    reason="bfloat16 projections run on oneDNN here (no AVX512-BF16, or AMX): "
    "test_refused_where_bf16_gemm_takes_no_projections checks the refusal",
)


def blocks_of(qtype: Q, out_features: int, in_features: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(random_blocks(qtype, out_features, in_features, seed))


def unfused(
    x: torch.Tensor, blocks: torch.Tensor, qtype: Q, bias: torch.Tensor | None
) -> torch.Tensor:
    weight = kernels.gguf_dequantize(blocks, int(qtype), x.shape[1], True)
    return kernels.bf16_gemm(x, kernels.bf16_gemm_pack(weight), bias)


@needs_bf16_gemm
@pytest.mark.parametrize("qtype", list(FORMATS), ids=lambda q: q.name)
# whole groups of 32 outputs; a last group of one block; a block of 1 to 15 outputs
@pytest.mark.parametrize("out_features", [64, 48, 75, 7])
# one tile (1, 14 rows), a tall first tile and even others (15, 200)
@pytest.mark.parametrize("rows", [1, 14, 15, 200])
def test_equals_the_unfused_composition_bit_for_bit(qtype: Q, out_features: int, rows: int) -> None:
    in_features = 512  # a whole number of blocks in every format (256-weight K-quants)
    blocks = blocks_of(qtype, out_features, in_features, seed=rows + out_features)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
    bias = torch.randn(out_features, generator=gen).to(torch.bfloat16)
    for b in (None, bias):
        out = kernels.gguf_bf16_matmul(x, blocks, int(qtype), b)
        assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
        assert torch.equal(out, unfused(x, blocks, qtype, b))


@needs_bf16_gemm
def test_quant_linear_takes_it_past_its_fused_rows_per_segment() -> None:
    """SmolLM2's fused projections mix Q4_1 and Q8_0 parts, Gemma's K-quants: a segment per
    type, each with its own slice of the bias, concatenated as one weight would be."""
    in_features = 256
    parts = [
        GgufWeight(f"w{i}", int(q), q.name, blocks_of(q, n, in_features, i), in_features)
        for i, (q, n) in enumerate([(Q.Q4_1, 40), (Q.Q8_0, 24), (Q.Q6_K, 33)])
    ]
    bias = torch.randn(97)
    layer = QuantLinear(parts, bias, kernels, bfloat16_rows=True)
    assert len(layer.segments) == 3
    x = torch.randn(GEMM_MAX_ROWS + 9, in_features).to(torch.bfloat16)
    # each segment's columns against its own part, with its part of the bias
    expected = torch.cat(
        [
            unfused(x, p.data, Q(p.type), bias.to(torch.bfloat16)[first : first + n])
            for p, first, n in [(parts[0], 0, 40), (parts[1], 40, 24), (parts[2], 64, 33)]
        ],
        dim=1,
    )
    assert torch.equal(layer(x), expected)
    assert torch.equal(layer(x.reshape(1, -1, in_features))[0], expected)
    # a float32 model's layer keeps the dense matmul in float32
    float32 = QuantLinear(parts, bias, kernels)
    assert float32(x.float()).dtype == torch.float32


def test_refused_where_bf16_gemm_takes_no_projections() -> None:
    blocks = blocks_of(Q.Q4_1, 32, 64, 0)
    x = torch.ones(4, 64, dtype=torch.bfloat16)
    if not kernels.bf16_gemm_packs():
        with pytest.raises(RuntimeError, match="do not run on bf16_gemm"):
            kernels.gguf_bf16_matmul(x, blocks, int(Q.Q4_1))
        return
    with pytest.raises(RuntimeError, match="contiguous CPU bfloat16"):
        kernels.gguf_bf16_matmul(x.float(), blocks, int(Q.Q4_1))
    with pytest.raises(RuntimeError, match=r"bias is a contiguous bfloat16 \[out\]"):
        kernels.gguf_bf16_matmul(x, blocks, int(Q.Q4_1), torch.ones(32))
    with pytest.raises(RuntimeError, match="takes 40 bytes"):
        kernels.gguf_bf16_matmul(x, blocks[:, :30].contiguous(), int(Q.Q4_1))
    with pytest.raises(RuntimeError, match="not a multiple"):
        kernels.gguf_bf16_matmul(torch.ones(4, 48, dtype=torch.bfloat16), blocks, int(Q.Q4_1))
    with pytest.raises(RuntimeError, match="has no kernel"):
        kernels.gguf_bf16_matmul(x, blocks, 1)  # float16: no blocks
    assert kernels.gguf_bf16_matmul(x[:0], blocks, int(Q.Q4_1)).shape == (0, 32)
