"""Running a test file again on the portable x86-64-v3 kernel build (AVX2 and FMA: the
image's level, and an AVX2-only host's paths), so that on a host with AVX-512 the AVX2
paths are tested too (WAVE3-NOTES: every kernel's AVX2 build is tested on every host)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from worker.native import KERNEL_ARCH_ENV

REPO = Path(__file__).resolve().parents[1]


def assert_passes_on_the_avx2_build(test_file: str, deselect: str = "avx2_build") -> None:
    """``test_file``'s tests but those whose names hold ``deselect`` pass in a process whose
    kernels are the x86-64-v3 build (built and cached once, as any level is)."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    run = subprocess.run(
        [*command, "-k", f"not {deselect}", test_file],
        cwd=REPO,
        env={**os.environ, KERNEL_ARCH_ENV: "x86-64-v3"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "failed" not in run.stdout
