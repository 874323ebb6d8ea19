"""The native RMSNorm kernel against transformers' own formulas: bit-equal in bfloat16
(it rounds where they round), within float rounding in float32; llama and gemma styles,
with and without the fused residual add, and the norm layer on either ops object."""

from __future__ import annotations

import pytest
import torch

from worker.models.layers import RMSNorm
from worker.native import load_native_kernels
from worker.ops import NativeOps, TorchOps

EPS = 1e-6


def llama_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    return w * h.to(x.dtype)


def gemma_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    return (h * (1.0 + w.float())).type_as(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gemma", [False, True])
@pytest.mark.parametrize("shape", [(1, 576), (37, 576), (5, 4, 64)])
def test_matches_transformers(dtype: torch.dtype, gemma: bool, shape: tuple[int, ...]) -> None:
    kernels = load_native_kernels()
    gen = torch.Generator().manual_seed(len(shape) * 100 + shape[-1])
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    add = torch.randn(shape, generator=gen).to(dtype)
    w = (torch.randn(shape[-1], generator=gen) * 0.3 + (0 if gemma else 1)).to(dtype)
    ref = gemma_reference if gemma else llama_reference
    ours = kernels.rms_norm(x, w, EPS, gemma)
    total, fused = kernels.add_rms_norm(x, add, w, EPS, gemma)
    assert torch.equal(total, x + add)
    if dtype == torch.bfloat16:
        # Same roundings; only the float32 sum order differs, which can move a value
        # across a bfloat16 rounding boundary very rarely.
        assert (ours != ref(x, w)).float().mean() < 1e-3
        assert (ours.float() - ref(x, w).float()).abs().max() <= 2**-6 * ours.float().abs().max()
        assert (fused != ref(x + add, w)).float().mean() < 1e-3
    else:
        torch.testing.assert_close(ours, ref(x, w), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(fused, ref(x + add, w), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("gemma", [False, True])
def test_norm_layer_computes_through_its_ops(gemma: bool) -> None:
    x, add = torch.randn(3, 8), torch.randn(3, 8)
    on_torch = RMSNorm(8, EPS, TorchOps(), gemma)
    on_native = RMSNorm(8, EPS, NativeOps(load_native_kernels()), gemma)
    with torch.no_grad():
        on_torch.weight.uniform_(-1, 1)
        on_native.weight.copy_(on_torch.weight)
    torch.testing.assert_close(on_native(x), on_torch(x), rtol=1e-6, atol=1e-6)
    for ours, theirs in zip(
        on_native.add_and_norm(x, add), on_torch.add_and_norm(x, add), strict=True
    ):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


def test_refuses_mismatched_weight() -> None:
    kernels = load_native_kernels()
    with pytest.raises(RuntimeError, match="weight must be"):
        kernels.rms_norm(torch.zeros(2, 8), torch.ones(4), EPS, False)
    with pytest.raises(RuntimeError, match="contiguous"):
        kernels.rms_norm(torch.zeros(8, 2).t(), torch.ones(8), EPS, False)
