"""``KVLeases``: a prefill instance's prompt blocks, lent to the decode instance that
will pull them (``kv_role`` ``kv_producer`` or ``kv_both``).

A request that asked for a remote decode finishes as any other (its one token sampled),
but its prompt's full blocks stay referenced under a lease; its last output carries the
``kv_transfer_params`` that name the lease. A decode instance's ``KVPull`` is checked
against the lease (this engine's id, the block ids it was told, the chained hashes of the
prompt it holds: a pull for another prompt, or a forged one, is refused naming the field)
and becomes a ``KVSend`` in the next step of this instance's worker. Every lease ends
once: pulled (its blocks freed once copied out), released (the decode side needed none),
failed (the send failed), or expired (no pull within the lease's time).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from common.messages import (
    KVPull,
    KVPullAnswer,
    KVSend,
    KVTransferParams,
    KVTransferResult,
    ModelRunnerOutput,
)
from engine_core.handoff import HandoffSide, HandoffStats
from engine_core.kv_cache import KVCacheManager
from engine_core.request import Request

logger = logging.getLogger(__name__)

LEASE_OUTCOMES = ("lease_pulled", "lease_released", "lease_failed", "lease_expired", "pull_refused")

Reply = tuple[bytes, KVPullAnswer]  # to the side-channel peer that sent the pull
_MAX_RANKS = 64  # destinations a pull may name (one per decode rank)
_SENT_REMEMBERED = 4096  # sends copied out, whose failure may still come


@dataclass
class Lease:
    lease_id: str
    owner: str  # the KV manager's owner id of its block references
    blocks: list[int]
    hashes: list[bytes]
    expires: float
    owner_key: str | None  # the API key (by digest) of the request it was made for
    transfer_id: str | None = None  # pulled as this transfer, being copied out
    peer: bytes = b""  # who pulled it


@dataclass(frozen=True)
class SideChannel:
    """Where decode instances reach this one, as its answers name it."""

    engine_id: str
    host: str
    port: int
    tp_size: int = 1  # this instance's tensor-parallel ranks


class KVLeases:
    def __init__(
        self,
        kv: KVCacheManager,
        side: HandoffSide,
        channel: SideChannel,
        lease_s: float,
        stats: HandoffStats,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.kv = kv
        self.side = side  # the unified pool's orders: the sends go there
        self.channel = channel
        self.lease_s = lease_s
        self.stats = stats
        self._clock = clock
        self.leases: dict[str, Lease] = {}
        self._sending: dict[str, Lease] = {}  # by transfer id, until copied out
        self._sent: OrderedDict[str, bytes] = OrderedDict()  # copied out: who to tell of a failure

    def hold(self, request: Request) -> KVTransferParams:
        """Lend the finished request's full prompt blocks; the params that name them."""
        num_full = min(request.num_prompt_tokens // self.kv.block_size, len(request.block_hashes))
        lease_id = secrets.token_hex(16)  # unguessable: a pull must name it
        blocks: list[int] = []
        if num_full:
            owner = f"lease:{lease_id}"
            blocks = self.kv.lend(request.request_id, owner, num_full)
            self.leases[lease_id] = Lease(
                lease_id,
                owner,
                blocks,
                list(request.block_hashes[:num_full]),
                self._clock() + self.lease_s,
                request.owner,
            )
        return KVTransferParams(
            do_remote_prefill=True,
            remote_engine_id=self.channel.engine_id,
            remote_block_ids=blocks,
            remote_request_id=lease_id,
            remote_host=self.channel.host,
            remote_port=self.channel.port,
            tp_size=self.channel.tp_size,
            block_size=self.kv.block_size,
        )

    def serve(self, peer: bytes, pull: KVPull) -> list[Reply]:
        """Check a decode instance's pull against its lease; order the send if it holds."""
        if not pull.block_ids:  # the decode side needs none of the blocks
            return [(peer, self._release(pull))]
        refusal = self._check(pull)
        if refusal is not None:
            why, param = refusal
            self.stats.ended("pull_refused")
            logger.warning("refused KV pull %s: %s", pull.transfer_id, why)
            return [(peer, KVPullAnswer(pull.transfer_id, False, why, param))]
        lease = self.leases[pull.lease_id]
        lease.transfer_id, lease.peer = pull.transfer_id, peer
        self._sending[pull.transfer_id] = lease
        self.side.orders.sends.append(KVSend(pull.transfer_id, pull.block_ids, pull.destinations))
        return [(peer, KVPullAnswer(pull.transfer_id, True))]

    def _release(self, pull: KVPull) -> KVPullAnswer:
        """A lease the decode side will not pull: freed now, if it is still waiting and
        the release comes from the engine and key it was made for."""
        lease = self.leases.get(pull.lease_id)
        if (
            lease is not None
            and lease.transfer_id is None
            and pull.engine_id == self.channel.engine_id
            and pull.owner == lease.owner_key
        ):
            self._end(lease, "lease_released")
        return KVPullAnswer(pull.transfer_id, True)

    def _check(self, pull: KVPull) -> tuple[str, str | None] | None:
        """Why the pull cannot be served, and the params field at fault; None if it can."""
        if pull.engine_id != self.channel.engine_id:
            why = f"this is engine {self.channel.engine_id}, not {pull.engine_id}"
            return why, "kv_transfer_params.remote_engine_id"
        lease = self.leases.get(pull.lease_id)
        if lease is None:
            return "no such lease here: it expired, was pulled already, or never was", None
        if pull.owner != lease.owner_key:
            return "the lease was made with another API key", "kv_transfer_params.remote_request_id"
        if lease.transfer_id is not None:  # a retried decode leg, say: its policy decides
            return "this lease is being pulled already", None
        if not 1 <= len(pull.destinations) <= _MAX_RANKS or not all(
            d.startswith(("tcp://", "kvtcp://")) for d in pull.destinations
        ):
            return "the pull names no usable KV destinations", None
        if pull.block_size != self.kv.block_size:
            return (
                f"blocks of {pull.block_size} tokens asked, this instance's hold "
                f"{self.kv.block_size}",
                "kv_transfer_params.block_size",
            )
        end = pull.first_block + len(pull.block_ids)
        if (
            pull.first_block < 0
            or end > len(lease.blocks)
            or len(pull.block_hashes) != len(pull.block_ids)
        ):
            return "the blocks asked lie outside the lease", "kv_transfer_params.remote_block_ids"
        if pull.block_ids != lease.blocks[pull.first_block : end]:
            return "these are not the lease's blocks", "kv_transfer_params.remote_block_ids"
        if pull.block_hashes != lease.hashes[pull.first_block : end]:
            # Another prompt (or salt): its KV is not this request's to read.
            return "the lease holds another prompt's KV", "kv_transfer_params.remote_request_id"
        return None

    def on_step_done(self, result: ModelRunnerOutput) -> None:
        """Blocks copied out by the worker: the lease has done its work (the bytes are
        still to go; a send that fails later is still reported to the puller)."""
        for transfer_id in result.kv_copied:
            lease = self._sending.pop(transfer_id, None)
            if lease is not None:
                self._sent[transfer_id] = lease.peer
                while len(self._sent) > _SENT_REMEMBERED:
                    self._sent.popitem(last=False)
                self._end(lease, "lease_pulled")

    def on_result(self, result: KVTransferResult) -> list[Reply]:
        """A send that failed: the decode side is told now rather than at its deadline.
        (Results that land here may be this instance's own landings, with kv_both.)"""
        if result.ok:
            return []
        lease = self._sending.pop(result.transfer_id, None)
        if lease is not None:
            self._end(lease, "lease_failed")
            peer = lease.peer
        elif result.transfer_id in self._sent:
            peer = self._sent.pop(result.transfer_id)
        else:
            return []
        error = result.error or "the prefill instance could not send the KV"
        return [(peer, KVPullAnswer(result.transfer_id, False, error))]

    def tick(self) -> None:
        """Free the leases no decode instance pulled in time."""
        now = self._clock()
        for lease in list(self.leases.values()):
            if lease.transfer_id is None and now > lease.expires:
                logger.warning("KV lease %s expired: no decode instance pulled it", lease.lease_id)
                self._end(lease, "lease_expired")

    def _end(self, lease: Lease, outcome: str) -> None:
        del self.leases[lease.lease_id]
        self.kv.free(lease.owner)
        self.stats.ended(outcome)

    def release_all(self) -> None:
        """The engine is going down: every lease ends (as expired)."""
        for lease in list(self.leases.values()):
            self._sending.pop(lease.transfer_id or "", None)
            self._end(lease, "lease_expired")
