"""The fused decode step (every layer in one native call) against the Python layers it
replaces, on tiny random bfloat16 checkpoints: bit-identical hidden states and KV caches
for decode steps of 1 to 17 rows (past one GEMM tile of 14), with the kernels this host
picks (on AVX512-BF16 without AMX: the GEMM for every projection), with the small-batch
GEMV beside oneDNN (as AMX hosts pick), and with oneDNN alone; steps of any rows on the
GEMM and of one or two on the GEMV through ``decode_rows``, the others through
``decode_layers``; chosen exactly for llama-shaped models, never for a prefill step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.counted_kernels import CountedKernels
from tests.cpu import bf16_packs, needs_bf16_packing, needs_onednn_bf16
from tests.fused_steps import fused_against_python
from tests.parity.families import build
from worker.attention import AttentionMetadata
from worker.models.decode_stack import DecodeStack
from worker.models.decoder import DecoderLM
from worker.models.loader import load_model
from worker.native import load_native_kernels
from worker.ops import NativeOps
from worker.packed_linear import BF16_GEMM_CODE, ONEDNN, Gemv, PackedLinear, Packing

BLOCK = 4
FUSED = ["llama", "llama-gqa3", "llama-mqa", "llama3-rope", "qwen2"]  # qwen2: q/k/v biases
# decode_rows alone: Qwen3's q/k norms; Gemma3's (1 + w) norms, q/k and sandwich norms,
# GeGLU, sliding windows and two RoPEs
OTHER_SHAPES = ["qwen3", "gemma3"]


class NoGemvOps(NativeOps):
    """The native kernels as on a CPU without AVX512-BF16: oneDNN for every projection."""

    @property
    def small_batch_linear(self) -> Gemv | None:
        return None

    @property
    def packing(self) -> Packing:
        return ONEDNN


class GemvOps(NativeOps):
    """The native kernels as an AMX host picks them: the GEMV for a few rows, oneDNN past
    them (on any host whose build has the GEMV)."""

    @property
    def small_batch_linear(self) -> Gemv | None:
        if not self.kernels.has_bf16_gemv():
            return None
        return Gemv(self.kernels.bf16_gemv, self.kernels.bf16_gemv_max_rows)

    @property
    def packing(self) -> Packing:
        return ONEDNN


OPS = {"host": NativeOps, "gemv": GemvOps, "onednn-only": NoGemvOps}
# The host's own kernels pack wherever anything packs (on AVX2 hosts without oneDNN's
# bfloat16, the native GEMM); the other two choices pack with oneDNN.
KERNEL_CHOICES = [
    pytest.param("host", marks=needs_bf16_packing),
    pytest.param("gemv", marks=needs_onednn_bf16),
    pytest.param("onednn-only", marks=needs_onednn_bf16),
]


def load(family: str, tmp_path: Path, kernels: str = "host") -> DecoderLM:
    build(family, tmp_path)
    ops = OPS[kernels](load_native_kernels())
    model = load_model(tmp_path, torch.bfloat16, torch.device("cpu"), ops)
    assert isinstance(model, DecoderLM)
    return model


def test_not_in_float32(tmp_path: Path) -> None:
    build("llama", tmp_path)
    ops = NativeOps(load_native_kernels())
    model = load_model(tmp_path, torch.float32, torch.device("cpu"), ops)
    assert isinstance(model, DecoderLM) and model.fused_decode is None


def test_only_over_prepacked_projections(tmp_path: Path) -> None:
    """Where neither oneDNN nor the native GEMM can pack bfloat16, the projections stay
    ``nn.Linear`` and the layers run one by one."""
    model = load("llama", tmp_path)
    assert (model.fused_decode is not None) == bf16_packs()
    assert any(isinstance(m, PackedLinear) for m in model.modules()) == bf16_packs()


@pytest.mark.parametrize("kernels", KERNEL_CHOICES)
@pytest.mark.parametrize("family", FUSED)
def test_bit_identical_to_the_python_layers(family: str, kernels: str, tmp_path: Path) -> None:
    model = load(family, tmp_path, kernels)
    fused = model.fused_decode
    assert isinstance(fused, DecodeStack) and fused.llama_shaped
    native = load_native_kernels()
    ops = OPS[kernels](native)
    linears = [m for m in model.modules() if isinstance(m, PackedLinear)]
    uses_gemv = any(m.gemv is not None for m in linears)
    assert uses_gemv == (ops.small_batch_linear is not None)
    uses_gemm = ops.packing.code == BF16_GEMM_CODE
    assert all(m.packing.code == ops.packing.code for m in linears)
    assert uses_gemm == (kernels == "host" and native.bf16_gemm_packs())
    # where the GEMM takes every batch there is no GEMV, and no plain copy of a weight
    assert not (uses_gemm and (uses_gemv or any(m.weight is not None for m in linears)))
    taken, calls = count_calls(fused)
    prefill_tokens, rows = fused_against_python(model, fused, seed=len(family))
    assert taken == [prefill_tokens, *rows]  # every decode step asked, and taken
    raw_rows = native.decode_rows_max_rows(True) if uses_gemm else 2 if uses_gemv else 0
    assert fused.raw_rows == raw_rows and fused.raw_gemm == uses_gemm
    assert not uses_gemm or raw_rows > max(rows)  # the GEMM's: every step on raw rows
    assert calls.rows == [n for n in rows if n <= raw_rows]
    assert calls.layers == [n for n in rows if n > raw_rows]


@pytest.mark.parametrize("kernels", KERNEL_CHOICES)
@pytest.mark.parametrize("family", OTHER_SHAPES)
def test_other_shapes_take_decode_rows_bit_identically(
    family: str, kernels: str, tmp_path: Path
) -> None:
    """Layers decode_layers does not run: the steps decode_rows takes (any on the GEMM, one
    or two on the GEMV) bit-identical to the Python layers, the others left to them, and no
    stack at all where decode_rows takes no rows (oneDNN alone)."""
    model = load(family, tmp_path, kernels)
    native = load_native_kernels()
    ops = OPS[kernels](native)
    uses_gemm = ops.packing.code == BF16_GEMM_CODE
    raw_rows = (
        native.decode_rows_max_rows(True)
        if uses_gemm
        else 2
        if ops.small_batch_linear is not None
        else 0
    )
    fused = model.fused_decode
    if raw_rows == 0:
        assert fused is None
        return
    assert isinstance(fused, DecodeStack) and not fused.llama_shaped
    assert fused.raw_rows == raw_rows
    taken, calls = count_calls(fused)
    prefill_tokens, rows = fused_against_python(model, fused, seed=len(family))
    assert taken == [prefill_tokens, *rows]  # every decode step asked
    assert calls.rows == [n for n in rows if n <= raw_rows]
    assert calls.layers == []  # the others ran through the Python layers


@needs_bf16_packing
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_decode_rows_times_its_phases_without_changing_a_bit(family: str, tmp_path: Path) -> None:
    """With ``phase_seconds`` (bench.step_profile's split of a fused step) every phase of
    every decode_rows step is timed into it, and the steps stay bit-identical to the Python
    layers; where this host's kernels take no decode_rows steps, nothing is timed."""
    model = load(family, tmp_path)
    fused = model.fused_decode
    if fused is None:  # gemma3 without decode_rows (AMX: GEMV and oneDNN): no fused step at all
        assert family == "gemma3" and not load_native_kernels().decode_rows_max_rows(True)
        return
    assert isinstance(fused, DecodeStack)
    phases = load_native_kernels().decode_rows_phases()
    assert phases == ["projections", "attention", "rotary + KV write", "norms + adds", "activation"]
    fused.phase_seconds = torch.zeros(len(phases), dtype=torch.float64)
    _, calls = count_calls(fused)
    fused_against_python(model, fused, seed=3)
    timed = dict(zip(phases, fused.phase_seconds.tolist(), strict=True))
    assert bool(calls.rows) == (fused.raw_rows > 0)
    if calls.rows:
        assert all(seconds > 0 for seconds in timed.values()), timed
    else:
        assert not any(timed.values()), timed


def test_decode_rows_refuses_phase_seconds_of_another_shape() -> None:
    if not load_native_kernels().has_bf16_gemv():  # no raw-row kernels: no plan to run
        with pytest.raises(RuntimeError, match="decode_rows: this build has no GEMV"):
            call_decode_rows(1, gemm=False)
        return
    with pytest.raises(RuntimeError, match=r"phase_seconds must be contiguous float64 \[5\]"):
        call_decode_rows(1, gemm=False, phase_seconds=torch.zeros(4, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="phase_seconds must be contiguous float64"):
        call_decode_rows(1, gemm=False, phase_seconds=torch.zeros(5, dtype=torch.float32))


def count_calls(fused: DecodeStack) -> tuple[list[int], CountedKernels]:
    """Counts, from now on, the rows of each step ``fused`` is asked to take, and its
    kernels' calls."""
    taken: list[int] = []
    takes = fused.takes

    def counted(meta: AttentionMetadata, num_tokens: int) -> bool:
        taken.append(num_tokens)
        return takes(meta, num_tokens)

    fused.takes = counted  # type: ignore[method-assign]
    calls = CountedKernels(fused.kernels)
    fused.kernels = calls  # type: ignore[assignment]
    return taken, calls


def call_decode_rows(
    rows: int,
    gemm: bool,
    gguf_types: list[int] | None = None,
    qk_norms: bool = False,
    activation: int = 0,
    phase_seconds: torch.Tensor | None = None,
) -> None:
    """decode_rows on one zero layer of width 8 (one head of 8, plain weights, two norms) and
    ``rows`` rows; with ``gguf_types``, as if those weights were GGUF blocks; the layer's
    shape flags as given (sandwich and Gemma norms off)."""
    kernels = load_native_kernels()
    w = torch.zeros(8, 8, dtype=torch.bfloat16)  # o's; gate_up's too (intermediate 4)
    qkv, down = torch.zeros(24, 8, dtype=torch.bfloat16), torch.zeros(8, 4, dtype=torch.bfloat16)
    cache = torch.zeros(2, 1, 1, BLOCK, 8, dtype=torch.bfloat16)
    table, lens = torch.zeros(rows, 1, dtype=torch.long), torch.ones(rows, dtype=torch.long)
    slots, rope = torch.zeros(rows, dtype=torch.long), torch.zeros(rows, 8, dtype=torch.bfloat16)
    plan = kernels.DecodeRowsPlan(
        [w[0], w[0]],
        [qkv, w, w, down],
        gemm,
        [None, None],
        gguf_types or [],
        [torch.empty(0, dtype=torch.uint8)] * len(gguf_types or []),
        [1] * len(gguf_types or []),
        False,  # float activations
        [],  # no int8 projections: no row sums,
        [],  # no scales
        False,
        qk_norms,
        False,
        activation,
        [cache],
        [0],
        [0],
        1,
        1,
        8,
        BLOCK,
        1e-6,
        1.0,
        torch.zeros(4, 8, dtype=torch.bfloat16),  # the embedding of 4 tokens
        0.0,
        w[0],
    )
    plan.run(torch.zeros(rows, dtype=torch.long), slots, table, lens, [rope], [rope], phase_seconds)


def test_decode_rows_refuses_more_rows_than_the_gemv_takes() -> None:
    kernels = load_native_kernels()
    if not kernels.has_bf16_gemv():  # no raw-row kernels: the plan itself is refused
        with pytest.raises(RuntimeError, match="decode_rows: this build has no GEMV"):
            call_decode_rows(1, gemm=False)
        return
    rows = kernels.decode_rows_max_rows(False) + 1
    with pytest.raises(
        RuntimeError, match=f"decode_rows takes 1 to {rows - 1} rows on the GEMV, got {rows}"
    ):
        call_decode_rows(rows, gemm=False)


def test_decode_rows_refuses_norms_or_an_activation_its_flags_do_not_name() -> None:
    with pytest.raises(RuntimeError, match="decode_rows: per layer 4 norms"):
        call_decode_rows(1, gemm=False, qk_norms=True)  # q and k norms missing
    with pytest.raises(RuntimeError, match="unknown activation code 5"):
        call_decode_rows(1, gemm=False, activation=5)


def test_decode_rows_takes_any_rows_on_the_gemm() -> None:
    kernels = load_native_kernels()
    assert kernels.decode_rows_max_rows(True) == (2**63 - 1 if kernels.has_bf16_gemm() else 0)


def test_decode_rows_refuses_plain_weights_for_the_gemm() -> None:
    kernels = load_native_kernels()
    if kernels.decode_rows_max_rows(True) == 0:  # no AVX2: no plan on the GEMM at all
        with pytest.raises(RuntimeError, match="decode_rows: this build has no bf16_gemm"):
            call_decode_rows(1, gemm=True)
        return
    with pytest.raises(RuntimeError, match=r"weight 0 must be .*packed by bf16_gemm_pack"):
        call_decode_rows(1, gemm=True)


def test_decode_rows_refuses_gguf_projections_with_the_gemm_or_without_a_type_each() -> None:
    with pytest.raises(RuntimeError, match="GGUF projections take a type and a repacked weight"):
        call_decode_rows(1, gemm=True, gguf_types=[3] * 4)
    with pytest.raises(RuntimeError, match="GGUF projections take a type and a repacked weight"):
        call_decode_rows(1, gemm=False, gguf_types=[3] * 3)
    # bfloat16 weights are not GGUF blocks (a build without the raw-row kernels refuses first)
    no_gemv = not load_native_kernels().has_bf16_gemv()
    refusal = "this build has no GEMV" if no_gemv else "GGUF weight 0 must be contiguous uint8"
    with pytest.raises(RuntimeError, match=refusal):
        call_decode_rows(1, gemm=False, gguf_types=[3] * 4)
