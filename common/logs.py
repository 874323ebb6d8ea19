"""Logging for every process: one line per event, naming the process; request log
lines carry the request id in their message."""

from __future__ import annotations

import logging
import sys


def setup_logging(level: str, process_name: str) -> None:
    fmt = f"%(asctime)s {process_name} %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=level.upper(), format=fmt, stream=sys.stderr, force=True)
