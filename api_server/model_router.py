"""``python -m api_server.model_router``: several base models behind one port, as
llama.cpp's router mode serves them (``tandem serve --model A --model B``).

Each model is served by its own ``tandem serve`` on 127.0.0.1 (``model_slots.py`` starts,
stops and counts them); this process routes every request by its ``model`` and passes
the answer through untouched, streams included. ``/v1/models`` lists every model with
its ``status`` (loaded, loading, unloaded), ``/readyz`` is ready while at least one model
is, ``/metrics`` merges the services' series (each labelled ``model_name``) and adds the
router's own. API keys, sign-in tokens (OIDC) and body limits are checked here before a
model is loaded (so an unauthenticated request never swaps one), and again by the
service, which needs the token's tenant anyway (its cache salt, its cancellation rights).

SIGTERM drains: ``/readyz`` 503, new requests 503, requests in flight may finish for
``--shutdown-timeout``, then the services drain and stop. A second signal, or SIGHUP (the
launcher died), stops at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from types import FrameType
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from api_server.app_parts import STATIC_DIR, chat_page, cors, exception_handlers
from api_server.audit_log import AuditLog, open_audit_log
from api_server.audit_middleware import audited
from api_server.blocklist import content_guard
from api_server.guard import Guard
from api_server.http_util import cancel_on_disconnect
from api_server.lora_routes import admin_keys_from_env
from api_server.metrics import audit_counters
from api_server.model_routes import FLAVOURS, ROUTED_POSTS, ModelRouter
from api_server.model_slots import ModelService, ModelSlots
from api_server.oidc import verifier_from
from common.audit_config import check_audit_sink
from common.cli_args import parse_config
from common.config import TandemConfig
from common.env_flags import env_name
from common.logs import setup_logging
from common.model_set_config import model_name_of
from common.process import PARENT_DIED, die_with_parent, exit_without_teardown, start_module
from common.tls_config import NO_TLS, check_tls_files

logger = logging.getLogger("api_server.model_router")


def service_config(config: TandemConfig, port: int, index: int) -> TandemConfig:
    """A model's own ``tandem serve``: on 127.0.0.1:port, plain HTTP (the router's own
    port is the one facing clients and serves the TLS flags; it reaches its services on
    loopback), its shared-memory segments named apart from the other services'."""
    server = dataclasses.replace(config.server, host="127.0.0.1", port=port, **NO_TLS)
    disagg = config.disagg
    if disagg.service_id:  # each service names its own shared-memory segments
        disagg = dataclasses.replace(disagg, service_id=f"{disagg.service_id}-{index}")
    return dataclasses.replace(config, server=server, disagg=disagg)


def _starter(index_of: dict[str, int]) -> Any:
    """Starts a model's ``tandem serve`` on 127.0.0.1:port, dying with this process; API
    keys reach it through the environment, as they reach every Tandem process."""

    def start(config: TandemConfig, port: int) -> Any:
        child = service_config(config, port, index_of[config.model.model])
        return start_module("common.cli", ["serve", *child.to_cli_args()], env=service_env())

    return start


def service_env() -> dict[str, str]:
    """This environment without the TLS flags' variables: a flag left off a command line
    is read from ``TANDEM_SSL_*``, which would turn a service's HTTPS back on."""
    tls = {env_name("--" + name.replace("_", "-")) for name in NO_TLS}
    return {k: v for k, v in os.environ.items() if k not in tls}


def router_app(
    router: ModelRouter,
    config: TandemConfig,
    admin_keys: tuple[str, ...],
    audit: AuditLog | None = None,
) -> Starlette:
    """The router's HTTP app: its routes behind the same guard (keys, body limits), CORS
    and error bodies as a single model's API server (``api_server/app.py``); rate limits
    are the services' own, per model. Its ``audit`` log has the lines of the generation
    requests it answers itself (refusals before any model sees them); a service writes
    the line of each request passed to it."""
    server = config.server

    async def livez(request: Request) -> Response:
        return JSONResponse({"status": "alive"})

    return Starlette(
        routes=[
            *(Route(p, cancel_on_disconnect(router.route), methods=["POST"]) for p in ROUTED_POSTS),
            Route("/v1/models", router.models, methods=["GET"]),
            Route("/health", router.health, methods=["GET"]),
            Route("/livez", livez, methods=["GET"]),
            Route("/readyz", router.readyz, methods=["GET"]),
            Route("/metrics", router.metrics, methods=["GET"]),
            Route("/stats", router.stats, methods=["GET"]),
            Route("/v1/requests/{request_id}/cancel", router.fan_out, methods=["POST"]),
            Route("/v1/responses/{response_id}", router.fan_out, methods=["GET", "DELETE"]),
            Route("/", chat_page, methods=["GET"]),
            Mount("/static", StaticFiles(directory=STATIC_DIR), name="static"),
        ],
        exception_handlers=exception_handlers(
            FLAVOURS, server.max_body_bytes, server.request_read_timeout_s
        ),
        middleware=[
            *cors(server.allowed_origins),
            *audited(audit),
            Middleware(
                Guard,
                api_keys=server.api_keys,
                max_body_bytes=server.max_body_bytes,
                error_formats=FLAVOURS,
                read_timeout_s=server.request_read_timeout_s,
                admin_keys=admin_keys,
                verifier=verifier_from(server),
            ),
        ],
    )


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
    audit = open_audit_log(
        config.server.audit_log,
        config.server.audit_log_raw,
        *audit_counters(router.registry, "model_router"),
    )
    server = _RouterServer(
        uvicorn.Config(
            router_app(router, config, admin_keys_from_env(), audit),
            host=config.server.host,
            port=config.server.port,
            log_level=config.server.log_level,
            access_log=config.server.log_level == "debug",
            timeout_graceful_shutdown=3,
            lifespan="off",
            **config.server.uvicorn_tls(),  # the router faces clients; its services do not
        ),
        router,
        config.server.shutdown_timeout_s,
    )
    asyncio.get_running_loop().add_signal_handler(PARENT_DIED, server.stop_now)
    await slots.load_first()
    watch = asyncio.get_running_loop().create_task(slots.watch())
    where = f"{config.server.scheme}://{config.server.host}:{config.server.port}"
    logger.info("routing %s on %s", ", ".join(names), where)
    try:
        await server.serve()
    finally:
        watch.cancel()
        await slots.stop()
        await router.client.aclose()
        if audit is not None:
            audit.close()
    return 0 if server.started else 1


def main(argv: list[str] | None = None) -> int:
    config = parse_config(argv, prog="python -m api_server.model_router")
    setup_logging(config.server.log_level, "model_router")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per passed request, else
    try:  # a bad certificate or blocklist is one line here, not a failed load later
        check_tls_files(*config.server.tls_flags)
        check_audit_sink(config.server.audit_log)
        content_guard(config.server.guard_blocklist)  # each model's API servers apply it
    except ValueError as e:
        logger.error("%s", e)
        return 2
    die_with_parent()
    return asyncio.run(serve(config))


if __name__ == "__main__":
    exit_without_teardown(main())
