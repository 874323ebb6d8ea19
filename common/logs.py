"""Logging for every process: one line per event, naming the process; request log
lines carry the request id in their message. SIGUSR1 writes every thread's Python stack
to the same stream: how an operator (``kill -USR1 PID``), or a test whose stack will not
stop, sees where a stuck process waits."""

from __future__ import annotations

import faulthandler
import logging
import signal
import sys


def setup_logging(level: str, process_name: str) -> None:
    fmt = f"%(asctime)s {process_name} %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=level.upper(), format=fmt, stream=sys.stderr, force=True)
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
