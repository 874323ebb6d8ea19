"""OpenVINO GenAI as an engine-level peer: its venv and SmolLM2's IR come from
``make bench-peers`` (``bench/peers/build_openvino.sh``); ``run`` drives
``openvino_runner.py`` in that venv and samples its peak RSS."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.rss import PeakRss
from common.model_files import cache_root

VERSION = os.environ.get("OPENVINO_VERSION", "2026.4.1")
RUNNER = Path(__file__).with_name("openvino_runner.py")


def _home() -> Path:
    return cache_root() / f"openvino-{VERSION}"


def python() -> Path | None:
    """The OpenVINO venv's interpreter, once ``make bench-peers`` has made it."""
    venv = _home() / "venv"
    exe = venv / "bin" / "python"
    return exe if (venv / ".complete").is_file() and exe.is_file() else None


def model_dir() -> Path | None:
    """SmolLM2 exported to an OpenVINO IR in float32 weights."""
    ir = _home() / "smollm2-135m-instruct-fp32"
    return ir if (ir / "openvino_model.xml").is_file() else None


@dataclass(frozen=True)
class OpenVinoRun:
    """What one run of the runner measured: per concurrency point, and the peak RSS of
    its process (the pipeline, its compiled model and its KV cache)."""

    version: str
    points: list[dict[str, Any]]
    peak_rss_bytes: int


def run(
    prompts: list[list[int]],
    max_tokens: int,
    concurrency: list[int],
    precision: str = "bf16",
    threads: int | None = None,
    cache_gb: int = 1,
) -> OpenVinoRun:
    exe, ir = python(), model_dir()
    if exe is None or ir is None:
        raise FileNotFoundError("OpenVINO GenAI is not installed; run `make bench-peers`")
    spec = {
        "model_dir": str(ir),
        "prompts": prompts,
        "max_tokens": max_tokens,
        "concurrency": concurrency,
        "precision": precision,
        "threads": threads or os.cpu_count() or 1,
        "cache_gb": cache_gb,
    }
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(spec, f)
        f.flush()
        proc = subprocess.Popen([str(exe), str(RUNNER), f.name], stdout=subprocess.PIPE)
        with PeakRss(proc.pid) as peak:
            out, _ = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"the OpenVINO runner exited with {proc.returncode}")
    result = json.loads(out)
    return OpenVinoRun(result["version"], result["points"], peak.bytes)
