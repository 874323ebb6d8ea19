"""The interface every model family offers the model runner."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from worker.attention import AttentionMetadata
from worker.ops import Ops
from worker.parallel import TensorParallel


class CausalLM(nn.Module):
    """A decoder-only LM over the flattened tokens of one step.

    ``forward`` returns hidden states for every scheduled token; ``compute_logits``
    is applied only to the rows that are sampled. Every layer computes through ``ops``.
    """

    def __init__(
        self, hf_config: dict[str, Any], ops: Ops, tp: TensorParallel | None = None
    ) -> None:
        super().__init__()

    @property
    def num_layers(self) -> int:
        raise NotImplementedError

    @property
    def tied_weights(self) -> dict[str, str]:
        """Parameters that are the same tensor as another, absent from checkpoints."""
        return {}

    def fuse(self) -> None:
        """Repack loaded weights for speed (e.g. q/k/v into one matmul); optional."""

    def shard_of(self, name: str) -> tuple[int, int, int] | None:
        """Tensor parallelism: (dim, start, length) of this rank's slice of checkpoint
        tensor ``name``, or None where the rank holds all of it (``worker/parallel.py``)."""
        return None

    def drop_replicated_biases(self) -> None:
        """Tensor parallelism, after loading: zero the biases only rank 0 may add."""

    def attention_shape(self) -> tuple[int, int, int]:
        """(query heads, KV heads, head dim) of the whole model, every rank's together."""
        raise NotImplementedError

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of one layer's KV cache of ``num_blocks`` blocks of ``block_size`` tokens
        (``worker/attention.py`` has the layout)."""
        raise NotImplementedError

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError
