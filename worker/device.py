"""Device and dtype choice for a worker."""

from __future__ import annotations

import logging

import torch

from common.config import AttentionBackend

logger = logging.getLogger(__name__)

_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def pick_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def cpu_has_fast_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return any(flag in flags.split() for flag in _BF16_CPU_FLAGS)


def native_bf16_gemm(backend: AttentionBackend) -> bool:
    """Whether this worker's projections can run on Tandem's bfloat16 GEMM: native kernels
    allowed by ``--attention-backend`` and built with it (AVX2 and FMA are enough)."""
    if backend == "torch":
        return False
    from worker.native import try_load_native_kernels  # builds them once, if need be

    kernels = try_load_native_kernels()
    return kernels is not None and kernels.bf16_gemm_packs()


def resolve_dtype(
    name: str, device: torch.device, backend: AttentionBackend = "auto"
) -> torch.dtype:
    """``auto``: bfloat16 on CUDA, where the CPU has AVX512-BF16/AMX, or where Tandem's
    GEMM multiplies bfloat16 weights in float32 on AVX2 (as llama.cpp does a bf16 GGUF
    there: half float32's bytes a step, every product exact, sums in float32); float32
    elsewhere (PyTorch's bfloat16 matmul on such a CPU is emulated, ~5x slower than its
    float32)."""
    if name != "auto":
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
            name
        ]
    if device.type == "cuda":
        chosen, why = torch.bfloat16, "CUDA device"
    elif cpu_has_fast_bf16():
        chosen, why = torch.bfloat16, "CPU has AVX512-BF16/AMX"
    elif native_bf16_gemm(backend):
        chosen, why = torch.bfloat16, "no AVX512-BF16: bf16 weights, float32 FMAs on AVX2"
    else:
        chosen, why = torch.float32, "CPU lacks AVX512-BF16/AMX and AVX2 native kernels"
    logger.info("--dtype auto chose %s (%s)", str(chosen).removeprefix("torch."), why)
    return chosen
