"""Graceful drain: SIGTERM turns /readyz 503 and refuses new requests at once, lets
in-flight ones finish (or ends them with an error after --shutdown-timeout), and leaves
no process, socket file or runtime directory behind; a second signal stops at once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil

from common.process import dies_with_this_process
from tests.stack import TandemStack, free_port

MODEL = "smollm2-135m-instruct"


def stream(url: str, max_tokens: int, events: list[str]) -> None:
    body = {
        "model": MODEL,
        "prompt": "Count to a thousand:",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            events.extend(line[6:] for line in r.iter_lines() if line.startswith("data: "))
    except httpx.HTTPError as e:
        events.append(f"broken: {type(e).__name__}")


def started(events: list[str], n: int = 3, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len(events) < n:
        assert time.monotonic() < deadline, "the stream never started"
        time.sleep(0.05)


def runtime_dirs(procs: list[psutil.Process]) -> set[str]:
    """The private directories holding the service's ipc:// socket files."""
    dirs = set()
    for p in procs:
        for arg in p.cmdline():
            if arg.startswith("ipc://"):
                dirs.add(os.path.dirname(arg.removeprefix("ipc://")))
    return dirs


def test_sigterm_finishes_in_flight_requests_and_refuses_new_ones(smollm2_dir: Path) -> None:
    stack = TandemStack("--shutdown-timeout", "60").start()
    dirs = runtime_dirs(stack.descendants())
    assert dirs and all(os.stat(d).st_mode & 0o777 == 0o700 for d in dirs)  # private
    events: list[str] = []
    reader = threading.Thread(target=stream, args=(stack.url, 80, events))
    reader.start()
    started(events)
    assert stack.proc is not None
    stack.proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    ready = httpx.get(f"{stack.url}/readyz", timeout=5)
    while ready.status_code == 200 and time.monotonic() - signalled < 2:
        ready = httpx.get(f"{stack.url}/readyz", timeout=5)
    assert ready.status_code == 503 and "draining" in ready.json()["reason"]
    assert time.monotonic() - signalled < 2  # at once, for the load balancer
    refused = httpx.post(
        f"{stack.url}/v1/completions", json={"model": MODEL, "prompt": "hi"}, timeout=5
    )
    assert refused.status_code == 503 and refused.headers["retry-after"]
    assert "shutting down" in refused.json()["error"]["message"]
    assert httpx.get(f"{stack.url}/livez", timeout=5).status_code == 200
    reader.join(timeout=60)
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["choices"][0]["finish_reason"] == "length"  # it ran to the end
    assert last["usage"]["completion_tokens"] == 80
    assert stack.stop() == 0  # and nothing is left running
    assert not [d for d in dirs if os.path.exists(d)], "runtime directories left behind"


def test_shutdown_timeout_ends_the_rest_with_an_error(smollm2_dir: Path) -> None:
    stack = TandemStack("--shutdown-timeout", "2").start()
    events: list[str] = []
    reader = threading.Thread(target=stream, args=(stack.url, 4000, events))
    reader.start()
    started(events)
    assert stack.proc is not None
    stack.proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    reader.join(timeout=30)
    ended = time.monotonic() - signalled
    assert 1.5 < ended < 10, ended
    assert events[-1] == "[DONE]" and "error" in json.loads(events[-2])
    assert "shut down" in json.loads(events[-2])["error"]["message"]
    assert stack.stop() == 0


def test_a_second_signal_stops_at_once(smollm2_dir: Path) -> None:
    stack = TandemStack("--shutdown-timeout", "120").start()
    events: list[str] = []
    reader = threading.Thread(target=stream, args=(stack.url, 4000, events))
    reader.start()
    started(events)
    assert stack.proc is not None
    stack.proc.send_signal(signal.SIGTERM)
    time.sleep(1.0)
    assert stack.proc.poll() is None  # still draining
    stack.proc.send_signal(signal.SIGINT)
    signalled = time.monotonic()
    assert stack.stop(timeout_s=20) == 0
    assert time.monotonic() - signalled < 15  # not the 120 s drain
    reader.join(timeout=10)
    assert not reader.is_alive()


def test_processes_run_apart_drain_on_sigterm_together(smollm2_dir: Path, tmp_path: Path) -> None:
    """As a container runtime stops a deployment: every process gets SIGTERM at once."""
    port = free_port()
    addresses = [
        "--input-address",
        f"ipc://{tmp_path}/in.sock",
        "--output-address",
        f"ipc://{tmp_path}/out.sock",
    ]
    flags = ["--model", str(smollm2_dir), "--served-model-name", MODEL, "--port", str(port)]
    env = dies_with_this_process()  # no process outlives a killed test run
    engine = subprocess.Popen([sys.executable, "-m", "engine_core", *flags, *addresses], env=env)
    api = subprocess.Popen([sys.executable, "-m", "api_server", *flags, *addresses], env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "never became healthy"
            time.sleep(0.2)
        workers = psutil.Process(engine.pid).children()
        assert len(workers) == 1
        events: list[str] = []
        reader = threading.Thread(target=stream, args=(url, 60, events))
        reader.start()
        started(events)
        for pid in (api.pid, engine.pid, workers[0].pid):
            os.kill(pid, signal.SIGTERM)
        reader.join(timeout=60)
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
        assert api.wait(timeout=30) == 0
        assert engine.wait(timeout=30) == 0
        _, alive = psutil.wait_procs(workers, timeout=10)
        assert alive == []
    finally:
        for proc in (api, engine):
            if proc.poll() is None:
                proc.kill()
