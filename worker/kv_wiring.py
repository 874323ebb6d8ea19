"""Which KV memory and hand-off transport a worker of split pools gets, from the config:

- ``shm``, pools of equal widths: both pools' rank r map one segment (zero-copy);
- ``shm``, different widths: prefill ranks keep their caches in their own segments and
  each decode rank copies its heads out of them (``KVPuller``);
- an instance of a fleet's split (``--kv-transfer-config``): its one pool's worker
  streams (a producer), lands (a consumer) or both;
- ``tcp``: local caches; the prefill side streams (``KVSender``, re-sharding through its
  rank 0 when either pool is tensor-parallel), the decode side lands (``KVReceiver``).
"""

from __future__ import annotations

from typing import Any

import zmq

from common.config import TandemConfig
from common.curve import CurveKeys
from common.messages import PoolRole
from common.pool_config import DisaggConfig, KVMode
from common.shm import segment_name
from worker.kv_receiver import KVReceiver
from worker.kv_reshard import KVLayout, KVPuller, prefill_segment, shared_segment
from worker.kv_transfer import KVSender, Reshard
from worker.kv_transport import (
    KVTransport,
    NoTransport,
    PullTransport,
    ReceiveTransport,
    SendReceiveTransport,
    SendTransport,
)
from worker.model_runner import ModelRunner


def kv_segment(disagg: DisaggConfig, pool: PoolRole, rank: int) -> str | None:
    """The shared-memory segment this worker's KV caches live in, or None (local)."""
    mode = disagg.kv_mode
    if mode is KVMode.SHARED:
        return segment_name(disagg.service_id, shared_segment(rank, disagg.tp_size(pool)))
    if mode is KVMode.SHM_COPY and pool == PoolRole.PREFILL:
        return segment_name(disagg.service_id, prefill_segment(rank))
    return None  # local memory (the decode side of SHM_COPY copies into its own)


def layout(runner: ModelRunner, disagg: DisaggConfig, pool: PoolRole) -> KVLayout:
    num_heads, num_kv_heads, head_dim = runner.model.attention_shape()
    return KVLayout(num_heads, num_kv_heads, head_dim, disagg.tp_size(pool))


def kv_transport(
    runner: ModelRunner,
    config: TandemConfig,
    pool: PoolRole,
    ctx: zmq.Context[Any],
    keys: CurveKeys | None,
) -> KVTransport:
    """This worker's end of the hand-off, by the KV mode and its pool's role."""
    disagg = config.disagg
    mode = disagg.kv_mode
    if mode is KVMode.SHM_COPY and pool == PoolRole.DECODE:
        mine = layout(runner, disagg, PoolRole.DECODE).heads(runner.tp.rank)
        source = layout(runner, disagg, PoolRole.PREFILL)
        return PullTransport(
            KVPuller(disagg.service_id, source, mine, runner.kv_caches, runner.block_size)
        )
    if mode is KVMode.NONE:
        return instance_transport(runner, config, ctx, keys)
    if mode is not KVMode.TCP:
        return NoTransport()
    if pool == PoolRole.PREFILL:
        tensor_parallel = disagg.prefill_tp > 1 or disagg.decode_tp > 1
        reshard = (
            Reshard(
                runner.tp,
                layout(runner, disagg, PoolRole.PREFILL),
                layout(runner, disagg, PoolRole.DECODE),
            )
            if tensor_parallel
            else None
        )
        secure = keys.make_client if keys else None
        return SendTransport(KVSender(ctx, runner.block_size, secure, reshard))
    return _receiver(runner, disagg, ctx, keys)


def _receiver(
    runner: ModelRunner, disagg: DisaggConfig, ctx: zmq.Context[Any], keys: CurveKeys | None
) -> ReceiveTransport:
    receiver = KVReceiver(
        ctx,
        runner.kv_caches,
        disagg.kv_transfer_address,
        disagg.kv_transfer_host,
        keys.make_server if keys else None,
        raw=keys is None,  # no encryption asked: a plain socket (worker/kv_socket.py)
    )
    return ReceiveTransport(receiver)


def instance_transport(
    runner: ModelRunner, config: TandemConfig, ctx: zmq.Context[Any], keys: CurveKeys | None
) -> KVTransport:
    """A unified pool's worker: a fleet instance's sender (it lends KV), receiver (it
    pulls KV) or both, by its ``kv_role``; none outside a fleet's split."""
    role = config.disagg.instance_kv.role
    # The decode instance's width comes with each pull (its destinations): any TP on
    # either side, the heads re-sharded through this instance's rank 0.
    own = layout(runner, config.disagg, PoolRole.UNIFIED)
    reshard = Reshard(runner.tp, own, own)
    secure = keys.make_client if keys else None
    send = (
        SendTransport(KVSender(ctx, runner.block_size, secure, reshard)) if role.produces else None
    )
    receive = _receiver(runner, config.disagg, ctx, keys) if role.consumes else None
    if send is not None and receive is not None:
        return SendReceiveTransport(send, receive)
    return send or receive or NoTransport()
