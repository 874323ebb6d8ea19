"""``--kv-transfer-config``: this instance's part in a fleet's prefill/decode split,
spelled as vLLM's ``KVTransferConfig``.

``{"kv_role": "kv_producer", "kv_ip": "10.0.0.5", "kv_port": 14579}`` makes a prefill
instance: a request whose ``kv_transfer_params`` ask for a remote decode is prefilled,
its prompt blocks are held under a lease, and the answer carries what a decode instance
needs to pull them from the side channel at ``kv_ip:kv_port``. ``kv_consumer`` makes a
decode instance (it pulls); ``kv_both`` does both. The bytes travel over Tandem's TCP
KV stream (checksummed; CurveZMQ with ``--curve-keys``), not NIXL: the HTTP contract is
the NixlConnector's, so vllm-router's ``--kv-connector nixl`` drives it
(``docs/fleet.md``).

Tandem's own settings sit in ``kv_connector_extra_config``: ``lease_s`` (how long a
prefill instance holds blocks no decode instance has pulled, and how long a decode
instance waits for them to land; default ``--kv-transfer-lease-s``) and
``ack_timeout_s`` (how long a decode instance waits for a prefill instance to take its
pull before the failure policy applies).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Literal

from common.config_checks import json_object, refuse_unknown_fields, require

FailurePolicy = Literal["fail", "recompute"]
CONNECTORS = ("TandemConnector",)
# vLLM's fields that configure other connectors' machinery: accepted, without effect.
_INERT = ("kv_buffer_device", "kv_buffer_size", "kv_rank", "kv_parallel_size")


class KVRole(enum.Enum):
    """What an instance does with other instances' KV, decided once."""

    NONE = "none"  # a unified instance: no kv_transfer_params taken
    PRODUCER = "kv_producer"  # prefills and lends its blocks
    CONSUMER = "kv_consumer"  # pulls a prompt's blocks and decodes
    BOTH = "kv_both"

    @property
    def produces(self) -> bool:
        return self in (KVRole.PRODUCER, KVRole.BOTH)

    @property
    def consumes(self) -> bool:
        return self in (KVRole.CONSUMER, KVRole.BOTH)


@dataclass(frozen=True)
class ExtraConfig:
    lease_s: float | None = None  # None: --kv-transfer-lease-s
    ack_timeout_s: float = 0.5

    def __post_init__(self) -> None:
        require(
            self.lease_s is None or self.lease_s > 0,
            "--kv-transfer-config: kv_connector_extra_config.lease_s must be positive",
        )
        require(
            self.ack_timeout_s > 0,
            "--kv-transfer-config: kv_connector_extra_config.ack_timeout_s must be positive",
        )


@dataclass(frozen=True)
class KVTransferConfig:
    kv_role: str | None = None
    kv_connector: str | None = None  # None: TandemConnector
    engine_id: str | None = None  # None: a fresh id at every start
    kv_ip: str = "127.0.0.1"  # the side channel decode instances pull through
    kv_port: int = 14579
    kv_load_failure_policy: FailurePolicy = "recompute"
    kv_connector_extra_config: ExtraConfig = field(default_factory=ExtraConfig)

    def __post_init__(self) -> None:
        roles = [r.value for r in KVRole if r is not KVRole.NONE]
        require(
            self.kv_role is None or self.kv_role in roles,
            f"--kv-transfer-config: kv_role must be one of {', '.join(roles)}, got {self.kv_role!r}",
        )
        require(
            self.kv_connector in (None, *CONNECTORS),
            f"--kv-transfer-config: kv_connector {self.kv_connector!r} is not available; "
            "Tandem moves KV over its own TCP stream (TandemConnector, the default), "
            "speaking the NixlConnector's HTTP contract",
        )
        require(
            0 <= self.kv_port <= 65535, f"--kv-transfer-config: kv_port {self.kv_port} is no port"
        )
        require(
            self.kv_load_failure_policy in ("fail", "recompute"),
            "--kv-transfer-config: kv_load_failure_policy must be fail or recompute",
        )
        require(
            self.engine_id is None or (0 < len(self.engine_id) <= 128),
            "--kv-transfer-config: engine_id must be 1 to 128 characters",
        )

    @property
    def role(self) -> KVRole:
        return KVRole(self.kv_role) if self.kv_role else KVRole.NONE

    @property
    def side_channel_address(self) -> str:
        """Where a producer binds the socket decode instances send their pulls to."""
        return f"tcp://{self.kv_ip}:{self.kv_port}"


def parse_kv_transfer_config(text: str | None) -> KVTransferConfig:
    """The flag's JSON as a config; a clear error naming any field it does not know."""
    if not text:
        return KVTransferConfig()
    flag = "--kv-transfer-config"
    raw = {k: v for k, v in json_object(text, flag).items() if k not in _INERT}
    refuse_unknown_fields(raw, KVTransferConfig, flag)
    extra = raw.pop("kv_connector_extra_config", None) or {}
    require(isinstance(extra, dict), f"{flag}: kv_connector_extra_config must be an object")
    refuse_unknown_fields(extra, ExtraConfig, flag, "kv_connector_extra_config.")
    try:
        return KVTransferConfig(**raw, kv_connector_extra_config=ExtraConfig(**extra))
    except TypeError as e:
        raise ValueError(f"{flag}: {e}") from None
