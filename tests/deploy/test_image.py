"""The container image for real: built with podman from a debootstrapped Debian base
(deploy/podman/setup.sh), run read-only as its non-root user, streamed through curl,
drained by SIGTERM; then the compose `split` profile under podman-compose, four
containers handing KV off through their shared /dev/shm."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.deploy.metrics import metrics_once_handed_off
from tests.stack import free_port
from tests.tools import venv_tool

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[2]
IMAGE = "localhost/tandem:test"
MODEL = "smollm2-135m-instruct"
LONG = " ".join(f"Item {i} of the inventory is a {w}." for i, w in enumerate(["lamp"] * 60))
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")
WHEELS = Path("/opt/wheels")  # where this machine's pip finds its CPU torch


def sh(*argv: str, timeout: float = 120, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)  # type: ignore[call-overload]


@pytest.fixture(scope="module")
def image() -> str:
    setup = sh("bash", str(ROOT / "deploy" / "podman" / "setup.sh"), timeout=900)
    if setup.returncode != 0:
        reason = f"podman cannot be installed here: {setup.stderr.strip()[-400:]}"
        print(reason)
        pytest.skip(reason)
    mounts = []
    if WHEELS.is_dir():
        mounts += ["-v", f"{WHEELS}:/wheels:ro"]
    if HOST_CA.is_file():  # a proxy that re-signs TLS: pip inside the build trusts it
        mounts += ["-v", f"{HOST_CA}:/host-ca.crt:ro"]
    build = sh(
        "podman", "build", "--format", "docker", "--network", "host", *mounts,
        "--build-arg", "BASE_IMAGE=localhost/bookworm-base",
        "-f", str(ROOT / "deploy" / "Dockerfile"), "-t", IMAGE, str(ROOT),
        timeout=1500,
    )  # fmt: skip
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    return IMAGE


def wait_ready(url: str, alive: Callable[[], bool], timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert alive(), "the container exited before it was ready"
        assert time.monotonic() < deadline, "never became ready"
        time.sleep(1)


def curl_stream(url: str, prompt: str) -> list[str]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "stream": True}
    out = sh(
        "curl", "-sS", "-N", "--fail-with-body", f"{url}/v1/completions",
        "-H", "Content-Type: application/json", "-d", json.dumps(body),
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    return [line for line in out.stdout.splitlines() if line.startswith("data: ")]


def test_the_image_serves_as_a_non_root_read_only_container_and_drains(image: str) -> None:
    name = f"tandem-test-{uuid.uuid4().hex[:8]}"
    port = free_port()
    sh(
        "podman", "run", "-d", "--name", name, "--network", "host", "--read-only",
        "--tmpfs", "/tmp", "-e", "TANDEM_HOST=127.0.0.1", "-e", f"TANDEM_PORT={port}", image,
    ).check_returncode()  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:

        def running() -> bool:
            state = sh("podman", "inspect", "-f", "{{.State.Running}}", name)
            return state.stdout.strip() == "true"

        wait_ready(url, running)
        lines = curl_stream(url, "Once upon a time")
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"
        assert sh("podman", "exec", name, "id", "-u").stdout.strip() == "10001"
        # The image's HEALTHCHECK (podman runs it only when asked: no systemd here).
        check = sh("podman", "image", "inspect", "-f", "{{json .HealthCheck}}", image).stdout
        assert "/livez" in check
        assert sh("podman", "healthcheck", "run", name).returncode == 0
        # The kernels built at image build for the portable level load on this CPU (the
        # image insists on the native backend: a failed load would have stopped the start).
        env = sh("podman", "exec", name, "env").stdout
        assert "TANDEM_KERNEL_ARCH=x86-64-v3" in env and "TANDEM_ATTENTION_BACKEND=native" in env
        sh("podman", "kill", "--signal", "TERM", name).check_returncode()
        code = sh("podman", "wait", name, timeout=90).stdout.strip()
        assert code == "0", sh("podman", "logs", name).stderr[-3000:]
    finally:
        sh("podman", "rm", "-f", name)


@pytest.fixture
def split_compose(image: str) -> Iterator[str]:
    port = free_port()
    env = {
        **os.environ,
        "COMPOSE_PROFILES": "split",
        "TANDEM_IMAGE": image,
        "TANDEM_HOST_PORT": str(port),
    }
    compose = [venv_tool("podman-compose"), "-f", "docker-compose.yml"]
    cwd = ROOT / "deploy"
    up = sh(*compose, "up", "-d", "--no-build", env=env, cwd=cwd, timeout=300)
    assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
    url = f"http://127.0.0.1:{port}"
    try:
        names = sh("podman", "ps", "--filter", "label=io.podman.compose.project=tandem",
                   "--format", "{{.Names}}").stdout.split()  # fmt: skip
        assert len(names) == 4, names

        def alive() -> bool:
            ps = sh("podman", "ps", "--filter", "label=io.podman.compose.project=tandem", "-q")
            return len(ps.stdout.split()) == 4

        wait_ready(url, alive)
        yield url
    finally:
        down = sh(*compose, "down", "-t", "40", env=env, cwd=cwd, timeout=300)
        assert down.returncode == 0, down.stderr[-2000:]


def test_the_compose_split_profile_hands_kv_off_through_shared_memory(split_compose: str) -> None:
    lines = curl_stream(split_compose, LONG)
    assert lines[-1] == "data: [DONE]"
    metrics = metrics_once_handed_off(split_compose)
    bytes_streamed = re.search(r"tandem:kv_transfer_bytes_total\{[^}]*\} (\S+)", metrics)
    assert bytes_streamed is not None and float(bytes_streamed[1]) == 0  # ids, not bytes
