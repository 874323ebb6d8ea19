"""The engine's sockets: never beyond 127.0.0.1 without --expose-engine, never then
without CurveZMQ keys, and a peer without the keys never reaches the engine. CORS is off
unless origins are named."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq
import zmq.auth

from common.curve import generate_keys
from common.messages import EngineRequest, SamplingParams, WorkerFailed
from tests.stack import TandemStack, free_port

MODEL = "smollm2-135m-instruct"
ORIGIN = "https://app.example.com"


def engine_addresses(host: str) -> list[str]:
    return [
        "--input-address",
        f"tcp://{host}:{free_port()}",
        "--output-address",
        f"tcp://{host}:{free_port()}",
    ]


@pytest.mark.parametrize(
    ("extra", "says"),
    [([], "--expose-engine"), (["--expose-engine"], "--curve-keys")],
    ids=["no flag", "no keys"],
)
def test_engine_beyond_loopback_needs_the_flag_and_keys(extra: list[str], says: str) -> None:
    for module in ("engine_core", "api_server"):
        run = subprocess.run(
            [sys.executable, "-m", module, *engine_addresses("127.0.0.2"), *extra],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert run.returncode == 2 and says in run.stderr, run.stderr


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = generate_keys(str(tmp_path_factory.mktemp("keys") / "curve"))
    assert path.stat().st_mode & 0o777 == 0o700
    assert (path / "server.key_secret").stat().st_mode & 0o777 == 0o600
    return path


@pytest.fixture(scope="module")
def exposed(smollm2_dir: Path, keys: Path) -> Iterator[tuple[TandemStack, list[str]]]:
    addresses = engine_addresses("127.0.0.2")
    flags = [*addresses, "--expose-engine", "--curve-keys", str(keys)]
    with TandemStack(*flags, "--allowed-origins", ORIGIN, "--num-kv-blocks", "64") as stack:
        yield stack, addresses


def total_requests(url: str) -> int:
    return int(httpx.get(f"{url}/stats", timeout=10).json()["total_requests"])


def test_curve_keys_let_the_deployment_in_and_no_one_else(
    exposed: tuple[TandemStack, list[str]], tmp_path: Path
) -> None:
    stack, addresses = exposed
    r = httpx.post(
        f"{stack.url}/v1/completions",
        json={"model": MODEL, "prompt": "The capital of France is", "max_tokens": 3},
        timeout=60,
    )
    assert r.status_code == 200  # the API server holds the keys
    before = total_requests(stack.url)
    rogue_keys = generate_keys(str(tmp_path / "rogue"))
    frame = msgspec.msgpack.encode(
        EngineRequest("rogue", b"nobody", [1, 2, 3], SamplingParams(max_tokens=2), 0.0)
    )
    ctx = zmq.Context()
    for curve in (None, rogue_keys):  # no keys at all, then someone else's keys
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            public, secret = zmq.auth.load_certificate(str(curve / "client.key_secret"))
            server_public, _ = zmq.auth.load_certificate(str(curve / "server.key"))
            push.curve_publickey, push.curve_secretkey = public, secret
            push.curve_serverkey = server_public
        push.connect(addresses[1])
        # Never connected (the handshake failed) or queued then dropped: never delivered.
        with contextlib.suppress(zmq.Again):
            push.send(frame, zmq.NOBLOCK)
        time.sleep(1.0)
        push.close()
    ctx.term()
    time.sleep(0.5)
    assert total_requests(stack.url) == before  # neither frame reached the engine
    assert "[rogue]" not in stack.log()


@pytest.mark.parametrize(
    "flag", ["--prefill-pool-address", "--decode-pool-address", "--kv-transfer-address"]
)
def test_pool_and_hand_off_sockets_beyond_loopback_need_the_flag(flag: str) -> None:
    split = ["--prefill-workers", "1", "--decode-workers", "1", "--kv-transfer", "tcp"]
    run = subprocess.run(
        [sys.executable, "-m", "engine_core", *split, flag, f"tcp://127.0.0.2:{free_port()}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2 and flag in run.stderr and "--expose-engine" in run.stderr


LONG = " ".join(f"Item {i} of the inventory is a lamp." for i in range(60))


def test_split_pools_across_hosts_speak_only_curve(smollm2_dir: Path, keys: Path) -> None:
    """Pools and the KV hand-off beyond loopback: the workers' sockets, the engine's pool
    sockets and the KV stream are Curve (the service could not serve otherwise), and a
    plaintext peer posing as a worker is never heard."""
    prefill_pool = f"tcp://127.0.0.2:{free_port()}"
    flags = [
        *engine_addresses("127.0.0.2"),
        *("--expose-engine", "--curve-keys", str(keys)),
        *("--prefill-workers", "1", "--decode-workers", "1", "--kv-transfer", "tcp"),
        *("--prefill-pool-address", prefill_pool),
        *("--decode-pool-address", f"tcp://127.0.0.2:{free_port()}"),
        *("--kv-transfer-address", "tcp://127.0.0.2:0"),
    ]
    with TandemStack(*flags) as stack:
        body = {"model": MODEL, "prompt": LONG, "max_tokens": 4, "temperature": 0}
        r = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        stats = stack.stats_when(lambda s: s["kv_transfers"]["outcomes"]["done"] > 0)
        transfers = stats["kv_transfers"]
        assert transfers["outcomes"]["done"] == 1 and transfers["bytes"] > 0
        # A plaintext DEALER claiming to be prefill worker 0 reports a failure: were it
        # heard, the engine would take the pool down.
        ctx = zmq.Context()
        rogue = ctx.socket(zmq.DEALER)
        rogue.setsockopt(zmq.LINGER, 0)
        rogue.setsockopt(zmq.IDENTITY, b"worker-0")
        rogue.connect(prefill_pool)
        with contextlib.suppress(zmq.Again):
            rogue.send(msgspec.msgpack.encode(WorkerFailed(0, "rogue")), zmq.NOBLOCK)
        time.sleep(1.5)
        rogue.close()
        ctx.term()
        assert httpx.get(f"{stack.url}/readyz", timeout=10).status_code == 200
        r = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200 and "rogue" not in stack.log()


def test_cors_answers_only_the_named_origins(
    exposed: tuple[TandemStack, list[str]], server: TandemStack
) -> None:
    stack, _ = exposed
    preflight = {
        "Origin": ORIGIN,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    r = httpx.options(f"{stack.url}/v1/chat/completions", headers=preflight)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.options(
        f"{stack.url}/v1/chat/completions", headers={**preflight, "Origin": "https://evil.example"}
    )
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    # Off by default: no CORS headers at all.
    plain = httpx.get(f"{server.url}/v1/models", headers={"Origin": ORIGIN})
    assert plain.status_code == 200 and "access-control-allow-origin" not in plain.headers
