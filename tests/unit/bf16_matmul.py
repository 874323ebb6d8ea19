"""The reference the bfloat16 projection kernels (the GEMV, the GEMM) are held to: a
float32 matmul rounded once to bfloat16."""

from __future__ import annotations

import torch


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    out = x.float() @ w.float().T
    return (out if b is None else out + b.float()).to(torch.bfloat16)


def within_one_rounding(ours: torch.Tensor, ref: torch.Tensor) -> bool:
    """One rounding of a float32 sum whose additions ran in another order: every result
    is the reference's or its bfloat16 neighbour."""
    ulp = torch.finfo(torch.bfloat16).eps * ref.float().abs().clamp_min(1e-3)
    return bool(((ours.float() - ref.float()).abs() <= ulp).all())
