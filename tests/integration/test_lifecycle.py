"""Process lifecycle: clean stops, loading state, and a dying worker or engine."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from common.config import EngineAddresses
from common.ipc import make_runtime_dir
from common.process import dies_with_this_process
from tests.stack import TandemStack, completion, free_port

MODEL = "smollm2-135m-instruct"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_every_process_with_exit_0(smollm2_dir: Path, sig: int) -> None:
    stack = TandemStack().start()
    names = sorted(p.cmdline()[p.cmdline().index("-m") + 1] for p in stack.descendants())
    assert names == ["api_server", "engine_core", "worker"]
    assert stack.stop(sig) == 0  # stop() also asserts no process is left
    assert "Traceback" not in stack.log()  # a clean stop logs no error


def test_sigusr1_writes_each_process_stacks_to_the_log_and_serving_goes_on(
    smollm2_dir: Path,
) -> None:
    """Where a stuck process waits, without stopping it: one dump per process (its
    signalled thread marked "Current thread"), and the service still answers."""
    stack = TandemStack().start()
    assert stack.proc is not None
    processes = [psutil.Process(stack.proc.pid), *stack.descendants()]
    assert len(processes) == 4  # the launcher, api_server, engine_core, worker
    for p in processes:
        p.send_signal(signal.SIGUSR1)
    deadline = time.monotonic() + 10
    while stack.log().count("Current thread 0x") < len(processes):
        assert time.monotonic() < deadline, stack.log()
        time.sleep(0.1)
    time.sleep(0.5)  # a fifth dump would have come by now
    log = stack.log()
    assert log.count("Current thread 0x") == len(processes)
    assert "engine_core/proc.py" in log and "worker/worker.py" in log
    assert completion(stack.url, "Hi", max_tokens=2)["choices"][0]["finish_reason"]
    assert stack.stop() == 0


def long_stream(url: str, events: list[str]) -> None:
    body = {
        "model": MODEL,
        "prompt": "Count to a thousand:",
        "max_tokens": 4000,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        events.extend(line[6:] for line in r.iter_lines() if line.startswith("data: "))


@pytest.mark.parametrize("victim", ["worker", "engine_core"])
def test_a_dying_process_fails_requests_and_stops_the_service(
    smollm2_dir: Path, victim: str
) -> None:
    stack = TandemStack("--grace-period-s", "3").start()
    events: list[str] = []
    reader = threading.Thread(target=long_stream, args=(stack.url, events))
    reader.start()
    deadline = time.monotonic() + 30
    while len(events) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(events) >= 3, "the stream never started"
    survivors = stack.descendants()
    stack.process_named(victim).kill()
    killed_at = time.monotonic()

    health = httpx.get(f"{stack.url}/health", timeout=5)
    while health.status_code == 200 and time.monotonic() - killed_at < 5:
        time.sleep(0.05)
        health = httpx.get(f"{stack.url}/health", timeout=5)
    assert health.status_code == 503
    assert time.monotonic() - killed_at < 1.5  # noticed within about a second
    assert health.json()["status"] == "dead"
    ready = httpx.get(f"{stack.url}/readyz", timeout=5)
    assert ready.status_code == 503 and ready.json()["status"] == "not_ready"
    assert ready.json()["role"] == "unified" and ready.json()["reason"]
    assert httpx.get(f"{stack.url}/livez", timeout=5).status_code == 200  # HTTP still runs
    new = httpx.post(
        f"{stack.url}/v1/completions", json={"model": MODEL, "prompt": "hi"}, timeout=5
    )
    assert new.status_code == 503 and new.headers["retry-after"]
    reader.join(timeout=10)
    assert events[-1] == "[DONE]"
    assert "error" in json.loads(events[-2])  # the in-flight stream ended with an error

    assert stack.proc is not None
    code = stack.proc.wait(timeout=30)
    assert code != 0
    assert time.monotonic() - killed_at >= 2.5  # the grace period was honoured
    log = stack.log()
    expected = "a worker process died" if victim == "worker" else "engine_core (pid"
    assert "tandem: " in log and expected in log.split("tandem: ")[-1]
    _, alive = psutil.wait_procs(survivors, timeout=10)
    assert alive == []


def test_a_paused_service_is_not_taken_for_a_dead_one(smollm2_dir: Path) -> None:
    """Every process stopped at once and resumed (as a paused VM, or memory reclaim on a
    busy host, stops them) serves on: the API server does not count the pause as an
    engine that stopped answering."""
    with TandemStack() as stack:
        assert stack.proc is not None
        paused = [psutil.Process(stack.proc.pid), *stack.descendants()]
        for p in paused:
            p.suspend()
        time.sleep(2.5)  # over twice the second an engine may stay silent
        for p in paused:
            p.resume()
        time.sleep(1.0)  # a second of looks by the watchdog after the pause
        out = completion(stack.url, "The capital of France is", max_tokens=4, temperature=0)
        assert "Paris" in out["choices"][0]["text"]
        assert httpx.get(f"{stack.url}/health", timeout=5).status_code == 200
        assert "stopped answering" not in stack.log()
        assert stack.proc.poll() is None


def test_api_server_alone_reports_loading_until_an_engine_comes(smollm2_dir: Path) -> None:
    """Each process runs by its own command (as in containers); /health follows the engine."""
    runtime = make_runtime_dir()
    addresses = EngineAddresses.ipc_in(runtime)
    port = free_port()
    flags = [
        "--model",
        str(smollm2_dir),
        "--served-model-name",
        MODEL,
        "--port",
        str(port),
        "--input-address",
        addresses.input_address,
        "--output-address",
        addresses.output_address,
    ]
    env = dies_with_this_process()  # no process outlives a killed test run
    api = subprocess.Popen([sys.executable, "-m", "api_server", *flags], env=env)
    engine = None
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                r = httpx.get(f"{url}/health", timeout=2)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "api_server never answered"
                time.sleep(0.2)
        assert (r.status_code, r.json()) == (503, {"status": "loading", "model_loaded": False})
        assert httpx.get(f"{url}/livez", timeout=2).status_code == 200
        ready = httpx.get(f"{url}/readyz", timeout=2)
        assert ready.status_code == 503
        assert ready.json() == {
            "role": "unified",
            "status": "not_ready",
            "reason": "waiting for the engine core to answer",
        }
        r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi"}, timeout=5)
        assert r.status_code == 503 and "loading" in r.json()["error"]["message"]

        engine = subprocess.Popen([sys.executable, "-m", "engine_core", *flags], env=env)
        deadline = time.monotonic() + 120
        reasons = set()
        while httpx.get(f"{url}/health", timeout=2).status_code != 200:
            assert time.monotonic() < deadline, "never became healthy"
            reasons.add(httpx.get(f"{url}/readyz", timeout=2).json().get("reason"))
            time.sleep(0.2)
        assert "workers are loading the model and warming up" in reasons
        ready = httpx.get(f"{url}/readyz", timeout=2)
        assert (ready.status_code, ready.json()) == (200, {"role": "unified", "status": "ready"})
        r = httpx.post(
            f"{url}/v1/completions",
            json={
                "model": MODEL,
                "prompt": "The capital of France is",
                "max_tokens": 4,
                "temperature": 0,
            },
            timeout=60,
        )
        assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["text"]
    finally:
        for proc in (api, engine):
            if proc is not None:
                proc.send_signal(signal.SIGTERM)
                assert proc.wait(timeout=30) == 0
