"""How the workers are laid out: one unified pool, or a prefill and a decode pool that
hand KV over; their tensor-parallel ranks, threads and addresses (``docs/disaggregation.md``)."""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from typing import Literal

from common.config_checks import require
from common.kv_transfer_config import KVRole, KVTransferConfig, parse_kv_transfer_config
from common.messages import PoolRole

KVTransfer = Literal["shm", "tcp"]
KVLoadFailurePolicy = Literal["fail", "recompute"]


class KVMode(enum.Enum):
    """How a request's KV reaches the decode pool: decided once, from the flags."""

    NONE = "none"  # one unified pool: nothing is handed off
    SHARED = "shared"  # shm, pools of equal widths: one block pool both map, zero-copy
    SHM_COPY = "shm-copy"  # shm, different widths: decode ranks copy out of prefill segments
    TCP = "tcp"  # separate memories: the prefill side streams, the decode side lands

    @property
    def num_kv_managers(self) -> int:
        """Block pools kept apart (each publishes its own KV events)."""
        return 1 if self in (KVMode.NONE, KVMode.SHARED) else 2


@dataclass(frozen=True)
class PoolSpec:
    """One pool as the engine starts it: its role, tensor-parallel ranks, worker
    processes and the address its workers connect to (empty: the engine picks one)."""

    role: PoolRole
    tp: int
    workers: int  # processes: its ranks, or (TP 1) its replicas
    address: str


