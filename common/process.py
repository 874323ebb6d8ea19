"""Process helpers shared by the launcher and the processes it starts."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask Linux to send ``sig`` to this process when its parent exits, so a killed
    launcher or engine never leaves orphans behind. A no-op elsewhere."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
    except OSError:
        return
    if os.getppid() == 1:  # the parent died before prctl took effect
        os.kill(os.getpid(), sig)


def start_module(
    module: str, args: list[str], env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """``python -m module args``: the same command a container would run."""
    return subprocess.Popen([sys.executable, "-m", module, *args], env=env, start_new_session=True)


_SMALL_THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "RAYON_NUM_THREADS": "1"}
_SAVED_PREFIX = "TANDEM_SAVED_"


def small_thread_env() -> dict[str, str]:
    """Environment for processes that do no tensor math (API server, engine core): one
    thread for BLAS/OpenMP and tokenizers, so the worker keeps the cores. The user's own
    values are saved aside for ``worker_env``."""
    env = dict(os.environ)
    for key, value in _SMALL_THREADS.items():
        if key in env:
            env[_SAVED_PREFIX + key] = env[key]
        env[key] = value
    env["TOKENIZERS_PARALLELISM"] = "false"
    return env


def worker_env() -> dict[str, str]:
    """The environment a worker starts with: the thread settings the user gave the
    launcher, not the engine core's single-thread ones."""
    env = dict(os.environ)
    for key in _SMALL_THREADS:
        saved = env.pop(_SAVED_PREFIX + key, None)
        if saved is not None:
            env[key] = saved
        elif env.get(key) == _SMALL_THREADS[key]:
            env.pop(key)
    return env


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float = 10.0) -> int:
    """SIGTERM, wait, then SIGKILL. Returns the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


# Exit codes that tell the launcher why a process ended.
EXIT_WORKER_DIED = 3
EXIT_ENGINE_DIED = 4  # the API server lost its engine
