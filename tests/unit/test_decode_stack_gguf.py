"""The fused decode step over GGUF projections with biases (Qwen2's q/k/v, as a Qwen2.5
GGUF holds them in float32) against the Python layers: a tiny random Qwen2 whose every
layer projection is a ``QuantLinear`` over random Q4_0 blocks, or over K-quants as a
Q4_K_M file mixes them (Q4_K, Q5_K, Q6_K). Bit-identical hidden states and KV caches for
decode steps of 1 to 17 rows, every step through ``decode_rows`` where this host takes raw
rows (AVX512-BF16), else through ``decode_layers``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from tests.counted_kernels import CountedKernels
from tests.fused_steps import fused_against_python, takes_gguf_raw_rows
from tests.parity.families import build
from tests.unit.test_gguf_linear import random_blocks
from worker.attention import build_metadata
from worker.models.decode_stack import DecodeStack
from worker.models.decoder import DecoderLayer, DecoderLM
from worker.models.gguf_weights import GgufWeight
from worker.models.loader import load_model
from worker.models.quant_linear import QuantLinear
from worker.native import load_native_kernels
from worker.ops import NativeOps

BLOCK = 4
PROJECTIONS = (
    ("self_attn", "qkv_proj"),
    ("self_attn", "o_proj"),
    ("mlp", "gate_up_proj"),
    ("mlp", "down_proj"),
)


# The block type of each of PROJECTIONS: Q4_0 throughout, or K-quants (whose 256-weight
# blocks need in_features of whole blocks: the tiny Qwen2 widened to 256, its MLP to 512),
# or the checkpoint's parts of mixed types (q, k, v; gate, up), as Q4_K_M files mix them:
# qkv and gate_up then are QuantLinears of two segments each.
Types = tuple[Q | tuple[Q, ...], ...]
Q4_0: Types = (Q.Q4_0,) * 4
K_QUANTS: Types = (Q.Q4_K, Q.Q5_K, Q.Q4_K, Q.Q6_K)
MIXED: Types = ((Q.Q4_0, Q.Q4_0, Q.Q8_0), Q.Q5_0, (Q.Q8_0, Q.Q4_1), Q.Q4_0)
WIDTHS: dict[Types, dict[str, int]] = {
    Q4_0: {},
    K_QUANTS: {"hidden_size": 256, "intermediate_size": 512},
    MIXED: {},
}


def quantized_qwen2(tmp_path: Path, types: Types = Q4_0) -> DecoderLM:
    """The tiny Qwen2 in bfloat16, its layers' projections swapped for GGUF blocks of
    ``types`` (the checkpoint's biases kept, as ``quantize_linears`` keeps them); a tuple
    of types makes the projection of the checkpoint's parts, one type each."""
    build("qwen2", tmp_path, **WIDTHS[types])
    kernels = load_native_kernels()
    ops = NativeOps(kernels)
    model = load_model(tmp_path, torch.bfloat16, torch.device("cpu"), ops)
    assert isinstance(model, DecoderLM)
    attn = model.attention_shape()
    heads, kv_heads, head_dim = attn
    part_outputs = {
        "qkv_proj": [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim],
        "gate_up_proj": [model.args.intermediate_size] * 2,
    }
    seed = 0
    for layer in model.model.layers:
        assert isinstance(layer, DecoderLayer)
        for (parent_name, name), qtypes in zip(PROJECTIONS, types, strict=True):
            parent = getattr(layer, parent_name)
            linear = getattr(parent, name)
            width = linear.in_features
            kinds = qtypes if isinstance(qtypes, tuple) else (qtypes,)
            outs = part_outputs[name] if len(kinds) > 1 else [linear.out_features]
            weights = []
            for qtype, out in zip(kinds, outs, strict=True):
                blocks = torch.from_numpy(random_blocks(qtype, out, width, seed))
                weights.append(GgufWeight(f"{name}{seed}", int(qtype), qtype.name, blocks, width))
                seed += 1
            setattr(parent, name, QuantLinear(weights, linear.bias, kernels, True))
    model.fused_decode = DecodeStack.build(model, ops)
    return model


@pytest.mark.parametrize("types", [Q4_0, K_QUANTS, MIXED], ids=["Q4_0", "K-quants", "mixed"])
def test_gguf_projections_with_biases_take_raw_rows_bit_identically(
    tmp_path: Path, types: Types
) -> None:
    model = quantized_qwen2(tmp_path, types)
    fused = model.fused_decode
    mixed = types == MIXED
    if mixed and not fused:  # decode_layers takes no projection of two segments
        assert load_native_kernels().decode_rows_max_rows(False) == 0
        return
    assert isinstance(fused, DecodeStack)
    # qkv and gate_up of two segments each where their parts' types differ
    segments = {
        (name.rsplit(".", 1)[-1], len(m.segments))
        for name, m in model.named_modules()
        if isinstance(m, QuantLinear)
    }
    two = {"qkv_proj", "gate_up_proj"} if mixed else set()
    assert segments == {(name, 2 if name in two else 1) for _, name in PROJECTIONS}
    biases = [b for b in fused.biases if b is not None]
    # qkv's bias in every layer, float32 as QuantLinear holds it; o has none in Qwen2
    assert len(biases) == model.num_layers and all(b.dtype == torch.float32 for b in biases)
    raw = takes_gguf_raw_rows(fused)
    assert not fused.raw_gemm
    calls = CountedKernels(fused.kernels)
    fused.kernels = calls  # type: ignore[assignment]

    _, steps = fused_against_python(model, fused, seed=2)
    assert calls.rows == (steps if raw else [])
    assert calls.layers == ([] if raw else steps)


def test_the_bias_is_added(tmp_path: Path) -> None:
    """The biases matter to the step: without them the same raw-row step differs (a new
    caches list makes the stack a new plan, over the biases as they are then)."""
    model = quantized_qwen2(tmp_path)
    fused = model.fused_decode
    assert isinstance(fused, DecodeStack)
    shape = model.kv_cache_shape(8, BLOCK)
    meta = build_metadata([[0, 1]], [5], [1], BLOCK, torch.device("cpu"))
    ids = torch.tensor([7])
    cos = torch.ones(1, model.args.head_dim, dtype=torch.bfloat16)
    sin = torch.zeros(1, model.args.head_dim, dtype=torch.bfloat16)

    def run() -> torch.Tensor:
        caches = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(model.num_layers)]
        with torch.inference_mode():
            return fused(ids, {"default": (cos, sin)}, caches, meta)

    with_biases = run()
    fused.biases = [None] * len(fused.biases)
    assert not torch.equal(run(), with_biases)
