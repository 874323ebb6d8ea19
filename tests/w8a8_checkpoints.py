"""W8A8 checkpoints as llm-compressor saves them, written by compressed-tensors (the
library that defines the format and that llm-compressor saves through): the ``W8A8``
preset on every ``Linear`` but the LM head, each weight's per-channel scale computed as
compressed-tensors' own ``calculate_qparams`` computes it (what llm-compressor's
min-max observer hands it), then compressed to int8 and saved with the checkpoint's
``quantization_config``. llm-compressor itself pins transformers below ours, so it is
not installed; its W8A8 save is this path, after whatever it did to the float weights."""

from __future__ import annotations

from pathlib import Path

import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.quantization import (
    QuantizationConfig,
    apply_quantization_config,
    preset_name_to_scheme,
)
from compressed_tensors.quantization.utils import calculate_qparams
from transformers import PreTrainedModel


def save_w8a8(model: PreTrainedModel, out: Path) -> None:
    """``model`` (float, as ``transformers`` holds it) saved into ``out`` as a W8A8
    checkpoint; ``model`` is left compressed."""
    scheme = preset_name_to_scheme("W8A8", ["Linear"])
    apply_quantization_config(
        model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"])
    )
    with torch.no_grad():
        for module in model.modules():
            args = getattr(getattr(module, "quantization_scheme", None), "weights", None)
            if args is None:
                continue
            params = dict(module.named_parameters())  # with the scheme's, which apply added
            w = params["weight"]
            scale, zero = calculate_qparams(w.amin(1, keepdim=True), w.amax(1, keepdim=True), args)
            params["weight_scale"].copy_(scale)
            params["weight_zero_point"].copy_(zero)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="int-quantized")
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(str(out))
