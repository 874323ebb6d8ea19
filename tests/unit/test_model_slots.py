"""The model router's slots (``api_server/model_slots.py``) with fake services: what
loads, what is unloaded to make room and when, and how a request that cannot be served
in time is told so. The real processes and routing: tests/integration/test_model_router.py."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from api_server.model_slots import ModelService, ModelSlots, ModelUnavailable, SlotState
from common.config import TandemConfig


class FakeProc:
    """A service process: alive until terminated, or ending with ``exit_code`` at once."""

    def __init__(self, exit_code: int | None = None) -> None:
        self.returncode = exit_code
        self.terminated = False

    def poll(self) -> int | None:
        return self.returncode

    def terminate(self) -> None:
        self.terminated, self.returncode = True, -15

    def kill(self) -> None:
        self.returncode = -9

    def wait(self, timeout: float | None = None) -> int:
        assert self.returncode is not None
        return self.returncode


class Fleet:
    """Starts fake services; ``exits``/``never_healthy`` name models whose start fails."""

    def __init__(
        self,
        exits: tuple[str, ...] = (),
        never_healthy: tuple[str, ...] = (),
        unstartable: tuple[str, ...] = (),
    ):
        self.started: list[str] = []
        self.procs: dict[str, FakeProc] = {}
        self.exits, self.never_healthy, self.unstartable = exits, never_healthy, unstartable

    def start(self, config: TandemConfig, port: int) -> Any:
        name = config.model.model
        if name in self.unstartable:
            raise OSError(f"cannot start {name}")
        self.started.append(name)
        self.procs[name] = FakeProc(3 if name in self.exits else None)
        return self.procs[name]

    async def healthy(self, service: ModelService) -> bool:
        return service.name not in self.never_healthy

    def slots(self, names: str, models_max: int, timeout_s: float = 5.0) -> ModelSlots:
        services = [ModelService(n, TandemConfig().for_model(n)) for n in names.split()]
        return ModelSlots(services, models_max, timeout_s, self.start, self.healthy)


def states(slots: ModelSlots) -> dict[str, str]:
    return {n: s.state.value for n, s in slots.services.items()}


async def settle() -> None:
    for _ in range(20):  # the load and unload tasks run their course
        await asyncio.sleep(0)
    await asyncio.sleep(0.05)


def test_the_first_models_max_load_at_start_and_a_loaded_model_is_held_at_once() -> None:
    async def run() -> None:
        fleet = Fleet()
        slots = fleet.slots("a b c", models_max=2)
        await slots.load_first()
        await settle()
        assert states(slots) == {"a": "loaded", "b": "loaded", "c": "unloaded"}
        a = await slots.acquire("a")
        assert (a.name, a.in_flight) == ("a", 1)
        await slots.release(a)
        assert a.in_flight == 0 and fleet.started == ["a", "b"]

    asyncio.run(run())


def test_the_least_recently_used_idle_model_makes_room() -> None:
    async def run() -> None:
        fleet = Fleet()
        slots = fleet.slots("a b c", models_max=2)
        await slots.load_first()
        await settle()
        for name in ("b", "a"):  # b used before a: b is the least recently used
            await slots.release(await slots.acquire(name))
        c = await slots.acquire("c")
        assert states(slots) == {"a": "loaded", "b": "unloaded", "c": "loaded"}
        assert fleet.procs["b"].terminated and not fleet.procs["a"].terminated
        assert [(s.loads, s.unloads) for s in slots.services.values()] == [(1, 0), (1, 1), (1, 0)]
        await slots.release(c)

    asyncio.run(run())


def test_a_busy_model_is_unloaded_once_its_requests_end_and_takes_no_new_ones_meanwhile() -> None:
    async def run() -> None:
        fleet = Fleet()
        slots = fleet.slots("a b", models_max=1)
        await slots.load_first()
        await settle()
        held = await slots.acquire("a")
        wants_b = asyncio.ensure_future(slots.acquire("b"))
        await settle()
        assert not wants_b.done() and states(slots) == {"a": "unloading", "b": "unloaded"}
        wants_a = asyncio.ensure_future(slots.acquire("a"))  # waits: a is on its way out
        await settle()
        assert not wants_a.done() and not fleet.procs["a"].terminated
        await slots.release(held)
        b = await asyncio.wait_for(wants_b, 5)
        assert b.name == "b" and fleet.procs["a"].terminated
        await settle()
        assert not wants_a.done()  # a comes back once b's request ends
        await slots.release(b)
        a = await asyncio.wait_for(wants_a, 5)
        assert fleet.started == ["a", "b", "a"] and a.loads == 2
        await slots.release(a)

    asyncio.run(run())


def test_a_service_that_exits_while_loading_fails_its_waiters_with_the_reason() -> None:
    async def run() -> None:
        fleet = Fleet(exits=("b",))
        slots = fleet.slots("a b", models_max=0)
        with pytest.raises(ModelUnavailable, match="exited with code 3"):
            await slots.acquire("b")
        assert slots.services["b"].state is SlotState.DOWN
        a = await slots.acquire("a")  # the other model is not held back
        await slots.release(a)

    asyncio.run(run())


def test_a_model_not_healthy_in_time_is_a_503_reason_and_its_process_is_stopped() -> None:
    async def run() -> None:
        fleet = Fleet(never_healthy=("a",))
        slots = fleet.slots("a", models_max=1, timeout_s=1.0)
        with pytest.raises(
            ModelUnavailable, match=r"(did not finish loading|not healthy) within 1 s"
        ):
            await slots.acquire("a")
        await settle()
        assert fleet.procs["a"].terminated

    asyncio.run(run())


def test_a_loaded_service_that_dies_is_loaded_again_by_the_next_request() -> None:
    async def run() -> None:
        fleet = Fleet()
        slots = fleet.slots("a", models_max=1)
        await slots.load_first()
        await settle()
        watch = asyncio.ensure_future(slots.watch())
        fleet.procs["a"].returncode = -9
        await asyncio.sleep(0.6)
        assert states(slots) == {"a": "unloaded"}
        a = await slots.acquire("a")
        assert a.loads == 2 and fleet.started == ["a", "a"]
        watch.cancel()
        await slots.release(a)
        await slots.stop()
        assert fleet.procs["a"].terminated

    asyncio.run(run())


def test_an_idle_model_makes_room_before_a_busy_one_used_longer_ago() -> None:
    async def run() -> None:
        fleet = Fleet()
        slots = fleet.slots("a b c", models_max=2)
        await slots.load_first()
        await settle()
        busy = await slots.acquire("a")  # a long stream on a, begun first
        await slots.release(await slots.acquire("b"))
        c = await asyncio.wait_for(slots.acquire("c"), 5)
        assert states(slots) == {"a": "loaded", "b": "unloaded", "c": "loaded"}
        await slots.release(c)
        await slots.release(busy)

    asyncio.run(run())


def test_a_start_that_raises_fails_that_load_and_frees_its_slot() -> None:
    async def run() -> None:
        fleet = Fleet(unstartable=("b",))
        slots = fleet.slots("a b", models_max=1)
        with pytest.raises(ModelUnavailable, match="OSError: cannot start b"):
            await slots.acquire("b")
        assert states(slots) == {"a": "unloaded", "b": "unloaded"}
        a = await asyncio.wait_for(slots.acquire("a"), 5)  # the slot is free again
        await slots.release(a)

    asyncio.run(run())
