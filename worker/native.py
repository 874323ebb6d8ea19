"""Tandem's native CPU kernels (``worker/csrc/``), built once per machine with torch's
C++ extension tooling (gcc and ninja) and cached under ``~/.cache/tandem/kernels`` (``$TANDEM_CACHE/kernels``).

The build key covers the sources, the flags, the torch and Python versions and the CPU's
instruction-set flags (the code is compiled for this CPU), so a cache copied to another
machine is rebuilt rather than trusted. When the kernels cannot be built the worker falls
back to its pure-PyTorch path (``--attention-backend auto``) or fails at start
(``--attention-backend native``).

    python -m worker.native   # build now (``make setup`` does), print where
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any, Protocol

import torch

from common.model_files import cache_root

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = [
    CSRC / name
    for name in ("module.cpp", "decode_attention.cpp", "rms_norm.cpp", "elementwise.cpp")
]
HEADERS = [CSRC / "simd.h"]
CFLAGS = [
    "-O3",
    "-march=native",
    "-fopenmp",  # at::parallel_for is OpenMP in torch's CPU builds; without it, one thread
    # Let gcc vectorize the float reductions (dot products, sums); no NaN/Inf reliance.
    "-fno-math-errno",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-fno-trapping-math",
    # No fused multiply-adds the source did not write: roundings must match PyTorch's.
    "-ffp-contract=off",
]


class NativeKernels(Protocol):
    def decode_attention(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
        window: int,
        block_size: int,
    ) -> torch.Tensor: ...

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool
    ) -> torch.Tensor: ...

    def write_kv(
        self, kv_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None: ...

    def rotary_(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int
    ) -> None: ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...

    def apply_token_bitmask_(self, logits: torch.Tensor, mask: torch.Tensor) -> None: ...

    def add_rms_norm(
        self, x: torch.Tensor, add: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def build_dir() -> Path:
    key = hashlib.sha256()
    for source in SOURCES + HEADERS:
        key.update(source.read_bytes())
    for part in (" ".join(CFLAGS), torch.__version__, sys.version, _cpu_flags()):
        key.update(part.encode())
    return cache_root() / "kernels" / key.hexdigest()[:16]


@contextmanager
def _ninja_on_path() -> Iterator[None]:
    """torch runs ``ninja`` from PATH; the one our ``ninja`` dependency installed sits
    in this environment's bin, which is not on PATH unless the venv is activated."""
    try:
        import ninja

        bin_dir = str(ninja.BIN_DIR)
    except ImportError:  # a system ninja may still be on PATH
        yield
        return
    saved = os.environ.get("PATH", "")
    os.environ["PATH"] = bin_dir + os.pathsep + saved
    try:
        yield
    finally:
        os.environ["PATH"] = saved


@cache
def load_native_kernels() -> NativeKernels:
    """The built module; raises if it cannot be built (no compiler, no ninja, ...).
    Concurrent callers in several processes wait on the build's lock file."""
    from torch.utils.cpp_extension import load

    directory = build_dir()
    directory.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with _ninja_on_path():
        module: Any = load(
            name="tandem_native",
            sources=[str(s) for s in SOURCES],
            extra_cflags=CFLAGS,
            build_directory=str(directory),
            verbose=False,
        )
    logger.info("native kernels ready in %.1f s (%s)", time.monotonic() - started, directory)
    return module


def try_load_native_kernels() -> NativeKernels | None:
    """The kernels, or None (with a warning saying why) when they cannot be built."""
    try:
        return load_native_kernels()
    except Exception as e:  # a missing compiler shows up as many exception types
        logger.warning("native kernels unavailable, using the PyTorch path: %s", e)
        return None


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    load_native_kernels()
    print(build_dir())
