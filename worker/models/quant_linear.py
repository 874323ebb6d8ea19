"""Linear layers over GGUF-quantized weights (``--quantization gguf``), and the pass that
puts them in a loaded model in place of its projections.

The weights stay in the file's blocks (Q4_1, Q8_0, Q5_0, Q4_K, Q6_K, ...), so a decode
step reads ~3x fewer bytes than in bfloat16. Up to ``fused_max_rows`` rows (decode
steps) go to the native ``gguf_linear``: a bfloat16 row or two dotted with the blocks as
they are, more (the K-quants: from one) with the quants repacked for a GEMM (a bfloat16
model), else each weight row dequantized in cache and dotted with every input row in
float32. Larger batches (prefill chunks) compute in the activations' dtype over the weight
dequantized for the call, where the matmul's cost dwarfs the dequantization: for a bfloat16
model where ``bf16_gemm`` takes the projections (AVX512-BF16, no AMX), on it, a group of its
32 outputs dequantized at a time (``gguf_bf16_matmul``); else one dense matmul over the whole
weight. Dequantization is exact (bit for bit gguf-py's, which transformers loads GGUF files
with), so float32 parity holds.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

from worker.models.gguf_weights import GgufFile, GgufWeight
from worker.native import NativeKernels

logger = logging.getLogger(__name__)

# Past this many rows one dense matmul over the dequantized weight is faster
# (python -m bench.gguf_linear): for float32 rows, and where the quants have no GEMM copy.
FUSED_MAX_ROWS = 32
# The same for bfloat16 rows over repacked quants (gguf_gemm.cpp): on a Zen 5, over
# SmolLM2's projections in four runs, the GEMM took 26-33 ms at 64 rows against the
# matmul's 33-47; at 128 55-60 against 50-65, ahead in two runs and behind in two, where
# it keeps the weights exact (not rounded to bfloat16) for the same time; it lost at 256
# (113-137 against 85-100).
GEMM_MAX_ROWS = 128
# With 8-bit activations every step's rows take gguf_linear's integer dots.
Q8_MAX_ROWS = 1 << 62
# Our fused projections and the checkpoint projections they are made of, in order.
FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@dataclass(frozen=True)
class _Segment:
    """Consecutive output rows of one block type: the file's blocks, and for a bfloat16
    model where the kernels have one, the same quants repacked for many rows
    (``gguf_gemm_pack``)."""

    type: int
    data: torch.Tensor
    gemm: torch.Tensor | None = None


class QuantLinear(nn.Module):
    """``nn.Linear`` (inference only) over GGUF blocks: the weights of ``parts`` side by
    side (their outputs concatenated), with an optional float bias."""

    bias: torch.Tensor | None

    def __init__(
        self,
        parts: list[GgufWeight],
        bias: torch.Tensor | None,
        kernels: NativeKernels,
        bfloat16_rows: bool = False,
        q8_activations: bool = False,
    ) -> None:
        """``q8_activations``: every row count on ``gguf_linear``'s 8-bit activations
        (llama.cpp's arithmetic), else the exact float paths below."""
        super().__init__()
        self.q8_activations = q8_activations
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.type_names = [p.type_name for p in parts]
        self.kernels = kernels
        segments: list[_Segment] = []
        for part in parts:  # rows of one type are one segment: one kernel call
            if segments and segments[-1].type == part.type:
                last = segments.pop()
                segments.append(_Segment(part.type, torch.cat([last.data, part.data])))
            else:
                segments.append(_Segment(part.type, part.data))
        if bfloat16_rows:  # decode steps from gguf_gemm_min_rows: the GEMM over a copy
            segments = [
                _Segment(s.type, s.data, kernels.gguf_gemm_pack(s.data, s.type, self.in_features))
                if kernels.gguf_gemm_packs(s.type)
                else s
                for s in segments
            ]
        self.segments = segments
        gemm = bfloat16_rows and all(s.gemm is not None for s in segments)
        # 8-bit activations: one kernel at every size (the quality measured is the one served)
        self.fused_max_rows = (
            Q8_MAX_ROWS if q8_activations else GEMM_MAX_ROWS if gemm else FUSED_MAX_ROWS
        )
        self.register_buffer(
            "bias", None if bias is None else bias.detach().float(), persistent=False
        )
        # Past fused_max_rows: bf16_gemm over the weight dequantized a group at a time
        # where it takes a bfloat16 model's projections, else a dense matmul.
        self._many_rows = (
            self._on_bf16_gemm
            if bfloat16_rows and kernels.bf16_gemm_packs()
            else self._on_dense_matmul
        )

    def block_tensors(self) -> list[torch.Tensor]:
        """The tensors holding the weight's blocks (``worker.huge_pages`` moves them in
        place)."""
        return [t for s in self.segments for t in (s.data, s.gemm) if t is not None]

    @property
    def nbytes(self) -> int:
        """The file's blocks (a batch-1 step reads them once; the repacked copy is apart)."""
        return sum(s.data.numel() for s in self.segments)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight ``[out, in]`` as transformers holds it in float32 (in bfloat16:
        rounded once from that)."""
        bf16 = dtype == torch.bfloat16
        parts = [
            self.kernels.gguf_dequantize(s.data, s.type, self.in_features, bf16)
            for s in self.segments
        ]
        return (parts[0] if len(parts) == 1 else torch.cat(parts)).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.shape[0] <= self.fused_max_rows:
            # bfloat16 rows as they are (their products with the quants are exact), else
            # float32: as decode_stack.cpp's gguf_projection passes them.
            rows = (flat if flat.dtype == torch.bfloat16 else flat.float()).contiguous()
            if len(self.segments) == 1:  # as decode_stack.cpp's gguf_projection does
                (s,) = self.segments
                # bfloat16 rounded once from the float32 product, in the kernel: a wide
                # head's float32 product is a large fresh allocation every step
                bf16 = x.dtype == torch.bfloat16
                out = self.kernels.gguf_linear(
                    rows, s.data, s.type, self.bias, s.gemm, bf16, self.q8_activations
                )
            else:
                outs = [
                    self.kernels.gguf_linear(
                        rows, s.data, s.type, None, s.gemm, False, self.q8_activations
                    )
                    for s in self.segments
                ]
                out = torch.cat(outs, dim=1)
                if self.bias is not None:
                    out += self.bias
            out = out.to(x.dtype)
        else:
            out = self._many_rows(flat)
        return out.reshape(*x.shape[:-1], self.out_features)

    def _on_dense_matmul(self, flat: torch.Tensor) -> torch.Tensor:
        weight = self.dequantized(flat.dtype)
        bias = None if self.bias is None else self.bias.to(flat.dtype)
        return nn.functional.linear(flat, weight, bias)

    def _on_bf16_gemm(self, flat: torch.Tensor) -> torch.Tensor:
        rows = flat.to(torch.bfloat16).contiguous()
        bias = None if self.bias is None else self.bias.to(torch.bfloat16)
        outs, first = [], 0
        for s in self.segments:
            count = s.data.shape[0]
            part = None if bias is None else bias[first : first + count]
            outs.append(self.kernels.gguf_bf16_matmul(rows, s.data, s.type, part))
            first += count
        return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)).to(flat.dtype)


def _parts_of(module_name: str) -> list[str]:
    prefix, _, last = module_name.rpartition(".")
    parts = FUSED_PARTS.get(last)
    return [f"{prefix}.{p}" for p in parts] if parts else [module_name]


def quantize_linears(
    model: nn.Module,
    gguf: GgufFile,
    kernels: NativeKernels,
    tied_embeddings: bool,
    q8_activations: bool = False,
) -> Counter[str]:
    """Replace every projection of ``model`` (loaded and fused) whose weights the GGUF
    holds as blocks by a ``QuantLinear``; returns how many of each block type. Those it
    holds as plain floats stay ``nn.Linear``. A tied LM head reads the token embedding's
    blocks (the embedding lookup itself keeps the loaded float table)."""
    counts: Counter[str] = Counter()
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            fallback = "token_embd.weight" if name == "lm_head" and tied_embeddings else None
            parts = [gguf.weight(part, fallback) for part in _parts_of(name)]
            if any(p is None for p in parts):
                continue
            weights = [p for p in parts if p is not None]
            out_features = sum(w.out_features for w in weights)
            if (out_features, weights[0].in_features) != tuple(child.weight.shape):
                raise ValueError(
                    f"{gguf.path}: {', '.join(w.name for w in weights)} make a "
                    f"[{out_features}, {weights[0].in_features}] weight, but {name} is "
                    f"{list(child.weight.shape)}"
                )
            bfloat16_rows = child.weight.dtype == torch.bfloat16
            linear = QuantLinear(weights, child.bias, kernels, bfloat16_rows, q8_activations)
            setattr(parent, child_name, linear)
            counts.update(w.type_name for w in weights)
    return counts
