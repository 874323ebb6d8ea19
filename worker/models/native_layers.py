"""Layers on Tandem's native CPU kernels, with transformers' rounding: RMSNorm in one
pass per row instead of PyTorch's five ops and two casts (``worker/csrc/rms_norm.cpp``),
and SwiGLU's ``silu(gate) * up`` in one (``elementwise.cpp``). ``use_native_layers``
swaps them in after loading, as ``pack_linears`` does for linears."""

from __future__ import annotations

import torch
from torch import nn

from worker.models.layers import GatedMLP, GemmaRMSNorm, RMSNorm
from worker.native import NativeKernels


class NativeRMSNorm(nn.Module):
    def __init__(self, norm: RMSNorm | GemmaRMSNorm, kernels: NativeKernels) -> None:
        super().__init__()
        self.weight = norm.weight
        self.eps = norm.eps
        self.gemma = isinstance(norm, GemmaRMSNorm)
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.rms_norm(x.contiguous(), self.weight, self.eps, self.gemma)

    def add_and_norm(self, x: torch.Tensor, add: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x + add, norm(x + add))`` in one pass."""
        return self.kernels.add_rms_norm(
            x.contiguous(), add.contiguous(), self.weight, self.eps, self.gemma
        )


def use_native_layers(model: nn.Module, kernels: NativeKernels) -> int:
    """Replace every RMSNorm of ``model`` and hand the kernels to its SwiGLU MLPs;
    returns how many modules changed."""
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, RMSNorm | GemmaRMSNorm)
    ]
    for name, module in targets:
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, NativeRMSNorm(module, kernels))
    mlps = [m for m in model.modules() if isinstance(m, GatedMLP) and m.activation == "silu"]
    for mlp in mlps:
        mlp.native = kernels
    return len(targets) + len(mlps)
