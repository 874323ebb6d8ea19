"""Peak resident memory of a process tree, sampled in a background thread."""

from __future__ import annotations

import contextlib
import threading
from types import TracebackType

import psutil


def process_tree(pid: int, recursive: bool = True) -> list[psutil.Process]:
    """``pid`` and (``recursive``) all its descendants now; empty once it is gone."""
    try:
        root = psutil.Process(pid)
        return [root, *(root.children(recursive=True) if recursive else [])]
    except psutil.NoSuchProcess:
        return []


def tree_rss_bytes(pid: int, recursive: bool = True) -> int:
    """RSS of ``pid`` and (``recursive``) all its descendants now (0 once it is gone)."""
    total = 0
    for p in process_tree(pid, recursive):
        with contextlib.suppress(psutil.NoSuchProcess):
            total += p.memory_info().rss
    return total


class PeakRss:
    """``with PeakRss(pid) as peak: ...`` then ``peak.bytes``: the highest tree RSS seen."""

    def __init__(self, pid: int, interval_s: float = 0.2, recursive: bool = True) -> None:
        self.pid = pid
        self.recursive = recursive
        self.interval_s = interval_s
        self.bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while True:
            self.bytes = max(self.bytes, tree_rss_bytes(self.pid, self.recursive))
            if self._stop.wait(self.interval_s):
                return

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join()
        self.bytes = max(self.bytes, tree_rss_bytes(self.pid, self.recursive))
