"""Tensor parallelism across the worker processes of one pool, on ``torch.distributed``
(gloo on CPU, NCCL on CUDA).

Rank r of N holds its share of every layer (Megatron-style, as vLLM does): the q/k/v and
gate/up projections split by output columns (whole heads), o_proj and down_proj by input
rows, followed by one all-reduce each; the embedding and LM head split by vocabulary
(a masked lookup plus an all-reduce; local logits gathered before sampling). KV heads
split with the q heads; where there are fewer KV heads than ranks each rank holds the
one KV head its q heads use (replicated, vLLM's rule). Norms and RoPE are replicated.
Rank 0 alone samples; the other ranks learn the sampled tokens from the next step's
``prev_sampled`` or, with async scheduling (the next step is sent before this one's
tokens reach the engine), from rank 0 by a broadcast right after it samples.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Heads:
    """The attention heads one rank holds: q heads [q_first, q_first + q_count) and KV
    heads [kv_first, kv_first + kv_count) of the model's."""

    q_first: int
    q_count: int
    kv_first: int
    kv_count: int


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in its pool's tensor-parallel group (size 1: no group)."""

    rank: int = 0
    size: int = 1
    broadcasts_samples: bool = False  # rank 0's sampled tokens go to the others at once

    def split(self, total: int, what: str) -> int:
        """This rank's equal share of ``total`` (the vocabulary: its logits are gathered,
        and a gather takes equal parts)."""
        if total % self.size:
            raise ValueError(
                f"--tensor-parallel-size {self.size} does not divide the model's {what} ({total})"
            )
        return total // self.size

    def rows(self, total: int) -> tuple[int, int]:
        """(first, count) of this rank's near-equal share of ``total`` rows (the MLP's
        intermediate size: its output is all-reduced, so shares may differ by one)."""
        first, end = self.rank * total // self.size, (self.rank + 1) * total // self.size
        return first, end - first

    def heads(self, num_heads: int, num_kv_heads: int) -> Heads:
        """This rank's q and KV heads. With at least as many KV heads as ranks, each rank
        takes whole GQA groups (a KV head and the q heads reading it), as evenly as the
        groups allow: SmolLM2's 3 groups of 3 split 3 + 6 heads over 2 ranks. With fewer,
        the q heads split evenly and each rank holds the one KV head they read."""
        group = num_heads // num_kv_heads
        if num_kv_heads >= self.size:
            first, count = self.rows(num_kv_heads)
            return Heads(first * group, count * group, first, count)
        if self.size % num_kv_heads or num_heads % self.size:
            raise ValueError(
                f"--tensor-parallel-size {self.size} must divide the model's {num_heads} "
                f"attention heads and be a multiple of its {num_kv_heads} KV heads"
            )
        per_rank = num_heads // self.size
        return Heads(self.rank * per_rank, per_rank, self.rank * num_kv_heads // self.size, 1)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` side by side along the last dim (rank order)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    def share_samples(self, token_ids: list[int], device: torch.device) -> list[int]:
        """Rank 0's sampled tokens, on every rank (the others pass placeholders of the
        same length)."""
        values = torch.tensor(token_ids, dtype=torch.long, device=device)
        dist.broadcast(values, src=0)
        return [int(t) for t in values.tolist()]


def init_group(
    rank: int,
    size: int,
    init_address: str,
    device: torch.device,
    broadcasts_samples: bool = False,
) -> TensorParallel:
    """Join the pool's process group (blocks until every rank has joined)."""
    if size == 1:
        return TensorParallel()
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        init_method=init_address,
        rank=rank,
        world_size=size,
        timeout=timedelta(minutes=10),  # a rank still loading its shard is waited for
    )
    logger.info("rank %d of %d joined the %s group at %s", rank, size, backend, init_address)
    return TensorParallel(rank, size, broadcasts_samples)


def destroy_group(tp: TensorParallel) -> None:
    if tp.size > 1 and dist.is_initialized():
        dist.destroy_process_group()
