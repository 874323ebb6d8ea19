"""Split prefill/decode pools as processes: what operators see (readiness, /stats per pool,
hand-off metrics), shared-memory hygiene through a run, SIGTERM and SIGKILL, a prefill
worker killed mid-hand-off, and every process started by its own command."""

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

from common.process import dies_with_this_process
from common.shm import SHM_DIR
from tests.dashboard import exported_names, metric_names, split_row_panels
from tests.stack import CPU_WORKERS, TandemStack, free_port

MODEL = "smollm2-135m-instruct"
SPLIT = ("--prefill-workers", "1", "--decode-workers", "1")
LONG = " ".join(f"Item {i} of the inventory is a {w}." for i, w in enumerate(["lamp"] * 60))


def segments() -> set[str]:
    return {p.name for p in SHM_DIR.glob("tandem-*")}


def complete(url: str, prompt: str, max_tokens: int = 6) -> dict[str, object]:
    r = httpx.post(
        f"{url}/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    result: dict[str, object] = r.json()
    return result


def metric_lines(url: str, name: str) -> list[str]:
    return [
        line
        for line in httpx.get(f"{url}/metrics").text.splitlines()
        if line.startswith(f"tandem:{name}")
    ]


@pytest.mark.parametrize("kv_transfer", ["shm", "tcp"])
def test_operators_see_both_pools_and_the_hand_offs(smollm2_dir: Path, kv_transfer: str) -> None:
    before = segments()
    env = CPU_WORKERS if kv_transfer == "shm" else None  # shm maps KV in host memory
    with TandemStack(*SPLIT, "--kv-transfer", kv_transfer, env=env) as stack:
        names = sorted(
            p.cmdline()[p.cmdline().index("--pool") + 1]
            for p in stack.descendants()
            if "--pool" in p.cmdline()
        )
        assert names == ["decode", "prefill"]
        ready = httpx.get(f"{stack.url}/readyz").json()
        assert ready == {"role": "split", "status": "ready"}
        new = segments() - before
        if kv_transfer == "shm":  # one segment, both workers map it
            assert len(new) == 1
            (segment,) = new
            mapped_by = [
                p.cmdline()[p.cmdline().index("--pool") + 1]
                for p in stack.descendants()
                if "--pool" in p.cmdline() and segment in Path(f"/proc/{p.pid}/maps").read_text()
            ]
            assert sorted(mapped_by) == ["decode", "prefill"]
        else:
            assert not new  # each pool has its own memory
        complete(stack.url, LONG)  # handed off
        complete(stack.url, "Hi")  # short: prefilled where the router sees fit
        stats = stack.stats_when(lambda s: sum(s["kv_transfers"]["outcomes"].values()) == 2)
        assert set(stats["pools"]) == {"prefill", "decode"}
        assert stats["total_requests"] == 2 and stats["num_kv_blocks_in_use"] == 0
        assert stats["kv_transfers"]["outcomes"]["done"] >= 1
        running = metric_lines(stack.url, "num_requests_running")
        assert {line.split('pool="')[1].split('"')[0] for line in running} == {"prefill", "decode"}
        # Two workers on this host's cores: one thread each (no governor below two).
        assert {name: pool["worker_threads"] for name, pool in stats["pools"].items()} == {
            "prefill": 1,
            "decode": 1,
        }
        assert stats["worker_threads"] == 2
        threads = metric_lines(stack.url, "worker_threads")
        assert sorted(line.split('pool="')[1].split('"')[0] for line in threads) == [
            "decode",
            "prefill",
        ]
        assert all(line.endswith(" 1.0") for line in threads), threads
        done = next(
            line
            for line in metric_lines(stack.url, "kv_transfers_total")
            if 'outcome="done"' in line
        )
        assert float(done.rsplit(" ", 1)[1]) >= 1
        assert metric_lines(stack.url, "kv_transfer_duration_seconds_count")
        if kv_transfer == "tcp":
            (bytes_line,) = metric_lines(stack.url, "kv_transfer_bytes_total")
            assert float(bytes_line.rsplit(" ", 1)[1]) > 0
        # The dashboard's split-pool panels query only series this service exports.
        exported = exported_names(httpx.get(f"{stack.url}/metrics").text)
        wanted = metric_names(split_row_panels())
        assert wanted and wanted <= exported, sorted(wanted - exported)
    assert segments() == before  # unlinked at shutdown


def test_a_crashed_service_leaves_segments_that_the_next_start_removes(smollm2_dir: Path) -> None:
    before = segments()
    stack = TandemStack(*SPLIT, env=CPU_WORKERS).start()  # shm: CPU workers
    (crashed,) = segments() - before
    for p in [*stack.descendants(), psutil.Process(stack.proc.pid)]:  # type: ignore[union-attr]
        p.kill()  # every process at once: nobody cleans up
    time.sleep(1)
    assert crashed in segments()
    with TandemStack(*SPLIT, env=CPU_WORKERS) as again:
        assert crashed not in segments()  # found stale by its unclaimed service file
        complete(again.url, LONG)
    assert segments() == before


def test_a_prefill_worker_killed_mid_hand_off_fails_requests_cleanly(smollm2_dir: Path) -> None:
    before = segments()
    stack = TandemStack(*SPLIT, "--grace-period-s", "1", env=CPU_WORKERS).start()
    results: list[httpx.Response | str] = []

    def send(i: int) -> None:
        try:
            body = {"model": MODEL, "prompt": f"{i}. {LONG}", "max_tokens": 40, "ignore_eos": True}
            results.append(httpx.post(f"{stack.url}/v1/completions", json=body, timeout=60))
        except httpx.HTTPError as e:
            results.append(type(e).__name__)

    senders = [threading.Thread(target=send, args=(i,)) for i in range(6)]
    for t in senders:
        t.start()
    deadline = time.monotonic() + 60
    while httpx.get(f"{stack.url}/stats").json()["kv_transfers"]["outcomes"]["done"] < 1:
        assert time.monotonic() < deadline, "no hand-off happened"
        time.sleep(0.02)
    prefill = next(p for p in stack.descendants() if "prefill" in p.cmdline())
    prefill.kill()
    for t in senders:
        t.join(timeout=30)
        assert not t.is_alive(), "a request hung"
    codes = sorted(r.status_code if isinstance(r, httpx.Response) else 0 for r in results)
    failed = [r for r in results if isinstance(r, httpx.Response) and r.status_code != 200]
    assert failed, codes  # the requests it held ended with an error...
    for r in failed:
        assert r.status_code in (500, 503) and "prefill worker-0" in r.json()["error"]["message"]
    assert stack.proc is not None and stack.proc.wait(timeout=30) != 0  # ...and the service stops
    assert "prefill worker-0 (pid" in stack.log().split("tandem: ")[-1]
    stack.stop()
    assert segments() == before


def test_every_process_by_its_own_command(smollm2_dir: Path, tmp_path: Path) -> None:
    """As containers run them: the engine starts no worker and notices a lost one by
    heartbeat (a pause of every process is not a loss); each worker connects to its pool's
    address."""
    port = free_port()
    addresses = {
        "--input-address": f"ipc://{tmp_path}/in.sock",
        "--output-address": f"ipc://{tmp_path}/out.sock",
        "--prefill-pool-address": f"tcp://127.0.0.1:{free_port()}",
        "--decode-pool-address": f"tcp://127.0.0.1:{free_port()}",
    }
    flags = [
        "--model", str(smollm2_dir), "--served-model-name", MODEL, "--port", str(port),
        *SPLIT, "--kv-transfer", "tcp", "--external-workers", "--service-id", "apart",
        *(x for pair in addresses.items() for x in pair),
    ]  # fmt: skip
    env = dies_with_this_process()  # no process outlives a killed test run
    engine = subprocess.Popen([sys.executable, "-m", "engine_core", *flags], env=env)
    workers = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "worker",
                *flags,
                "--pool",
                pool,
                "--worker-address",
                addresses[f"--{pool}-pool-address"],
            ],
            env=env,
        )
        for pool in ("prefill", "decode")
    ]
    api = subprocess.Popen([sys.executable, "-m", "api_server", *flags], env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            exited = [p.args for p in (engine, api, *workers) if p.poll() is not None]
            assert not exited, f"exited before ready: {exited}"
            assert time.monotonic() < deadline, "never became ready"
            time.sleep(0.3)
        assert psutil.Process(engine.pid).children() == []  # it started none
        out = complete(url, LONG)
        assert json.dumps(out).count("text") >= 1
        # Every process paused longer than the engine's 3 s heartbeat timeout (less than
        # the workers' 5 s ZMTP one), the workers resumed a second after the engine (as
        # memory reclaim on a busy host gives each process its pages back in turn).
        engine_side = [psutil.Process(p.pid) for p in (engine, api)]
        worker_side = [psutil.Process(p.pid) for p in workers]
        for p in engine_side + worker_side:
            p.suspend()
        time.sleep(3.5)
        for p in engine_side:
            p.resume()
        time.sleep(1.0)
        for p in worker_side:
            p.resume()
        time.sleep(1.0)
        assert complete(url, LONG)["choices"] == out["choices"]  # served on, greedy alike
        assert httpx.get(f"{url}/readyz", timeout=2).status_code == 200
        assert engine.poll() is None
        workers[1].send_signal(signal.SIGKILL)  # the decode worker, gone without a word
        killed = time.monotonic()
        while httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
            assert time.monotonic() - killed < 10, "the engine never noticed"
            time.sleep(0.1)
        assert time.monotonic() - killed < 6  # the heartbeat timeout, 3 s, plus a margin
        assert engine.wait(timeout=30) != 0
        # The prefill worker does not outlive its engine: told to stop on the engine's
        # way out, or noticing it gone (tests/unit/test_engine_link.py), it exits, and its
        # supervisor (compose, Kubernetes) restarts it against the next engine.
        assert workers[0].wait(timeout=15) is not None  # stopped by the engine, or on losing it
    finally:
        for proc in (api, engine):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in workers:
            if proc.poll() is None:
                proc.kill()
        for proc in (api, engine, *workers):
            try:
                proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                proc.kill()
