"""llama.cpp's ``llama-server`` as a peer: built by ``make bench-peers`` into the cache,
started with one parallel slot per concurrent client on SmolLM2 as it ships (the Q4_1
GGUF) or on a bfloat16 GGUF converted from the safetensors Tandem serves."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.harness import free_port, wait_healthy
from common.model_files import EMBEDDED_MODELS, cache_root, find_embedded_gguf

VERSION = os.environ.get("LLAMA_CPP_PYTHON_VERSION", "0.3.36")


def binary() -> Path | None:
    path = cache_root() / f"llama.cpp-{VERSION}" / "bin" / "llama-server"
    return path if path.is_file() and os.access(path, os.X_OK) else None


def gguf() -> Path:
    """The GGUF SmolLM2 ships as (Q4_1 linears, Q8_0 embedding)."""
    return find_embedded_gguf(EMBEDDED_MODELS["smollm2-135m-instruct"])


def bf16_gguf() -> Path | None:
    """The bfloat16 GGUF ``make bench-peers`` converts from Tandem's safetensors."""
    path = cache_root() / f"llama.cpp-{VERSION}" / "smollm2-135m-instruct-bf16.gguf"
    return path if path.is_file() else None


def q8_0_gguf() -> Path | None:
    """The Q8_0 GGUF ``make bench-peers`` converts from Tandem's safetensors (every linear
    8-bit: the integer peer for ``--quantization int8`` and for Tandem on the same file)."""
    path = cache_root() / f"llama.cpp-{VERSION}" / "smollm2-135m-instruct-q8_0.gguf"
    return path if path.is_file() else None


@contextmanager
def llama_server(
    slots: int, model: Path | None = None, longest_request: int = 0
) -> Iterator[tuple[str, int]]:
    """Yields the URL and pid of a llama-server with ``slots`` parallel slots on ``model``
    (default: the shipped GGUF), each slot room for ``longest_request`` tokens (prompt and
    output; at least 1,536). A slot's context is ``-c`` divided by the slots, and a request
    past it is refused."""
    context_per_slot = max(1536, -(-longest_request // 256) * 256)
    exe = binary()
    if exe is None:
        raise FileNotFoundError("llama-server is not built; run `make bench-peers`")
    port = free_port()
    cmd = [
        str(exe),
        "-m",
        str(model or gguf()),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-np",
        str(slots),
        "-c",
        str(slots * context_per_slot),
        "-t",
        str(os.cpu_count() or 1),
        "--no-webui",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, "llama-server", 120)
        yield url, proc.pid
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
