"""Tenants kept apart: prefix-cache entries by cache_salt, cancellation by the key that
made the request, and API keys that never show anywhere."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import psutil

from tests.stack import TandemStack

MODEL = "smollm2-135m-instruct"
# Long enough for several full 16-token blocks.
LONG = " ".join(f"Fact {i}: the number {i} squared is {i * i}." for i in range(40))


def cached_tokens(url: str, salt: str | None, headers: dict[str, str] | None = None) -> int:
    body: dict[str, object] = {"model": MODEL, "prompt": LONG, "max_tokens": 1, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    r = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_cache_salt_keeps_prefix_cache_entries_apart(server: TandemStack) -> None:
    httpx.post(f"{server.url}/reset_prefix_cache")
    assert cached_tokens(server.url, "tenant-a") == 0
    assert cached_tokens(server.url, "tenant-b") == 0  # another tenant sees none of A's
    assert cached_tokens(server.url, None) == 0  # nor does an unsalted request
    assert cached_tokens(server.url, "tenant-a") > 200  # A hits its own
    assert cached_tokens(server.url, "tenant-b") > 200


KEY_A, KEY_B = "sk-tenant-a-0123456789", "sk-tenant-b-9876543210"


def start_stream(url: str, key: str, events: list[str], path: str = "/v1/completions") -> None:
    body: dict[str, object] = {
        "model": MODEL,
        "max_tokens": 2000,
        "ignore_eos": True,
        "stream": True,
    }
    if path == "/v1/messages":
        body["messages"] = [{"role": "user", "content": "Count to a thousand"}]
        # The Messages API has no ignore_eos, and a sampled answer may end within a second,
        # before the test cancels it: a schema of at least 500 numbers keeps it going.
        numbers = {"type": "array", "items": {"type": "integer"}, "minItems": 500}
        schema = {"type": "object", "properties": {"n": numbers}, "required": ["n"]}
        body["output_format"] = {"type": "json_schema", "schema": schema}
    else:
        body["prompt"] = "Count to a thousand:"
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.stream("POST", f"{url}{path}", json=body, headers=headers, timeout=60) as r:
        events.append(r.headers["x-request-id"])
        events.extend(line for line in r.iter_lines() if line.startswith(("data: ", "event: ")))


def request_id_of(events: list[str]) -> str:
    deadline = time.monotonic() + 30
    while len(events) < 3:
        assert time.monotonic() < deadline, "the stream never started"
        time.sleep(0.05)
    return events[0]


def test_only_the_key_that_made_a_request_may_cancel_it(smollm2_dir: Path) -> None:
    with TandemStack(
        "--num-kv-blocks", "256", env={"TANDEM_API_KEYS": f"{KEY_A},{KEY_B}"}
    ) as stack:
        for path in ("/v1/completions", "/v1/messages"):
            events: list[str] = []
            reader = threading.Thread(target=start_stream, args=(stack.url, KEY_A, events, path))
            reader.start()
            request_id = request_id_of(events)
            cancel = f"{stack.url}/v1/requests/{request_id}/cancel"
            assert httpx.post(cancel).status_code == 401  # no key at all
            other = httpx.post(cancel, headers={"Authorization": f"Bearer {KEY_B}"})
            assert other.status_code == 404  # not 403: the id's existence does not leak
            assert other.json()["error"]["code"] == "request_not_found"
            mine = httpx.post(cancel, headers={"Authorization": f"Bearer {KEY_A}"})
            assert mine.status_code == 200 and mine.json() == {"id": request_id, "cancelled": True}
            reader.join(timeout=10)
            assert not reader.is_alive(), "the cancelled stream did not end"
            if path == "/v1/completions":
                finish = json.loads(events[-2][6:])["choices"][0]["finish_reason"]
                assert finish == "abort"
            else:  # an Anthropic stream, cancelled by its msg_ id
                assert request_id.startswith("msg_") and events[-2] == "event: message_stop"
        stats = httpx.get(f"{stack.url}/stats", headers={"x-api-key": KEY_A}).json()
        assert stats["active_requests"] == 0
        reset = httpx.post(f"{stack.url}/reset_prefix_cache")
        assert reset.status_code == 401  # admin routes need a key too
        pids = [p for p in [stack.proc, *stack.descendants()] if p is not None]
        titles = " ".join(" ".join(psutil.Process(p.pid).cmdline()) for p in pids)
        metrics = httpx.get(f"{stack.url}/metrics").text
        stats_text = json.dumps(stats)
        bad = httpx.post(
            f"{stack.url}/v1/completions",
            json={"model": "x", "prompt": "y"},
            headers={"Authorization": f"Bearer {KEY_A}"},
        ).text
        wrong_key = httpx.post(
            f"{stack.url}/v1/completions",
            json={"model": MODEL, "prompt": "y"},
            headers={"Authorization": f"Bearer {KEY_A}x"},
        ).text
        assert stack.stop() == 0
        log = stack.log()
    for key in (KEY_A, KEY_B):
        for where, text in [
            ("log", log),
            ("process titles", titles),
            ("/metrics", metrics),
            ("/stats", stats_text),
            ("error bodies", bad + wrong_key),
        ]:
            assert key not in text and key[3:] not in text, f"an API key leaked into {where}"
