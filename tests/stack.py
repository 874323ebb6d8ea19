"""Start the real Tandem stack (launcher -> engine_core -> worker, api_server) on a free
loopback port, and tear it down leaving no process behind."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil

from common.process import dies_with_this_process

READY_TIMEOUT_S = 300.0
# A worker writes every page of its KV cache before it is ready (worker/kv_memory.py), and
# on these hosts fresh huge pages cost ~2 s per GiB; no test here needs the default 1 GiB
# (float32 SmolLM2: 11,648 tokens in half of it), so a stack that names no size takes half.
TEST_KV_CACHE_GB = "0.5"
KV_SIZE_FLAGS = ("--kv-cache-gb", "--num-kv-blocks")
LOG_TAIL_LINES = 40
STUCK_LOG_LINES = 300  # room for every process's thread stacks
# Workers take a GPU whenever they see one; a stack testing a CPU-only feature (the GGUF
# kernels, the shared-memory KV hand-off, tensor parallelism over gloo) hides it, as a
# user on a GPU host would.
CPU_WORKERS = {"CUDA_VISIBLE_DEVICES": ""}


# Ports handed out in this test run. The kernel may give a port it just freed to the next
# bind(0), so a test asking for three (HTTP, two pools) could get one twice and a server
# would fail to listen (seen in CI: the API server's port was the decode pool's).
_handed_out: set[int] = set()


def free_port() -> int:
    """A loopback port nothing listens on, never one this run handed out before."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _handed_out:
            _handed_out.add(port)
            return port


def free_port_range(n: int) -> int:
    """The first of ``n`` consecutive loopback ports nothing listens on (a fleet's
    instances and event sockets take ports from a base)."""
    for _ in range(100):
        base = free_port()
        with contextlib.ExitStack() as held:
            try:
                for port in range(base, base + n):
                    sock = held.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        if not _handed_out.intersection(range(base + 1, base + n)):
            _handed_out.update(range(base, base + n))
            return base
    raise RuntimeError(f"no {n} consecutive free ports")


def module_of(proc: psutil.Process) -> str | None:
    """``<module>`` of a process started as ``python -m <module>``, else None."""
    cmdline = proc.cmdline()
    return cmdline[cmdline.index("-m") + 1] if "-m" in cmdline else None


