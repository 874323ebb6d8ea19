"""W8A8 checkpoints as llm-compressor saves them (the compressed-tensors tests' and the
vLLM W8A8 peer's), written by compressed-tensors (the library that defines the format
and that llm-compressor saves through): the ``W8A8``
preset on every ``Linear`` but the LM head, each weight's per-channel scale computed as
compressed-tensors' own ``calculate_qparams`` computes it (what llm-compressor's
min-max observer hands it), then compressed to int8 and saved with the checkpoint's
``quantization_config``. llm-compressor itself pins transformers below ours, so it is
not installed; its W8A8 save is this path, after whatever it did to the float weights."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.quantization import (
    QuantizationConfig,
    apply_quantization_config,
    preset_name_to_scheme,
)
from compressed_tensors.quantization.utils import calculate_qparams
from transformers import AutoModelForCausalLM, PreTrainedModel

from common.model_files import cache_root, resolve_model_dir


def save_w8a8(model: PreTrainedModel, out: Path, ignore: tuple[str, ...] = ()) -> None:
    """``model`` (float, as ``transformers`` holds it) saved into ``out`` as a W8A8
    checkpoint, the LM head and ``ignore`` (names or ``re:`` patterns, as llm-compressor
    takes them) left float; ``model`` is left compressed."""
    scheme = preset_name_to_scheme("W8A8", ["Linear"])
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head", *ignore])
    apply_quantization_config(model, config)
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


def w8a8_of(model: str) -> Path:
    """A W8A8 checkpoint of the embedded ``model`` (its tokenizer beside it), made once
    into the cache: plain round-to-nearest per channel, no smoothing."""
    out = cache_root() / "models" / f"{model}-w8a8"
    if (out / "config.json").is_file():
        return out
    source = resolve_model_dir(model)
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    save_w8a8(AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32), partial)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (source / name).is_file():
            shutil.copy(source / name, partial / name)
    partial.rename(out)
    return out
