"""KV cache events in vLLM's wire format, and the log a KV manager records them in.

A router (vLLM's ``kv_aware`` policy, llm-d's indexer) keeps an index of which prefix
blocks each instance holds from these events. The structs reproduce the definitions of
vLLM's ``vllm/distributed/kv_events.py`` (0.34) field for field, so they encode to the
same MessagePack: a batch is an array ``[ts, events, data_parallel_rank]``; each event a
map tagged ``"type": "BlockStored" | "BlockRemoved" | "AllBlocksCleared"``, fields with a
default left out when unset, those without one (``lora_id``, ``medium``, ``lora_name``)
always present. ``tests/unit/test_kv_events.py`` decodes them with vLLM's own classes.

Block hashes go out as vLLM sends them by default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``):
the last 64 bits of the block's hash as an unsigned int. Consumers use them only to chain
a block to its parent and to name removals; they match prefixes by the token ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import msgspec

from common.messages import LoRARequest

MEDIUM_GPU = "GPU"  # vLLM's name for the device tier, whatever the device
MEDIUM_CPU = "CPU"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of every KV cache event."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def external_hash(block_hash: bytes) -> int:
    """The hash as vLLM publishes it: its last 8 bytes, big-endian, unsigned."""
    return int.from_bytes(block_hash, "big") & 0xFFFF_FFFF_FFFF_FFFF


class KVEventSink(Protocol):
    """Where a KV manager reports blocks entering and leaving its prefix cache."""

    def stored(
        self,
        hashes: Sequence[bytes],
        parent: bytes | None,
        token_ids: Sequence[int],
        lora: LoRARequest | None = None,
    ) -> None: ...

    def removed(self, block_hash: bytes) -> None: ...

    def cleared(self) -> None: ...

    def take(self) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
        """The events since the last ``take``, oldest first."""
        ...


class NoKVEvents:
    """Events off: nothing recorded."""

    def stored(
        self,
        hashes: Sequence[bytes],
        parent: bytes | None,
        token_ids: Sequence[int],
        lora: LoRARequest | None = None,
    ) -> None:
        pass

    def removed(self, block_hash: bytes) -> None:
        pass

    def cleared(self) -> None:
        pass

    def take(self) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
        return []


class KVEventLog:
    """Events recorded by the step loop's KV manager, taken once per step for publishing."""

    def __init__(self, block_size: int, medium: str = MEDIUM_GPU) -> None:
        self.block_size = block_size
        self.medium = medium
        self._events: list[BlockStored | BlockRemoved | AllBlocksCleared] = []

    def stored(
        self,
        hashes: Sequence[bytes],
        parent: bytes | None,
        token_ids: Sequence[int],
        lora: LoRARequest | None = None,
    ) -> None:
        self._events.append(
            BlockStored(
                block_hashes=[external_hash(h) for h in hashes],
                parent_block_hash=None if parent is None else external_hash(parent),
                token_ids=list(token_ids),
                block_size=self.block_size,
                lora_id=None if lora is None else lora.int_id,
                medium=self.medium,
                lora_name=None if lora is None else lora.name,
                group_idx=0,
                kv_cache_spec_kind="full_attention",
            )
        )

    def removed(self, block_hash: bytes) -> None:
        self._events.append(
            BlockRemoved(block_hashes=[external_hash(block_hash)], medium=self.medium, group_idx=0)
        )

    def cleared(self) -> None:
        self._events.append(AllBlocksCleared())

    def take(self) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
        events, self._events = self._events, []
        return events
