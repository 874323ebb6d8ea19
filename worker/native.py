"""Tandem's native CPU kernels (``worker/csrc/``), built once per machine with torch's
C++ extension tooling (gcc and ninja) and cached under ``~/.cache/tandem/kernels``
(``$TANDEM_CACHE/kernels``).

They are compiled for the instruction-set level ``$TANDEM_KERNEL_ARCH`` names: ``native``
(the default: this CPU, fastest) or a portable x86-64 level (``x86-64-v2``, ``-v3``,
``-v4``) for a build that must run on other CPUs, as a container image's must. The
build key covers the sources, the flags, the torch and Python versions and, for
``native``, the CPU's instruction-set flags, so a native cache copied to another machine
is rebuilt rather than trusted. A portable build is checked against the CPU at load: a
CPU below the level is refused with an error naming the missing flags, never run into
an illegal instruction. A finished build is imported directly, so a read-only image
with no compiler loads what its build step made. When the kernels cannot be had the
worker falls back to its pure-PyTorch path (``--attention-backend auto``) or fails at
start (``--attention-backend native``).

    python -m worker.native   # build now (``make setup`` and the image build do), print where
"""

from __future__ import annotations

import hashlib
import importlib.util
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
    for name in (
        "module.cpp",
        "decode_attention.cpp",
        "decode_attention_bf16.cpp",
        "decode_attention_avx2.cpp",
        "prefill_attention_bf16.cpp",
        "rms_norm.cpp",
        "elementwise.cpp",
        "gemv.cpp",
        "amx_linear.cpp",
        "bf16_gemm.cpp",
        "decode_stack.cpp",
        "decode_rows.cpp",
        "decode_rows_plan.cpp",
        "gguf_linear.cpp",
        "gguf_bf16_dot.cpp",
        "gguf_gemm.cpp",
        "gguf_matmul.cpp",
        "gguf_q8.cpp",
        "int8_linear.cpp",
        "int8_amx.cpp",
        "parallel_trace.cpp",
        "lora_sgmv.cpp",
    )
]
HEADERS = [
    CSRC / "simd.h",
    CSRC / "avx2.h",
    CSRC / "bf16_gemm_avx2.h",
    CSRC / "kernels.h",
    CSRC / "decode_rows_plan.h",
    CSRC / "gguf_formats.h",
    CSRC / "gguf_dot_avx2.h",
    CSRC / "attention_problem.h",
    CSRC / "parallel.h",
    CSRC / "int8_problem.h",
    CSRC / "amx_tiles.h",
    CSRC / "int8_rows.h",
]
KERNEL_ARCH_ENV = "TANDEM_KERNEL_ARCH"
# The CPU flags (as /proc/cpuinfo names them) each portable x86-64 level requires, on
# top of the level below it (the psABI's micro-architecture levels).
_LEVEL_FLAGS = {
    "x86-64-v2": ("cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"),
    "x86-64-v3": ("avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"),
    "x86-64-v4": ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"),
}
_LEVELS = ("x86-64", *_LEVEL_FLAGS)
BUILT_MARKER = "tandem_native.built"
BASE_CFLAGS = [
    "-O3",
    "-fopenmp",  # at::parallel_for is OpenMP in torch's CPU builds; without it, one thread
    # Let gcc vectorize the float reductions (dot products, sums); no NaN/Inf reliance.
    "-fno-math-errno",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-fno-trapping-math",
    # No fused multiply-adds the source did not write: roundings must match PyTorch's.
    "-ffp-contract=off",
]


