"""``python -m api_server [tandem serve flags]``: the HTTP server of one process.

It exits with ``EXIT_ENGINE_DIED`` a grace period after losing its engine, having
answered in-flight requests with errors and new ones with 503 meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from types import FrameType

import uvicorn

from api_server.app import create_app
from api_server.client import EngineClient
from api_server.generation import CompletionService
from api_server.rate_limit import RateLimiter
from api_server.sampling_defaults import load_sampling_defaults
from common.cli_args import parse_config
from common.config import TandemConfig
from common.logs import setup_logging
from common.model_files import resolve_model_dir
from common.process import EXIT_ENGINE_DIED, die_with_parent

logger = logging.getLogger("api_server")


class _Server(uvicorn.Server):
    """uvicorn re-raises SIGTERM/SIGINT after its graceful shutdown, so the process would
    die by the signal; a requested stop is a clean exit here (code 0)."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C
        self.should_exit = True


async def serve(config: TandemConfig) -> int:
    from transformers import AutoTokenizer

    model_dir = resolve_model_dir(config.model.model)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
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
    )
    app = create_app(
        service,
        chat_template,
        config.server.api_keys,
        config.server.max_body_bytes,
        config.server.max_n,
        config.server.strict_request_fields,
    )
    server = _Server(
        uvicorn.Config(
            app,
            host=config.server.host,
            port=config.server.port,
            log_level=config.server.log_level,
            access_log=config.server.log_level == "debug",
            timeout_graceful_shutdown=3,
        )
    )
    try:
        await server.serve()
    finally:
        await client.close()
    if not server.started:
        return 1
    return exit_code


def main(argv: list[str] | None = None) -> int:
    config = parse_config(argv, prog="python -m api_server")
    setup_logging(config.server.log_level, "api_server")
    if not (config.addresses.input_address and config.addresses.output_address):
        logger.error("--input-address and --output-address are required")
        return 2
    die_with_parent()
    return asyncio.run(serve(config))


if __name__ == "__main__":
    sys.exit(main())
