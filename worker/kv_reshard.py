"""Moving KV between pools of different tensor-parallel widths (``--prefill-tp`` /
``--decode-tp``): each pool lays the model's KV heads out over its own ranks
(``TensorParallel.heads``), so a hand-off re-shards them.

Over ``tcp`` the prefill ranks send their heads of the handed-off blocks to their rank 0
(``torch.distributed`` point-to-point, in the step that carries the order), which puts
the model's heads back together and streams each decode rank exactly the heads it holds.
Over ``shm`` each decode rank copies its heads itself out of the prefill ranks' caches,
which live in shared memory (``KVPuller``). Where fewer KV heads than ranks make several
ranks hold the same head, the first of them is its source.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from multiprocessing import shared_memory

import torch
import torch.distributed as dist

from common.messages import KVReceive, KVTransferResult
from common.shm import map_segment, segment_name
from worker.parallel import Heads, TensorParallel


@dataclass(frozen=True)
class KVLayout:
    """How one pool spreads the model's KV heads over its ranks."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    tp_size: int

    def heads(self, rank: int) -> Heads:
        return TensorParallel(rank, self.tp_size).heads(self.num_heads, self.num_kv_heads)

    def sources(self) -> list[tuple[int, Heads]]:
        """Ranks in order with the heads each is first to hold (every KV head once)."""
        out, covered = [], 0
        for rank in range(self.tp_size):
            heads = self.heads(rank)
            if heads.kv_first + heads.kv_count > covered:
                out.append((rank, heads))
                covered = heads.kv_first + heads.kv_count
        return out


def _as_heads(payload: torch.Tensor, block_size: int, kv_count: int) -> torch.Tensor:
    """``[layers, 2, blocks, row]`` as ``[layers, 2, blocks, heads, block_size, dim]`` (a
    block's rows head by head, as the cache holds them)."""
    layers, two, blocks, _ = payload.shape
    return payload.view(layers, two, blocks, kv_count, block_size, -1)


def gather_heads(
    payload: torch.Tensor, tp: TensorParallel, layout: KVLayout, block_size: int
) -> torch.Tensor | None:
    """Collective over the prefill pool's ranks, each holding ``payload`` (its heads of
    the blocks, ``[layers, 2, blocks, row]``): rank 0 gets every head,
    ``[layers, 2, blocks, kv_heads, block_size, dim]``; the other ranks get None."""
    mine = layout.heads(tp.rank)
    if tp.size == 1:
        return _as_heads(payload, block_size, mine.kv_count)
    sources = layout.sources()
    if tp.rank > 0:
        if any(rank == tp.rank for rank, _ in sources):
            dist.send(payload.contiguous(), dst=0)
        return None
    layers, two, blocks, _ = payload.shape
    full = payload.new_empty(
        (layers, two, blocks, layout.num_kv_heads, block_size, layout.head_dim)
    )
    for rank, heads in sources:
        if rank == 0:
            part = payload
        else:
            part = payload.new_empty(
                (layers, two, blocks, block_size * heads.kv_count * layout.head_dim)
            )
            dist.recv(part, src=rank)
        span = slice(heads.kv_first, heads.kv_first + heads.kv_count)
        full[:, :, :, span] = _as_heads(part, block_size, heads.kv_count)
    return full


def heads_for(full: torch.Tensor, heads: Heads) -> torch.Tensor:
    """One decode rank's heads of ``gather_heads``' result as ``[layers, 2, blocks, row]``
    (its cache's block rows)."""
    part = full[:, :, :, heads.kv_first : heads.kv_first + heads.kv_count]
    return part.contiguous().view(full.shape[0], full.shape[1], full.shape[2], -1)


class KVPuller:
    """A decode rank's side of ``shm`` between pools of different widths: copies handed-off
    blocks out of the prefill ranks' shared-memory caches into its own, its heads only."""

    def __init__(
        self,
        service_id: str,
        source: KVLayout,
        mine: Heads,
        caches: list[torch.Tensor],
        block_size: int,
    ) -> None:
        self._service_id = service_id
        self._caches = caches
        self._block_size = block_size
        self._mine = mine
        # The prefill ranks holding this rank's heads, and which of them each gives.
        self._sources = [
            (rank, heads)
            for rank, heads in source.sources()
            if heads.kv_first < mine.kv_first + mine.kv_count
            and mine.kv_first < heads.kv_first + heads.kv_count
        ]
        self._head_dim = source.head_dim
        self._segments: dict[int, shared_memory.SharedMemory] = {}
        self._views: dict[int, list[torch.Tensor]] = {}
        self._results: list[KVTransferResult] = []

    def _source_caches(self, rank: int, kv_count: int) -> list[torch.Tensor]:
        """Prefill rank ``rank``'s caches, mapped on first use (the pools are ready by
        then, so the segment exists), as ``[2, blocks, heads, block_size, dim]`` each."""
        if rank not in self._views:
            segment = map_segment(segment_name(self._service_id, prefill_segment(rank)))
            self._segments[rank] = segment
            dtype = self._caches[0].dtype
            layers = len(self._caches)
            per_block = 2 * self._block_size * kv_count * self._head_dim
            blocks = segment.size // (layers * per_block * dtype.itemsize)
            per_layer = blocks * per_block
            flat = torch.frombuffer(segment.buf, dtype=dtype, count=per_layer * layers)
            self._views[rank] = [
                flat[i * per_layer : (i + 1) * per_layer].view(
                    2, blocks, kv_count, self._block_size, self._head_dim
                )
                for i in range(layers)
            ]
        return self._views[rank]

    def pull(self, order: KVReceive) -> None:
        """Copy the order's blocks now (the engine holds them on the prefill side until
        this rank reports)."""
        mine = self._mine
        src_index = torch.tensor(order.src_block_ids, dtype=torch.long)
        dst_index = torch.tensor(order.block_ids, dtype=torch.long)
        num_bytes = 0
        for rank, heads in self._sources:
            first = max(heads.kv_first, mine.kv_first)
            end = min(heads.kv_first + heads.kv_count, mine.kv_first + mine.kv_count)
            src_span = slice(first - heads.kv_first, end - heads.kv_first)
            dst_span = slice(first - mine.kv_first, end - mine.kv_first)
            for cache, src in zip(
                self._caches, self._source_caches(rank, heads.kv_count), strict=True
            ):
                part = src.index_select(1, src_index)[:, :, src_span]
                cache[:, :, dst_span].index_copy_(1, dst_index, part)  # a strided view
                num_bytes += part.numel() * part.element_size()
        self._results.append(KVTransferResult(order.transfer_id, True, None, num_bytes))

    def take_results(self) -> list[KVTransferResult]:
        out, self._results = self._results, []
        return out

    def close(self) -> None:
        self._views.clear()
        for segment in self._segments.values():
            with contextlib.suppress(BufferError):  # a tensor still views it: exit unmaps
                segment.close()


def prefill_segment(rank: int) -> str:
    """What a prefill rank's shared-memory caches are called (``segment_name``'s ``what``:
    no dash, which separates the service id)."""
    return f"kvp{rank}"


def shared_segment(rank: int, tp_size: int) -> str:
    """The segment both pools of equal widths map for rank ``rank``: zero-copy hand-off."""
    return "kv" if tp_size == 1 else f"kv{rank}"