class DecodeRowsPlan(Protocol):
    """One model's ``decode_rows`` steps (``worker/csrc/kernels.h``): weights, caches and
    shapes checked once; ``run`` takes a step's token ids to its final norm's rows."""

    def run(
        self,
        ids: torch.Tensor,
        slots: torch.Tensor,
        block_table: torch.Tensor,
        context_lens: torch.Tensor,
        cos: list[torch.Tensor],
        sin: list[torch.Tensor],
        phase_seconds: torch.Tensor | None,
    ) -> torch.Tensor: ...


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

    def has_bf16_prefill_attention(self) -> bool: ...

    def prefill_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        offset: int,
        scale: float,
        window: int,
    ) -> torch.Tensor: ...

    def prefill_attention_chunks_(
        self,
        out: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        starts: list[int],
        ends: list[int],
        scale: float,
        window: int,
    ) -> None: ...

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool
    ) -> torch.Tensor: ...

    def write_kv(
        self, kv_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None: ...

    def rotary_(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int
    ) -> None: ...

    def act_mul(self, gate_up: torch.Tensor, activation: int) -> torch.Tensor: ...

    def lora_sgmv_(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        rows: torch.Tensor,
        group_starts: torch.Tensor,
        a: list[torch.Tensor],
        bt: list[torch.Tensor],
        blocks: list[torch.Tensor],
        scales: list[float],
    ) -> None: ...

    def apply_token_bitmask_(self, logits: torch.Tensor, mask: torch.Tensor) -> None: ...

    def argmax_rows(self, x: torch.Tensor) -> torch.Tensor: ...

    def add_rms_norm(
        self, x: torch.Tensor, add: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def has_bf16_gemv(self) -> bool: ...

    def bf16_gemv_max_rows(self, out_features: int, in_features: int) -> int: ...

    def bf16_gemv(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor: ...

    def has_amx_linear(self) -> bool: ...

    def has_bf16_gemm(self) -> bool: ...

    def bf16_gemm_packs(self) -> bool: ...

    def bf16_gemm_pack(self, weight: torch.Tensor) -> torch.Tensor: ...

    def bf16_gemm(
        self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor: ...

    def gguf_dequantize(
        self, weight: torch.Tensor, type: int, in_features: int, bfloat16: bool = False
    ) -> torch.Tensor: ...

    def gguf_bf16_matmul(
        self, x: torch.Tensor, weight: torch.Tensor, type: int, bias: torch.Tensor | None = None
    ) -> torch.Tensor: ...

    def gguf_linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        type: int,
        bias: torch.Tensor | None,
        packed: torch.Tensor | None = None,
        bf16_out: bool = False,
        q8_activations: bool = False,
    ) -> torch.Tensor: ...

    def gguf_quantize_q8(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def gguf_has_bf16_rows(self, type: int, rows: int) -> bool: ...

    def gguf_gemm_packs(self, type: int) -> bool: ...

    def gguf_gemm_min_rows(self, type: int) -> int: ...

    def gguf_gemm_pack(self, weight: torch.Tensor, type: int, in_features: int) -> torch.Tensor: ...

    def int8_linear_isas(self) -> list[int]: ...

    def int8_pack(self, qweight: torch.Tensor) -> torch.Tensor: ...

    def int8_quantize_rows(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def int8_matmul_int32(
        self, xq: torch.Tensor, packed: torch.Tensor, weight_sums: torch.Tensor, isa: int = -1
    ) -> torch.Tensor: ...

    def int8_linear(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        weight_sums: torch.Tensor,
        weight_scales: torch.Tensor,
        bias: torch.Tensor | None = None,
        isa: int = -1,
    ) -> torch.Tensor: ...

    def decode_layers(
        self,
        x: torch.Tensor,
        norms: list[torch.Tensor],
        plain: list[torch.Tensor | None],
        packed: list[torch.Tensor],
        packings: list[int],
        biases: list[torch.Tensor | None],
        gguf_types: list[int],
        gguf_fused_max_rows: int,
        gguf_q8: bool,
        kv_caches: list[torch.Tensor],
        windows: list[int],
        slots: torch.Tensor,
        block_table: torch.Tensor,
        context_lens: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        heads: int,
        kv_heads: int,
        head_dim: int,
        block_size: int,
        eps: float,
        scale: float,
    ) -> torch.Tensor: ...

    def decode_rows_max_rows(self, gemm: bool) -> int: ...

    def DecodeRowsPlan(  # the extension's class, made by calling it
        self,
        norms: list[torch.Tensor],
        projections: list[torch.Tensor],
        gemm: bool,
        biases: list[torch.Tensor | None],
        gguf_types: list[int],
        gguf_packed: list[torch.Tensor],
        gguf_segments: list[int],
        gguf_q8: bool,
        int8_sums: list[torch.Tensor],
        int8_scales: list[torch.Tensor],
        gemma_norms: bool,
        qk_norms: bool,
        sandwich_norms: bool,
        activation: int,
        kv_caches: list[torch.Tensor],
        windows: list[int],
        rope_of_layer: list[int],
        heads: int,
        kv_heads: int,
        head_dim: int,
        block_size: int,
        eps: float,
        scale: float,
        embedding: torch.Tensor,
        embed_scale: float,
        final_norm: torch.Tensor,
    ) -> DecodeRowsPlan: ...

    def decode_rows_phases(self) -> list[str]: ...

    def parallel_steal_trace(self, costs_us: torch.Tensor) -> torch.Tensor: ...


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def kernel_arch() -> str:
    """The instruction-set level to build for: ``native`` or a portable ``x86-64-vN``."""
    arch = os.environ.get(KERNEL_ARCH_ENV, "native").strip() or "native"
    if arch != "native" and arch not in _LEVELS:
        raise ValueError(
            f"{KERNEL_ARCH_ENV}={arch!r}: expected native or one of {', '.join(_LEVELS)}"
        )
    return arch


def cflags(arch: str) -> list[str]:
    return [BASE_CFLAGS[0], f"-march={arch}", *BASE_CFLAGS[1:]]


def missing_cpu_flags(arch: str, cpu_flags: str) -> list[str]:
    """The flags ``arch`` needs that ``cpu_flags`` (a /proc/cpuinfo flags line) lacks."""
    if arch == "native" or platform.machine() not in ("x86_64", "AMD64"):
        return []
    have = set(cpu_flags.split(":", 1)[-1].split())
    needed = [f for level in _LEVELS[1 : _LEVELS.index(arch) + 1] for f in _LEVEL_FLAGS[level]]
    return [f for f in needed if f not in have]


def check_cpu_supports(arch: str) -> None:
    missing = missing_cpu_flags(arch, _cpu_flags())
    if missing:
        raise RuntimeError(
            f"the native kernels were built for {arch}, which this CPU does not support "
            f"(missing: {', '.join(missing)}); rebuild them for it with "
            f"{KERNEL_ARCH_ENV}=native python -m worker.native"
        )


def build_dir(arch: str | None = None) -> Path:
    arch = arch or kernel_arch()
    key = hashlib.sha256()
    for source in SOURCES + HEADERS:
        key.update(source.read_bytes())
    # A native build is only good for this CPU; a portable one for any CPU of its level.
    cpu = _cpu_flags() if arch == "native" else ""
    for part in (" ".join(cflags(arch)), torch.__version__, sys.version, cpu):
        key.update(part.encode())
    return cache_root() / "kernels" / f"{arch}-{key.hexdigest()[:16]}"


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


def _import_built(directory: Path) -> Any:
    """Import a finished build without torch's JIT step, which wants ninja, a compiler
    and a writable directory even when nothing changed."""
    spec = importlib.util.spec_from_file_location("tandem_native", directory / "tandem_native.so")
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import the native kernels from {directory}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@cache
def load_native_kernels() -> NativeKernels:
    """The built module; raises if it cannot be built (no compiler, no ninja, ...) or
    the CPU is below the level it was built for. Concurrent callers in several
    processes wait on the build's lock file."""
    from torch.utils.cpp_extension import load

    arch = kernel_arch()
    check_cpu_supports(arch)
    directory = build_dir(arch)
    if (directory / BUILT_MARKER).exists():
        return _import_built(directory)
    directory.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with _ninja_on_path():
        module: Any = load(
            name="tandem_native",
            sources=[str(s) for s in SOURCES],
            extra_cflags=cflags(arch),
            build_directory=str(directory),
            verbose=False,
        )
    (directory / BUILT_MARKER).write_text(arch + "\n")
    logger.info(
        "native kernels (%s) ready in %.1f s (%s)", arch, time.monotonic() - started, directory
    )
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
