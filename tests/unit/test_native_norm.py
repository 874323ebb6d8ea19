"""The native RMSNorm kernel against transformers' own formulas: bit-equal in bfloat16
(it rounds where they round), within float rounding in float32; llama and gemma styles,
with and without the fused residual add, and the module swap in a loaded model."""

from __future__ import annotations

import pytest
import torch

from worker.models.layers import GemmaRMSNorm, RMSNorm
from worker.models.native_layers import NativeRMSNorm, use_native_layers
from worker.native import load_native_kernels

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


def test_use_native_layers_swaps_every_norm() -> None:
    kernels = load_native_kernels()
    inner = torch.nn.Sequential(GemmaRMSNorm(8, EPS))
    model = torch.nn.Sequential(RMSNorm(8, EPS), inner)
    x = torch.randn(3, 8)
    before = model(x)
    assert use_native_layers(model, kernels) == 2
    assert isinstance(model[0], NativeRMSNorm) and isinstance(inner[0], NativeRMSNorm)
    torch.testing.assert_close(model(x), before, rtol=1e-6, atol=1e-6)


def test_refuses_mismatched_weight() -> None:
    kernels = load_native_kernels()
    with pytest.raises(RuntimeError, match="weight must be"):
        kernels.rms_norm(torch.zeros(2, 8), torch.ones(4), EPS, False)
    with pytest.raises(RuntimeError, match="contiguous"):
        kernels.rms_norm(torch.zeros(8, 2).t(), torch.ones(8), EPS, False)
