"""The audit log: ``--audit-log PATH`` (``-`` for stdout), one JSON line per request, with
the prompt and completion as SHA-256 digests unless ``--audit-log-raw``.

Only the flags live here; the API servers write the lines (``api_server/audit_log.py``).
"""

from __future__ import annotations

import argparse

from common.config_checks import require

STDOUT = "-"


def check_audit_flags(path: str | None, raw: bool) -> None:
    """How the flags go together, refused where the config is built."""
    require(not raw or bool(path), "--audit-log-raw writes raw text to --audit-log: give it")


def add_audit_args(parser: argparse.ArgumentParser) -> None:
    """The audit flags of ``tandem serve`` (``common/cli_args.py`` adds them)."""
    g = parser.add_argument_group("audit log")
    g.add_argument(
        "--audit-log",
        default=None,
        metavar="PATH",
        help="write one JSON line per request to PATH (rotated; '-' for stdout): time, "
        "request and trace ids, tenant, route, model, status, token counts, latency, "
        "finish reason, and the prompt and completion as SHA-256",
    )
    g.add_argument(
        "--audit-log-raw",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="put the prompt and completion text in the audit log instead of their SHA-256",
    )


def check_audit_sink(path: str | None) -> None:
    """A ``--audit-log`` file that cannot be appended to, as one line before anything
    starts (``ValueError``) rather than a traceback from the API server later."""
    if not path or path == STDOUT:
        return
    try:
        with open(path, "a"):
            pass
    except OSError as e:
        raise ValueError(
            f"--audit-log {path} cannot be opened for appending: {e.strerror}"
        ) from None
