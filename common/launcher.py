"""``tandem serve``: start the engine core (which starts its workers) and the API
server, each by its own command, and supervise them.

Ctrl-C or SIGTERM stops every process and exits 0. If a child dies on its own, the
others get a grace period (to answer in-flight and new requests with errors), then are
stopped, and the launcher exits non-zero naming the process that died.
"""

from __future__ import annotations

import logging
import shutil
import signal
import subprocess
import sys
import time
from types import FrameType

from common.config import API_KEYS_ENV, EngineAddresses, TandemConfig
from common.ipc import make_runtime_dir
from common.model_files import resolve_model_dir
from common.process import (
    EXIT_ENGINE_DIED,
    EXIT_WORKER_DIED,
    small_thread_env,
    start_module,
    stop_process,
)

logger = logging.getLogger("tandem")

_EXIT_MEANING = {
    EXIT_WORKER_DIED: "a worker process died",
    EXIT_ENGINE_DIED: "it lost the engine core",
}


def _describe(name: str, proc: subprocess.Popen[bytes]) -> str:
    code = proc.returncode
    how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
    meaning = _EXIT_MEANING.get(code)
    return f"{name} (pid {proc.pid}) {how}" + (f": {meaning}" if meaning else "")


class _Stop(Exception):
    pass


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    raise _Stop(signal.Signals(signum).name)


def serve(config: TandemConfig) -> int:
    # Resolve (and convert, once) before any child starts, so none of them waits on it.
    served_name = config.served_model_name
    model_dir = resolve_model_dir(config.model.model)
    runtime_dir = make_runtime_dir()
    config = config.with_model_path(str(model_dir), served_name)
    if not config.addresses.input_address:
        config = config.with_addresses(EngineAddresses.ipc_in(runtime_dir))
    signal.signal(signal.SIGINT, _raise_stop)
    signal.signal(signal.SIGTERM, _raise_stop)
    children: list[tuple[str, subprocess.Popen[bytes]]] = []
    try:
        args = config.to_cli_args()
        children.append(("engine_core", start_module("engine_core", args, env=small_thread_env())))
        api_env = small_thread_env()
        if config.server.api_keys:  # secrets travel by environment, never on a command line
            api_env[API_KEYS_ENV] = ",".join(config.server.api_keys)
        children.append(("api_server", start_module("api_server", args, env=api_env)))
        logger.info(
            "serving %s on http://%s:%d (engine pid %d, api pid %d)",
            served_name,
            config.server.host,
            config.server.port,
            children[0][1].pid,
            children[1][1].pid,
        )
        while True:
            for name, proc in children:
                if proc.poll() is not None:
                    return _after_death(name, proc, children, config.server.grace_period_s)
            time.sleep(0.1)
    except _Stop as e:
        logger.info("stopping (%s)", e)
        return 0
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for _, proc in reversed(children):  # API server first: it stops taking requests
            stop_process(proc)
        shutil.rmtree(runtime_dir, ignore_errors=True)


def _after_death(
    name: str,
    proc: subprocess.Popen[bytes],
    children: list[tuple[str, subprocess.Popen[bytes]]],
    grace_s: float,
) -> int:
    message = _describe(name, proc)
    logger.error("%s; stopping the service in %.1f s", message, grace_s)
    time.sleep(grace_s)
    print(f"tandem: {message}", file=sys.stderr)
    return 1
