"""What this CPU can run, for tests of paths that exist only on some CPUs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


def cpu_has(flag: str) -> bool:
    """Whether /proc/cpuinfo lists ``flag`` (``avx512_bf16``, ``amx_bf16``, ...)."""
    flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if "flags" in line)
    return flag in flags.split()


# oneDNN prepacks bfloat16 only on CPUs with AVX512BW/VL/DQ or AVX-NE-CONVERT; elsewhere
# (AMD Zen 2/3, older Intel) it raises, and the loader does not pack
# (tests/unit/test_packed_linear.py checks that on every CPU).
ONEDNN_BF16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
needs_onednn_bf16 = pytest.mark.skipif(
    not ONEDNN_BF16,
    reason="the prepacked bfloat16 path is not used on this CPU (oneDNN needs AVX512BW/VL/DQ "
    "to prepack); test_packs_exactly_where_onednn_computes_in_bfloat16 covers what replaces it",
)


def bf16_packs() -> bool:
    """Whether a bfloat16 model's projections are packed here at all: by oneDNN, or by
    Tandem's own GEMM (``bf16_gemm_packs``: AVX2 and FMA, no AMX), which needs no oneDNN."""
    from worker.native import load_native_kernels

    return ONEDNN_BF16 or load_native_kernels().bf16_gemm_packs()


needs_bf16_packing = pytest.mark.skipif(
    not bf16_packs(),
    reason="no bfloat16 packing on this CPU: oneDNN cannot prepack and the native GEMM needs "
    "AVX2 and FMA",
)
