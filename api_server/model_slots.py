"""The model router's services, one per ``--model``: which are loaded, which requests
hold them, and which is unloaded to make room (``--models-max``, least recently used).

Each service is a whole ``tandem serve`` for one model on a port of 127.0.0.1 (engine
core, its pools and API server), started and stopped here. A request ``acquire``s its
model's service, which loads it if needed and may wait (up to ``--model-load-timeout-s``)
for a slot; it ``release``s it when its response has ended. A service chosen to make room
takes no new request: it is stopped once the requests it holds have ended, so a waiting
model is never starved by a busy one."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import subprocess
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx

from common.config import TandemConfig
from common.ipc import free_tcp_port

logger = logging.getLogger("api_server.model_router")

_POLL_S = 0.25
_STOP_WAIT_S = 60.0  # a drained service stops in seconds; SIGKILL after this


class SlotState(enum.Enum):
    DOWN = "unloaded"
    LOADING = "loading"
    READY = "loaded"
    UNLOADING = "unloading"  # chosen to make room: no new requests, stopped when idle


class ModelUnavailable(Exception):
    """A request's model could not be served in time: 503 with Retry-After."""


# Starts a model's service: (its config, the port to serve on) -> the process.
Starter = Callable[[TandemConfig, int], subprocess.Popen[bytes]]


@dataclass
class ModelService:
    """One model's ``tandem serve`` and the requests that hold it."""

    name: str
    config: TandemConfig
    state: SlotState = SlotState.DOWN
    proc: subprocess.Popen[bytes] | None = None
    port: int = 0  # chosen afresh at each load
    in_flight: int = 0
    last_used: float = 0.0
    loads: int = 0
    unloads: int = 0
    failure: str = ""  # why the last load failed ("" if it did not)
    attempt: int = 0  # counts load attempts, so a waiter knows whether its own failed
    waiting: int = 0  # requests waiting for it to load

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def holds_memory(self) -> bool:
        return self.state is not SlotState.DOWN


# Whether a started service answers yet.
HealthCheck = Callable[["ModelService"], Awaitable[bool]]


async def http_healthy(service: ModelService) -> bool:
    """``GET /health`` is 200: the service's engine is ready."""
    async with httpx.AsyncClient(timeout=2.0, trust_env=False) as client:
        with contextlib.suppress(httpx.HTTPError):
            return (await client.get(f"{service.url}/health")).status_code == 200
    return False


