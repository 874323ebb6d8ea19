"""A decode step through every layer in one native call.

The interpreter costs ~6 ms a step whatever the batch (``bench/step_profile``): a fifth
of a batch-1 step, more than its attention. ``worker/csrc/decode_stack.cpp`` runs the
very kernels ``DecoderLayer.forward`` calls on ``NativeOps`` over ``PackedLinear``
projections (the GEMV for the rows it takes where it exists, the matmul of their
``Packing`` otherwise), in the same order with the same arguments, so a step through it is
bit-identical to one through the Python layers; ``QuantLinear`` projections of one block type
(``--quantization gguf``) run as their ``forward`` does. It applies where that holds and
the model is llama-shaped: Llama, SmolLM2, Qwen2 (q/k/v biases) in bfloat16 on the
native kernels. Steps whose projections all run on one raw-row kernel go to
``decode_rows`` instead (``worker/csrc/decode_rows.cpp``): steps of any rows where the
AVX512-BF16 GEMM packs every projection (AMD hosts without AMX), steps of one or two rows
on the GEMV over plain weights, and GGUF steps of as many rows as every ``QuantLinear``
fuses (``gguf_linear``, on AVX512-BF16 hosts, Qwen2's biases too, and projections whose
parts are blocks of different types, several segments, as Q4_K_M files make q, k and v:
``decode_layers`` takes one segment only), and ``--quantization int8`` steps of any rows on
any host (every projection an ``Int8Linear``, on ``int8_linear``). It runs the same kernels on
raw rows, with no tensor made per op (but a GGUF projection's product), which took ~1 ms
of a ~10 ms step at one row and ~0.5 ms of ~15 at 32. ``decode_rows`` also runs the layers
of other shapes: Qwen3's q/k norms, and Gemma3's (1 + w) norms, q/k norms, sandwich norms,
GeGLU and two RoPEs; those models' steps go to it where it takes their rows (on AVX512-BF16
hosts without AMX: any decode step; elsewhere, or past the rows its GGUF projections fuse,
the Python layers). Float32, tensor parallelism and steps holding a prefill keep the Python
layers.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping

import torch

from worker.attention import AttentionMetadata
from worker.models.decoder import DecoderArgs, DecoderLayer, DecoderLM
from worker.models.int8_linear import Int8Linear
from worker.models.quant_linear import FUSED_MAX_ROWS, QuantLinear
from worker.native import DecodeRowsPlan
from worker.ops import NATIVE_ACTIVATIONS, NativeOps, Ops
from worker.packed_linear import BF16_GEMM_CODE, ONEDNN_CODE, PackedLinear


class DecodeStack:
    """Every layer's weights, gathered once after loading, for ``decode_layers``."""

    def __init__(self, model: DecoderLM, ops: NativeOps) -> None:
        args = model.args
        self.kernels = ops.kernels
        self.heads, self.kv_heads, self.head_dim = model.attention_shape()
        self.eps = args.rms_norm_eps
        self.scale: float = args.attn_scale if args.attn_scale is not None else args.head_dim**-0.5
        # Where set (bench.step_profile), decode_rows adds each phase's wall time to it, in
        # the kernels' decode_rows_phases() order; None in serving: no clock read.
        self.phase_seconds: torch.Tensor | None = None
        # The step's ends: the model's embedding (and its scale) and final norm.
        self.embed = model.embed
        self.embedding = model.model.embed_tokens.weight.detach()
        self.embed_scale = args.embed_scale
        self.final_norm = model.model.norm
        self.windows = [w or 0 for w in args.layer_windows] or [0] * args.num_layers
        self.ropes = list(args.layer_ropes) or ["default"] * args.num_layers
        # decode_rows' plan takes each distinct RoPE's cos and sin once a step.
        self.rope_names = list(dict.fromkeys(self.ropes))
        # decode_rows' plan, and the caches list and block size it was made for
        self._rows_plan: tuple[DecodeRowsPlan, list[torch.Tensor], int] | None = None
        # decode_layers (the tensor path) runs Llama-shaped layers only, and GGUF projections
        # of one segment; the others take decode_rows' steps and leave the rest to Python.
        self.llama_shaped = llama_shaped(args)
        self.gemma_norms, self.qk_norms = args.norm == "gemma", args.qk_norm
        self.sandwich_norms = args.sandwich_norms
        self.activation = NATIVE_ACTIVATIONS[args.activation]
        self.norms: list[torch.Tensor] = []
        self.plain: list[torch.Tensor | None] = []  # per projection: the GEMV's weight
        self.packed: list[torch.Tensor] = []  # per projection: the packed weight
        self.packings: list[int] = []  # per projection: its Packing's code
        self.gguf_types: list[int] = []  # per projection: its ggml type, -1 if not GGUF
        # decode_rows' GGUF projections: each one's segment count, and every segment's
        # blocks, repacked quants and type (QuantLinear.segments, in order)
        self.gguf_segments: list[int] = []
        self.gguf_blocks: list[torch.Tensor] = []
        self.gguf_packed: list[torch.Tensor] = []
        self.gguf_segment_types: list[int] = []
        # decode_rows' int8 projections (--quantization int8): each one's packed weight, row
        # sums and scales
        self.int8_packed: list[torch.Tensor] = []
        self.int8_sums: list[torch.Tensor] = []
        self.int8_scales: list[torch.Tensor] = []
        self.biases: list[torch.Tensor | None] = []
        gemv_rows: list[int] = []  # per projection: the rows its GEMV takes (0: none)
        fused_max_rows: list[int] = []  # per QuantLinear: the most rows it fuses
        q8_activations: set[bool] = set()  # per QuantLinear: whether it quantizes its rows
        unused = torch.empty(0)
        for layer in model.model.layers:
            assert isinstance(layer, DecoderLayer)  # narrows ModuleList's item type
            attn, mlp = layer.self_attn, layer.mlp
            # decode_rows' order (kernels.h's NormSlot): input, post-attention, then the
            # sandwich's pre- and post-feedforward, then q and k
            norms = [layer.input_layernorm, layer.post_attention_layernorm]
            if args.sandwich_norms:
                norms += [layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm]
            if args.qk_norm:
                assert attn.q_norm is not None and attn.k_norm is not None  # made with qk_norm
                norms += [attn.q_norm, attn.k_norm]
            self.norms += [norm.weight.detach() for norm in norms]
            linears = [
                _projection(m)
                for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            ]
            for linear in linears:
                if isinstance(linear, Int8Linear):
                    self.int8_packed.append(linear.packed)
                    self.int8_sums.append(linear.weight_sums)
                    self.int8_scales.append(linear.weight_scales)
                    # decode_layers' arguments: unused (it takes no int8 projection)
                    self.plain.append(None)
                    self.packed.append(unused)
                    self.packings.append(ONEDNN_CODE)
                    self.gguf_types.append(-1)
                    gemv_rows.append(0)
                elif isinstance(linear, QuantLinear):
                    fused_max_rows.append(linear.fused_max_rows)
                    q8_activations.add(linear.q8_activations)
                    self.gguf_segments.append(len(linear.segments))
                    for s in linear.segments:
                        self.gguf_blocks.append(s.data)
                        self.gguf_packed.append(unused if s.gemm is None else s.gemm)
                        self.gguf_segment_types.append(s.type)
                    # decode_layers' arguments: the first segment (it runs single ones only)
                    first = linear.segments[0]
                    self.plain.append(first.data)
                    self.packed.append(unused if first.gemm is None else first.gemm)
                    self.packings.append(ONEDNN_CODE)  # unused
                    self.gguf_types.append(first.type)
                    gemv_rows.append(0)
                else:
                    self.plain.append(linear.weight)
                    self.packed.append(linear.packed_weight)
                    self.packings.append(linear.packing.code)
                    self.gguf_types.append(-1)
                    gemv_rows.append(linear.gemv_rows if linear.weight is not None else 0)
            self.biases += [linears[0].bias, linears[1].bias]
        # decode_layers takes one limit: the fewest rows any projection fuses.
        self.gguf_fused_max_rows = min(fused_max_rows, default=FUSED_MAX_ROWS)
        # One choice for the whole model (quantize_linears makes it once).
        assert len(q8_activations) <= 1, "every QuantLinear quantizes its rows or none does"
        self.gguf_q8 = q8_activations == {True}
        # The most rows decode_rows takes: any where every projection is the GEMM's, as
        # many as every QuantLinear fuses where every projection is GGUF, else as many as
        # every projection's GEMV takes too.
        self.raw_gguf = all(t >= 0 for t in self.gguf_types)
        # int8 projections: decode_rows takes steps of any rows, on any host (int8_linear)
        self.raw_int8 = len(self.int8_packed) == len(self.packings)
        # (a GGUF or int8 projection's packing code is a placeholder, never the GEMM's)
        self.raw_gemm = all(code == BF16_GEMM_CODE for code in self.packings) and not any(gemv_rows)
        raw_limit = ops.kernels.decode_rows_max_rows(self.raw_gemm)
        if self.raw_int8:
            self.raw_rows = sys.maxsize
        elif self.raw_gguf:  # decode_rows takes GGUF steps where it takes any (AVX512-BF16)
            self.raw_rows = self.gguf_fused_max_rows if raw_limit else 0
        else:
            self.raw_rows = raw_limit if self.raw_gemm else min([raw_limit, *gemv_rows])
        raw = (
            self.int8_packed
            if self.raw_int8
            else self.gguf_blocks
            if self.raw_gguf
            else self.packed
            if self.raw_gemm
            else self.plain
        )
        self.raw_weights = [w for w in raw if w is not None] if self.raw_rows else []
        # decode_rows' GGUF arguments: each segment's type and repacked quants, each
        # projection's segment count.
        self.raw_gguf_types = self.gguf_segment_types if self.raw_gguf else []
        self.raw_gguf_packed = self.gguf_packed if self.raw_gguf else []
        self.raw_gguf_segments = self.gguf_segments if self.raw_gguf else []
        self.layers_path = (
            self.llama_shaped and all(n == 1 for n in self.gguf_segments) and not self.int8_packed
        )

    @staticmethod
    def build(model: DecoderLM, ops: Ops) -> DecodeStack | None:
        """The stack, or None where the fused step does not apply (see the module doc)."""
        args = model.args
        if args.activation not in NATIVE_ACTIVATIONS:
            return None
        if not (model.tp.size == 1 and isinstance(ops, NativeOps)):
            return None
        layers = list(model.model.layers)
        if model.model.embed_tokens.weight.dtype != torch.bfloat16:
            return None
        projections = [
            m
            for layer in layers
            for m in layer.modules()
            if isinstance(m, PackedLinear | QuantLinear | Int8Linear)
        ]
        if len(projections) != 4 * len(layers):
            return None  # not packed for oneDNN (no oneDNN)
        stack = DecodeStack(model, ops)
        # Where decode_layers cannot run the layers only decode_rows does: no stack where it
        # takes no rows either.
        return stack if stack.layers_path or stack.raw_rows else None

    def takes(self, meta: AttentionMetadata, num_tokens: int) -> bool:
        """Whether this step is one the stack runs: decodes only (where decode_layers cannot
        run the layers, as many rows as decode_rows takes)."""
        return (
            not meta.prefills
            and num_tokens > 0
            and (self.layers_path or num_tokens <= self.raw_rows)
            and meta.decode_block_table is not None
            and meta.decode_context_lens is not None
        )

    def __call__(
        self,
        input_ids: torch.Tensor,
        rope: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The tokens embedded, through every layer and the final norm; ``rope``: each
        RoPE's (cos, sin) for the step's positions, by name. decode_rows embeds and norms
        too (each a torch op less over cold caches: ~0.1 ms of a one-row step)."""
        table, lens = meta.decode_block_table, meta.decode_context_lens
        assert table is not None and lens is not None
        if input_ids.shape[0] <= self.raw_rows:
            return self.rows_plan(kv_caches, meta.block_size).run(
                input_ids,
                meta.slot_mapping,
                table,
                lens,
                [rope[name][0] for name in self.rope_names],
                [rope[name][1] for name in self.rope_names],
                self.phase_seconds,
            )
        cos, sin = rope[self.ropes[0]]  # takes() sent only Llama-shaped layers: one RoPE
        hidden = self.kernels.decode_layers(
            self.embed(input_ids),
            self.norms,
            self.plain,
            self.packed,
            self.packings,
            self.biases,
            self.gguf_types,
            self.gguf_fused_max_rows,
            self.gguf_q8,
            kv_caches,
            self.windows,
            meta.slot_mapping,
            table,
            lens,
            cos,
            sin,
            *self._shape(meta),
        )
        return self.final_norm(hidden)

    def rows_plan(self, kv_caches: list[torch.Tensor], block_size: int) -> DecodeRowsPlan:
        """decode_rows' plan over these caches: made at the first step (the caches are made
        after the stack) and again only if the runner's caches list were another."""
        made = self._rows_plan
        if made is None or made[1] is not kv_caches or made[2] != block_size:
            plan = self.kernels.DecodeRowsPlan(
                self.norms,
                self.raw_weights,
                self.raw_gemm,
                self.biases,
                self.raw_gguf_types,
                self.raw_gguf_packed,
                self.raw_gguf_segments,
                self.gguf_q8,
                self.int8_sums if self.raw_int8 else [],
                self.int8_scales if self.raw_int8 else [],
                self.gemma_norms,
                self.qk_norms,
                self.sandwich_norms,
                self.activation,
                kv_caches,
                self.windows,
                [self.rope_names.index(name) for name in self.ropes],
                self.heads,
                self.kv_heads,
                self.head_dim,
                block_size,
                self.eps,
                self.scale,
                self.embedding,
                self.embed_scale or 0.0,
                self.final_norm.weight.detach(),
            )
            made = self._rows_plan = (plan, kv_caches, block_size)
        return made[0]

    def _shape(self, meta: AttentionMetadata) -> tuple[int, int, int, int, float, float]:
        """Both entries' last arguments: heads, KV heads, head size, block size, eps, scale."""
        return self.heads, self.kv_heads, self.head_dim, meta.block_size, self.eps, self.scale


def llama_shaped(args: DecoderArgs) -> bool:
    """Whether every layer is Llama's (decode_layers' shape): llama-style norms, two a
    layer, SiLU, one RoPE."""
    return (
        args.norm == "llama"
        and not args.sandwich_norms
        and not args.qk_norm
        and args.activation == "silu"
        and len(set(args.layer_ropes)) <= 1
    )


def _projection(module: object) -> PackedLinear | QuantLinear | Int8Linear:
    if not isinstance(module, PackedLinear | QuantLinear | Int8Linear):
        raise TypeError(
            f"expected a PackedLinear, QuantLinear or Int8Linear, got {type(module).__name__}"
        )
    return module
