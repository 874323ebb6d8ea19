"""The fused decode step (every layer in one ``decode_rows`` call) split into its phases
for ``bench.step_profile``: the step labelled and its attended KV positions counted,
``decode_rows``' own clock read over the profile's unprofiled steps, and the rates its
projections and attention reached against the machine's."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from bench.floor import Machine, ModelCost
from worker.attention import AttentionMetadata
from worker.models.decode_stack import DecodeStack
from worker.models.decoder import DecoderLM, FusedDecode
from worker.packed_linear import PackedLinear


class FusedLabel:
    """A ``FusedDecode`` whose calls are labelled in the profile, and that counts the KV
    positions its steps attend to (for the attention phase's bytes read)."""

    def __init__(self, fused: FusedDecode, call: Callable[..., torch.Tensor]) -> None:
        self._fused, self._call = fused, call
        self.positions = 0

    @property
    def stack(self) -> DecodeStack | None:
        """The fused stack, where it is ``decode_rows``' (whose phases are timed)."""
        return self._fused if isinstance(self._fused, DecodeStack) else None

    def takes(self, meta: AttentionMetadata, num_tokens: int) -> bool:
        return self._fused.takes(meta, num_tokens)

    def __call__(
        self,
        input_ids: torch.Tensor,
        rope: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        if meta.decode_context_lens is not None:
            self.positions += int(meta.decode_context_lens.sum())
        return self._call(input_ids, rope, kv_caches, meta)


def run_timing_phases(
    fused: object, step: Callable[[], object], steps: int
) -> dict[str, Any] | None:
    """``steps`` steps, with ``decode_rows`` timing its phases where ``fused`` (the model's
    fused decode, as ``label_ops`` wrapped it) runs them through it (each
    phase's wall time on the step's thread, the parallel regions' waits included; reading
    the clock costs ~10 us a step): each phase's mean ms a step and the KV positions a
    step's attention read, or None where the steps were not ``decode_rows``'."""
    if not isinstance(fused, FusedLabel) or (stack := fused.stack) is None:
        for _ in range(steps):
            step()
        return None
    names = stack.kernels.decode_rows_phases()
    stack.phase_seconds = torch.zeros(len(names), dtype=torch.float64)
    fused.positions = 0
    try:
        for _ in range(steps):
            step()
        seconds = stack.phase_seconds.tolist()
    finally:
        stack.phase_seconds = None
    if not any(seconds):
        return None  # the steps' rows went to decode_layers
    return {
        "phases_ms": {n: 1e3 * t / steps for n, t in zip(names, seconds, strict=True)},
        "positions_per_step": fused.positions / steps,
    }


def layer_projection_params(model: DecoderLM) -> int:
    """Weights of every layer's projections (the fused step's GEMMs; not the LM head)."""
    return sum(
        m.in_features * m.out_features
        for layer in model.model.layers
        for m in layer.modules()
        if isinstance(m, PackedLinear)
    )


def phase_rates(
    row: dict[str, Any], projection_params: int, cost: ModelCost, machine: Machine, itemsize: int
) -> str:
    """What the fused step's projections computed and read, and its attention read, per
    second, against the machine's matmul rate and read bandwidth."""
    phases, batch = row["fused_phases"], row["batch"]
    projection_s = phases["phases_ms"]["projections"] / 1e3
    tflops = 2 * batch * projection_params / projection_s / 1e12
    weights_gb_s = projection_params * itemsize / projection_s / 1e9
    attention_s = phases["phases_ms"]["attention"] / 1e3
    kv_bytes = phases["positions_per_step"] * cost.kv_bytes_per_position
    kv_gb_s = kv_bytes / attention_s / 1e9
    context = phases["positions_per_step"] / batch
    return (
        f"batch {batch}, fused phases (contexts ~{context:.0f}): projections "
        f"{tflops:.2f} TFLOP/s ({100 * tflops / machine.matmul_tflops:.0f}% of the matmul "
        f"rate), their weights read at {weights_gb_s:.1f} GB/s; attention read "
        f"{kv_bytes / 1e6:.0f} MB of KV at {kv_gb_s:.1f} GB/s "
        f"({100 * kv_gb_s / machine.read_gb_s:.0f}% of the read bandwidth)"
    )
