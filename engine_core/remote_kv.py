"""This instance's part in a fleet's prefill/decode split, decided once (``kv_role``).

``RemoteKV`` holds the instance's leases (``kv_leases.py``: blocks lent to decode
instances) and pulls (``kv_pulls.py``: KV taken from prefill instances); its role says
which requests it takes. It is the unified pool's end of the KV orders (``side``), takes
the messages of other instances' engines (``deliver``) and leaves its own in an outbox
that the engine process's side-channel thread sends. ``NoRemoteKV``: split pools inside
one instance, which take no part in a fleet's split.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

from common.config import TandemConfig
from common.kv_transfer_config import KVRole
from common.messages import (
    KVPull,
    KVTransferResult,
    KVTransferStats,
    ModelRunnerOutput,
    PeerMessage,
    WorkerReady,
)
from engine_core.handoff import HandoffSide, HandoffStats
from engine_core.kv_cache import KVCacheManager
from engine_core.kv_leases import LEASE_OUTCOMES, KVLeases, SideChannel
from engine_core.kv_pulls import KVPulls, PullTimes
from engine_core.request import Request
from engine_core.scheduler import ClientOutputs, Scheduler

Peer = bytes | str  # a side-channel identity to answer, or an address to send to
Outgoing = tuple[Peer, PeerMessage]


def role_refusal(role: KVRole, request: Request) -> tuple[str, str] | None:
    """Why this instance cannot take the request's ``kv_transfer_params``, and the field."""
    if request.remote_prefill and not role.consumes:
        why = "this instance pulls no remote KV (it is not a kv_consumer)"
        return why, "kv_transfer_params.do_remote_prefill"
    if request.remote_decode and not role.produces:
        why = "this instance lends no KV to remote decodes (it is not a kv_producer)"
        return why, "kv_transfer_params.do_remote_decode"
    return None


def unified_instance(
    config: TandemConfig,
    kv: KVCacheManager,
    ready: WorkerReady,
    kv_addresses: list[str],
    clock: Callable[[], float] = time.monotonic,
) -> tuple[Scheduler, RemoteKV]:
    """A unified pool's scheduler and its part in a fleet's split (perhaps none).
    ``kv_addresses``: where each of the pool's ranks takes pulled KV (its heads)."""
    instance, disagg = config.disagg.instance_kv, config.disagg
    lease_s = instance.kv_connector_extra_config.lease_s or disagg.kv_transfer_lease_s
    stats = HandoffStats(LEASE_OUTCOMES)
    side = HandoffSide()
    channel = SideChannel(
        instance.engine_id or uuid.uuid4().hex,
        disagg.kv_transfer_host or instance.kv_ip,
        instance.kv_port,
        disagg.tensor_parallel_size,
    )
    leases = KVLeases(kv, side, channel, lease_s, stats, clock)
    scheduler = Scheduler(
        config.scheduler,
        kv,
        ready.model,
        clock,
        lender=leases,
        max_loras=config.model.step_max_loras,
    )
    times = PullTimes(instance.kv_connector_extra_config.ack_timeout_s, lease_s)
    destinations = [address for address in kv_addresses if address]
    policy = instance.kv_load_failure_policy
    pulls = KVPulls(scheduler, side, destinations, times, policy, stats, channel.engine_id, clock)
    return scheduler, RemoteKV(instance.role, leases, pulls, side, stats)


class RemoteKV:
    def __init__(
        self,
        role: KVRole,
        leases: KVLeases,
        pulls: KVPulls,
        side: HandoffSide,
        stats: HandoffStats,
    ) -> None:
        self.role = role
        self.leases = leases
        self.pulls = pulls
        self.side = side
        self.stats = stats
        side.on_step_done = self._step_done
        side.on_result = self._result
        self._outbox: list[Outgoing] = []

    @property
    def in_flight(self) -> dict[str, Request]:
        return self.pulls.in_flight

    @property
    def num_leases(self) -> int:
        """Prompt blocks lent and not yet pulled (a drain waits for them)."""
        return len(self.leases.leases)

    def add(self, request: Request) -> ClientOutputs:
        """A request whose prompt a prefill instance computed: pull its KV first."""
        return self.pulls.add(request)

    def tick(self) -> ClientOutputs:
        self.leases.tick()
        return self.pulls.tick()

    def deliver(self, peer: bytes, message: PeerMessage) -> ClientOutputs:
        """A message from another instance's engine (``peer``: its side-channel identity)."""
        if isinstance(message, KVPull):
            self._outbox += self.leases.serve(peer, message)
            return {}
        return self.pulls.on_message(message)

    def take_outbox(self) -> list[Outgoing]:
        out = [*self._outbox, *self.pulls.outbox]
        self._outbox, self.pulls.outbox = [], []
        return out

    def _step_done(self, result: ModelRunnerOutput) -> ClientOutputs:
        self.leases.on_step_done(result)
        return {}

    def _result(self, result: KVTransferResult) -> ClientOutputs:
        """A transfer's end on this instance's workers: a send of a lease (failures only)
        or a landing of a pull; with kv_both pulling from itself, the same id is both."""
        self._outbox += self.leases.on_result(result)
        return self.pulls.on_result(result)

    def abort(self, request_id: str) -> ClientOutputs | None:
        return self.pulls.abort(request_id)

    def snapshot(self) -> KVTransferStats | None:
        return self.stats.snapshot() if self.role is not KVRole.NONE else None

    def fail_all(self, reason: str, outcome: str = "worker_died") -> ClientOutputs:
        self.leases.release_all()
        return self.pulls.fail_all(reason, outcome)


class NoRemoteKV:
    role = KVRole.NONE
    num_leases = 0

    @property
    def in_flight(self) -> dict[str, Request]:
        return {}

    def add(self, request: Request) -> ClientOutputs:
        raise AssertionError("refused by role_refusal")

    def tick(self) -> ClientOutputs:
        return {}

    def deliver(self, peer: bytes, message: PeerMessage) -> ClientOutputs:
        return {}

    def take_outbox(self) -> list[Outgoing]:
        return []

    def abort(self, request_id: str) -> ClientOutputs | None:
        return None

    def snapshot(self) -> KVTransferStats | None:
        return None

    def fail_all(self, reason: str, outcome: str = "worker_died") -> ClientOutputs:
        return {}
