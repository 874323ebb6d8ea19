"""LoRA adapters in PEFT's saved format, checked before any worker loads one.

An adapter folder holds ``adapter_config.json`` and ``adapter_model.safetensors``;
``read_adapter`` reads the config and the safetensors header (names, dtypes, shapes),
never the tensor data, and without torch: the engine core checks adapters and never
imports torch. What is served is plain LoRA, ``y = W x + lora_B(lora_A(x)) * scaling``,
on the seven projections of a decoder layer; every PEFT option that computes something
else (DoRA, per-module ranks, trained biases, extra saved modules, ...) is refused with
an ``AdapterError`` that names it.

``target_modules`` may be a list (PEFT matches each entry as a suffix of a module's
path, so ``"q_proj"`` and ``"self_attn.q_proj"`` both name q_proj), ``"all-linear"``, or a
regular expression that PEFT ``re.fullmatch``-es against module paths such as
``model.layers.0.self_attn.q_proj``; the same matching is done here.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# Where each target sits in a decoder layer (the middle of its module path).
PARENTS = {name: "self_attn" for name in LORA_TARGETS[:4]} | {
    name: "mlp" for name in LORA_TARGETS[4:]
}

# PEFT's saved names: the PeftModel's ``base_model.model`` prefix, then the module path
# (no adapter name: save_pretrained drops it).
_TENSOR_NAME = re.compile(
    r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight"
)

# Config fields naming PEFT features whose forward is not lora_B(lora_A(x)) * scaling on
# these projections: refused while set (truthy).
_UNSUPPORTED = {
    "modules_to_save": "extra trained modules (modules_to_save)",
    "use_dora": "DoRA (use_dora)",
    "lora_bias": "trained LoRA biases (lora_bias)",
    "use_qalora": "QA-LoRA (use_qalora)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
    "arrow_config": "Arrow routing (arrow_config)",
    "kasa_config": "KaSA (kasa_config)",
    "monteclora_config": "MonteCLoRA (monteclora_config)",
    "trainable_token_indices": "trained token embeddings (trainable_token_indices)",
    "target_parameters": "LoRA on parameters (target_parameters)",
    "layer_replication": "layer replication (layer_replication)",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
}

# safetensors dtypes a LoRA factor may have, and their sizes in bytes
_FLOAT_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
_MAX_HEADER = 100 * 2**20  # safetensors' own limit on the header's JSON


class AdapterError(ValueError):
    """An adapter that cannot be served; the message names the file, module or shape."""


@dataclass(frozen=True)
class AdapterConfig:
    """What serving needs of a checked adapter. ``target_modules``: the projections
    (``LORA_TARGETS`` names) its tensors hold factors for."""

    rank: int
    alpha: float
    use_rslora: bool
    target_modules: frozenset[str]

    @property
    def scaling(self) -> float:
        """PEFT's: alpha / r, or alpha / sqrt(r) with rank-stabilized LoRA."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


def read_adapter(
    path: Path,
    module_shapes: Mapping[str, tuple[int, int]],
    num_layers: int,
    max_rank: int,
) -> AdapterConfig:
    """Check the adapter in folder ``path`` against a model whose target projections
    have full (in_features, out_features) ``module_shapes`` and ``num_layers`` layers.

    Raises ``AdapterError`` saying what is wrong: missing or corrupt files, a rank above
    ``max_rank``, an unsupported option or target, a tensor of another name or shape.
    """
    if not path.is_dir():
        raise AdapterError(f"LoRA adapter folder {path} does not exist")
    config = _read_config(path / CONFIG_FILE)
    rank, alpha = _rank_and_alpha(config, path, max_rank)
    targets = _targets(config.get("target_modules"), path, module_shapes, num_layers)
    tensors = _safetensors_header(path / WEIGHTS_FILE)
    modules = _check_tensors(tensors, path, rank, targets, module_shapes, num_layers)
    return AdapterConfig(rank, alpha, bool(config.get("use_rslora", False)), modules)


