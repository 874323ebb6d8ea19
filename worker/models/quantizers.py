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
from common.model_files import gguf_source, read_hf_config, resolve_model_dir
from worker.models import compressed_tensors, smooth_quant
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


def _native_ops(what: str, ops: Ops | None, tp: TensorParallel, device: torch.device) -> NativeOps:
    """``ops`` where they are the native CPU kernels of one rank; ``what``: the mode, as
    the error names it."""
    if device.type != "cpu" or not isinstance(ops, NativeOps):
        raise ValueError(
            f"{what} runs on the native CPU kernels; this worker has "
            f"{ops.name if ops is not None else 'PyTorch'} ops on {device}"
        )
    if tp.size > 1:
        raise ValueError(f"{what} does not shard across tensor-parallel ranks")
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
        native = _native_ops(f"--quantization {self.flag}", ops, tp, device)
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
        native = _native_ops(f"--quantization {self.flag}", ops, tp, device)
        if self.smooth:
            if not isinstance(model, DecoderLM):
                raise ValueError(f"--quantization int8 smooths decoder models, not {type(model)}")
            smooth_quant.smooth(model, smooth_quant.calibration_ids(self.model_dir))
        count = quantize_linears_int8(model, native.kernels)
        isa = ("portable", "AVX2", "AVX-VNNI", "AVX512-VNNI", "AMX-INT8")[
            native.kernels.int8_linear_isas()[-1]
        ]
        logger.info("quantized %d projections to int8 per channel (W8A8 on %s)", count, isa)


@dataclass(frozen=True)
class CheckpointW8A8:
    """W8A8 as a compressed-tensors checkpoint holds it (``compressed_tensors.py``): its
    int8 weights and per-channel scales as they are, no smoothing or rounding of ours."""

    model_dir: Path
    flag: str = "compressed-tensors"

    def apply(
        self,
        model: CausalLM,
        config: dict[str, Any],
        ops: Ops | None,
        tp: TensorParallel,
        device: torch.device,
    ) -> None:
        # (chosen by the checkpoint itself, whatever --quantization said)
        native = _native_ops("a W8A8 checkpoint (compressed-tensors)", ops, tp, device)
        if not isinstance(model, DecoderLM):
            raise ValueError(f"W8A8 checkpoints are served for decoder models, not {type(model)}")
        scales = compressed_tensors.read_weight_scales(self.model_dir)
        count = compressed_tensors.quantize_from_checkpoint(model, scales, native.kernels)
        logger.info("%d projections int8 from the checkpoint's W8A8 (compressed-tensors)", count)


def quantizer_for(
    quantization: Quantization, model: str, gguf_activations: GgufActivations = "auto"
) -> WeightQuantizer | None:
    """The quantizer ``--quantization`` names for ``--model`` (None: weights as loaded).
    A W8A8 checkpoint (compressed-tensors) is served as its ``quantization_config`` says,
    as vLLM serves it, whether ``--quantization`` is left out or names ``int8`` or
    ``compressed-tensors``; ``gguf`` for it, or ``compressed-tensors`` for a checkpoint
    that is not one, is a ``ValueError``."""
    if quantization == "gguf":
        return GgufBlocks(gguf_source(model), gguf_activations)
    model_dir = resolve_model_dir(model)
    if compressed_tensors.is_w8a8_checkpoint(read_hf_config(model_dir)):
        if quantization == "none":
            logger.info("%s is a W8A8 checkpoint (compressed-tensors): served as int8", model)
        return CheckpointW8A8(model_dir)
    if quantization == "compressed-tensors":
        raise ValueError(
            f"--quantization compressed-tensors: {model} has no compressed-tensors "
            "quantization_config"
        )
    if quantization == "int8":
        return Int8PerChannel(model_dir)
    return None
