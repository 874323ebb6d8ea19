"""Which KV memory and hand-off transport a worker of split pools gets, from the config:

- ``shm``, pools of equal widths: both pools' rank r map one segment (zero-copy);
- ``shm``, different widths: prefill ranks keep their caches in their own segments and
  each decode rank copies its heads out of them (``KVPuller``);
- ``tcp``: local caches; the prefill side streams (``KVSender``, re-sharding through its
  rank 0 when either pool is tensor-parallel), the decode side lands (``KVReceiver``).
"""

from __future__ import annotations

from typing import Any

import zmq

from common.config import TandemConfig
from common.curve import CurveKeys
from common.messages import PoolRole
from common.pool_config import DisaggConfig
from common.shm import segment_name
from worker.kv_reshard import KVLayout, KVPuller, prefill_segment, shared_segment
from worker.kv_transfer import KVReceiver, KVSender, Reshard
from worker.model_runner import ModelRunner


def kv_segment(disagg: DisaggConfig, pool: PoolRole, rank: int) -> str | None:
    """The shared-memory segment this worker's KV caches live in, or None (local)."""
    if not disagg.split or disagg.kv_transfer != "shm":
        return None
    if not disagg.reshards:
        return segment_name(disagg.service_id, shared_segment(rank, disagg.tp_size(str(pool))))
    if pool == PoolRole.PREFILL:
        return segment_name(disagg.service_id, prefill_segment(rank))
    return None  # the decode side copies into its own memory


def layout(runner: ModelRunner, disagg: DisaggConfig, pool: str) -> KVLayout:
    num_heads, num_kv_heads, head_dim = runner.model.attention_shape()
    return KVLayout(num_heads, num_kv_heads, head_dim, disagg.tp_size(pool))


def attach_kv_transport(
    runner: ModelRunner,
    config: TandemConfig,
    pool: PoolRole,
    ctx: zmq.Context[Any],
    keys: CurveKeys | None,
) -> None:
    disagg = config.disagg
    if not disagg.split or pool == PoolRole.UNIFIED:
        return
    if disagg.kv_transfer == "shm":
        if disagg.reshards and pool == PoolRole.DECODE:
            mine = layout(runner, disagg, "decode").heads(runner.tp.rank)
            source = layout(runner, disagg, "prefill")
            puller = KVPuller(disagg.service_id, source, mine, runner.kv_caches, runner.block_size)
            runner.attach_transfer(puller=puller)
        return
    if pool == PoolRole.PREFILL:
        tensor_parallel = disagg.prefill_tp > 1 or disagg.decode_tp > 1
        reshard = (
            Reshard(runner.tp, layout(runner, disagg, "prefill"), layout(runner, disagg, "decode"))
            if tensor_parallel
            else None
        )
        secure = keys.make_client if keys else None
        runner.attach_transfer(sender=KVSender(ctx, runner.block_size, secure, reshard))
        return
    receiver = KVReceiver(
        ctx,
        runner.kv_caches,
        disagg.kv_transfer_address,
        disagg.kv_transfer_host,
        keys.make_server if keys else None,
    )
    runner.attach_transfer(receiver=receiver)