@dataclass(frozen=True)
class DisaggConfig:
    """Worker pools: one unified pool (both counts 0), or a prefill and a decode pool that
    step apart and hand each request's KV over (``docs/disaggregation.md``)."""

    prefill_workers: int = 0
    decode_workers: int = 0
    kv_transfer: KVTransfer = "shm"  # one host, zero-copy; tcp: across hosts
    kv_transfer_lease_s: float = 30.0  # tcp: a hand-off not landed by then expires
    kv_load_failure_policy: KVLoadFailurePolicy = "fail"  # or recompute in the decode pool
    # Prompts whose uncached part is shorter are prefilled in the decode pool (tcp; with
    # shm only while the prefill pool is busy). 0 = always hand off.
    disagg_min_prompt_tokens: int = 32
    tensor_parallel_size: int = 1  # ranks of the unified pool, each holding a shard
    prefill_tp: int = 1  # ranks of the prefill pool (split pools)
    decode_tp: int = 1  # ranks of the decode pool; may differ: the hand-off re-shards
    worker_threads: int | None = None  # per worker process; None: cores / worker processes
    # One core fewer while another process keeps the worker's threads waiting for theirs
    # (worker/thread_governor.py); off: always worker_threads.
    adaptive_worker_threads: bool = True
    # The engine binds these for its pools; a worker by its own command connects to one.
    external_workers: bool = False  # the engine waits for workers started apart
    unified_pool_address: str = ""
    prefill_pool_address: str = ""
    decode_pool_address: str = ""
    # A decode worker takes KV over TCP here (port 0: any free one), and tells the engine
    # to reach it at kv_transfer_host (the bind host when empty).
    kv_transfer_address: str = "tcp://127.0.0.1:0"
    kv_transfer_host: str = ""
    service_id: str = ""  # names the service's shared-memory segments; random when empty
    # This instance's part in a fleet's prefill/decode split (vLLM's KVTransferConfig).
    kv_transfer_config: str | None = None

    def __post_init__(self) -> None:
        instance = parse_kv_transfer_config(self.kv_transfer_config)  # refused here
        require(
            instance.role is KVRole.NONE or not self.split,
            "--kv-transfer-config makes one instance of a fleet's prefill/decode split: it "
            "takes one unified pool (split pools hand KV over inside one instance already)",
        )
        require(
            self.prefill_workers >= 0 and self.decode_workers >= 0,
            "--prefill-workers and --decode-workers must not be negative",
        )
        require(
            (self.prefill_workers == 0) == (self.decode_workers == 0),
            "split pools need both --prefill-workers and --decode-workers (at least 1 each); "
            "leave both out for one unified pool",
        )
        require(self.kv_transfer in ("shm", "tcp"), "--kv-transfer must be shm or tcp")
        require(
            self.kv_load_failure_policy in ("fail", "recompute"),
            "--kv-load-failure-policy must be fail or recompute",
        )
        require(self.kv_transfer_lease_s > 0, "--kv-transfer-lease-s must be positive")
        require(
            self.disagg_min_prompt_tokens >= 0, "--disagg-min-prompt-tokens must not be negative"
        )
        require(
            self.tensor_parallel_size >= 1,
            f"--tensor-parallel-size must be at least 1, got {self.tensor_parallel_size}",
        )
        require(
            self.tensor_parallel_size == 1 or not self.split,
            "--tensor-parallel-size applies to a unified pool; give split pools "
            "--prefill-tp and --decode-tp",
        )
        for pool, tp, workers in (
            (PoolRole.PREFILL, self.prefill_tp, self.prefill_workers),
            (PoolRole.DECODE, self.decode_tp, self.decode_workers),
        ):
            require(tp >= 1, f"--{pool}-tp must be at least 1, got {tp}")
            require(tp == 1 or self.split, f"--{pool}-tp needs split pools (--{pool}-workers 1)")
            require(
                tp == 1 or workers == 1,
                f"--{pool}-tp {tp} makes one pool of {tp} ranks: give --{pool}-workers 1",
            )
        require(
            self.worker_threads is None or self.worker_threads >= 1,
            f"--worker-threads must be at least 1, got {self.worker_threads}",
        )
        require(
            self.kv_transfer_address.startswith("tcp://"),
            "--kv-transfer-address must be tcp://HOST:PORT",
        )
        require(
            all(c.isalnum() or c in "-_" for c in self.service_id),
            "--service-id may hold only letters, digits, - and _",
        )

    @property
    def instance_kv(self) -> KVTransferConfig:
        """This instance's part in a fleet's prefill/decode split."""
        return parse_kv_transfer_config(self.kv_transfer_config)

    @property
    def split(self) -> bool:
        return self.prefill_workers > 0

    @property
    def kv_mode(self) -> KVMode:
        if not self.split:
            return KVMode.NONE
        if self.kv_transfer == "tcp":
            return KVMode.TCP
        return KVMode.SHM_COPY if self.reshards else KVMode.SHARED

    @property
    def service_role(self) -> str:
        """This engine's part in the service as the heartbeat names it."""
        return "split" if self.split else "unified"

    @property
    def reshards(self) -> bool:
        """Split pools of different widths: each lays its KV heads out by its own ranks,
        so the hand-off copies and re-shards (even with ``shm``)."""
        return self.split and self.prefill_tp != self.decode_tp

    def pool_specs(self) -> tuple[PoolSpec, ...]:
        """The pools, prefill before decode (a new prompt's first pool comes first)."""
        if not self.split:
            tp = self.tensor_parallel_size
            return (PoolSpec(PoolRole.UNIFIED, tp, tp, self.unified_pool_address),)
        return (
            _split_spec(
                PoolRole.PREFILL, self.prefill_tp, self.prefill_workers, self.prefill_pool_address
            ),
            _split_spec(
                PoolRole.DECODE, self.decode_tp, self.decode_workers, self.decode_pool_address
            ),
        )

    def spec(self, role: PoolRole) -> PoolSpec:
        return next(s for s in self.pool_specs() if s.role == role)

    def tp_size(self, role: PoolRole) -> int:
        """Tensor-parallel ranks of one pool (1: its workers each hold the whole model)."""
        return self.spec(role).tp

    def num_workers(self, role: PoolRole) -> int:
        """Worker processes of one pool: its ranks, or (TP 1) its workers."""
        return self.spec(role).workers

    def threads_per_worker(self) -> int:
        """``--worker-threads``, else this machine's cores shared by the worker processes
        (split pools and tensor-parallel ranks divide them). One flag for every worker: a
        worker started by its own command (a container) takes its own."""
        if self.worker_threads is not None:
            return self.worker_threads
        workers = sum(s.workers for s in self.pool_specs())  # per rank: cores / ranks
        return max(1, (os.cpu_count() or 1) // workers)


def _split_spec(role: PoolRole, tp: int, workers: int, address: str) -> PoolSpec:
    """A pool of split pools: ``tp`` ranks of one worker, or (TP 1) ``workers`` replicas."""
    return PoolSpec(role, tp, tp if tp > 1 else workers, address)
