"""``python -m engine_core [tandem serve flags]``: run the engine core and its workers.

SIGTERM (or SIGINT) drains: new requests are refused, running ones may finish for
``--shutdown-timeout`` seconds, the rest end with an error, and the process exits 0. A
second signal, or SIGHUP (its Tandem parent died), stops at once.
"""

from __future__ import annotations

import logging
import shutil
import signal
import sys
from types import FrameType

from common.cli_args import parse_config
from common.ipc import make_runtime_dir
from common.logs import setup_logging
from common.process import EXIT_WORKER_DIED, PARENT_DIED, die_with_parent, record_exit_reason
from engine_core.proc import EngineCoreProc, WorkerDied


class _ShutdownRequested(Exception):
    pass


def _raise_shutdown(signum: int, frame: FrameType | None) -> None:
    raise _ShutdownRequested(signal.Signals(signum).name)


class _Signals:
    """First SIGTERM/SIGINT: drain the engine (or stop, if it is not serving yet);
    another one: stop at once."""

    def __init__(self) -> None:
        self.engine: EngineCoreProc | None = None
        self.timeout_s = 0.0

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        engine = self.engine
        if engine is None or not engine.ready or engine.draining:
            raise _ShutdownRequested(signal.Signals(signum).name)
        logging.getLogger("engine_core").info(
            "%s: draining for up to %.0f s", signal.Signals(signum).name, self.timeout_s
        )
        engine.begin_drain(self.timeout_s)


def main(argv: list[str] | None = None) -> int:
    config = parse_config(argv, prog="python -m engine_core")
    setup_logging(config.server.log_level, "engine_core")
    logger = logging.getLogger("engine_core")
    if not (config.addresses.input_address and config.addresses.output_address):
        logger.error("--input-address and --output-address are required")
        return 2
    die_with_parent()
    signals = _Signals()
    signals.timeout_s = config.server.shutdown_timeout_s
    signal.signal(signal.SIGTERM, signals)
    signal.signal(signal.SIGINT, signals)
    signal.signal(PARENT_DIED, _raise_shutdown)
    runtime_dir = make_runtime_dir()
    engine: EngineCoreProc | None = None
    code = 0
    try:
        engine = EngineCoreProc(config, runtime_dir)
        signals.engine = engine
        engine.run()
    except _ShutdownRequested as e:
        logger.info("stopping (%s)", e)
        if engine is not None:
            engine.fail(f"the engine core was stopped ({e})")
    except WorkerDied as e:
        logger.error("%s; failing in-flight requests and exiting", e)
        record_exit_reason(str(e))
        if engine is not None:
            engine.fail(str(e))
        code = EXIT_WORKER_DIED
    except Exception as e:
        logger.exception("engine core failed")
        record_exit_reason(f"engine core failed: {type(e).__name__}: {e}")
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
