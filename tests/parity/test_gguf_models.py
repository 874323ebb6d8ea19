"""``--quantization gguf`` on the embedded real models: the projections kept in the GGUF's
blocks (SmolLM2: Q4_1 and a Q8_0 LM head; Gemma 3: Q5_0, Q4_K, Q6_K and Q8_0), float32
logits within 1e-3 of transformers' float32 model loaded from the same GGUF, for a
batched prefill of the parity prompts and decode steps after it; in bfloat16, the fused
decode step over the blocks bit-identical to the Python layers, and a prefill past the
fused rows (on bf16_gemm where it takes the projections) as close to float32's as
bfloat16 allows."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from gguf import GGMLQuantizationType
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from common.config import GgufActivations
from common.model_files import gguf_source, resolve_model_dir
from tests.counted_kernels import CountedKernels
from tests.fused_steps import takes_gguf_raw_rows
from tests.parity.test_real_models_http import PROMPTS
from worker.attention import AttentionMetadata, build_metadata
from worker.models.base import CausalLM
from worker.models.decode_stack import DecodeStack
from worker.models.decoder import DecoderLM
from worker.models.loader import load_model
from worker.models.quant_linear import FUSED_MAX_ROWS, GEMM_MAX_ROWS, Q8_MAX_ROWS, QuantLinear
from worker.models.quantizers import GgufBlocks
from worker.native import load_native_kernels
from worker.ops import NativeOps

TOL = 1e-3
BLOCK = 16
DECODE_STEPS = 6
BLOCK_TYPES = {
    "smollm2-135m-instruct": {"Q4_1", "Q8_0"},
    "gemma-3-270m": {"Q5_0", "Q4_K", "Q6_K", "Q8_0"},
}


def quantized(name: str, dtype: torch.dtype, activations: GgufActivations = "float") -> CausalLM:
    """The model over its GGUF's blocks; float activations (exact: parity) unless asked."""
    ops = NativeOps(load_native_kernels())
    directory = resolve_model_dir(name)
    quantizer = GgufBlocks(gguf_source(name), activations)
    return load_model(directory, dtype, torch.device("cpu"), ops, None, quantizer)


class Batch:
    """Sequences stepped together through a model with a paged KV cache."""

    def __init__(self, model: CausalLM, prompts: list[list[int]], dtype: torch.dtype) -> None:
        self.model, self.seqs = model, [list(p) for p in prompts]
        per_seq = 8  # blocks
        self.blocks = [list(range(per_seq * i, per_seq * (i + 1))) for i in range(len(prompts))]
        shape = model.kv_cache_shape(per_seq * len(prompts), BLOCK)
        self.caches = [torch.zeros(shape, dtype=dtype) for _ in range(model.num_layers)]

    @torch.inference_mode()
    def step(self, starts: list[int]) -> torch.Tensor:
        """Run every sequence from its ``start``; the logits of each one's last token."""
        counts = [len(s) - start for s, start in zip(self.seqs, starts, strict=True)]
        ids = [t for s, start in zip(self.seqs, starts, strict=True) for t in s[start:]]
        pos = [p for s, start in zip(self.seqs, starts, strict=True) for p in range(start, len(s))]
        meta = build_metadata(self.blocks, starts, counts, BLOCK, torch.device("cpu"))
        hidden = self.model(torch.tensor(ids), torch.tensor(pos), self.caches, meta)
        last = torch.tensor(counts).cumsum(0) - 1
        return self.model.compute_logits(hidden[last]).float()


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_float32_logits_match_transformers_on_the_same_gguf(name: str) -> None:
    model = quantized(name, torch.float32)
    kinds = Counter(t for m in model.modules() if isinstance(m, QuantLinear) for t in m.type_names)
    assert set(kinds) == BLOCK_TYPES[name]
    layers = model.num_layers
    assert sum(kinds.values()) == 7 * layers + 1  # q, k, v, o, gate, up, down; the LM head
    directory = resolve_model_dir(name)
    ref = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(directory))
    prompts = [tok(text).input_ids for text in PROMPTS[name]]
    assert_float32_logits_follow(Batch(model, prompts, torch.float32), ref)


def assert_float32_logits_follow(batch: Batch, ref: PreTrainedModel) -> None:
    """One prefill step of every prompt, then ``DECODE_STEPS`` greedy decode steps of
    every sequence: after each, every sequence's logits within ``TOL`` of ``ref``'s on
    the whole sequence."""
    logits = batch.step([0] * len(batch.seqs))
    for step in range(DECODE_STEPS + 1):
        with torch.no_grad():
            for seq, ours in zip(batch.seqs, logits, strict=True):
                theirs = ref(torch.tensor([seq])).logits[0, -1]
                diff = (ours - theirs).abs().max().item()
                assert diff < TOL, f"step {step}: max |logit diff| {diff:.2e}"
        if step == DECODE_STEPS:
            break
        starts = [len(s) for s in batch.seqs]
        for seq, row in zip(batch.seqs, logits, strict=True):
            seq.append(int(row.argmax()))
        logits = batch.step(starts)


