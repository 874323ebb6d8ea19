"""``python -m api_server [tandem serve flags]``: the HTTP server of one process.

SIGTERM (or SIGINT) drains: ``/readyz`` turns 503 at once, new requests get 503 +
Retry-After, in-flight ones may finish for ``--shutdown-timeout`` seconds, then the rest
end with an error and the process exits 0. A second signal, or SIGHUP (its Tandem parent
died), stops at once. It exits with ``EXIT_ENGINE_DIED`` a grace period after losing its
engine, having answered in-flight requests with errors and new ones with 503 meanwhile.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import socket
import time
from types import FrameType

import uvicorn

from api_server.app import ROUTE_PATHS, create_app
from api_server.audit_log import open_audit_log
from api_server.blocklist import content_guard
from api_server.client import EngineClient
from api_server.content_guard import ContentGuard
from api_server.generation import CompletionService
from api_server.http_protocol import with_header_timeout
from api_server.instance_info import InstanceInfo
from api_server.lora_routes import LoRARoutes, admin_keys_from_env
from api_server.oidc import verifier_from
from api_server.rate_limit import RateLimiter
from api_server.request_tracing import trace_requests
from api_server.sampling_defaults import load_sampling_defaults
from api_server.tokenizer_loader import load_tokenizer
from common.audit_config import check_audit_sink
from common.cli_args import parse_config
from common.config import TandemConfig
from common.logs import setup_logging
from common.model_files import resolve_model_dir
from common.process import (
    EXIT_ENGINE_DIED,
    PARENT_DIED,
    die_with_parent,
    exit_without_teardown,
    freeze_startup_heap,
    record_exit_reason,
)
from common.tls_config import check_tls_files
from common.tracing import start_tracing

logger = logging.getLogger("api_server")


def instance_id(config: TandemConfig) -> str:
    """This instance's name for a router: its host, port and engine address."""
    where = f"{socket.gethostname()}:{config.server.port}:{config.addresses.input_address}"
    return hashlib.blake2b(where.encode(), digest_size=8).hexdigest()


DRAIN_POLL_S = 0.05


class _Server(uvicorn.Server):
    """uvicorn, with Tandem's signals: the first SIGTERM/SIGINT drains (``drain``), a
    second one or SIGHUP stops at once. (uvicorn itself would stop listening at once and
    re-raise the signal after its own shutdown; a requested stop is exit code 0 here.)"""

    def __init__(self, config: uvicorn.Config, service: CompletionService, timeout_s: float):
        super().__init__(config)
        self.service = service
        self.timeout_s = timeout_s
        self._drain: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._num_signals = 0

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.add_signal_handler(PARENT_DIED, self._stop_now)
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Called from a signal handler: hand over to the event loop.
        self._num_signals += 1
        if self._loop is None or self._num_signals > 1:
            self._stop_now()
        else:
            self._loop.call_soon_threadsafe(self._start_drain)

    def _stop_now(self) -> None:
        self.force_exit = True
        self.should_exit = True

    def _start_drain(self) -> None:
        if self._drain is None:
            self._drain = asyncio.get_running_loop().create_task(self.drain())

    async def drain(self) -> None:
        """Refuse new work, let in-flight requests finish for ``timeout_s``, end the
        rest with an error, then stop serving."""
        service = self.service
        service.draining = True
        client = service.client
        logger.info(
            "draining: %d request(s) in flight, up to %.0f s", client.num_in_flight, self.timeout_s
        )
        deadline = time.monotonic() + self.timeout_s
        while client.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        if client.num_in_flight:
            logger.warning(
                "shutdown timeout: ending %d request(s) with an error", client.num_in_flight
            )
            client.fail_in_flight("the server shut down before this request finished")
            while client.num_in_flight and not self.force_exit:  # their error events go out
                await asyncio.sleep(DRAIN_POLL_S)
        logger.info("drained; stopping")
        self.should_exit = True