class TandemStack:
    """``tandem serve`` as a user runs it. ``start()`` waits for ``/health`` 200."""

    def __init__(
        self, *args: str, env: dict[str, str] | None = None, command: str = "serve"
    ) -> None:
        self.command = command  # or "fleet": then the port is the router's
        self.port = free_port()
        self.args = ["--port", str(self.port), *args]
        if command == "serve" and not any(a.split("=")[0] in KV_SIZE_FLAGS for a in args):
            self.args += ["--kv-cache-gb", TEST_KV_CACHE_GB]
        # The launcher dies with this process (the test run) if it is killed: no server
        # outlives a killed pytest.
        self.env = dies_with_this_process({**os.environ, **(env or {})})
        self.log_path = Path(tempfile.mkstemp(prefix="tandem-stack-", suffix=".log")[1])
        # The log outlives stop() (tests read it after), not this object.
        self._remove_log = weakref.finalize(self, self.log_path.unlink, missing_ok=True)
        self.proc: subprocess.Popen[bytes] | None = None
        self._descendants: list[psutil.Process] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, wait: bool = True) -> TandemStack:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "common.cli", self.command, *self.args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )
        if wait:
            self.wait_healthy()
        return self

    def wait_healthy(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tandem exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    self._descendants = self.descendants()
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"tandem not healthy after {timeout_s} s:\n{self.log()}")

    def descendants(self) -> list[psutil.Process]:
        assert self.proc is not None
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def process_named(self, module: str) -> psutil.Process:
        """The child started as ``python -m <module>``."""
        for p in self.descendants():
            if module_of(p) == module:
                return p
        raise LookupError(f"no {module} process among {[p.cmdline() for p in self.descendants()]}")

    def stats_when(
        self, settled: Callable[[dict[str, Any]], bool], timeout_s: float = 10.0
    ) -> dict[str, Any]:
        """``/stats`` once ``settled`` holds of it, or the last reading after ``timeout_s``
        (for the caller's assertion to show). The engine's cumulative counters (hand-offs
        among them) reach the API server with its heartbeat, every 0.2 s, so a reading
        taken right after a response may be a beat behind it."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats: dict[str, Any] = httpx.get(f"{self.url}/stats", timeout=10).json()
            if settled(stats) or time.monotonic() > deadline:
                return stats
            time.sleep(0.05)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def down_report(self) -> str | None:
        """None while the launcher runs; once it has exited, its code and the end of its
        log, for a test that finds the stack gone without having stopped it."""
        if self.proc is None or self.proc.poll() is None:
            return None
        tail = "\n".join(self.log().splitlines()[-LOG_TAIL_LINES:])
        return f"tandem exited with {self.proc.returncode}; the end of its log:\n{tail}"

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        """Signal the launcher, wait for it, and check that every process it started is
        gone. Returns the launcher's exit code."""
        assert self.proc is not None
        known = self._descendants + self.descendants()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            report = self._stuck_report(known, sig, timeout_s)
            self.proc.kill()
            for p in known:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
            raise AssertionError(report) from None
        _, alive = psutil.wait_procs(known, timeout=10)
        for p in alive:
            p.kill()
        assert not alive, f"processes left behind: {[p.cmdline() for p in alive]}"
        return code

    def _stuck_report(self, known: list[psutil.Process], sig: int, timeout_s: float) -> str:
        """Where a stack that did not stop waits: each process's state, and the Python
        stacks every Tandem process writes to the log on SIGUSR1 (``common/logs.py``)."""
        assert self.proc is not None
        procs = {p.pid: p for p in known}
        with contextlib.suppress(psutil.NoSuchProcess):
            procs = {self.proc.pid: psutil.Process(self.proc.pid), **procs}
        states = []
        for p in procs.values():
            with contextlib.suppress(psutil.NoSuchProcess):
                states.append(f"pid {p.pid} {module_of(p)}: {p.status()}")
                p.send_signal(signal.SIGUSR1)
        time.sleep(1.0)  # for the stacks to reach the log
        tail = "\n".join(self.log().splitlines()[-STUCK_LOG_LINES:])
        return (
            f"tandem did not exit within {timeout_s:.0f} s of {signal.Signals(sig).name}; "
            f"processes: {'; '.join(states)}; the end of its log:\n{tail}"
        )

    def __enter__(self) -> TandemStack:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.stop()
        elif (report := self.down_report()) is not None:
            print(report)  # shown beside the failure a stack that died early causes
        self._remove_log()


@contextlib.contextmanager
def started_together(stacks: dict[str, TandemStack]) -> Iterator[dict[str, TandemStack]]:
    """Start every stack at once (their model loads overlap), wait until each is
    healthy; at the end stop those still running (a test may have killed some)."""
    try:
        for stack in stacks.values():
            stack.start(wait=False)
        for stack in stacks.values():
            stack.wait_healthy()
        yield stacks
    finally:
        for stack in stacks.values():
            if stack.proc is not None and stack.proc.poll() is None:
                stack.stop()


def completion(url: str, prompt: str | list[int] | list[str], **params: Any) -> dict[str, Any]:
    body = {
        "model": "smollm2-135m-instruct",
        "prompt": prompt,
        **params,
    }  # params may name another model
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    result: dict[str, Any] = r.json()
    return result


def greedy_token_ids(url: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Each prompt's greedy completion token ids, all requests sent at once."""

    async def go() -> list[list[int]]:
        async with httpx.AsyncClient(timeout=600) as client:

            async def one(prompt: list[int]) -> list[int]:
                body = {
                    "model": "smollm2-135m-instruct",
                    "prompt": prompt,
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "return_token_ids": True,
                }
                r = await client.post(f"{url}/v1/completions", json=body)
                assert r.status_code == 200, r.text
                return list(r.json()["choices"][0]["token_ids"])

            return list(await asyncio.gather(*(one(p) for p in prompts)))

    return asyncio.run(go())
