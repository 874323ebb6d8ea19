"""The native kernels, counting the rows of each fused decode step by the entry it took
(``decode_rows`` on raw rows or ``decode_layers``), for the tests of ``DecodeStack``, and
of each ``QuantLinear`` call past its fused rows on ``gguf_bf16_matmul``."""

from __future__ import annotations

import torch


class CountedKernels:
    """Wraps the kernels a ``DecodeStack`` calls; every other attribute is the kernels'."""

    def __init__(self, kernels: object) -> None:
        self._kernels = kernels
        self.rows: list[int] = []
        self.layers: list[int] = []
        self.matmuls: list[int] = []

    def __getattr__(self, name: str) -> object:
        return getattr(self._kernels, name)

    def decode_rows(self, x: torch.Tensor, *args: object) -> torch.Tensor:
        self.rows.append(x.shape[0])
        return self._kernels.decode_rows(x, *args)  # type: ignore[attr-defined]

    def decode_layers(self, x: torch.Tensor, *args: object) -> torch.Tensor:
        self.layers.append(x.shape[0])
        return self._kernels.decode_layers(x, *args)  # type: ignore[attr-defined]

    def gguf_bf16_matmul(self, x: torch.Tensor, *args: object) -> torch.Tensor:
        self.matmuls.append(x.shape[0])
        return self._kernels.gguf_bf16_matmul(x, *args)  # type: ignore[attr-defined]
