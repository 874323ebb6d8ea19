"""SmoothQuant (Xiao et al., 2023) for ``--quantization int8``: before the projections are
quantized, each one's input channels are rescaled so that activation outliers move into
the weights, where per-channel quantization absorbs them.

For a projection ``y = x W^T`` whose input channel j reaches ``max|x_j|`` on a calibration
text, ``s_j = max|x_j|^a / max|W[:, j]|^(1-a)`` (a = 0.5); the weight's columns are
multiplied by ``s`` and the producer of ``x`` divides its channel j by ``s_j``, so the
float model computes the same function (up to float rounding):
- q/k/v and gate/up: the RMSNorm before them (its weight, or Gemma's ``1 + w``);
- down: the up half of gate/up (``act(gate) * up`` is linear in ``up``).
What llm-compressor's SmoothQuantModifier does offline, done here at load on
``calibration.txt`` (Genesis 31-32, ~3k tokens; bench.quality scores Genesis 1-30). On
SmolLM2 it halves the KL divergence to float32 of plain W8A8 (bench.quality).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import AutoTokenizer

from worker.attention import build_metadata
from worker.models.decoder import DecoderLayer, DecoderLM
from worker.models.layers import RMSNorm

CALIBRATION = Path(__file__).parent / "calibration.txt"
ALPHA = 0.5
WINDOW = 512  # tokens a calibration forward takes
BLOCK = 16
TOKENS = 1024  # calibration tokens used


def calibration_ids(model_dir: Path) -> list[int]:
    """The first ``TOKENS`` tokens of the calibration text in ``model_dir``'s tokenizer."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as e:  # transformers raises many types for a missing tokenizer
        raise ValueError(
            f"--quantization int8 calibrates its smoothing on the model's tokenizer, and "
            f"{model_dir} has none that loads: {e}"
        ) from None
    ids: list[int] = tokenizer(CALIBRATION.read_text()).input_ids
    return ids[:TOKENS]


@torch.inference_mode()
def input_maxima(model: DecoderLM, ids: list[int]) -> dict[nn.Module, torch.Tensor]:
    """Each projection's ``max|x_j|`` over the calibration windows (float32)."""
    maxima: dict[nn.Module, torch.Tensor] = {}

    def record(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        x = args[0].detach().float().reshape(-1, args[0].shape[-1]).abs().amax(dim=0)
        maxima[module] = torch.maximum(maxima[module], x) if module in maxima else x

    hooks = [
        m.register_forward_pre_hook(record)
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and name != "lm_head"
    ]
    try:
        for start in range(0, len(ids), WINDOW):
            window = ids[start : start + WINDOW]
            blocks = -(-len(window) // BLOCK)
            caches = [
                torch.zeros(
                    model.kv_cache_shape(blocks, BLOCK), dtype=model.model.embed_tokens.weight.dtype
                )
                for _ in range(model.num_layers)
            ]
            meta = build_metadata(
                [list(range(blocks))], [0], [len(window)], BLOCK, torch.device("cpu")
            )
            model(torch.tensor(window), torch.arange(len(window)), caches, meta)
    finally:
        for hook in hooks:
            hook.remove()
    return maxima


def _factors(x_max: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    w_max = weight.detach().float().abs().amax(dim=0)
    return x_max.clamp(min=1e-5) ** ALPHA / w_max.clamp(min=1e-5) ** (1 - ALPHA)


def _scale_columns(linear: nn.Linear, s: torch.Tensor) -> None:
    linear.weight.data = (linear.weight.data.float() * s[None, :]).to(linear.weight.dtype)


def _divide_norm(norm: RMSNorm, s: torch.Tensor, gemma: bool) -> None:
    w = norm.weight.data.float()
    norm.weight.data = ((1 + w) / s - 1 if gemma else w / s).to(norm.weight.dtype)


def _smooth_layer(layer: DecoderLayer, maxima: dict[nn.Module, torch.Tensor], gemma: bool) -> None:
    attn, mlp = layer.self_attn, layer.mlp
    if attn.qkv_proj is None or mlp.gate_up_proj is None:
        raise RuntimeError("smoothing runs on a fused model (after fuse())")
    ffn_norm = layer.pre_feedforward_layernorm if layer.sandwich else layer.post_attention_layernorm
    for norm, linear in ((layer.input_layernorm, attn.qkv_proj), (ffn_norm, mlp.gate_up_proj)):
        s = _factors(maxima[linear], linear.weight)
        _scale_columns(linear, s)
        _divide_norm(norm, s, gemma)
    s = _factors(maxima[mlp.down_proj], mlp.down_proj.weight)
    _scale_columns(mlp.down_proj, s)
    gate_up = mlp.gate_up_proj.weight.data
    half = gate_up.shape[0] // 2
    gate_up[half:] = (gate_up[half:].float() / s[:, None]).to(gate_up.dtype)


def smooth(model: DecoderLM, ids: list[int]) -> None:
    """Rescale every layer's projections in place, as the module docstring says, from
    their inputs' maxima over the token ids ``ids`` (``calibration_ids``)."""
    maxima = input_maxima(model, ids)
    gemma = model.args.norm == "gemma"
    for layer in model.model.layers:
        if not isinstance(layer, DecoderLayer):
            raise TypeError(f"expected decoder layers, got {type(layer).__name__}")
        _smooth_layer(layer, maxima, gemma)
