"""The launcher names the child whose end explains the service's end (real child
processes, standing in for the engine core and an API server)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from common.launcher import Service
from common.process import EXIT_ENGINE_DIED, EXIT_WORKER_DIED


def child(code: int, after_s: float, reason: str, reason_file: str) -> subprocess.Popen[bytes]:
    script = (
        f"import sys, time; time.sleep({after_s}); "
        f"open({reason_file!r}, 'w').write({reason!r}); sys.exit({code})"
    )
    return subprocess.Popen([sys.executable, "-c", script])


def first_ended(service: Service) -> tuple[str, subprocess.Popen[bytes]]:
    """What the launcher's loop finds: the first child, in start order, that has ended."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for name, proc in service.children:
            if proc.poll() is not None:
                return name, proc
        time.sleep(0.01)
    raise AssertionError("no child ended")


def test_an_api_server_that_lost_the_engine_points_at_the_engine(tmp_path: Path) -> None:
    service = Service(str(tmp_path))
    # The engine core still waits for its failed worker when the API server, which lost
    # it, is found ended first.
    reason = "worker-0 failed: ValueError: --kv-cache-gb 1e-06 holds no KV block"
    engine = child(EXIT_WORKER_DIED, 1.5, reason, service.reason_file("engine_core"))
    api = child(EXIT_ENGINE_DIED, 0.0, "", service.reason_file("api_server"))
    service.children += [("engine_core", engine), ("api_server", api)]
    assert first_ended(service) == ("api_server", api)
    name, proc = service.cause(*first_ended(service))
    assert (name, proc) == ("engine_core", engine)
    line = service.describe(name, proc)
    assert line == (
        f"engine_core (pid {engine.pid}) exited with code {EXIT_WORKER_DIED}: "
        f"a worker process died ({reason})"
    )


def test_any_other_end_is_its_own_cause(tmp_path: Path) -> None:
    service = Service(str(tmp_path))
    engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    api = child(1, 0.0, "", service.reason_file("api_server"))  # not "lost the engine"
    service.children += [("engine_core", engine), ("api_server", api)]
    try:
        started = time.monotonic()
        assert service.cause(*first_ended(service)) == ("api_server", api)
        assert time.monotonic() - started < 5  # nobody waited on the engine core
    finally:
        engine.kill()
        engine.wait()
