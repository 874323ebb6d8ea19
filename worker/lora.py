"""LoRA adapters on the worker: rows of several adapters and of the base model in one
forward (the SGMV idea of Punica and vLLM).

``attach_lora`` wraps each layer's four projections once, in ``LoRALinear``: the base
projection runs over every row of the step as before, then each adapter of the step adds
its delta to its own rows only: for a few rows one native call for every adapter
(``lora_sgmv_``, ``worker/csrc/lora_sgmv.cpp``), for many (a long prefill) per adapter
the rows gathered, two thin matmuls and an ``index_add_``. Which
rows run with which adapter is the step's ``LoRABatch``, set by the model runner before
the forward and cleared after; the wrapped projections and the model hold it by
reference, so there is no global state. A step with no adapter rows runs the base
projections alone, and the model's fused decode path with them.

The adapters themselves (``LoRAWeights``, ``load_lora_weights``: ``worker/lora_weights.py``)
are kept loaded by a ``LoRACache`` of a fixed capacity, least recently used out first.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn

from common.messages import LoRARequest
from worker.lora_weights import (
    PROJECTIONS,
    LoRAFactors,
    LoRAWeights,
    load_lora_weights,
    lora_module_shapes,
)
from worker.models.decoder import DecoderLayer, DecoderLM
from worker.native import NativeKernels

__all__ = [
    "LoRABatch",
    "LoRACache",
    "LoRAFactors",
    "LoRALinear",
    "LoRAWeights",
    "attach_lora",
    "load_lora_weights",
    "lora_module_shapes",
]


# Where a step has at most this many adapter rows, the native SGMV kernel adds the
# deltas (one call per projection, whatever the number of adapters); above it, as in a
# long prefill, per-adapter matmuls reuse each factor across the rows and win.
NATIVE_MAX_ROWS = 64


class LoRABatch:
    """The current step's adapter rows: per adapter, the indices (long, on the model's
    device) of the step's flattened token rows that run with it. Rows of no adapter are
    absent. Owned by the model runner (``set`` before a forward, ``clear`` after); read
    by every ``LoRALinear`` and by ``DecoderLM.forward``. ``kernels``: the native
    kernels where the worker runs them (``lora_sgmv_``), else None."""

    def __init__(self, kernels: NativeKernels | None = None) -> None:
        self.kernels = kernels
        self.groups: tuple[tuple[LoRAWeights, torch.Tensor], ...] = ()
        # The native kernel's view of the groups: their rows end to end, and where each
        # group starts (None: the step takes the matmul path).
        self._segments: tuple[torch.Tensor, torch.Tensor] | None = None
        self._no_factors: dict[tuple[int, int], LoRAFactors] = {}

    def set(self, groups: list[tuple[LoRAWeights, torch.Tensor]]) -> None:
        """The rows of each adapter for the next forward (each row in one group at most:
        a row of two groups would get both deltas)."""
        self.groups = tuple((weights, rows) for weights, rows in groups if rows.numel())
        self._segments = None
        num_rows = sum(rows.numel() for _, rows in self.groups)
        if self.kernels is not None and 0 < num_rows <= NATIVE_MAX_ROWS:
            sizes = [0] + [rows.numel() for _, rows in self.groups]
            starts = torch.tensor(sizes, dtype=torch.long).cumsum(0)
            self._segments = torch.cat([rows for _, rows in self.groups]), starts

    def clear(self) -> None:
        self.groups = ()
        self._segments = None

    @property
    def active(self) -> bool:
        """Whether any row of the step runs with an adapter."""
        return bool(self.groups)

    def add_deltas(self, y: torch.Tensor, x: torch.Tensor, layer: int, projection: str) -> None:
        """``y[rows] += lora_B(lora_A(x[rows])) * scaling`` for each adapter's rows, in
        place: the scaling after both matmuls, as PEFT applies it."""
        if self._segments is not None and self.kernels is not None:
            rows, starts = self._segments
            factors = [
                w.layers[layer].get(projection) or self._none(x.shape[1], y.shape[1])
                for w, _ in self.groups
            ]
            scales = [w.scaling for w, _ in self.groups]
            self.kernels.lora_sgmv_(
                y,
                x.contiguous(),
                rows,
                starts,
                [f.a for f in factors],
                [f.bt for f in factors],
                [f.blocks for f in factors],
                scales,
            )
            return
        for weights, rows in self.groups:
            f = weights.layers[layer].get(projection)
            if f is not None:
                delta = F.linear(x.index_select(0, rows).float(), f.a) @ f.bt
                y.index_add_(0, rows, (delta * weights.scaling).to(y.dtype))

    def _none(self, in_features: int, out_features: int) -> LoRAFactors:
        """Rank-0 factors for a group whose adapter leaves a projection alone: the kernel
        adds it an exact zero."""
        key = (in_features, out_features)
        if key not in self._no_factors:
            a, b = torch.zeros(0, in_features), torch.zeros(out_features, 0)
            self._no_factors[key] = LoRAFactors.of(a, b, [])
        return self._no_factors[key]


class LoRALinear(nn.Module):
    """A layer's projection (``nn.Linear`` or a quantized one, called as is) plus each
    adapter's delta on its rows: ``y[rows] += lora_B(lora_A(x[rows])) * scaling``, added
    before any all-reduce that follows the projection."""

    def __init__(self, base: nn.Module, layer_index: int, projection: str, batch: LoRABatch):
        super().__init__()
        self.base = base
        self.layer_index, self.projection = layer_index, projection
        self.batch = batch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.base(x)
        if self.batch.groups:
            self.batch.add_deltas(y, x, self.layer_index, self.projection)
        return y

    def extra_repr(self) -> str:
        return f"layer={self.layer_index}, projection={self.projection}"


def attach_lora(model: DecoderLM, batch: LoRABatch) -> None:
    """Once, after loading: wrap every layer's projections to add ``batch``'s adapter
    deltas, and have the model leave its fused decode path to steps without them."""
    if model.lora_batch is not None:
        raise RuntimeError("attach_lora runs once per model")
    for index, layer in enumerate(model.model.layers):
        if not isinstance(layer, DecoderLayer):
            raise TypeError(f"layer {index} is a {type(layer).__name__}, not a DecoderLayer")
        for projection in PROJECTIONS:
            owner = layer.self_attn if projection in ("qkv_proj", "o_proj") else layer.mlp
            base = getattr(owner, projection)
            if not isinstance(base, nn.Module):
                raise RuntimeError(f"attach_lora runs after fuse(): layer {index} {projection}")
            setattr(owner, projection, LoRALinear(base, index, projection, batch))
    model.lora_batch = batch


class LoRACache:
    """The adapters this worker keeps loaded, by ``int_id``, at most ``capacity`` of
    them: ``get`` loads one on a miss, dropping the least recently used. A dropped
    adapter still in the current step's ``LoRABatch`` lives on until the batch is
    cleared; the next step that asks for it loads it again."""

    def __init__(self, model: DecoderLM, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a LoRA cache holds at least one adapter, not {capacity}")
        self.model, self.capacity = model, capacity
        self._loaded: OrderedDict[int, LoRAWeights] = OrderedDict()
        self.num_loads = 0

    def get(self, request: LoRARequest) -> LoRAWeights:
        """``request``'s adapter, loaded now if it is not kept. Raises ``AdapterError``
        (keeping nothing) where its files do not fit the model."""
        weights = self._loaded.get(request.int_id)
        if weights is not None:
            self._loaded.move_to_end(request.int_id)
            return weights
        weights = load_lora_weights(request, self.model)
        self.num_loads += 1
        if len(self._loaded) >= self.capacity:
            self._loaded.popitem(last=False)
        self._loaded[request.int_id] = weights
        return weights

    def __contains__(self, int_id: int) -> bool:
        return int_id in self._loaded

    def __len__(self) -> int:
        return len(self._loaded)
