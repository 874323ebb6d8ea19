"""``python -m api_server.model_router``: several base models behind one port, as
llama.cpp's router mode serves them (``tandem serve --model A --model B``).

Each model is served by its own ``tandem serve`` on 127.0.0.1 (``model_slots.py`` starts,
stops and counts them); this process routes every request by its ``model`` and passes
the answer through untouched, streams included. ``/v1/models`` lists every model with
its ``status`` (loaded, loading, unloaded), ``/readyz`` is ready while at least one model
is, ``/metrics`` merges the services' series (each labelled ``model_name``) and adds the
router's own. API keys and body limits are checked here before a model is loaded (so an
unauthenticated request never swaps one), and again by the service.

SIGTERM drains: ``/readyz`` 503, new requests 503, requests in flight may finish for
``--shutdown-timeout``, then the services drain and stop. A second signal, or SIGHUP (the
launcher died), stops at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from types import FrameType
from typing import Any

import uvicorn

from api_server.lora_routes import admin_keys_from_env
from api_server.model_routes import ModelRouter
from api_server.model_slots import ModelService, ModelSlots
from common.cli_args import parse_config
from common.config import TandemConfig
from common.logs import setup_logging
from common.model_set_config import model_name_of
from common.process import PARENT_DIED, die_with_parent, exit_without_teardown, start_module

logger = logging.getLogger("api_server.model_router")


def _starter(index_of: dict[str, int]) -> Any:
    """Starts a model's ``tandem serve`` on 127.0.0.1:port, dying with this process; API
    keys reach it through the environment, as they reach every Tandem process."""

    def start(config: TandemConfig, port: int) -> Any:
        server = dataclasses.replace(config.server, host="127.0.0.1", port=port)
        disagg = config.disagg
        if disagg.service_id:  # each service names its own shared-memory segments
            index = index_of[config.model.model]
            disagg = dataclasses.replace(disagg, service_id=f"{disagg.service_id}-{index}")
        child = dataclasses.replace(config, server=server, disagg=disagg)
        return start_module("common.cli", ["serve", *child.to_cli_args()])

    return start


class _RouterServer(uvicorn.Server):
    """uvicorn with Tandem's signals: the first SIGTERM/SIGINT drains, a second one (or
    SIGHUP) stops at once."""

    def __init__(self, config: uvicorn.Config, router: ModelRouter, timeout_s: float) -> None:
        super().__init__(config)
        self.router, self.timeout_s = router, timeout_s
        self._signals = 0
        self._drain: asyncio.Task[None] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._signals += 1
        if self._signals > 1:
            self.stop_now()
        else:
            asyncio.get_running_loop().call_soon_threadsafe(self._start_drain)

    def stop_now(self) -> None:
        self.force_exit = self.should_exit = True

    def _start_drain(self) -> None:
        self._drain = self._drain or asyncio.get_running_loop().create_task(self.drain())

    async def drain(self) -> None:
        router = self.router
        router.draining = True
        logger.info(
            "draining: %d request(s) in flight, up to %.0f s", router.in_flight, self.timeout_s
        )
        deadline = time.monotonic() + self.timeout_s
        while router.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.should_exit = True


async def serve(config: TandemConfig) -> int:
    names = [model_name_of(m) for m in config.model_names]
    services = [
        ModelService(n, config.for_model(m)) for n, m in zip(names, config.model_names, strict=True)
    ]
    index_of = {m: i for i, m in enumerate(config.model_names)}
    set_config = config.model_set
    slots = ModelSlots(
        services, set_config.models_max, set_config.model_load_timeout_s, _starter(index_of)
    )
    router = ModelRouter(slots)
    server = _RouterServer(
        uvicorn.Config(
            router.app(config, admin_keys_from_env()),
            host=config.server.host,
            port=config.server.port,
            log_level=config.server.log_level,
            access_log=config.server.log_level == "debug",
            timeout_graceful_shutdown=3,
            lifespan="off",
        ),
        router,
        config.server.shutdown_timeout_s,
    )
    asyncio.get_running_loop().add_signal_handler(PARENT_DIED, server.stop_now)
    await slots.load_first()
    watch = asyncio.get_running_loop().create_task(slots.watch())
    logger.info(
        "routing %s on http://%s:%d", ", ".join(names), config.server.host, config.server.port
    )
    try:
        await server.serve()
    finally:
        watch.cancel()
        await slots.stop()
        await router.client.aclose()
    return 0 if server.started else 1


def main(argv: list[str] | None = None) -> int:
    config = parse_config(argv, prog="python -m api_server.model_router")
    setup_logging(config.server.log_level, "model_router")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per passed request, else
    die_with_parent()
    return asyncio.run(serve(config))


if __name__ == "__main__":
    exit_without_teardown(main())
