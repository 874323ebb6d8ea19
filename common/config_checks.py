"""The checks every configuration group makes of its values when it is built."""

from __future__ import annotations


def require(condition: bool, message: str) -> None:
    """A flag's value refused where its group is built: ``ValueError(message)``, which the
    command line prints as the error (never an ``assert``: it must hold under ``-O``)."""
    if not condition:
        raise ValueError(message)


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]")


def is_private_address(address: str) -> bool:
    """``ipc://`` (a file only this user can open), or ``tcp://`` on 127.0.0.1."""
    if not address.startswith("tcp://"):
        return True
    host = address.removeprefix("tcp://").rsplit(":", 1)[0]
    return host in LOOPBACK_HOSTS
