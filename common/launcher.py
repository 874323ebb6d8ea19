"""``tandem serve``: start the engine core (which starts its workers) and the API
server, each by its own command, and supervise them.

SIGTERM or Ctrl-C drains: the API server stops taking requests (``/readyz`` 503, new
requests 503) and lets in-flight ones finish for ``--shutdown-timeout`` seconds, then
the engine core stops its workers, and the launcher exits 0. A second SIGTERM/Ctrl-C
stops everything at once. If a child dies on its own, the others get a grace period (to
answer in-flight and new requests with errors), then are stopped, and the launcher
exits non-zero with one line naming the process and the cause. Started by a supervisor
that sets ``TANDEM_PARENT_PID`` to its own pid (the test suite, the benchmarks), the
launcher stops everything at once when that parent dies, as its own children do.

With several ``--model``s it starts the model router instead (``api_server/model_router.py``),
which starts a ``tandem serve`` per model and routes by the request's ``model``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable
from types import FrameType

from common.audit_config import check_audit_sink
from common.config import API_KEYS_ENV, EngineAddresses, TandemConfig
from common.ipc import make_runtime_dir
from common.model_files import gguf_source, resolve_model_dir
from common.model_set_config import model_name_of
from common.process import (
    EXIT_ENGINE_DIED,
    EXIT_REASON_ENV,
    EXIT_WORKER_DIED,
    PARENT_DIED,
    die_with_parent,
    small_thread_env,
    start_module,
)
from common.tls_config import check_tls_files

logger = logging.getLogger("tandem")

_EXIT_MEANING = {
    EXIT_WORKER_DIED: "a worker process died",
    EXIT_ENGINE_DIED: "it lost the engine core",
}
_POLL_S = 0.1
# An engine core ending on its own waits up to 5 s for its workers, then stops each one
# left (SIGTERM, up to 10 s: engine_core.executor). A rank whose peer died mid-collective
# can take all of it, and under load the API server, having lost the engine, may end
# seconds before the engine core does (seen with two test runs sharing this 2-core host,
# when the wait was 6 s).
_CAUSE_WAIT_S = 16.0
_ENGINE_STOP_S = 15.0  # the engine has nothing left to drain once the API servers are gone


# Every signal that stops the launcher; once it is stopping, any of them means hurry.
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, PARENT_DIED)


class _Stop(Exception):
    pass


class _ParentDied(Exception):
    """Nobody is left to drain for: stop at once."""


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    raise _Stop(signal.Signals(signum).name)


def _raise_parent_died(signum: int, frame: FrameType | None) -> None:
    raise _ParentDied


class _Hurry:
    """Counts the signals that arrive while draining: any one means stop at once."""

    def __init__(self) -> None:
        self.asked = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if not self.asked:
            logger.info("%s again: stopping at once", signal.Signals(signum).name)
        self.asked = True


def check_port_free(host: str, port: int) -> None:
    """Fail before anything starts when the HTTP port cannot be bound."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as e:
            raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}") from None


class Service:
    """The launcher's children and how each one ended."""

    def __init__(self, runtime_dir: str) -> None:
        self.runtime_dir = runtime_dir
        self.children: list[tuple[str, subprocess.Popen[bytes]]] = []

    def reason_file(self, name: str) -> str:
        return os.path.join(self.runtime_dir, f"exit-{name}.txt")

    def start(self, name: str, module: str, args: list[str], env: dict[str, str]) -> None:
        env = {**env, EXIT_REASON_ENV: self.reason_file(name)}
        self.children.append((name, start_module(module, args, env=env)))

    def named(self, prefix: str) -> list[subprocess.Popen[bytes]]:
        return [proc for name, proc in self.children if name.startswith(prefix)]

    def cause(
        self, name: str, proc: subprocess.Popen[bytes]
    ) -> tuple[str, subprocess.Popen[bytes]]:
        """The child whose end explains the service's, given the first one found ended.
        An API server that lost the engine core ended because the engine core is ending
        (its workers failed, say), and may be found first while the engine core still
        waits for its workers: the engine core holds the reason, so it is given the time
        its own shutdown takes."""
        if proc.returncode != EXIT_ENGINE_DIED:
            return name, proc
        for engine_name, engine in self.children:
            if engine_name == "engine_core":
                with contextlib.suppress(subprocess.TimeoutExpired):
                    engine.wait(_CAUSE_WAIT_S)
                if engine.returncode is not None:
                    return engine_name, engine
        return name, proc

    def describe(self, name: str, proc: subprocess.Popen[bytes]) -> str:
        code = proc.returncode
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        meaning = _EXIT_MEANING.get(code)
        if meaning:
            how += f": {meaning}"
        try:
            with open(self.reason_file(name)) as f:
                cause = f.read().strip()
        except OSError:
            cause = ""
        return f"{name} (pid {proc.pid}) {how}" + (f" ({cause})" if cause else "")


