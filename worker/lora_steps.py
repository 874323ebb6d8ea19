"""Which rows of a step run with which LoRA adapter, for the model runner.

``StepAdapters`` owns the adapters this worker keeps loaded (``LoRACache``) and the
``LoRABatch`` the model's wrapped projections read (``worker/lora.py``): ``rows`` sets
the step's row groups for the forward and clears them after, so a step without adapter
rows leaves the model exactly as without LoRA (the fused decode path included).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from common.messages import LoRARequest
from worker.lora import LoRABatch, LoRACache, attach_lora, lora_module_shapes
from worker.models.base import CausalLM
from worker.models.decoder import DecoderLM
from worker.native import NativeKernels

# (adapter or None, first row, number of rows) per request of a step, in batch order.
AdapterRows = Sequence[tuple[LoRARequest | None, int, int]]


class NoAdapters:
    """LoRA off (no ``--enable-lora``): every row runs the base model."""

    module_shapes: dict[str, tuple[int, int]] = {}

    @contextmanager
    def rows(self, adapter_rows: AdapterRows, device: torch.device) -> Iterator[None]:
        yield


class StepAdapters:
    def __init__(self, model: CausalLM, capacity: int, kernels: NativeKernels | None) -> None:
        if not isinstance(model, DecoderLM):  # every family served is one
            raise ValueError(f"LoRA adapters are served on decoder models, not {type(model)}")
        self.batch = LoRABatch(kernels)
        attach_lora(model, self.batch)
        self.cache = LoRACache(model, capacity)
        self.module_shapes = lora_module_shapes(model)

    @contextmanager
    def rows(self, adapter_rows: AdapterRows, device: torch.device) -> Iterator[None]:
        by_adapter: dict[int, tuple[LoRARequest, list[int]]] = {}
        for lora, first, count in adapter_rows:
            if lora is not None:
                by_adapter.setdefault(lora.int_id, (lora, []))[1].extend(
                    range(first, first + count)
                )
        if not by_adapter:
            yield
            return
        self.batch.set(
            [
                (self.cache.get(lora), torch.tensor(rows, dtype=torch.long, device=device))
                for lora, rows in by_adapter.values()
            ]
        )
        try:
            yield
        finally:
            self.batch.clear()
