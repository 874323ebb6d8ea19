"""W8A8 linear layers (``--quantization int8``, or a W8A8 checkpoint's own integers:
``compressed_tensors.py``): the projections of a float checkpoint quantized once at load
to int8 per output channel, their inputs quantized per token at every call, multiplied in
int32 by the native ``int8_linear`` (``worker/csrc/int8_linear.cpp``: AMX-INT8,
AVX512-VNNI, AVX-VNNI, AVX2 or portable C++, the best this build and CPU have).

This is vLLM's CPU W8A8 scheme (compressed-tensors' ``int8`` weights, channel strategy,
dynamic per-token activations): symmetric scales ``max|w[n]| / 127`` and ``max|x[m]| / 127``,
round half to even. A decode step reads a quarter of float32's bytes and half of
bfloat16's, and a VNNI instruction does twice the multiply-adds of a bfloat16 one.

Opt-in, never chosen for a user: outputs are not the float model's token for token. The
LM head stays in the model's dtype (as vLLM's compressed-tensors checkpoints leave it), so
only the projections inside the layers change; ``python -m bench.quality`` measures what
that costs (perplexity, KL divergence, top-1 agreement against float32).
"""

from __future__ import annotations

import torch
from torch import nn

from worker.native import NativeKernels

# The largest int8 magnitude our quantization uses: symmetric, so -128 never occurs in the
# rows (the VNNI paths' unsigned offset relies on it). The kernels take weights of -128 too
# (compressed-tensors checkpoints hold them), which only our own weights never have.
QMAX = 127


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [out, in]`` (any float dtype) as int8 ``[out, in]`` and float32 scales
    ``[out]`` with ``weight ~ scales[:, None] * q``: the kernels' own rule for activations
    (127 / max in float32, one product, round half to even) applied to each output row."""
    w = weight.detach().float()
    top = w.abs().amax(dim=1)
    inv = torch.where(top > 0, torch.tensor(float(QMAX)) / top, torch.zeros_like(top))
    q = (w * inv[:, None]).round().clamp(-QMAX, QMAX).to(torch.int8)
    return q, top / QMAX


class Int8Linear(nn.Module):
    """``nn.Linear`` (inference only) over an int8 per-channel weight in the kernels'
    packing, with the float bias kept as it was."""

    bias: torch.Tensor | None
    packed: torch.Tensor
    weight_sums: torch.Tensor
    weight_scales: torch.Tensor

    def __init__(
        self,
        linear: nn.Linear,
        kernels: NativeKernels,
        quantized: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """``linear``'s weight quantized per channel here, or ``quantized``: its int8
        ``[out, in]`` weight and float32 ``[out]`` scales as a checkpoint holds them."""
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.kernels = kernels
        q, scales = quantized if quantized is not None else quantize_per_channel(linear.weight)
        self.register_buffer("packed", kernels.int8_pack(q), persistent=False)
        self.register_buffer("weight_sums", q.sum(dim=1, dtype=torch.int32), persistent=False)
        self.register_buffer("weight_scales", scales.float().contiguous(), persistent=False)
        bias = None if linear.bias is None else linear.bias.detach().float().contiguous()
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).contiguous()
        out = self.kernels.int8_linear(
            flat, self.packed, self.weight_sums, self.weight_scales, self.bias
        )
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def quantize_linears_int8(model: nn.Module, kernels: NativeKernels) -> int:
    """Replace every projection inside the layers (every ``nn.Linear`` but the LM head)
    by an ``Int8Linear``; returns how many."""
    count = 0
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            if isinstance(child, nn.Linear) and name != "lm_head":
                setattr(parent, child_name, Int8Linear(child, kernels))
                count += 1
    return count
