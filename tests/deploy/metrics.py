"""What the deployment tests read from a split service's ``/metrics``."""

from __future__ import annotations

import re
import time

import httpx

_DONE = re.compile(r'tandem:kv_transfers_total\{[^}]*outcome="done"[^}]*\} (\S+)')


def metrics_once_handed_off(url: str, timeout_s: float = 10.0) -> str:
    """``/metrics`` once it counts a finished KV hand-off. The engine's hand-off counters
    reach the API server with its heartbeat (every 0.2 s): a scrape right after a response
    may be a beat behind (an 8-token answer takes ~50 ms), so wait a few beats."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        done = _DONE.search(metrics)
        if (done is not None and float(done[1]) >= 1) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert done is not None and float(done[1]) >= 1, metrics[-2000:]
    return metrics
