"""The checks every configuration group makes of its values when it is built."""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Any


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


def json_object(text: str, flag: str) -> dict[str, Any]:
    """A flag's JSON text as an object, or a ``ValueError`` naming the flag."""
    try:
        raw: Any = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} is not JSON: {e}") from None
    require(isinstance(raw, dict), f"{flag} must be a JSON object")
    return dict(raw)


def refuse_unknown_fields(raw: dict[str, Any], cls: type, flag: str, prefix: str = "") -> None:
    """A ``ValueError`` naming the keys of ``raw`` that dataclass ``cls`` has no field for."""
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(raw) - known)
    require(
        not unknown,
        f"{flag}: unknown field {prefix}{', '.join(unknown)} (known: {', '.join(sorted(known))})",
    )
