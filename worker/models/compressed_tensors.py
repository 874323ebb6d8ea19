"""W8A8 checkpoints in the compressed-tensors format: what llm-compressor writes (its
``W8A8`` scheme, often after SmoothQuant or GPTQ) and vLLM serves from the checkpoint's
own ``quantization_config``.

Such a checkpoint keeps every quantized projection as an int8 ``weight [out, in]`` and a
``weight_scale [out, 1]`` (symmetric, per output channel; compressed-tensors rounds
``w / (max|w| / 127.5)`` into [-128, 127]), and asks for its inputs quantized per token at
run time (symmetric, dynamic): exactly what ``Int8Linear`` computes, so the projections run
on the same kernels with the checkpoint's integers and scales as they are. The loader
fills the model's float parameters with the int8 weights (small integers, exact in any
float dtype) and skips the scales; after fusion, ``quantize_from_checkpoint`` swaps each
projection for an ``Int8Linear`` over those integers and the parts' scales (q, k, v or
gate, up: rows and scales side by side, in fusion order). Any other compressed-tensors
scheme (4-bit, groups, FP8, static or asymmetric activations, a quantized KV cache) is
refused at load, naming what differs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from worker.models.decoder import DecoderLayer, DecoderLM
from worker.models.int8_linear import Int8Linear
from worker.native import NativeKernels

# The W8A8 scheme's arguments, as compressed-tensors' preset writes them.
_WEIGHTS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
_INPUTS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
# Our fused projections, by the checkpoint's parts they hold (in fusion order).
_PARTS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}
SCALE = ".weight_scale"


def is_w8a8_checkpoint(config: dict[str, Any]) -> bool:
    """Whether a model's ``config.json`` declares a compressed-tensors W8A8 checkpoint;
    False where it declares no quantization. Raises ``ValueError`` naming the field for a
    compressed-tensors scheme other than W8A8, or another quantization method."""
    q = config.get("quantization_config")
    if not q:
        return False
    method = q.get("quant_method")
    if method != "compressed-tensors":
        raise ValueError(f"the checkpoint's quant_method {method!r} is not served")

    def refuse(what: str) -> ValueError:
        return ValueError(f"compressed-tensors checkpoint: {what}; only W8A8 int8 is served")

    if q.get("quantization_status") != "compressed":
        raise refuse(f"quantization_status {q.get('quantization_status')!r}, not 'compressed'")
    if q.get("kv_cache_scheme") is not None:
        raise refuse("a quantized KV cache (kv_cache_scheme)")
    # older llm-compressor saves write a dense sparsity config: no sparsity
    sparsity = q.get("sparsity_config") or {}
    if (sparsity and sparsity.get("format") != "dense") or q.get("transform_config"):
        raise refuse("sparsity or transforms")
    groups = q.get("config_groups") or {}
    if not groups:
        raise refuse("no config_groups")
    for name, group in groups.items():
        form = group.get("format") or q.get("format")  # a group's own, else the checkpoint's
        if form != "int-quantized":
            raise refuse(f"group {name}'s format {form!r}")
        for field, want in (("weights", _WEIGHTS), ("input_activations", _INPUTS)):
            args = group.get(field) or {}
            wrong = {k: args.get(k) for k, v in want.items() if args.get(k) != v}
            if wrong:
                raise refuse(f"group {name}'s {field} {wrong} (W8A8: {want})")
        if group.get("output_activations") is not None:
            raise refuse(f"group {name} quantizes output activations")
    return True


def quantize_from_checkpoint(
    model: DecoderLM, scales: dict[str, torch.Tensor], kernels: NativeKernels
) -> int:
    """Swap each fused projection whose parts the checkpoint quantized (``scales``: every
    ``…weight_scale`` tensor by name) for an ``Int8Linear`` over the integers the loader
    put in its weight; returns how many. A projection whose parts are quantized in part,
    a weight that is not int8 integers, or a scale left unused (a quantized LM head) is a
    ``ValueError``."""
    used: set[str] = set()
    count = 0
    for prefix, layer in model.named_modules():
        if not isinstance(layer, DecoderLayer):
            continue
        for fused, parts in _PARTS.items():
            names = [f"{prefix}.{part}{SCALE}" for part in parts]
            found = [n for n in names if n in scales]
            if not found:
                continue  # left in float by the checkpoint's ignore list
            if len(found) != len(names):
                raise ValueError(
                    f"{prefix}.{fused}: the checkpoint quantizes {found} but not all of "
                    f"{names}; they run as one projection"
                )
            parent_name, child_name = fused.split(".")
            parent = getattr(layer, parent_name)
            linear = getattr(parent, child_name)
            if not isinstance(linear, nn.Linear):
                raise TypeError(f"{prefix}.{fused} is a {type(linear).__name__}, not nn.Linear")
            w = linear.weight.detach()
            if not bool(((w == w.round()) & (w >= -128) & (w <= 127)).all()):
                raise ValueError(f"{prefix}.{fused}: the checkpoint's weights are not int8")
            s = torch.cat([scales[n].reshape(-1) for n in names]).float()
            if s.numel() != w.shape[0]:
                raise ValueError(
                    f"{prefix}.{fused}: {s.numel()} weight scales for {w.shape[0]} outputs "
                    "(W8A8's are one per output channel)"
                )
            q = w.to(torch.int8)
            setattr(parent, child_name, Int8Linear(linear, kernels, (q, s)))
            used.update(names)
            count += 1
    unused = sorted(set(scales) - used)
    if unused:
        raise ValueError(
            f"the checkpoint quantizes {unused[0]} (and {len(unused) - 1} more), which are "
            "not served as int8 (the LM head and embedding stay float)"
        )
    return count


def read_weight_scales(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every ``…weight_scale`` tensor of the checkpoint's safetensors files, by name."""
    scales: dict[str, torch.Tensor] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if name.endswith(SCALE):
                    scales[name] = f.get_tensor(name)
    return scales
