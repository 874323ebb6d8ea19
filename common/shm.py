"""The shared-memory segments of split pools (``--kv-transfer shm``): names, ownership,
cleanup.

A service's segments are named ``tandem-<service id>-<what>`` (``/dev/shm``, mode 0600:
never world-writable). The engine core owns them: it writes the service id into its
private runtime directory and holds an exclusive lock on that file for as long as it
runs, and unlinks the segments when it stops. After a crash (SIGKILL) the lock is gone
with the process, so the next engine to start finds the stale segments by that file —
a segment whose service id no locked file claims is unlinked, whatever pids were reused.

Every process that maps a segment also holds a shared lock on it (``flock`` works on
``/dev/shm``) for as long as it has it mapped, so a segment in use is never taken for
stale: not when the engine that owns it keeps its runtime directory somewhere else (another
``XDG_RUNTIME_DIR``), and not while a crashed engine's workers still run. Another user's
segments are not ours to probe or remove (0600), and are left alone.

Python 3.11's ``SharedMemory`` registers even a segment it merely attached with the
resource tracker, which would unlink it when that process exits; workers unregister
(``attach_segment``), since the engine alone decides when a segment goes.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import shutil
import tempfile
import time
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path

logger = logging.getLogger(__name__)

PREFIX = "tandem-"
SERVICE_FILE = "service-id"
SHM_DIR = Path("/dev/shm")


def new_service_id() -> str:
    return secrets.token_hex(6)


def segment_name(service_id: str, what: str) -> str:
    return f"{PREFIX}{service_id}-{what}"


def runtime_base() -> str:
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return base if os.access(base, os.W_OK) else tempfile.gettempdir()


class ServiceLock:
    """The engine's claim on its service id: a locked file in its runtime directory."""

    def __init__(self, runtime_dir: str, service_id: str) -> None:
        self.service_id = service_id
        self.path = Path(runtime_dir) / SERVICE_FILE
        # Locked and written under another name, then renamed into place: another engine
        # starting now (``remove_stale``) never finds the file before it is claimed.
        pending = self.path.with_name(f"{SERVICE_FILE}.{os.getpid()}")
        self._fd = os.open(pending, os.O_CREAT | os.O_RDWR, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.ftruncate(self._fd, 0)
        os.write(self._fd, service_id.encode())
        os.rename(pending, self.path)

    def release(self) -> None:
        """Unlink the service's segments and drop the claim."""
        for segment in segments_of(self.service_id):
            unlink_segment(segment)
        os.close(self._fd)


def segments_of(service_id: str) -> list[str]:
    prefix = f"{PREFIX}{service_id}-"
    return sorted(p.name for p in SHM_DIR.glob(prefix + "*")) if SHM_DIR.is_dir() else []


def unlink_segment(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        segment = shared_memory.SharedMemory(name=name)
        segment.close()
        segment.unlink()  # also unregisters it from this process's resource tracker


def _claimed(service_file: Path) -> bool:
    """Whether a live engine holds this service file's lock."""
    try:
        fd = os.open(service_file, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _unlink_if_unused(segment: Path) -> bool:
    """Unlink ``segment`` unless a process has it mapped (it holds a shared lock) or it is
    another user's; whether it was unlinked."""
    try:
        fd = os.open(segment, os.O_RDONLY)
    except FileNotFoundError:
        return False
    except PermissionError:
        logger.info("leaving %s alone: another user's", segment.name)
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        logger.warning("leaving %s alone: unclaimed here but mapped by a process", segment.name)
        return False
    else:
        with contextlib.suppress(FileNotFoundError):
            segment.unlink()
        return True
    finally:
        os.close(fd)


def remove_stale(base: str | None = None) -> list[str]:
    """Unlink every Tandem segment that no running engine claims and no process has
    mapped, and the runtime directories of engines that died; returns the segments
    removed."""
    base = base or runtime_base()
    live: set[str] = set()
    for service_file in Path(base).glob(f"{PREFIX}*/{SERVICE_FILE}"):
        if _claimed(service_file):
            live.add(service_file.read_text().strip())
        else:
            shutil.rmtree(service_file.parent, ignore_errors=True)
    removed = []
    if SHM_DIR.is_dir():
        for segment in SHM_DIR.glob(f"{PREFIX}*"):
            service_id = segment.name.removeprefix(PREFIX).rsplit("-", 1)[0]
            if service_id not in live and _unlink_if_unused(segment):
                removed.append(segment.name)
    if removed:
        logger.warning("removed %d stale shared-memory segment(s): %s", len(removed), removed)
    return removed


def attach_segment(name: str, size: int, timeout_s: float = 60.0) -> shared_memory.SharedMemory:
    """Create the segment (0600) or, if another worker did first, map it once it has its
    full size. Either way it stays off this process's resource tracker, and in use (a
    shared lock) until it is closed."""
    try:
        segment = shared_memory.SharedMemory(name=name, create=True, size=size)
    except FileExistsError:
        deadline = time.monotonic() + timeout_s
        while True:
            opened = _open_sized(name, size)
            if opened is not None:
                segment = opened
                break
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"shared-memory segment {name} never reached {size} bytes"
                ) from None
            time.sleep(0.05)
    return _in_use(segment)


def _open_sized(name: str, size: int) -> shared_memory.SharedMemory | None:
    """The segment mapped, or None while its creator has not yet sized it to ``size``
    (an empty one, between its ``shm_open`` and ``ftruncate``, ``mmap`` refuses)."""
    try:
        segment = shared_memory.SharedMemory(name=name)
    except ValueError:  # "cannot mmap an empty file"
        return None
    if segment.size >= size:
        return segment
    segment.close()
    return None


def map_segment(name: str) -> shared_memory.SharedMemory:
    """Map an existing segment, whatever its size, off this process's resource tracker
    and in use until it is closed."""
    return _in_use(shared_memory.SharedMemory(name=name))


def _in_use(segment: shared_memory.SharedMemory) -> shared_memory.SharedMemory:
    """Take ``segment`` off the resource tracker and hold a shared lock on it while its
    descriptor is open (``close`` releases it), so ``remove_stale`` leaves it alone."""
    resource_tracker.unregister(segment._name, "shared_memory")  # type: ignore[attr-defined]
    fcntl.flock(segment._fd, fcntl.LOCK_SH)  # type: ignore[attr-defined]
    if os.fstat(segment._fd).st_nlink == 0:  # type: ignore[attr-defined]
        # Another engine's start took it for stale in the instant before the lock: the
        # other processes of this pool would map a different segment by that name.
        segment.close()
        raise RuntimeError(f"shared-memory segment {segment.name} was removed as it was mapped")
    return segment
