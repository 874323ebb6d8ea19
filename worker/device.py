"""Device and dtype choice for a worker."""

from __future__ import annotations

import logging

import torch

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


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto``: bfloat16 on CUDA or where the CPU has AVX512-BF16/AMX, else float32."""
    if name != "auto":
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
            name
        ]
    if device.type == "cuda":
        chosen, why = torch.bfloat16, "CUDA device"
    elif cpu_has_fast_bf16():
        chosen, why = torch.bfloat16, "CPU has AVX512-BF16/AMX"
    else:
        chosen, why = torch.float32, "CPU lacks AVX512-BF16/AMX"
    logger.info("--dtype auto chose %s (%s)", str(chosen).removeprefix("torch."), why)
    return chosen