class ModelSlots:
    """The services and the rule of ``--models-max`` (0: every model stays loaded)."""

    def __init__(
        self,
        services: list[ModelService],
        models_max: int,
        load_timeout_s: float,
        start: Starter,
        healthy: HealthCheck | None = None,
    ) -> None:
        self.services = {s.name: s for s in services}
        self.models_max = models_max or len(services)
        self.load_timeout_s = load_timeout_s
        self._start = start
        self._healthy = healthy or http_healthy
        self._changed = asyncio.Condition()
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopping = False

    # --- requests --------------------------------------------------------------------

    async def acquire(self, name: str) -> ModelService:
        """The model's service, loaded and counted as held; raises ``ModelUnavailable``
        when it fails to load or no slot frees within the load timeout."""
        service = self.services[name]
        deadline = time.monotonic() + self.load_timeout_s
        attempt = service.attempt
        async with self._changed:
            service.waiting += 1
            try:
                while True:
                    if service.state is SlotState.READY:
                        service.in_flight += 1
                        service.last_used = time.monotonic()
                        return service
                    failed = service.attempt > attempt and service.failure
                    if failed and service.state is SlotState.DOWN:
                        raise ModelUnavailable(f"model '{name}' failed to load: {service.failure}")
                    if service.state is SlotState.DOWN:
                        self._make_room_for(service)
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise ModelUnavailable(self._late(service))
                    # asyncio.timeout, not wait_for: on 3.11 wait_for may swallow the
                    # cancel of a client gone away just as a notify lands
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(left):
                            await self._changed.wait()
            finally:
                service.waiting -= 1

    def _late(self, service: ModelService) -> str:
        within = f"within {self.load_timeout_s:.0f} s (--model-load-timeout-s)"
        if service.state is SlotState.LOADING:
            return f"model '{service.name}' did not finish loading {within}"
        return (
            f"model '{service.name}' is not loaded and no slot of --models-max "
            f"{self.models_max} freed {within}"
        )

    async def release(self, service: ModelService) -> None:
        async with self._changed:
            service.in_flight -= 1
            service.last_used = time.monotonic()
            self._changed.notify_all()

    # --- loading and unloading -----------------------------------------------------------

    def _make_room_for(self, service: ModelService) -> None:
        """Start loading ``service`` if a slot is free, else pick the least recently used
        loaded service that nobody waits for and unload it (once its requests end)."""
        held = [s for s in self.services.values() if s.holds_memory]
        if len(held) < self.models_max:
            self._begin_load(service)
            return
        if any(s.state is SlotState.UNLOADING for s in held):
            return  # room is being made already
        victims = [s for s in held if s.state is SlotState.READY and s.waiting == 0]
        if victims:
            # idle ones first (a busy one would keep the waiter waiting), then the least
            # recently used
            victim = min(victims, key=lambda s: (s.in_flight > 0, s.last_used))
            victim.state = SlotState.UNLOADING
            logger.info("unloading %s to make room for %s", victim.name, service.name)
            self._spawn(self._unload(victim))

    def _spawn(self, work: object) -> None:
        assert asyncio.iscoroutine(work)  # our own coroutines only
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _begin_load(self, service: ModelService) -> None:
        # LOADING at once, so that no other waiter starts a second load meanwhile
        service.state, service.failure = SlotState.LOADING, ""
        service.loads += 1
        self._spawn(self._load(service))

    async def _load(self, service: ModelService) -> None:
        """Start the service and wait for its ``/health``; DOWN with the reason if it
        exits or is not healthy within the load timeout."""
        started = time.monotonic()
        proc: subprocess.Popen[bytes] | None = None
        try:
            service.port = free_tcp_port()
            logger.info("loading %s on %s", service.name, service.url)
            service.proc = proc = self._start(service.config, service.port)
            failure = await self._wait_healthy(service, proc, started + self.load_timeout_s)
        except Exception as e:  # a start that fails (Popen, the port) fails this load only
            failure = f"{type(e).__name__}: {e}"
        if failure and proc is not None:
            # stopped before the slot is given back, and outside the lock: it may take a while
            await asyncio.to_thread(_stop, proc)
        async with self._changed:
            service.attempt += 1
            if failure:
                service.state, service.failure, service.proc = SlotState.DOWN, failure, None
                logger.error("%s did not load: %s", service.name, failure)
            else:
                service.state = SlotState.READY
                logger.info("%s loaded in %.1f s", service.name, time.monotonic() - started)
            self._changed.notify_all()

    async def _wait_healthy(
        self, service: ModelService, proc: subprocess.Popen[bytes], deadline: float
    ) -> str:
        while time.monotonic() < deadline and not self._stopping:
            if proc.poll() is not None:
                return f"its service exited with code {proc.returncode}"
            if await self._healthy(service):
                return ""
            await asyncio.sleep(_POLL_S)
        return "stopping" if self._stopping else f"not healthy within {self.load_timeout_s:.0f} s"

    async def _unload(self, service: ModelService) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: service.in_flight == 0)
        proc = service.proc
        if proc is not None:
            await asyncio.to_thread(_stop, proc)
        async with self._changed:
            service.state, service.proc = SlotState.DOWN, None
            service.unloads += 1
            logger.info("unloaded %s", service.name)
            self._changed.notify_all()

    async def watch(self) -> None:
        """Marks a loaded service whose process ended on its own as unloaded (the next
        request for it loads it again); runs for the router's life."""
        while True:
            await asyncio.sleep(_POLL_S)
            async with self._changed:
                for s in self.services.values():
                    if (
                        s.state is SlotState.READY
                        and s.proc is not None
                        and s.proc.poll() is not None
                    ):
                        logger.error("%s's service exited with code %s", s.name, s.proc.returncode)
                        s.state, s.proc = SlotState.DOWN, None
                        self._changed.notify_all()

    async def load_first(self) -> None:
        """Load the first ``--models-max`` models (all, by default) at start."""
        async with self._changed:
            for service in list(self.services.values())[: self.models_max]:
                self._begin_load(service)

    def ready(self) -> list[str]:
        return [s.name for s in self.services.values() if s.state is SlotState.READY]

    async def stop(self) -> None:
        """Drain and stop every service (SIGTERM each, then wait)."""
        self._stopping = True
        for task in list(self._tasks):
            task.cancel()
        procs = [s.proc for s in self.services.values() if s.proc is not None]
        await asyncio.gather(*(asyncio.to_thread(_stop, p) for p in procs))
        for s in self.services.values():
            s.state, s.proc = SlotState.DOWN, None


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM (the service drains), SIGKILL if it has not ended in time."""
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(_STOP_WAIT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