def _read_config(file: Path) -> dict[str, Any]:
    try:
        config = json.loads(file.read_text())
    except FileNotFoundError:
        raise AdapterError(f"{file} is missing (a PEFT adapter folder holds it)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{file} is not a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise AdapterError(f"{file}: peft_type {peft_type!r} is not supported (LORA is)")
    for field, what in _UNSUPPORTED.items():
        if config.get(field):
            raise AdapterError(f"{file}: {what} is not supported; save a plain LoRA adapter")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{file}: bias {config['bias']!r} is not supported (only 'none')")
    if config.get("fan_in_fan_out"):
        raise AdapterError(f"{file}: fan_in_fan_out (Conv1D weights) is not supported")
    return config


def _rank_and_alpha(config: dict[str, Any], path: Path, max_rank: int) -> tuple[int, float]:
    rank, alpha = config.get("r"), config.get("lora_alpha", 8)  # 8: PEFT's default alpha
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        raise AdapterError(f"{path / CONFIG_FILE}: r must be a positive integer, not {rank!r}")
    if rank > max_rank:
        raise AdapterError(
            f"{path}: adapter rank r={rank} is above the server's maximum LoRA rank "
            f"{max_rank}; raise the maximum or use an adapter of rank <= {max_rank}"
        )
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise AdapterError(f"{path / CONFIG_FILE}: lora_alpha must be a number, not {alpha!r}")
    return rank, float(alpha)


def _targets(
    target_modules: Any, path: Path, module_shapes: Mapping[str, tuple[int, int]], num_layers: int
) -> frozenset[str]:
    """The projections ``target_modules`` names, matched as PEFT matches them."""
    where = path / CONFIG_FILE
    if target_modules == "all-linear":  # PEFT: every linear layer but the output layer
        return frozenset(name for name in LORA_TARGETS if name in module_shapes)
    if isinstance(target_modules, str):
        try:
            pattern = re.compile(target_modules)
        except re.error as e:
            raise AdapterError(f"{where}: target_modules {target_modules!r}: {e}") from None
        for other in ("model.embed_tokens", "lm_head"):
            if pattern.fullmatch(other):
                raise AdapterError(
                    f"{where}: target_modules matches {other}, which LoRA is not served on "
                    f"(only {', '.join(LORA_TARGETS)})"
                )
        found = frozenset(
            name
            for name in module_shapes
            if name in PARENTS
            and any(
                pattern.fullmatch(f"model.layers.{i}.{PARENTS[name]}.{name}")
                for i in range(num_layers)
            )
        )
        if not found:
            raise AdapterError(f"{where}: target_modules {target_modules!r} matches no projection")
        return found
    if not isinstance(target_modules, list) or not target_modules:
        raise AdapterError(f"{where}: target_modules must be a non-empty list or a string")
    names = set()
    for entry in target_modules:
        name = entry.rsplit(".", 1)[-1] if isinstance(entry, str) else entry
        if name not in LORA_TARGETS:
            raise AdapterError(
                f"{where}: target module {entry!r} is not supported "
                f"(LoRA is served on {', '.join(LORA_TARGETS)})"
            )
        if name not in module_shapes:
            raise AdapterError(f"{where}: the model has no {name} for target module {entry!r}")
        names.add(name)
    return frozenset(names)


def _check_tensors(
    tensors: dict[str, tuple[str, list[int]]],
    path: Path,
    rank: int,
    targets: frozenset[str],
    module_shapes: Mapping[str, tuple[int, int]],
    num_layers: int,
) -> frozenset[str]:
    """Every tensor one factor of a targeted projection, of its shape, both factors of
    each; returns the projections they are for."""
    where = path / WEIGHTS_FILE
    factors: dict[tuple[int, str], set[str]] = {}
    for name, (dtype, shape) in tensors.items():
        match = _TENSOR_NAME.fullmatch(name)
        if match is None:
            raise AdapterError(
                f"{where}: tensor {name} is not a LoRA factor of a decoder projection "
                "(base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight)"
            )
        layer, parent, module, factor = int(match[1]), match[2], match[3], match[4]
        if module not in targets or PARENTS.get(module) != parent:
            raise AdapterError(
                f"{where}: tensor {name} is for {parent}.{module}, not a target module "
                f"of the adapter ({', '.join(sorted(targets))})"
            )
        if layer >= num_layers:
            raise AdapterError(
                f"{where}: tensor {name} is for layer {layer}; the model has {num_layers}"
            )
        if dtype not in _FLOAT_SIZES:
            raise AdapterError(f"{where}: tensor {name} has dtype {dtype}, not a float type")
        in_features, out_features = module_shapes[module]
        expected = [rank, in_features] if factor == "A" else [out_features, rank]
        if shape != expected:
            raise AdapterError(
                f"{where}: tensor {name} has shape {shape}, expected {expected} "
                f"(r={rank}, {module} is {in_features} -> {out_features} in this model)"
            )
        factors.setdefault((layer, module), set()).add(factor)
    if not factors:
        raise AdapterError(f"{where} holds no LoRA weights")
    for (layer, module), have in sorted(factors.items()):
        if have != {"A", "B"}:
            missing = "lora_B" if "A" in have else "lora_A"
            raise AdapterError(f"{where}: layer {layer} {module} has no {missing} weight")
    return frozenset(module for _, module in factors)


def _safetensors_header(file: Path) -> dict[str, tuple[str, list[int]]]:
    """Each tensor's (dtype, shape) from a safetensors file's header: 8 bytes of
    little-endian length, that much JSON, then the data, which each entry's
    ``data_offsets`` must lie within and fill for its dtype and shape."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            if size < 8 or length > min(size - 8, _MAX_HEADER):
                raise AdapterError(f"{file} is not a safetensors file (corrupt or truncated?)")
            header = json.loads(f.read(length))
    except FileNotFoundError:
        raise AdapterError(f"{file} is missing (a PEFT adapter folder holds it)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterError(f"{file}: corrupt safetensors header: {e}") from None
    if not isinstance(header, dict):
        raise AdapterError(f"{file}: corrupt safetensors header (not a JSON object)")
    data_size = size - 8 - length
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            numel = math.prod(shape)
            ok = isinstance(dtype, str) and all(
                isinstance(n, int) and n >= 0 for n in [*shape, begin, end]
            )
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok or not 0 <= begin <= end <= data_size:
            raise AdapterError(f"{file}: corrupt safetensors entry for {name} (truncated?)")
        if dtype in _FLOAT_SIZES and end - begin != numel * _FLOAT_SIZES[dtype]:
            raise AdapterError(f"{file}: tensor {name}'s data does not match its shape")
        tensors[name] = (dtype, list(shape))
    return tensors
