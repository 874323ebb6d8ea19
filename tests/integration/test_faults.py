"""Faults against real processes: a worker that raises mid-forward or is killed, a
killed launcher, start-up errors, and request ids reused after their request ended."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.stack import TandemStack, free_port

MODEL = "smollm2-135m-instruct"


def long_stream(url: str, events: list[tuple[float, str]]) -> None:
    body = {
        "model": MODEL,
        "prompt": "Count to a thousand:",
        "max_tokens": 3000,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append((time.monotonic(), line[6:]))


def plain(url: str, results: list[httpx.Response]) -> None:
    body = {"model": MODEL, "prompt": "Count:", "max_tokens": 3000, "ignore_eos": True}
    results.append(httpx.post(f"{url}/v1/completions", json=body, timeout=60))


@pytest.mark.parametrize("fault", ["raise", "sigkill"])
def test_a_failing_worker_ends_every_request_within_a_second(smollm2_dir: Path, fault: str) -> None:
    env = {"TANDEM_FAULT_INJECTION": "raise-on-step=60"} if fault == "raise" else {}
    stack = TandemStack("--grace-period-s", "2", env=env).start()
    events: list[tuple[float, str]] = []
    results: list[httpx.Response] = []
    threads = [
        threading.Thread(target=long_stream, args=(stack.url, events)),
        threading.Thread(target=plain, args=(stack.url, results)),
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while len(events) < 10:
        assert time.monotonic() < deadline, "the stream never started"
        time.sleep(0.02)
    if fault == "sigkill":
        stack.process_named("worker").kill()
    for t in threads:
        t.join(timeout=20)
        assert not t.is_alive(), "a request hung"
    failure = json.loads(events[-2][1])
    assert events[-1][1] == "[DONE]" and "error" in failure
    last_token_at = events[-3][0]
    assert events[-2][0] - last_token_at < 1.0  # noticed within a second
    assert results[0].status_code in (500, 503) and "error" in results[0].json()
    ready = httpx.get(f"{stack.url}/readyz", timeout=5)
    assert ready.status_code == 503
    assert stack.proc is not None
    code = stack.proc.wait(timeout=30)
    assert code != 0
    why = stack.log().split("tandem: ")[-1]
    assert "a worker process died" in why
    expected = "fault injected on step 60" if fault == "raise" else "killed by signal 9"
    assert expected in why and "worker-0" in why  # the one line names the cause
    stack.stop()


def test_a_killed_launcher_takes_every_process_with_it(smollm2_dir: Path) -> None:
    stack = TandemStack().start()
    children = stack.descendants()
    assert len(children) == 3
    assert stack.proc is not None
    stack.proc.kill()
    killed = time.monotonic()
    _, alive = psutil.wait_procs(children, timeout=5)
    assert alive == [], [p.cmdline()[:3] for p in alive]
    assert time.monotonic() - killed < 5.5


def test_a_killed_test_run_takes_its_server_with_it(smollm2_dir: Path) -> None:
    """The suite's own servers die with it (``TANDEM_PARENT_PID``): a pytest killed by a
    timeout leaves no launcher, engine, worker or API server running."""
    repo = Path(__file__).parents[2]
    starter = (
        "import time\n"
        "from tests.stack import TandemStack\n"
        "stack = TandemStack().start()\n"
        "print(stack.proc.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    run = subprocess.Popen(
        [sys.executable, "-c", starter], cwd=repo, stdout=subprocess.PIPE, text=True
    )
    try:
        assert run.stdout is not None
        launcher = psutil.Process(int(run.stdout.readline()))
        stack = [launcher, *launcher.children(recursive=True)]
        assert len(stack) == 4  # launcher, engine core, worker, API server
        run.kill()
        killed = time.monotonic()
        _, alive = psutil.wait_procs(stack, timeout=15)
        assert alive == [], [p.cmdline()[:3] for p in alive]
        assert time.monotonic() - killed < 15
    finally:
        run.kill()
        run.wait()


def broken_model(kind: str, smollm2_dir: Path, tmp_path: Path) -> Path:
    """A model directory with one thing wrong."""
    path = tmp_path / kind
    path.mkdir()
    for name in os.listdir(smollm2_dir):
        if not name.startswith("."):
            (path / name).symlink_to(smollm2_dir / name)
    if kind == "truncated-weights":
        (path / "model.safetensors").unlink()
        data = (smollm2_dir / "model.safetensors").read_bytes()
        (path / "model.safetensors").write_bytes(data[: len(data) // 3])
    elif kind == "unsupported-architecture":
        config = json.loads((smollm2_dir / "config.json").read_text())
        (path / "config.json").unlink()
        (path / "config.json").write_text(
            json.dumps({**config, "architectures": ["MambaForCausalLM"]})
        )
    return path


STARTUP_ERRORS = {
    "missing model directory": ("no-such-model", "missing"),
    "truncated safetensors": ("model.safetensors", "truncated-weights"),
    "unsupported architecture": ("mambaforcausallm", "unsupported-architecture"),
    "KV memory too small": ("holds no KV block", None),
    "port in use": ("address already in use", None),
}


@pytest.mark.parametrize("case", STARTUP_ERRORS, ids=list(STARTUP_ERRORS))
def test_start_up_errors_end_the_service_with_one_line(
    smollm2_dir: Path, tmp_path: Path, case: str
) -> None:
    says, kind = STARTUP_ERRORS[case]
    port = free_port()
    flags = ["--port", str(port), "--grace-period-s", "0"]
    if case == "missing model directory":
        flags += ["--model", str(tmp_path / "no-such-model")]
    elif kind not in (None, "missing"):
        flags += ["--model", str(broken_model(kind, smollm2_dir, tmp_path))]
    if case == "KV memory too small":
        flags += ["--kv-cache-gb", "0.000001"]
    blocker = socket.socket()
    if case == "port in use":
        blocker.bind(("127.0.0.1", port))
        blocker.listen()
    try:
        run = subprocess.run(
            [sys.executable, "-m", "common.cli", "serve", *flags],
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        blocker.close()
    assert run.returncode != 0
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("tandem: ") and says.lower() in last.lower(), run.stderr[-2000:]
    leftovers = [
        p.info["cmdline"]
        for p in psutil.process_iter(["cmdline"])
        if str(port) in " ".join(p.info["cmdline"] or [])
    ]
    assert leftovers == []


def test_an_engine_dying_while_the_api_server_starts_leaves_no_traceback(
    smollm2_dir: Path, tmp_path: Path
) -> None:
    """The API server is still starting when the engine reports its worker dead: it stops
    as cleanly as it would later (uvicorn's lifespan task once left a CancelledError)."""
    model = broken_model("unsupported-architecture", smollm2_dir, tmp_path)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "common.cli",
            "serve",
            "--model",
            str(model),
            "--port",
            str(free_port()),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode != 0 and "mambaforcausallm" in run.stderr.lower()
    assert "CancelledError" not in run.stderr, run.stderr[-3000:]


def test_a_request_id_can_be_reused_once_its_request_has_ended(server: TandemStack) -> None:
    def send(request_id: str, **body: object) -> httpx.Response:
        return httpx.post(
            f"{server.url}/v1/completions",
            json={"model": MODEL, "prompt": "Hello", "max_tokens": 2, **body},
            headers={"X-Request-Id": request_id},
            timeout=60,
        )

    first = send("client-chosen-id")
    assert first.status_code == 200 and first.json()["id"] == "client-chosen-id"
    assert send("client-chosen-id").status_code == 200  # ended: free again
    # In flight: a second request may not take the id.
    events: list[str] = []

    def hold() -> None:
        body = {
            "model": MODEL,
            "prompt": "Count:",
            "max_tokens": 3000,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream(
            "POST",
            f"{server.url}/v1/completions",
            json=body,
            headers={"X-Request-Id": "held-id"},
            timeout=60,
        ) as r:
            for line in r.iter_lines():
                events.append(line)
                if len(events) > 6:
                    return  # leaving the stream aborts the request

    holder = threading.Thread(target=hold)
    holder.start()
    deadline = time.monotonic() + 30
    while len(events) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    clash = send("held-id")
    assert clash.status_code == 400 and "already in use" in clash.json()["error"]["message"]
    holder.join(timeout=30)
    deadline = time.monotonic() + 10
    while (reused := send("held-id")).status_code != 200:  # aborted: free again
        assert time.monotonic() < deadline, reused.text
        time.sleep(0.1)
    bad = send("not ok!")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-Request-Id"
