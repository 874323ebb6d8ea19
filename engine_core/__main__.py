"""``python -m engine_core [tandem serve flags]``: run the engine core and its workers."""

from __future__ import annotations

import logging
import shutil
import signal
import sys
from types import FrameType

from common.cli_args import parse_config
from common.ipc import make_runtime_dir
from common.logs import setup_logging
from common.process import EXIT_WORKER_DIED, die_with_parent
from engine_core.core import EngineCore, WorkerDied


class _ShutdownRequested(Exception):
    pass


def _raise_shutdown(signum: int, frame: FrameType | None) -> None:
    raise _ShutdownRequested(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    config = parse_config(argv, prog="python -m engine_core")
    setup_logging(config.server.log_level, "engine_core")
    logger = logging.getLogger("engine_core")
    if not (config.addresses.input_address and config.addresses.output_address):
        logger.error("--input-address and --output-address are required")
        return 2
    die_with_parent()
    signal.signal(signal.SIGTERM, _raise_shutdown)
    signal.signal(signal.SIGINT, _raise_shutdown)
    runtime_dir = make_runtime_dir()
    engine: EngineCore | None = None
    code = 0
    try:
        engine = EngineCore(config, runtime_dir)
        engine.run()
    except _ShutdownRequested as e:
        logger.info("stopping (%s)", e)
    except WorkerDied as e:
        logger.error("%s; failing in-flight requests and exiting", e)
        if engine is not None:
            engine.fail(str(e))
        code = EXIT_WORKER_DIED
    except Exception as e:
        logger.exception("engine core failed")
        if engine is not None:
            engine.fail(f"engine core failed: {type(e).__name__}: {e}")
        code = 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if engine is not None:
            engine.shutdown()
        shutil.rmtree(runtime_dir, ignore_errors=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
