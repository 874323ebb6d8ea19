"""Layers shared by the model families, written to match ``transformers`` numerically."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from worker.ops import ACTIVATIONS, Ops


class RMSNorm(nn.Module):
    """Llama style: normalize in float32, cast back, then scale by ``weight``; Gemma
    style (``gemma=True``): scale by ``1 + weight`` in float32, then cast back."""

    def __init__(self, hidden_size: int, eps: float, ops: Ops, gemma: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size) if gemma else torch.ones(hidden_size))
        self.eps = eps
        self.gemma = gemma
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps, self.gemma)

    def add_and_norm(self, x: torch.Tensor, add: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x + add, norm(x + add))``: a residual add and the norm after it."""
        return self.ops.add_rms_norm(x, add, self.weight, self.eps, self.gemma)


@dataclass(frozen=True)
class RopeSpec:
    """RoPE of one kind of layer: base, and the scaling a checkpoint asks for."""

    theta: float
    scaling: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    @staticmethod
    def from_params(params: dict[str, Any], default_theta: float = 10000.0) -> RopeSpec:
        """From a ``rope_parameters`` / ``rope_scaling`` dict (either transformers era)."""
        kind = params.get("rope_type", params.get("type", "default")) or "default"
        if kind not in ("default", "linear", "llama3"):
            raise ValueError(f"rope type {kind!r} is not supported (default, linear, llama3 are)")
        return RopeSpec(
            theta=float(params.get("rope_theta", default_theta)),
            scaling=kind,
            factor=float(params.get("factor", 1.0)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                params.get("original_max_position_embeddings", 8192)
            ),
        )

    def inv_freq(self, head_dim: int, device: torch.device) -> torch.Tensor:
        exponents = (
            torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
        )
        inv_freq = 1.0 / (self.theta**exponents)
        if self.scaling == "linear":
            return inv_freq / self.factor
        if self.scaling == "llama3":
            return self._llama3(inv_freq)
        return inv_freq

    def _llama3(self, inv_freq: torch.Tensor) -> torch.Tensor:
        old_len = self.original_max_position_embeddings
        low_freq_wavelen = old_len / self.low_freq_factor
        high_freq_wavelen = old_len / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (old_len / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin per position, computed in float32 as transformers does, once per position:
    a step looks its positions up in a table (two index_selects rather than seven ops over
    cold caches, ~0.1 ms of a one-row decode step). Each entry is the same elementwise
    computation as for that position alone, so the values are bit for bit the same."""

    _MIN_POSITIONS = 1024

    def __init__(self, head_dim: int, spec: RopeSpec) -> None:
        super().__init__()
        self.head_dim, self.spec = head_dim, spec
        # Plain attributes, not buffers: models are built on the meta device and these
        # are derived, float32 first whatever dtype the weights take.
        self._inv_freq: torch.Tensor | None = None
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype, positions_end: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions`` [n] (each below ``positions_end``) -> cos, sin [n, head_dim]."""
        table = self._tables.get(dtype)
        if (
            table is None
            or table[0].shape[0] < positions_end
            or table[0].device != positions.device
        ):
            size = max(self._MIN_POSITIONS, 1 << (positions_end - 1).bit_length())
            table = self._compute(torch.arange(size, device=positions.device), dtype)
            self._tables[dtype] = table
        cos, sin = table
        return cos.index_select(0, positions), sin.index_select(0, positions)

    def _compute(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._inv_freq is None or self._inv_freq.device != positions.device:
            self._inv_freq = self.spec.inv_freq(self.head_dim, positions.device)
        freqs = positions.float()[:, None] * self._inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def fuse_linears(layers: list[nn.Linear]) -> nn.Linear:
    """One Linear computing ``layers`` side by side (outputs concatenated): fewer,
    larger matmuls per step."""
    has_bias = layers[0].bias is not None
    fused = nn.Linear(
        layers[0].in_features, sum(layer.out_features for layer in layers), bias=has_bias
    )
    fused = fused.to(device=layers[0].weight.device, dtype=layers[0].weight.dtype)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([layer.weight for layer in layers]))
        if has_bias:
            fused.bias.copy_(torch.cat([layer.bias for layer in layers]))
    return fused


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))``: SwiGLU (silu) or GeGLU (tanh gelu). Loaded as
    ``gate_proj``/``up_proj``; ``fuse()`` then packs them into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str, ops: Ops) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            supported = ", ".join(ACTIVATIONS)
            raise ValueError(f"activation {activation!r} is not supported ({supported} are)")
        self.activation = activation
        self.ops = ops
        self.gate_proj: nn.Linear | None = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj: nn.Linear | None = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.gate_up_proj: nn.Linear | None = None
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def fuse(self) -> None:
        """Once, after loading: gate and up in one matmul."""
        if self.gate_proj is None or self.up_proj is None:
            raise RuntimeError("GatedMLP.fuse() runs once, after loading")
        self.gate_up_proj = fuse_linears([self.gate_proj, self.up_proj])
        self.gate_proj = self.up_proj = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is None:
            raise RuntimeError("GatedMLP runs after fuse()")
        return self.down_proj(self.ops.act_mul(self.gate_up_proj(x), self.activation))
