"""How a worker keeps its projection weights (``--quantization``), chosen once per worker
and applied by the loader after the float weights are in place: as loaded (no quantizer),
in a GGUF file's blocks (``GgufBlocks``), or int8 per channel (``Int8PerChannel``, W8A8).
Both run on the native CPU kernels only; each refuses what it cannot serve, naming why."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from common.config import GgufActivations, Quantization
from common.model_files import gguf_source, resolve_model_dir
from worker.models import smooth_quant
from worker.models.base import CausalLM
from worker.models.decoder import DecoderLM
from worker.models.gguf_weights import GgufFile
from worker.models.int8_linear import quantize_linears_int8
from worker.models.quant_linear import quantize_linears
from worker.ops import NativeOps, Ops
from worker.parallel import TensorParallel

logger = logging.getLogger(__name__)
GGUF_Q4_1 = 3  # ggml's type id: gguf_has_bf16_rows' answer for it is the CPU's


class WeightQuantizer(Protocol):
    @property
    def flag(self) -> str:
        """The ``--quantization`` value, for errors."""
        ...

    def apply(
        self,
        model: CausalLM,
        config: dict[str, Any],
        ops: Ops | None,
        tp: TensorParallel,
        device: torch.device,
    ) -> None:
        """Swap ``model``'s projections (loaded and fused) for quantized ones, in place."""


def _native_ops(flag: str, ops: Ops | None, tp: TensorParallel, device: torch.device) -> NativeOps:
    if device.type != "cpu" or not isinstance(ops, NativeOps):
        raise ValueError(
            f"--quantization {flag} runs on the native CPU kernels; this worker has "
            f"{ops.name if ops is not None else 'PyTorch'} ops on {device}"
        )
    if tp.size > 1:
        raise ValueError(f"--quantization {flag} does not shard across tensor-parallel ranks")
    return ops


@dataclass(frozen=True)
class GgufBlocks:
    """The projections a GGUF file of these weights holds quantized, kept in its blocks;
    ``activations``: how their inputs are multiplied (``--gguf-activations``)."""

    path: Path
    activations: GgufActivations = "auto"
    flag: str = "gguf"

    def apply(
        self,
        model: CausalLM,
        config: dict[str, Any],
        ops: Ops | None,
        tp: TensorParallel,
        device: torch.device,
    ) -> None:
        native = _native_ops(self.flag, ops, tp, device)
        heads = int(config["num_attention_heads"])
        gguf = GgufFile(
            self.path,
            num_layers=int(config["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads", heads)),
        )
        tied = "lm_head.weight" in model.tied_weights
        q8 = q8_activations(self.activations, native)
        counts = quantize_linears(model, gguf, native.kernels, tied, q8)
        if not counts:
            raise ValueError(f"{self.path} holds no quantized projection of this model")
        logger.info(
            "kept %d projection weights quantized from %s (%s), %s activations",
            sum(counts.values()),
            self.path.name,
            ", ".join(f"{n} {t}" for t, n in sorted(counts.items())),
            "8-bit" if q8 else "float",
        )


def q8_activations(activations: GgufActivations, native: NativeOps) -> bool:
    """``--gguf-activations``: ``auto`` is 8-bit activations where the CPU has no bfloat16
    dot product (AVX2 hosts: a SmolLM2 Q4_1 step measured faster so, docs/benchmarks.md),
    and float where it has AVX512-BF16: there the exact bfloat16-row kernels were the ones
    measured against llama.cpp, and stay until q8 is measured on such a host."""
    if activations == "auto":
        return not native.kernels.gguf_has_bf16_rows(GGUF_Q4_1, 1)
    return activations == "q8"


@dataclass(frozen=True)
class Int8PerChannel:
    """W8A8: every projection but the LM head quantized to int8 per output channel, after
    SmoothQuant's rescaling (``smooth``: calibrated on ``model_dir``'s tokenizer)."""

    model_dir: Path
    smooth: bool = True
    flag: str = "int8"

    def apply(
        self,
        model: CausalLM,
        config: dict[str, Any],
        ops: Ops | None,
        tp: TensorParallel,
        device: torch.device,
    ) -> None:
        native = _native_ops(self.flag, ops, tp, device)
        if self.smooth:
            if not isinstance(model, DecoderLM):
                raise ValueError(f"--quantization int8 smooths decoder models, not {type(model)}")
            smooth_quant.smooth(model, smooth_quant.calibration_ids(self.model_dir))
        count = quantize_linears_int8(model, native.kernels)
        isa = ("portable", "AVX2", "AVX-VNNI", "AVX512-VNNI", "AMX-INT8")[
            native.kernels.int8_linear_isas()[-1]
        ]
        logger.info("quantized %d projections to int8 per channel (W8A8 on %s)", count, isa)


def quantizer_for(
    quantization: Quantization, model: str, gguf_activations: GgufActivations = "auto"
) -> WeightQuantizer | None:
    """The quantizer ``--quantization`` names for ``--model`` (None: weights as loaded)."""
    if quantization == "gguf":
        return GgufBlocks(gguf_source(model), gguf_activations)
    if quantization == "int8":
        return Int8PerChannel(resolve_model_dir(model))
    return None
