"""The fused decode step over ``--quantization int8`` projections against the Python layers
it replaces: a tiny random model of each layer shape (Qwen2: q/k/v biases, kept in float32
as ``Int8Linear`` keeps them; Qwen3: q/k norms; Gemma 3: its norms, GeGLU and two RoPEs)
in bfloat16, every layer projection an ``Int8Linear``. Hidden states and KV caches
bit-identical for decode steps of 1 to 17 rows, every one of them through ``decode_rows``
on every host (``int8_linear`` runs on any)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.avx2_build import assert_passes_on_the_avx2_build
from tests.counted_kernels import CountedKernels
from tests.fused_steps import fused_against_python
from tests.parity.families import build
from worker.models.decode_stack import DecodeStack
from worker.models.decoder import DecoderLayer, DecoderLM
from worker.models.int8_linear import Int8Linear
from worker.models.loader import load_model
from worker.models.quantizers import Int8PerChannel
from worker.native import load_native_kernels
from worker.ops import NativeOps
from worker.packed_linear import PackedLinear


def int8_model(family: str, tmp_path: Path) -> DecoderLM:
    """The tiny ``family`` model in bfloat16 as the loader makes it for ``--quantization
    int8``, its layers' projections int8 (no smoothing: a random model has no text to
    calibrate on), its fused decode built over them."""
    build(family, tmp_path)
    ops = NativeOps(load_native_kernels())
    quantizer = Int8PerChannel(tmp_path, smooth=False)
    model = load_model(tmp_path, torch.bfloat16, torch.device("cpu"), ops, quantizer=quantizer)
    assert isinstance(model, DecoderLM)
    int8 = [m for m in model.modules() if isinstance(m, Int8Linear)]
    assert len(int8) == 4 * model.num_layers
    return model


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "gemma3"])
def test_int8_projections_take_raw_rows_bit_identically(tmp_path: Path, family: str) -> None:
    model = int8_model(family, tmp_path)
    fused = model.fused_decode
    assert isinstance(fused, DecodeStack)
    assert fused.raw_int8 and not fused.layers_path and not fused.raw_gemm
    if family == "qwen2":  # q/k/v's bias in every layer, float32 as Int8Linear holds it
        biases = [b for b in fused.biases if b is not None]
        assert len(biases) == model.num_layers and all(b.dtype == torch.float32 for b in biases)
    calls = CountedKernels(fused.kernels)
    fused.kernels = calls  # type: ignore[assignment]

    _, steps = fused_against_python(model, fused, seed=3)
    assert calls.rows == steps  # every decode step on raw rows, none on decode_layers
    assert calls.layers == []


def test_a_model_with_int8_and_other_projections_keeps_the_python_layers(
    tmp_path: Path,
) -> None:
    model = int8_model("qwen2", tmp_path)
    ops = NativeOps(load_native_kernels())
    assert DecodeStack.build(model, ops) is not None
    layer = model.model.layers[0]
    assert isinstance(layer, DecoderLayer)
    first = layer.self_attn
    assert isinstance(first.o_proj, Int8Linear)
    # One projection back to a packed float one: decode_rows takes int8 projections only
    # where every one is.
    linear = torch.nn.Linear(first.o_proj.in_features, first.o_proj.out_features, bias=False)
    first.o_proj = PackedLinear(linear.to(torch.bfloat16), ops.small_batch_linear, ops.packing)
    assert DecodeStack.build(model, ops) is None


def test_the_avx2_build_passes_these_tests() -> None:
    """This file again on the portable x86-64-v3 build: AVX2 hosts' int8 steps take
    decode_rows too (int8_linear's AVX2 path, the raw rows' AVX2 attention)."""
    assert_passes_on_the_avx2_build(__file__)
