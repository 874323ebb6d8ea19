"""Linear layers for bfloat16 on CPU: a matmul over a weight packed once at load time
(oneDNN's, or Tandem's AVX512-BF16 GEMM where it is faster), and for decode steps of a
few rows Tandem's streaming GEMV.

A plain bfloat16 ``F.linear`` makes oneDNN reorder the weight into its blocked layout on
every call, which costs about as much as the matmul at decode batch sizes. Reordering
once at load time (as PyTorch's inductor does when it freezes a model) makes every
projection 1.3-2x faster, with bit-identical results (checked in tests/unit). float32
is left alone: its prepacked kernels accumulate in another order, and float32 is the
dtype of the parity tests.

At decode batch sizes a projection is a single pass over its weight, and oneDNN's
per-call setup and packed layout keep it well below the memory's speed. On AMX CPUs
Tandem's AVX512-BF16 GEMV (``NativeOps.small_batch_linear``: 1-4 rows, and 3-32 rows on
AMX tiles where a weight's shape fits them) takes those rows instead, over the plain
weight kept beside the packed one: a second copy of the projection weights (the LM head
of a tied model excepted: its plain weight is the embedding) that buys batch-1 steps at
the memory floor (``python -m bench.gemv``).

On CPUs with AVX512-BF16 but no AMX (AMD Zen 4 and 5), Tandem's register-tiled GEMM
(``NativeOps.packing``, ``worker/csrc/bf16_gemm.cpp``) replaces oneDNN and takes every
batch, one row included: its packed copy takes the place of oneDNN's, there is no GEMV
and no plain copy, and it is faster at every batch measured there, decode (1.3x
oneDNN at 32 rows, 1.27x the GEMV at one row on a Zen 5, level with it on slower AMD hosts) and
prefill alike. A ``Packing`` is that choice, made once per process: how a weight is
packed, and the kernel that multiplies by it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

logger = logging.getLogger(__name__)

# The batch-size hint oneDNN packs for; 32 gave identical results to F.linear at every
# batch size measured (a hint of 1 does not for large batches).
PACK_HINT = 32


@dataclass(frozen=True)
class Gemv:
    """A kernel for projections of a few bfloat16 rows over the plain weight."""

    # ``(x [rows, in], weight [out, in], bias [out] | None) -> [rows, out]``
    run: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
    # ``(out_features, in_features) -> the most rows run takes`` (0: none); past them
    # oneDNN is faster (bench.gemv)
    max_rows: Callable[[int, int], int]


@dataclass(frozen=True)
class Packing:
    """A packed weight layout and the matmul over it."""

    name: str
    code: int  # its name in ``decode_layers`` (kOneDnnPacking, kBf16GemmPacking: kernels.h)
    # ``weight [out, in] -> packed``, once at load time
    pack: Callable[[torch.Tensor], torch.Tensor]
    # ``(x [rows, in], packed, bias [out] | None) -> [rows, out]``
    run: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def _onednn_pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_HINT)


def _onednn_run(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


# decode_layers' codes for the two layouts (kOneDnnPacking, kBf16GemmPacking: kernels.h)
ONEDNN_CODE, BF16_GEMM_CODE = 0, 1
ONEDNN = Packing("oneDNN", ONEDNN_CODE, _onednn_pack, _onednn_run)


def can_pack(dtype: torch.dtype, device: torch.device, packing: Packing = ONEDNN) -> bool:
    """bfloat16 on a CPU that multiplies by ``packing``'s layout: Tandem's GEMM runs on
    AVX2 (``bf16_gemm_packs``); oneDNN's refuses CPUs without AVX512BW/VL/DQ or
    AVX-NE-CONVERT (AMD Zen 2/3, Intel before Skylake-SP), where the model keeps
    ``nn.Linear``."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return False
    if packing is not ONEDNN:
        return True
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


class PackedLinear(nn.Module):
    """``nn.Linear`` with its weight held packed (oneDNN's blocked layout unless another
    ``packing`` is given; inference only); given a ``gemv``, batches of up to the rows it
    takes for this shape go to it over the plain weight, kept for it."""

    packed_weight: torch.Tensor
    weight: torch.Tensor | None  # the plain weight, kept only for the gemv
    bias: torch.Tensor | None

    def __init__(
        self, linear: nn.Linear, gemv: Gemv | None = None, packing: Packing = ONEDNN
    ) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.packing = packing
        with torch.no_grad():
            packed = packing.pack(linear.weight.detach().contiguous())
        self.register_buffer("packed_weight", packed, persistent=False)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        self.register_buffer("bias", bias, persistent=False)
        self.gemv = gemv
        self.gemv_rows = gemv.max_rows(self.out_features, self.in_features) if gemv else 0
        plain = linear.weight.detach().contiguous() if self.gemv_rows > 0 else None
        self.register_buffer("weight", plain, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if (
            self.gemv is not None
            and self.weight is not None
            and 0 < flat.shape[0] <= self.gemv_rows
        ):
            out = self.gemv.run(flat.contiguous(), self.weight, self.bias)
        else:
            out = self.packing.run(flat.contiguous(), self.packed_weight, self.bias)
        return out.reshape(*x.shape[:-1], self.out_features)


def pack_linears(model: nn.Module, gemv: Gemv | None = None, packing: Packing = ONEDNN) -> int:
    """Replace every ``nn.Linear`` in ``model`` by a ``PackedLinear`` packed by
    ``packing`` (with ``gemv`` for small batches, if given); returns how many."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, PackedLinear(child, gemv, packing))
                count += 1
    return count