@pytest.mark.parametrize(
    ("name", "rows", "activations"),
    [("smollm2-135m-instruct", n, "float") for n in (1, 2, 3, 4)]
    + [("gemma-3-270m", n, "float") for n in (1, 4)]
    + [("smollm2-135m-instruct", n, "q8") for n in (1, 3)]
    + [("gemma-3-270m", 2, "q8")],
)
def test_bf16_fused_decode_step_over_blocks_is_bit_identical(
    name: str, rows: int, activations: GgufActivations
) -> None:
    """1 row: the bfloat16 dot over the blocks; 2 to 4: the GEMM where this CPU has one;
    on AVX512-BF16 hosts every step through decode_rows' raw rows. Gemma's layers (sandwich
    and q/k norms, GeGLU, two RoPEs) and its projections of several block types (q, k and
    v of different types: a QuantLinear of several segments) only there. With 8-bit
    activations both sides run gguf_linear_q8 at every row count."""
    model = quantized(name, torch.bfloat16, activations)
    assert isinstance(model, DecoderLM)
    fused = model.fused_decode
    kernels = load_native_kernels()
    if name == "gemma-3-270m" and kernels.decode_rows_max_rows(False) == 0:
        assert fused is None  # decode_layers runs neither its layers nor its segments
        return
    assert isinstance(fused, DecodeStack)
    # Every block type of both files is repacked for the GEMM where the CPU has one.
    gemm = all(kernels.gguf_gemm_packs(t) for t in fused.gguf_segment_types)
    assert fused.gguf_q8 is (activations == "q8")
    fused_rows = Q8_MAX_ROWS if fused.gguf_q8 else GEMM_MAX_ROWS if gemm else FUSED_MAX_ROWS
    assert fused.gguf_fused_max_rows == fused_rows
    # Every layer projection is GGUF blocks without a bias: decode_rows takes the steps
    # where it takes any.
    raw = takes_gguf_raw_rows(fused)
    assert not fused.raw_gemm
    taken: list[int] = []
    takes = fused.takes

    def counted(meta: AttentionMetadata, num_tokens: int) -> bool:
        taken.append(num_tokens)
        return takes(meta, num_tokens)

    fused.takes = counted  # type: ignore[method-assign]
    calls = CountedKernels(fused.kernels)
    fused.kernels = calls  # type: ignore[assignment]
    tok = AutoTokenizer.from_pretrained(str(resolve_model_dir(name)))
    prompts = [tok(text).input_ids for text in PROMPTS[name]][:rows]
    assert len(prompts) == rows
    sides = {side: Batch(model, prompts, torch.bfloat16) for side in ("fused", "python")}
    for batch in sides.values():
        model.fused_decode = None  # a prefill never takes the fused step anyway
        batch.step([0] * len(prompts))
    for step in range(DECODE_STEPS):
        out = {}
        for side, batch in sides.items():
            starts = [len(s) for s in batch.seqs]
            for seq in batch.seqs:
                seq.append(1000 + step)
            model.fused_decode = fused if side == "fused" else None
            out[side] = batch.step(starts)
        assert torch.equal(out["fused"], out["python"]), f"decode step {step}"
    for a, b in zip(sides["fused"].caches, sides["python"].caches, strict=True):
        assert torch.equal(a, b)
    assert taken == [rows] * DECODE_STEPS  # the fused side's decode steps, all taken
    assert calls.rows == ([rows] * DECODE_STEPS if raw else [])
    assert calls.layers == ([] if raw else [rows] * DECODE_STEPS)


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_bf16_prefill_past_the_fused_rows_stays_near_float32(name: str) -> None:
    """The parity prompts and a 100-token one prefilled in one step (133-138 rows): every
    projection past its fused rows, on ``gguf_bf16_matmul`` where bf16_gemm takes a bfloat16
    model's projections (else the dense matmul); the logits within bfloat16's drift of
    float32's (which match transformers, above), and the next token as float32's."""
    tok = AutoTokenizer.from_pretrained(str(resolve_model_dir(name)))
    prompts = [tok(text).input_ids for text in PROMPTS[name]]
    prompts.append(tok(" ".join(PROMPTS[name]) * 6).input_ids[:100])
    assert sum(map(len, prompts)) > GEMM_MAX_ROWS
    reference = Batch(quantized(name, torch.float32), prompts, torch.float32).step([0] * 5)
    model = quantized(name, torch.bfloat16)
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    calls = CountedKernels(load_native_kernels())
    for layer in layers:
        layer.kernels = calls  # type: ignore[assignment]
    logits = Batch(model, prompts, torch.bfloat16).step([0] * len(prompts))
    on_gemm = load_native_kernels().bf16_gemm_packs()
    rows = sum(map(len, prompts))
    # 7 projections a layer, as 4 fused ones of 1 or 2 types; the LM head takes 5 rows
    assert calls.matmuls == ([rows] * len(calls.matmuls) if on_gemm else [])
    assert len(calls.matmuls) >= (4 * model.num_layers if on_gemm else 0)
    # bfloat16 drifts ~0.2-0.5 from float32 here (the dense matmul too); the next token
    # holds wherever float32's lead is well past that (4 of the 5 sequences of each model)
    drift = (logits - reference).abs().max().item()
    assert drift < 0.05 * reference.abs().max().item(), f"max |logit diff| {drift:.2f}"
    top2 = reference.topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] > 1.0
    assert clear.sum() >= 3
    assert torch.equal(logits.argmax(-1)[clear], reference.argmax(-1)[clear])


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_bf16_decode_steps_stay_near_float32(name: str) -> None:
    """Decode steps of the parity prompts together, in bfloat16 on the repacked quants
    where the CPU has the GEMM (Gemma's Q4_K and Q6_K from one row on), each fed float32's
    greedy token: every step's logits within bfloat16's drift of float32's, and its next
    token float32's wherever float32's lead is clear of that drift."""
    tok = AutoTokenizer.from_pretrained(str(resolve_model_dir(name)))
    prompts = [tok(text).input_ids for text in PROMPTS[name]]
    model = quantized(name, torch.bfloat16)
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    gemm = load_native_kernels().gguf_gemm_packs(int(GGMLQuantizationType.Q6_K))
    assert all((s.gemm is not None) == gemm for m in layers for s in m.segments)
    sides = {
        "float32": Batch(quantized(name, torch.float32), prompts, torch.float32),
        "bfloat16": Batch(model, prompts, torch.bfloat16),
    }
    starts = [0] * len(prompts)
    clear_steps = 0
    for step in range(DECODE_STEPS):
        logits = {side: batch.step(starts) for side, batch in sides.items()}
        reference = logits["float32"]
        drift = (logits["bfloat16"] - reference).abs().max().item()
        assert drift < 0.05 * reference.abs().max().item(), f"step {step}: {drift:.2f}"
        top2 = reference.topk(2, dim=-1).values
        clear = top2[:, 0] - top2[:, 1] > 1.0
        clear_steps += int(clear.sum())
        assert torch.equal(logits["bfloat16"].argmax(-1)[clear], reference.argmax(-1)[clear])
        starts = [len(s) for s in sides["float32"].seqs]
        for batch in sides.values():
            for seq, row in zip(batch.seqs, reference, strict=True):
                seq.append(int(row.argmax()))
    assert clear_steps >= DECODE_STEPS * len(prompts) // 2


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_q8_activations_stay_near_float_activations(name: str) -> None:
    """``--gguf-activations q8`` on a float32 model beside the exact float activations: the
    parity prompts prefilled together, then greedy decode steps (both sides fed the exact
    side's tokens); at every step the logits within the 8-bit rounding's drift and the
    next token the same wherever the exact side's lead is clear. (Perplexity over 27k
    tokens: ``python -m bench.quality``.)"""
    tok = AutoTokenizer.from_pretrained(str(resolve_model_dir(name)))
    prompts = [tok(text).input_ids for text in PROMPTS[name]]
    q8_model = quantized(name, torch.float32, "q8")
    assert all(m.q8_activations for m in q8_model.modules() if isinstance(m, QuantLinear))
    exact, q8 = (
        Batch(m, prompts, torch.float32) for m in (quantized(name, torch.float32), q8_model)
    )
    starts = [0] * len(prompts)
    clear_total = 0
    for step in range(DECODE_STEPS + 1):
        want, got = exact.step(starts), q8.step(starts)
        drift = (got - want).abs().max().item()
        assert drift < 0.1 * want.abs().max().item(), f"step {step}: max |logit diff| {drift:.2f}"
        top2 = want.topk(2, dim=-1).values
        clear = top2[:, 0] - top2[:, 1] > 1.0
        clear_total += int(clear.sum())
        assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear]), f"step {step}"
        starts = [len(s) for s in exact.seqs]
        for a, b, row in zip(exact.seqs, q8.seqs, want, strict=True):
            a.append(int(row.argmax()))
            b.append(int(row.argmax()))
    assert clear_total >= len(prompts) * (DECODE_STEPS + 1) // 2  # the check had teeth
