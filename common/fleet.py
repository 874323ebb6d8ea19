"""``tandem fleet``: Tandem instances behind vLLM's router (``vllm-router``), on one host.

For trying a fleet before deploying one (compose profiles ``fleet`` and ``xpyd``, the Helm
chart's router): ``--replicas N`` whole instances, each ``tandem serve`` on its own port
with its KV events published (vLLM's format) on its own ports, and the router in front with
the chosen ``--policy``; ``kv_aware`` is told each instance's event and replay endpoints
and the block size, so it routes by what each instance has cached. ``--prefill P --decode
D`` instead: P prefill instances (``kv_producer``, each with its side channel) and D decode
instances (``kv_consumer``) behind the router's ``--vllm-pd-disaggregation`` (the
NixlConnector's two-stage protocol: ``--kv-connector nixl``). Prints the router's URL;
Ctrl-C or SIGTERM stops everything. The router comes with ``pip install 'tandem[router]'``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from types import FrameType

from common.config import TandemConfig
from common.ipc import free_tcp_port
from common.process import start_module

ROUTER_POLICIES = (
    "kv_aware",
    "cache_aware",
    "power_of_two",
    "round_robin",
    "random",
    "consistent_hash",
    "sticky_least_loaded",
)
_ROUTER_LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
_START_TIMEOUT_S = 600.0
_STOP_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Instance:
    url: str
    args: list[str]  # `tandem serve` flags
    events: str  # its KV events' PUB endpoint, as the router connects to it
    replay: str


@dataclass(frozen=True)
class Shape:
    """Whole instances, or prefill and decode instances (a fleet's split)."""

    replicas: int = 2
    prefill: int = 0
    decode: int = 0

    def __post_init__(self) -> None:
        if (self.prefill == 0) != (self.decode == 0) or self.prefill < 0 or self.decode < 0:
            raise ValueError("--prefill and --decode go together, each at least 1")
        if self.replicas < 1:
            raise ValueError(f"--replicas must be at least 1, got {self.replicas}")

    @property
    def split(self) -> bool:
        return self.prefill > 0

    def roles(self) -> list[str | None]:
        """Each instance's kv_role, in order (None: a whole instance)."""
        if not self.split:
            return [None] * self.replicas
        roles: list[str | None] = ["kv_producer"] * self.prefill
        return roles + ["kv_consumer"] * self.decode


@dataclass(frozen=True)
class FleetPlan:
    instances: list[Instance]
    router_args: list[str]
    router_url: str


def router_binary() -> str:
    """The ``vllm-router`` beside this Python, else on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "vllm-router")
    found = beside if os.access(beside, os.X_OK) else shutil.which("vllm-router")
    if found is None:
        raise ValueError("vllm-router is not installed: pip install 'tandem[router]'")
    return found


def plan_fleet(
    config: TandemConfig,
    shape: Shape | int,
    policy: str,
    instance_base_port: int,
    events_base_port: int,
    health_check_interval_s: int = 5,
    side_channel_base_port: int = 14579,
) -> FleetPlan:
    """The instances' flags and the router's, from the flags ``tandem fleet`` was given
    (``--host``/``--port``: the router's; each instance on 127.0.0.1). ``shape``: an int
    is that many whole instances."""
    shape = shape if isinstance(shape, Shape) else Shape(replicas=shape)
    if config.server.ssl_certfile:
        raise ValueError(
            "tandem fleet serves no HTTPS: vllm-router faces the clients there, and its "
            "instances talk plain HTTP on 127.0.0.1; put a TLS proxy in front of the fleet, "
            "or give the --ssl-* flags to tandem serve"
        )
    if policy not in ROUTER_POLICIES:
        raise ValueError(f"--policy must be one of {', '.join(ROUTER_POLICIES)}")
    instances = []
    for i, role in enumerate(shape.roles()):
        port, pub, replay = (
            instance_base_port + i,
            events_base_port + 2 * i,
            events_base_port + 2 * i + 1,
        )
        endpoint, replay_endpoint = f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}"
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": endpoint,
            "replay_endpoint": replay_endpoint,
        }
        server = dataclasses.replace(config.server, host="127.0.0.1", port=port)
        cache = dataclasses.replace(config.cache, kv_events_config=json.dumps(events))
        instance_config = dataclasses.replace(config, server=server, cache=cache)
        if role is not None:
            transfer = {"kv_role": role, "kv_port": side_channel_base_port + i}
            instance_config = instance_config.with_disagg(kv_transfer_config=json.dumps(transfer))
        instances.append(
            Instance(
                f"http://127.0.0.1:{port}",
                instance_config.to_cli_args(),
                endpoint,
                replay_endpoint,
            )
        )
    host, port = config.server.host, config.server.port
    router_args = ["--host", host, "--port", str(port), "--policy", policy]
    if shape.split:
        prefill, decode = instances[: shape.prefill], instances[shape.prefill :]
        router_args += ["--vllm-pd-disaggregation", "--kv-connector", "nixl"]
        for inst in prefill:
            router_args += ["--prefill", inst.url]
        for inst in decode:
            router_args += ["--decode", inst.url]
        if policy == "kv_aware":  # by prefix for the prefill; the decode has nothing cached
            router_args += ["--decode-policy", "power_of_two"]
            for inst in prefill:
                router_args += ["--pd-kv-events", f"{inst.url}={inst.events}"]
    else:
        router_args += ["--worker-urls", *(inst.url for inst in instances)]
    router_args += [
        "--worker-startup-check-interval",
        "1",
        "--health-check-interval-secs",
        str(health_check_interval_s),
        "--prometheus-port",
        str(free_tcp_port()),
    ]
    if config.server.log_level.lower() in _ROUTER_LOG_LEVELS:  # the instances' level
        router_args += ["--log-level", config.server.log_level.lower()]
    if policy == "kv_aware" and not shape.split:  # refused under other policies
        for inst in instances:
            router_args += ["--kv-event-source", f"{inst.url}={inst.events}"]
            router_args += ["--kv-event-replay-source", f"{inst.url}={inst.replay}"]
        router_args += [
            "--kv-event-block-size",
            str(config.cache.block_size),
            "--kv-event-model",
            config.served_model_name,
        ]
    return FleetPlan(instances, router_args, f"http://{host}:{port}")


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as reply:
            return bool(reply.status == 200)
    except (urllib.error.URLError, OSError):
        return False


class _Stop(Exception):
    pass


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    raise _Stop


def run_fleet(fleet: FleetPlan) -> int:
    """Start the instances, then (once each answers /health) the router; serve until a
    signal or the router ends, then stop them all. An instance that dies is reported and
    left to the router's health checks (as a fleet's replica would be)."""
    router = router_binary()
    signal.signal(signal.SIGINT, _raise_stop)
    signal.signal(signal.SIGTERM, _raise_stop)
    children: list[tuple[str, subprocess.Popen[bytes]]] = []
    try:
        for n, instance in enumerate(fleet.instances):
            children.append(
                (f"instance {n}", start_module("common.cli", ["serve", *instance.args]))
            )
        deadline = time.monotonic() + _START_TIMEOUT_S
        waiting = [i.url for i in fleet.instances]
        while waiting:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"instances not healthy within {_START_TIMEOUT_S:.0f} s: {waiting}"
                )
            _check_running(children)
            waiting = [url for url in waiting if not _healthy(url)]
            time.sleep(0.5)
        children.append(
            ("router", subprocess.Popen([router, *fleet.router_args], start_new_session=True))
        )
        print(
            f"tandem fleet: router on {fleet.router_url}, instances "
            + " ".join(inst.url for inst in fleet.instances),
            flush=True,
        )
        reported: set[str] = set()
        while True:  # an instance that ends is routed around; the router ending ends all
            for name, proc in children:
                if proc.poll() is not None and name not in reported:
                    if name == "router":
                        raise RuntimeError(f"the router exited with {proc.returncode}")
                    reported.add(name)
                    print(f"tandem fleet: {name} exited with {proc.returncode}", flush=True)
            time.sleep(0.2)
    except _Stop:
        return 0
    except RuntimeError as e:
        print(f"tandem fleet: {e}", file=sys.stderr)
        return 1
    finally:
        _stop_all(children)


def _check_running(children: list[tuple[str, subprocess.Popen[bytes]]]) -> None:
    for name, proc in children:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}")


def _stop_all(children: list[tuple[str, subprocess.Popen[bytes]]]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    for _, proc in reversed(children):  # the router first: no new requests reach the rest
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + _STOP_TIMEOUT_S
    for _, proc in children:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