def listen_socket(host: str, port: int) -> socket.socket:
    """The HTTP port, shared (SO_REUSEPORT) by every API-server process of the service:
    the kernel spreads connections over them (``--api-server-count``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


async def serve(config: TandemConfig, guard: ContentGuard) -> int:
    model_dir = resolve_model_dir(config.model.model)
    tokenizer = load_tokenizer(model_dir)
    defaults = load_sampling_defaults(model_dir, config.model.generation_config)
    logger.info("sampling defaults for fields a request omits: %s", defaults.describe())
    exit_code = 0
    server: _Server | None = None

    def on_engine_dead(reason: str) -> None:
        nonlocal exit_code
        exit_code = EXIT_ENGINE_DIED

        def stop() -> None:
            if server is not None:
                server.should_exit = True

        asyncio.get_running_loop().call_later(config.server.grace_period_s, stop)

    client = EngineClient(config.addresses, on_dead=on_engine_dead)
    await client.start()
    chat_template = None
    if config.model.chat_template:
        with open(config.model.chat_template) as f:
            chat_template = f.read()
    limiter = RateLimiter(config.server.rate_limit_rpm, config.server.rate_limit_tpm)
    service = CompletionService(
        config.served_model_name,
        tokenizer,
        client,
        limiter,
        config.server.log_requests,
        sampling_defaults=defaults,
        guard=guard,
    )
    audit = open_audit_log(
        config.server.audit_log,
        config.server.audit_log_raw,
        service.metrics.audit_written,
        service.metrics.audit_dropped,
    )
    app = create_app(
        service,
        chat_template,
        config.server.api_keys,
        config.server.max_body_bytes,
        config.server.max_n,
        config.server.strict_request_fields,
        config.server.request_read_timeout_s,
        config.server.allowed_origins,
        config.server.api_server_count,
        InstanceInfo(
            config.served_model_name,
            config.cache.block_size,
            config.cache.kv_events,
            config.disagg.kv_mode.num_kv_managers,
            instance_id(config),
        ),
        config.model.tool_call_parser,
        config.model.reasoning_parser,
        LoRARoutes(service, config.model.max_lora_rank, config.model.allow_runtime_lora_updating)
        if config.model.enable_lora
        else None,
        admin_keys_from_env(),
        verifier_from(config.server),
        audit=audit,
    )
    tracing = start_tracing(config.server.otlp_traces_endpoint, "tandem-api-server")
    server = _Server(
        uvicorn.Config(
            trace_requests(app, tracing, ROUTE_PATHS),
            host=config.server.host,
            port=config.server.port,
            log_level=config.server.log_level,
            access_log=config.server.log_level == "debug",
            timeout_graceful_shutdown=3,
            # The app has no startup/shutdown hooks; uvicorn's lifespan task only left a
            # CancelledError traceback in the log at every stop.
            lifespan="off",
            http=with_header_timeout(config.server.request_read_timeout_s),
            **config.server.uvicorn_tls(),  # HTTPS with --ssl-certfile (common/tls_config.py)
        ),
        service,
        config.server.shutdown_timeout_s,
    )
    freeze_startup_heap()
    try:
        await server.serve(sockets=[listen_socket(config.server.host, config.server.port)])
    except OSError as e:
        logger.error("cannot listen on %s:%d: %s", config.server.host, config.server.port, e)
    finally:
        await client.close()
        tracing.shutdown()  # the spans of the requests just ended reach the collector
        if audit is not None:  # the lines of the requests just ended reach the sink
            audit.close()
    if not server.started:
        record_exit_reason(
            f"the API server could not listen on {config.server.host}:{config.server.port} "
            "(is the port in use?)"
        )
        return 1
    return exit_code


def main(argv: list[str] | None = None) -> int:
    config = parse_config(argv, prog="python -m api_server")
    setup_logging(config.server.log_level, "api_server")
    if not (config.addresses.input_address and config.addresses.output_address):
        logger.error("--input-address and --output-address are required")
        return 2
    try:  # a bad certificate or blocklist is one line here, not a traceback later
        check_tls_files(*config.server.tls_flags)
        check_audit_sink(config.server.audit_log)
        guard = content_guard(config.server.guard_blocklist)
    except ValueError as e:
        logger.error("%s", e)
        record_exit_reason(str(e))
        return 2
    die_with_parent()
    return asyncio.run(serve(config, guard))


if __name__ == "__main__":
    exit_without_teardown(main())
