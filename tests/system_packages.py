"""Debian packages some tests drive (prometheus, chromium), installed when missing so
that `make test` on a fresh machine needs nothing done by hand."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import tempfile


def ensure_debian_package(binary: str, package: str) -> str:
    """The path of ``binary``, installing ``package`` with apt-get first if needed."""
    found = shutil.which(binary)
    if found:
        return found
    # One install at a time, even across test processes.
    with open(os.path.join(tempfile.gettempdir(), "tandem-apt.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not shutil.which(binary):
            sudo = [] if os.geteuid() == 0 else ["sudo", "-n"]
            env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
            subprocess.run([*sudo, "apt-get", "update", "-qq"], check=True, env=env)
            subprocess.run([*sudo, "apt-get", "install", "-y", "-qq", package], check=True, env=env)
    found = shutil.which(binary)
    if not found:
        raise RuntimeError(f"installing {package} did not provide {binary}")
    return found
