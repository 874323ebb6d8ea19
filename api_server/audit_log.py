"""The audit log (``--audit-log PATH``, ``-`` for stdout): one JSON line per generation
request, written by a thread of its own so that serving never waits on the sink.

What a line holds is an ``AuditEntry``, a snapshot taken on the event loop when the
request ends (``audit_middleware.py`` takes it); the writer thread hashes, formats and
writes it. The queue between them is bounded: when the sink falls behind, a line that
finds it full is dropped and counted (``tandem:audit_lines_dropped_total``), never
waited for. Lines written are counted too (``tandem:audit_lines_written_total``).

The sink is a ``logging`` handler. A file is opened with O_APPEND and every line is one
``write(2)``, so the API-server processes of one service (``--api-server-count``) and a
model router's services may share one file without tearing lines. Rotation is
``WatchedFileHandler``'s: an external rotator (logrotate, ``create`` mode) moves the file
away and each process reopens the path at its next line. ``RotatingFileHandler`` is not
used: each process would rename the shared file on its own count, and lines would be lost
or rotated twice.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import logging.handlers
import os
import queue
import sys
import threading
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

from common.audit_config import STDOUT

logger = logging.getLogger(__name__)

MAX_QUEUED_LINES = 10_000  # about a minute of a busy server's lines; then lines are dropped
CLOSE_TIMEOUT_S = 5.0  # how long a stop waits for queued lines to reach the sink


class Tally(Protocol):
    """A counter (a prometheus-client ``Counter`` child)."""

    def inc(self, amount: float = 1) -> None: ...


@dataclass(frozen=True)
class AuditEntry:
    """One request, as its line reports it. ``prompts`` has one entry per prompt (text,
    or token ids where the client sent ids that were read as no text), ``completions``
    and ``finish_reasons`` one per choice; token counts are summed over them, as the
    response's ``usage`` is."""

    time: float  # arrival, seconds since the epoch
    route: str
    status: int
    outcome: str  # completed, disconnected (the client left first), error
    latency_s: float
    request_id: str | None = None
    trace_id: str | None = None
    tenant: str | None = None
    key_id: str | None = None
    model: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reasons: list[str | None] = field(default_factory=list)
    prompts: list[str | list[int]] = field(default_factory=list)
    completions: list[str] = field(default_factory=list)

    def line(self, raw: bool) -> str:
        """The JSON line (without its newline): texts as SHA-256 hex unless ``raw``."""
        when = datetime.fromtimestamp(self.time, UTC).isoformat(timespec="milliseconds")
        body: dict[str, Any] = {
            "time": when.replace("+00:00", "Z"),
            "request_id": self.request_id,
            "trace_id": self.trace_id,
            "tenant": self.tenant,
            "key_id": self.key_id,
            "route": self.route,
            "model": self.model,
            "status": self.status,
            "outcome": self.outcome,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "latency_ms": round(self.latency_s * 1000, 1),
            "finish_reasons": self.finish_reasons,
        }
        prompts = [p if isinstance(p, str) else json.dumps(p) for p in self.prompts]
        if raw:
            body |= {"prompt": prompts, "completion": self.completions}
        else:  # the key names say which: a digest is never read as text
            body |= {
                "prompt_sha256": [sha256(p) for p in prompts],
                "completion_sha256": [sha256(c) for c in self.completions],
            }
        return json.dumps(body, ensure_ascii=False)


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def write_line(fd: int, line: str) -> None:
    """``line`` and its newline in one ``write(2)``: on an O_APPEND file it lands whole
    after whatever another process wrote. (A short write, which only a full disk or a
    signal causes on a file, is finished by more writes.)"""
    data = memoryview((line + "\n").encode("utf-8", "surrogatepass"))
    while data:
        data = data[os.write(fd, data) :]


class AuditFileHandler(logging.handlers.WatchedFileHandler):
    """Lines appended to a file, each in one write; the path reopened when a rotator has
    moved the file away (``WatchedFileHandler``)."""

    def __init__(self, path: str) -> None:
        super().__init__(path, mode="a", encoding="utf-8")

    def emit(self, record: logging.LogRecord) -> None:
        # No handleError here: a failed write propagates to the writer, which counts it.
        self.reopenIfNeeded()
        if self.stream is None:  # a reopen that failed at the last line
            self.stream = self._open()
            self._statstream()
        write_line(self.stream.fileno(), self.format(record))


class AuditStreamHandler(logging.StreamHandler):
    """Lines to standard output, each in one write (whole lines, from several processes
    sharing the stream, up to the pipe's atomic size of 4 KiB)."""

    def __init__(self) -> None:
        super().__init__(sys.stdout)

    def emit(self, record: logging.LogRecord) -> None:
        self.flush()  # whatever print() left buffered goes first
        write_line(self.stream.fileno(), self.format(record))


def open_sink(path: str) -> logging.Handler:
    """The handler for ``--audit-log``'s value."""
    return AuditStreamHandler() if path == STDOUT else AuditFileHandler(path)


class AuditLog:
    """Takes entries on the event loop (``write``, which never blocks) and writes them
    from its own thread. ``close`` writes what is queued (for up to ``CLOSE_TIMEOUT_S``)
    and closes the sink."""

    def __init__(
        self,
        sink: logging.Handler,
        raw: bool,
        written: Tally,
        dropped: Tally,
        max_queued: int = MAX_QUEUED_LINES,
    ) -> None:
        self.raw = raw
        self._sink = sink
        self._written = written
        self._dropped = dropped
        self._queue: queue.Queue[AuditEntry | None] = queue.Queue(max_queued)  # None: stop
        self._warned = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="audit-log", daemon=True)
        self._thread.start()

    def write(self, entry: AuditEntry) -> None:
        """Queue ``entry``'s line; dropped and counted when the queue is full, or once the
        log is closed (a request ending during shutdown)."""
        if self._closed:
            self._dropped.inc()
            return
        try:
            self._queue.put_nowait(entry)
        except queue.Full:
            self._dropped.inc()

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        self._closed = True
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=timeout_s)
        self._thread.join(timeout_s)
        if self._thread.is_alive():  # a sink stuck for good: the queued lines are lost
            lost = 0
            with contextlib.suppress(queue.Empty):
                while True:
                    lost += self._queue.get_nowait() is not None
            logger.warning("audit log: the sink did not drain; %d queued lines are lost", lost)
            self._dropped.inc(lost)
            self._queue.put_nowait(None)  # the writer ends if the sink ever lets it go
        self._sink.close()

    @property
    def writer_alive(self) -> bool:
        return self._thread.is_alive()

    def join_writer(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while (entry := self._queue.get()) is not None:
            try:
                record = logging.makeLogRecord({"msg": entry.line(self.raw)})
                self._sink.handle(record)
            except Exception as e:  # a full disk, a closed pipe: the line is lost, counted
                self._dropped.inc()
                if not self._warned:
                    self._warned = True
                    logger.warning("audit log: a line could not be written (%s)", e)
            else:
                self._written.inc()


def open_audit_log(path: str | None, raw: bool, written: Tally, dropped: Tally) -> AuditLog | None:
    """The audit log ``--audit-log`` asks for; None without the flag. Opening the file
    here makes a path that cannot be written a startup error, not a silent loss."""
    return None if not path else AuditLog(open_sink(path), raw, written, dropped)
