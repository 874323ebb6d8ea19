"""``--dtype auto`` on this CPU: bfloat16 where the CPU multiplies in it (AVX512-BF16, AMX)
or where Tandem's GEMM multiplies bfloat16 weights in float32 (AVX2 and FMA, native
kernels allowed), float32 elsewhere; an explicit dtype is taken as given."""

from __future__ import annotations

import logging

import pytest
import torch

from tests.cpu import cpu_has
from worker.device import cpu_has_fast_bf16, native_bf16_gemm, resolve_dtype
from worker.native import kernel_arch, load_native_kernels

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("name", "dtype"),
    [("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16)],
)
def test_an_explicit_dtype_is_taken_as_given(name: str, dtype: torch.dtype) -> None:
    assert resolve_dtype(name, CPU) == dtype
    assert resolve_dtype(name, CPU, "torch") == dtype


def test_auto_takes_bfloat16_wherever_a_bf16_kernel_multiplies_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    gemm = load_native_kernels().bf16_gemm_packs()
    if kernel_arch() == "native" and not cpu_has("amx_bf16"):
        # the GEMM packs wherever AVX2 and FMA are and AMX is not
        assert gemm == (cpu_has("avx2") and cpu_has("fma"))
    assert native_bf16_gemm("auto") == gemm and native_bf16_gemm("native") == gemm
    assert not native_bf16_gemm("torch")  # PyTorch ops only: no native GEMM
    fast = cpu_has_fast_bf16()
    assert fast == (cpu_has("avx512_bf16") or cpu_has("amx_bf16"))
    with caplog.at_level(logging.INFO, logger="worker.device"):
        chosen = resolve_dtype("auto", CPU)
    assert chosen == (torch.bfloat16 if fast or gemm else torch.float32)
    why = "AVX512-BF16/AMX" if fast else "float32 FMAs on AVX2" if gemm else "lacks"
    assert why in caplog.text
    # with PyTorch ops alone, bfloat16 only where the CPU computes in it
    assert resolve_dtype("auto", CPU, "torch") == (torch.bfloat16 if fast else torch.float32)