def _start_one_model(service: Service, config: TandemConfig, served_name: str) -> TandemConfig:
    """The engine core (which starts its workers) and the API servers of one model."""
    model_dir = resolve_model_dir(config.model.model)
    config = config.with_model_path(str(model_dir), served_name)
    if not config.addresses.input_address:
        config = config.with_addresses(EngineAddresses.ipc_in(service.runtime_dir))
    args = config.to_cli_args()
    service.start("engine_core", "engine_core", args, small_thread_env())
    api_env = _with_keys(small_thread_env(), config)
    if config.server.api_server_count > 1:  # per-request metrics summed across them
        metrics_dir = os.path.join(service.runtime_dir, "prometheus")
        os.makedirs(metrics_dir)
        api_env["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    for i in range(config.server.api_server_count):  # all on one port (SO_REUSEPORT)
        service.start("api_server" if i == 0 else f"api_server-{i}", "api_server", args, api_env)
    return config


def _with_keys(env: dict[str, str], config: TandemConfig) -> dict[str, str]:
    if config.server.api_keys:  # secrets travel by environment, never on a command line
        env[API_KEYS_ENV] = ",".join(config.server.api_keys)
    return env


def serve(config: TandemConfig) -> int:
    # Resolve (and convert, once) before any child starts, so none of them waits on it.
    served_name = config.served_model_name
    for model in config.model_names:  # an unknown one is refused before anything starts
        resolve_model_dir(model)
        if config.model.quantization == "gguf":  # found (an assembled one: made) once
            gguf_source(model)
    check_port_free(config.server.host, config.server.port)
    check_tls_files(*config.server.tls_flags)  # read by the process facing clients
    check_audit_sink(config.server.audit_log)
    if config.server.otlp_traces_endpoint:
        from common.tracing import otlp_protocol  # OpenTelemetry loads only when asked

        otlp_protocol()  # an unknown wire, or gRPC not installed: said before anything starts
    runtime_dir = make_runtime_dir()
    signal.signal(signal.SIGINT, _raise_stop)
    signal.signal(signal.SIGTERM, _raise_stop)
    signal.signal(PARENT_DIED, _raise_parent_died)
    service = Service(runtime_dir)
    hurry = _Hurry()
    try:
        die_with_parent()
        if len(config.model_names) > 1:  # a model router, which starts a service per model
            args = config.to_cli_args()
            env = _with_keys(dict(os.environ), config)
            service.start("model_router", "api_server.model_router", args, env)
            served_name = ", ".join(model_name_of(m) for m in config.model_names)
        else:
            config = _start_one_model(service, config, served_name)
        logger.info(
            "serving %s on %s://%s:%d (%s)",
            served_name,
            config.server.scheme,
            config.server.host,
            config.server.port,
            ", ".join(f"{name} pid {proc.pid}" for name, proc in service.children),
        )
        while True:
            for name, proc in service.children:
                if proc.poll() is not None:
                    name, proc = service.cause(name, proc)
                    return _after_death(service, name, proc, config.server.grace_period_s)
            time.sleep(_POLL_S)
    except _Stop as e:
        for signum in _STOP_SIGNALS:
            signal.signal(signum, hurry)
        logger.info("stopping (%s): draining for up to %.0f s", e, config.server.shutdown_timeout_s)
        _drain(service, config.server.shutdown_timeout_s, hurry)
        return 0
    except _ParentDied:
        logger.warning("the process that started tandem serve died: stopping at once")
        return 1
    finally:
        for signum in _STOP_SIGNALS:
            signal.signal(signum, hurry)
        _stop_now(proc for _, proc in service.children)
        shutil.rmtree(runtime_dir, ignore_errors=True)


def _drain(service: Service, timeout_s: float, hurry: _Hurry) -> None:
    """API servers (or the model router) first: they finish or fail their requests; then
    the engine core."""
    groups = (
        ("model_router", timeout_s + _ENGINE_STOP_S + 10.0),
        ("api_server", timeout_s + 10.0),
        ("engine_core", _ENGINE_STOP_S),
    )
    for group, wait_s in groups:
        procs = [p for p in service.named(group) if p.poll() is None]
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + wait_s
        while any(p.poll() is None for p in procs):
            if hurry.asked or time.monotonic() > deadline:
                return  # the finally block stops the rest at once
            time.sleep(_POLL_S)


def _stop_now(procs: Iterable[subprocess.Popen[bytes]], timeout_s: float = 10.0) -> None:
    """SIGHUP (stop at once, cleaning up), then SIGKILL whatever is left."""
    alive = [p for p in procs if p.poll() is None]
    for proc in alive:
        proc.send_signal(PARENT_DIED)
    deadline = time.monotonic() + timeout_s
    for proc in alive:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _after_death(service: Service, name: str, proc: subprocess.Popen[bytes], grace_s: float) -> int:
    message = service.describe(name, proc)
    logger.error("%s; stopping the service in %.1f s", message, grace_s)
    time.sleep(grace_s)
    # The others stopped first, so none writes after the service's last line (an API
    # server still starting up printed uvicorn's banner after it).
    _stop_now(p for _, p in service.children)
    print(f"tandem: {message}", file=sys.stderr)
    return 1
