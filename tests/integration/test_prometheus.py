"""A real Prometheus (Debian's, installed when missing) scrapes a running Tandem; its
query API must show exactly the traffic sent. The Grafana dashboard may use only metric
names this scrape saw."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.dashboard import dashboard, metric_names, split_row_panels
from tests.stack import TandemStack, free_port
from tests.system_packages import ensure_debian_package

MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class Scraped:
    url: str  # Prometheus' base URL
    requests: int  # requests sent to Tandem
    tokens: int  # completion tokens they produced


@pytest.fixture(scope="module")
def scraped(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scraped]:
    """Prometheus scraping a Tandem that has served `send_traffic`'s requests."""
    binary = ensure_debian_package("prometheus", "prometheus")
    workdir = tmp_path_factory.mktemp("prometheus")
    with TandemStack() as stack:
        config = workdir / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n"
            "scrape_configs:\n  - job_name: tandem\n    static_configs:\n"
            f"      - targets: ['127.0.0.1:{stack.port}']\n"
        )
        port = free_port()
        log_path = workdir / "prometheus.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [
                    binary,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={workdir / 'data'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        prometheus = f"http://127.0.0.1:{port}"
        try:
            # A fresh Prometheus answers 503 until its TSDB is open; on a slow host that
            # takes a while. Only a scraped target makes the tests below meaningful.
            scrape_seen = wait_for(prometheus, 'up{job="tandem"}', 1.0, timeout_s=120)
            assert scrape_seen == 1.0, (
                f"Prometheus never scraped Tandem; its log:\n{log_path.read_text()[-3000:]}"
            )
            requests, tokens = send_traffic(stack.url)
            yield Scraped(prometheus, requests, tokens)
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def query(prometheus: str, expr: str) -> float | None:
    r = httpx.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=10)
    r.raise_for_status()  # 503 while Prometheus is still opening its TSDB
    result = r.json()["data"]["result"]
    return float(result[0]["value"][1]) if result else None


def wait_for(prometheus: str, expr: str, expected: float, timeout_s: float = 60) -> float | None:
    deadline = time.monotonic() + timeout_s
    value = None
    while time.monotonic() < deadline:
        try:
            value = query(prometheus, expr)
        except httpx.HTTPError:
            value = None  # not listening yet, or still opening its TSDB
        if value == expected:
            return value
        time.sleep(0.5)
    return value


def send_traffic(url: str) -> tuple[int, int]:
    """Requests of known size; returns (requests, completion tokens)."""
    bodies: list[tuple[str, dict[str, Any]]] = [
        ("/v1/completions", {"prompt": "The capital of France is", "max_tokens": 7}),
        ("/v1/completions", {"prompt": "Count: 1, 2,", "max_tokens": 12, "stream": True}),
        ("/v1/completions", {"prompt": [1, 2, 3, 4], "max_tokens": 5}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 9},
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Yo"}], "max_tokens": 4, "stream": True},
        ),
    ]
    tokens = 0
    for path, body in bodies:
        body = {"model": MODEL, "ignore_eos": True, **body}
        with httpx.stream("POST", f"{url}{path}", json=body, timeout=60) as r:
            assert r.status_code == 200
            r.read()
        tokens += int(body["max_tokens"])  # ignore_eos: every request runs to max_tokens
    return len(bodies), tokens


def test_prometheus_sees_the_traffic(scraped: Scraped) -> None:
    prometheus, requests, tokens = scraped.url, scraped.requests, scraped.tokens
    model = f'{{model_name="{MODEL}"}}'
    assert (
        wait_for(prometheus, f"tandem:time_to_first_token_seconds_count{model}", requests)
        == requests
    )
    assert wait_for(prometheus, f"tandem:generation_tokens_total{model}", tokens) == tokens
    assert (
        wait_for(prometheus, f"tandem:e2e_request_latency_seconds_count{model}", requests)
        == requests
    )
    assert (
        wait_for(
            prometheus, 'sum(tandem:request_success_total{finished_reason="length"})', requests
        )
        == requests
    )
    itl = f"tandem:inter_token_latency_seconds_count{model}"
    assert (
        wait_for(prometheus, itl, tokens - requests) == tokens - requests
    )  # one gap per later token
    completions = 'http_requests_total{handler="/v1/completions",status="200"}'
    assert wait_for(prometheus, completions, 3) == 3
    assert wait_for(prometheus, f"tandem:num_requests_running{model}", 0) == 0
    # The worker's cores, or fewer where its thread governor gave some up.
    threads = query(prometheus, f"tandem:worker_threads{model}")
    assert threads is not None and 1 <= threads <= (os.cpu_count() or 1)


def metric_names_seen(prometheus: str) -> set[str]:
    r = httpx.get(f"{prometheus}/api/v1/label/__name__/values", timeout=10)
    r.raise_for_status()
    return set(r.json()["data"])


def test_dashboard_uses_only_scraped_metric_names(scraped: Scraped) -> None:
    # Every series of the traffic must have landed before the names are listed.
    seen_requests = wait_for(
        scraped.url, "sum(tandem:e2e_request_latency_seconds_count)", scraped.requests
    )
    assert seen_requests == scraped.requests
    seen = metric_names_seen(scraped.url)
    split_only = metric_names(split_row_panels()) - metric_names(
        [p for p in dashboard()["panels"] if p not in split_row_panels()]
    )  # hand-off series exist only where pools are split (test_split_pools checks them)
    used = metric_names() - split_only
    assert len(used) >= 12
    assert used <= seen, f"dashboard names never scraped: {sorted(used - seen)}"
    titles = " ".join(p["title"] for p in dashboard()["panels"]).lower()
    for topic in (
        "first token",
        "inter-token",
        "end-to-end",
        "throughput",
        "running",
        "kv cache",
        "prefix",
        "preemptions",
        "per pool",
        "hand-off",
        "api-server process",
        "worker cpu threads",
    ):
        assert topic in titles
