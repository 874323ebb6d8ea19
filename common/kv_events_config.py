"""``--kv-events-config``: vLLM's ``KVEventsConfig``, spelled as vLLM spells it.

``{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",
"replay_endpoint": "tcp://*:5558", "topic": ""}``: the engine core publishes each step's
KV events on a ZeroMQ PUB socket and keeps the last ``buffer_steps`` batches for replay
on a ROUTER socket. With split pools the prefill pool publishes on ``endpoint`` and the
decode pool on the next port (as vLLM offsets a data-parallel rank's ports).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from common.config_checks import json_object, refuse_unknown_fields, require

_PORT = re.compile(r"^(tcp://.*):(\d+)$")


@dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" or "null"; None: zmq when enabled
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        require(
            self.publisher in (None, "zmq", "null"),
            f"--kv-events-config: publisher must be 'zmq' or 'null', got {self.publisher!r}",
        )
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            require(
                isinstance(value, int) and value >= 1,
                f"--kv-events-config: {name} must be a positive integer, got {value!r}",
            )
        for name in ("endpoint", "replay_endpoint"):
            address = getattr(self, name)
            require(
                address is None or address.startswith(("tcp://", "ipc://", "inproc://")),
                f"--kv-events-config: {name} must be a tcp://, ipc:// or inproc:// "
                f"address, got {address!r}",
            )

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher != "null"

    def for_pool(self, index: int) -> KVEventsConfig:
        """The endpoints of the ``index``-th pool publishing: tcp ports moved by ``index``."""
        replay = self.replay_endpoint
        return replace(
            self,
            endpoint=offset_port(self.endpoint, index),
            replay_endpoint=replay and offset_port(replay, index),
        )


def offset_port(address: str, offset: int) -> str:
    match = _PORT.match(address)
    if offset == 0 or match is None:
        return address
    return f"{match.group(1)}:{int(match.group(2)) + offset}"


def parse_kv_events_config(text: str | None) -> KVEventsConfig:
    """The flag's JSON as a config; a clear error naming any field it does not know."""
    if not text:
        return KVEventsConfig()
    raw = json_object(text, "--kv-events-config")
    refuse_unknown_fields(raw, KVEventsConfig, "--kv-events-config")
    return KVEventsConfig(**raw)
