"""The compose file's split topologies as plain processes: each service's entry point
and environment from deploy/docker-compose.yml, on this host's loopback (what the
containers share), with the ports moved to free ones. The image's own environment
(model, host, port) is set as its Dockerfile sets it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from common.process import dies_with_this_process
from common.shm import SHM_DIR
from tests.deploy.metrics import metrics_once_handed_off
from tests.stack import free_port

COMPOSE = Path(__file__).parents[2] / "deploy" / "docker-compose.yml"
MODEL = "smollm2-135m-instruct"
LONG = " ".join(f"Item {i} of the inventory is a {w}." for i, w in enumerate(["lamp"] * 60))


def commands(suffix: str, port: int) -> dict[str, tuple[list[str], dict[str, str]]]:
    """Service name -> (argv, env) for the split services of one profile."""
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    moved: dict[str, str] = {}  # compose port -> a free one here, the same for every service

    def move(value: str) -> str:
        return re.sub(
            r"127\.0\.0\.1:(\d+)",
            lambda m: f"127.0.0.1:{moved.setdefault(m[1], str(free_port()))}",
            value,
        )

    out = {}
    for name in ("api-server", "engine-core", "prefill-worker", "decode-worker"):
        service = services[name + suffix]
        entry = list(service["entrypoint"])
        assert entry[:2] == ["/usr/bin/tini", "--"] and entry[2] == "python"
        env = {k: move(str(v)) for k, v in service["environment"].items()}
        image_env = {"TANDEM_MODEL": MODEL, "TANDEM_HOST": "127.0.0.1", "TANDEM_PORT": str(port)}
        out[name] = ([sys.executable, *entry[3:]], {**os.environ, **image_env, **env})
    return out


@pytest.fixture(params=["", "-tcp"], ids=["split", "split-tcp"])
def topology(request: pytest.FixtureRequest, smollm2_dir: Path) -> Iterator[str]:
    port = free_port()
    procs = [
        subprocess.Popen(argv, env=dies_with_this_process(env))
        for argv, env in commands(request.param, port).values()
    ]
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            try:
                if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert all(p.poll() is None for p in procs), [p.returncode for p in procs]
            assert time.monotonic() < deadline, "never became ready"
            time.sleep(0.5)
        yield url
        for proc in procs[:2]:  # the API server and the engine drain; the engine tells
            proc.send_signal(signal.SIGTERM)  # its workers to stop: all four exit 0
        assert [p.wait(timeout=60) for p in procs] == [0, 0, 0, 0]
        assert not list(SHM_DIR.glob("tandem-compose*"))  # the KV segment is gone
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)


def test_the_compose_split_topology_serves_and_hands_off(topology: str) -> None:
    body = {"model": MODEL, "prompt": LONG, "max_tokens": 8, "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{topology}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and len(lines) >= 3
    metrics = metrics_once_handed_off(topology)
    pools = set(re.findall(r'tandem:num_requests_running\{[^}]*pool="(\w+)"', metrics))
    assert pools == {"prefill", "decode"}
