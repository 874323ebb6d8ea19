"""A decode step of 1-4 rows through every layer in one native call.

At batch 1 the interpreter, not the kernels, is the largest cost after the projections
(``bench/step_profile``: ~5 ms of a ~22 ms step). ``worker/csrc/decode_stack.cpp`` runs
the very kernels ``DecoderLayer.forward`` calls on ``NativeOps`` with the GEMV, in the
same order, so a step through it is bit-identical to one through the Python layers; it
only applies where that holds and the model is llama-shaped: Llama, SmolLM2, Qwen2 (q/k/v
biases). Qwen3's q/k norms, Gemma's sandwich norms and GeGLU, tensor parallelism and
steps holding a prefill keep the Python layers.
"""

from __future__ import annotations

import torch

from worker.attention import AttentionMetadata
from worker.models.decoder import DecoderLayer, DecoderLM
from worker.models.packed_linear import GEMV_MAX_ROWS, PackedLinear
from worker.ops import NativeOps, Ops


class DecodeStack:
    """Every layer's weights, gathered once after loading, for ``decode_layers``."""

    def __init__(self, model: DecoderLM, ops: NativeOps) -> None:
        args = model.args
        self.kernels = ops.kernels
        self.heads, self.kv_heads, self.head_dim = model.attention_shape()
        self.eps = args.rms_norm_eps
        self.scale = args.attn_scale if args.attn_scale is not None else args.head_dim**-0.5
        self.windows = [w or 0 for w in args.layer_windows] or [0] * args.num_layers
        self.rope = args.layer_ropes[0] if args.layer_ropes else "default"
        self.weights: list[torch.Tensor] = []
        self.biases: list[torch.Tensor | None] = []
        for layer in model.model.layers:
            assert isinstance(layer, DecoderLayer)  # narrows ModuleList's item type
            attn, mlp = layer.self_attn, layer.mlp
            qkv, o = _gemv_linear(attn.qkv_proj), _gemv_linear(attn.o_proj)
            gate_up, down = _gemv_linear(mlp.gate_up_proj), _gemv_linear(mlp.down_proj)
            self.weights += [
                layer.input_layernorm.weight.detach(),
                _plain(qkv),
                _plain(o),
                layer.post_attention_layernorm.weight.detach(),
                _plain(gate_up),
                _plain(down),
            ]
            self.biases += [qkv.bias, o.bias]

    @staticmethod
    def build(model: DecoderLM, ops: Ops) -> DecodeStack | None:
        """The stack, or None where the fused step does not apply (see the module doc)."""
        args = model.args
        llama_shaped = (
            args.norm == "llama"
            and not args.sandwich_norms
            and not args.qk_norm
            and args.activation == "silu"
            and len(set(args.layer_ropes)) <= 1
        )
        if not (llama_shaped and model.tp.size == 1 and isinstance(ops, NativeOps)):
            return None
        layers = list(model.model.layers)
        linears = [m for layer in layers for m in layer.modules() if isinstance(m, PackedLinear)]
        if len(linears) != 4 * len(layers) or any(m.weight is None for m in linears):
            return None  # not every projection has the GEMV (not bfloat16, no AVX512-BF16)
        return DecodeStack(model, ops)

    def takes(self, meta: AttentionMetadata, num_tokens: int) -> bool:
        """Whether this step is one the stack runs: decodes only, 1-4 of them."""
        return (
            not meta.prefills
            and 0 < num_tokens <= GEMV_MAX_ROWS
            and meta.decode_block_table is not None
            and meta.decode_context_lens is not None
        )

    def __call__(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The embeddings ``x`` through every layer (before the final norm)."""
        assert meta.decode_block_table is not None and meta.decode_context_lens is not None
        return self.kernels.decode_layers(
            x,
            self.weights,
            self.biases,
            kv_caches,
            self.windows,
            meta.slot_mapping,
            meta.decode_block_table,
            meta.decode_context_lens,
            cos,
            sin,
            self.heads,
            self.kv_heads,
            self.head_dim,
            meta.block_size,
            self.eps,
            self.scale,
        )


def _gemv_linear(module: object) -> PackedLinear:
    if not isinstance(module, PackedLinear):
        raise TypeError(f"expected a PackedLinear, got {type(module).__name__}")
    return module


def _plain(linear: PackedLinear) -> torch.Tensor:
    if linear.weight is None:
        raise ValueError("the fused decode step needs every projection's plain weight")
    return linear.weight
