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

    def DecodeRowsPlan(self, *args: object) -> _CountedPlan:  # the kernels' name
        return _CountedPlan(self._kernels.DecodeRowsPlan(*args), self.rows)  # type: ignore[attr-defined]

    def decode_layers(self, x: torch.Tensor, *args: object) -> torch.Tensor:
        self.layers.append(x.shape[0])
        return self._kernels.decode_layers(x, *args)  # type: ignore[attr-defined]

    def gguf_bf16_matmul(self, x: torch.Tensor, *args: object) -> torch.Tensor:
        self.matmuls.append(x.shape[0])
        return self._kernels.gguf_bf16_matmul(x, *args)  # type: ignore[attr-defined]


class _CountedPlan:
    """A ``DecodeRowsPlan`` that appends each step's rows to ``rows``."""

    def __init__(self, plan: object, rows: list[int]) -> None:
        self._plan, self._rows = plan, rows

    def run(self, ids: torch.Tensor, *args: object) -> torch.Tensor:
        self._rows.append(ids.shape[0])
        return self._plan.run(ids, *args)  # type: ignore[attr-defined]
