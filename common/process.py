"""Process helpers shared by the launcher and the processes it starts."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import os
import signal
import subprocess
import sys
from typing import NoReturn

_PR_SET_PDEATHSIG = 1
PARENT_PID_ENV = "TANDEM_PARENT_PID"  # the pid of the process a Tandem process dies with
EXIT_REASON_ENV = "TANDEM_EXIT_REASON_FILE"  # where a dying process leaves its one-line cause

# Signals, one meaning each: SIGTERM (and SIGINT) drain then stop, a second one stops at
# once; SIGHUP, sent by the kernel when a Tandem parent dies, stops at once.
PARENT_DIED = signal.SIGHUP


def die_with_parent() -> None:
    """Ask Linux to send ``PARENT_DIED`` (SIGHUP) to this process when the Tandem process
    that started it exits, so a killed launcher or engine never leaves orphans. Only for
    processes started by ``start_module`` (their parent's pid is in the environment): one
    started by a container's init (tini, catatonit) or by hand is left alone."""
    expected = os.environ.get(PARENT_PID_ENV)
    if expected is None or not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, PARENT_DIED, 0, 0, 0)
    except OSError:
        return
    if str(os.getppid()) != expected:  # the parent died before prctl took effect
        os.kill(os.getpid(), PARENT_DIED)


def exit_without_teardown(code: int) -> NoReturn:
    """End a process that has shut down cleanly (sockets closed, requests ended) without
    the interpreter's own teardown: with torch loaded (the worker; the API server, whose
    tokenizer pulls transformers and torch in) that takes ~0.9 s and releases nothing the
    kernel does not release anyway, and every stop of a service waited for it. Logs and
    standard streams are flushed first; our processes register no ``atexit`` work.
    For ``__main__`` entry points only: in a test process it would end the test run."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def release_free_memory() -> None:
    """``malloc_trim(0)``: return the C heap's free pages to the OS. Tensors of ever new
    shapes leave glibc's heap fragmented, so a busy worker's RSS creeps up; trimming when
    idle gives the pages back. A no-op off glibc."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def freeze_startup_heap() -> None:
    """Collect once, then move every object alive now into the collector's permanent
    generation, which no later collection scans. Call it when a process has started and
    before it serves. Startup leaves hundreds of thousands of objects that live as long as
    the process (imported modules, the tokenizer, the model's Python side, the KV
    manager's blocks), and every full collection walked them all: in a served 32-client
    run the API server's took 76 ms, and every stream's next token waited for it
    (docs/benchmarks.md). After this a full collection walks only what serving made."""
    gc.collect()
    gc.freeze()


def dies_with_this_process(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this environment) for a child that should stop when this process
    dies: the child arms ``die_with_parent`` against this pid."""
    return {**(os.environ if env is None else env), PARENT_PID_ENV: str(os.getpid())}


def start_module(
    module: str, args: list[str], env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """``python -m module args``: the same command a container would run."""
    child_env = dies_with_this_process(env)
    return subprocess.Popen(
        [sys.executable, "-m", module, *args], env=child_env, start_new_session=True
    )


def record_exit_reason(reason: str) -> None:
    """Leave the one line that says why this process is exiting where the launcher reads
    it (``TANDEM_EXIT_REASON_FILE``); nothing when run on its own."""
    path = os.environ.get(EXIT_REASON_ENV)
    if path:
        with open(path, "w") as f:
            f.write(reason.strip().splitlines()[0] if reason.strip() else reason)


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


# glibc (2.35 and later) then advises its large chunks to be transparent huge pages:
# oneDNN's packed weights and the activations, which a worker cannot place itself (its
# plain weights it moves, ``worker/huge_pages.py``). Older glibc and other libcs ignore it.
_HUGE_PAGE_MALLOC = "glibc.malloc.hugetlb=1"


def worker_env() -> dict[str, str]:
    """The environment a worker starts with: the thread settings the user gave the
    launcher, not the engine core's single-thread ones, and malloc on huge pages unless
    the user's ``GLIBC_TUNABLES`` says otherwise."""
    env = dict(os.environ)
    for key in _SMALL_THREADS:
        saved = env.pop(_SAVED_PREFIX + key, None)
        if saved is not None:
            env[key] = saved
        elif env.get(key) == _SMALL_THREADS[key]:
            env.pop(key)
    tunables = env.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb" not in tunables:
        env["GLIBC_TUNABLES"] = ":".join(t for t in (tunables, _HUGE_PAGE_MALLOC) if t)
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
