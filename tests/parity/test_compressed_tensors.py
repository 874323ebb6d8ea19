"""W8A8 checkpoints in the compressed-tensors format (as llm-compressor saves them, written
here by compressed-tensors itself: ``bench/peers/w8a8_checkpoint.py``) served from the
checkpoint's own ``quantization_config``, as vLLM serves them:

- every projection inside the layers an ``Int8Linear`` over the checkpoint's integers and
  scales exactly (q, k, v and gate, up side by side as fused), weights of -128 included;
- the logits those of the W8A8 arithmetic on the checkpoint, computed in float32 by
  ``transformers``' model with the dequantized weights (q * scale) and every projection's
  input quantized per token by a hook, to float32 rounding (1e-5, where the float
  model's logits are ~3e-3 away);
- schemes other than W8A8 refused at load, naming the field.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel

from bench.peers.w8a8_checkpoint import save_w8a8
from tests.parity.families import build
from tests.parity.test_family_logits import Paged, prompt
from worker.models.compressed_tensors import is_w8a8_checkpoint
from worker.models.int8_linear import Int8Linear
from worker.models.loader import load_model
from worker.models.quantizers import CheckpointW8A8, quantizer_for
from worker.native import load_native_kernels
from worker.ops import NativeOps

FAMILIES = ["llama", "qwen2", "gemma3"]


def checkpoint_tensors(directory: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118


def w8a8_reference(float_dir: Path, tensors: dict[str, torch.Tensor]) -> PreTrainedModel:
    """The float model with the checkpoint's weights dequantized, each projection's input
    quantized per token as W8A8 asks (127 / max|x| in float32, round half to even)."""
    model = AutoModelForCausalLM.from_pretrained(str(float_dir), dtype=torch.float32)
    with torch.no_grad():
        for name, module in model.named_modules():
            scale = tensors.get(f"{name}.weight_scale")
            if scale is None:
                continue
            module.weight.copy_(tensors[f"{name}.weight"].float() * scale.float())

            def quantize_input(_: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
                x = args[0]
                top = x.abs().amax(-1, keepdim=True)
                inv = torch.where(top > 0, 127.0 / top, torch.zeros_like(top))
                return ((x * inv).round().clamp(-127, 127) * (top / 127.0),)

            module.register_forward_pre_hook(quantize_input)
    return model.eval()


class PagedW8A8(Paged):
    def __init__(self, checkpoint: Path) -> None:
        quantizer = quantizer_for("none", str(checkpoint))
        assert isinstance(quantizer, CheckpointW8A8)
        ops = NativeOps(load_native_kernels())
        cpu = torch.device("cpu")
        self.model = load_model(checkpoint, torch.float32, cpu, ops, None, quantizer)
        self.caches = [
            torch.zeros(self.model.kv_cache_shape(64, 4)) for _ in range(self.model.num_layers)
        ]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_w8a8_checkpoint_is_served_as_it_holds_its_weights(family: str, tmp_path: Path) -> None:
    float_dir, w8a8_dir = tmp_path / "float", tmp_path / "w8a8"
    save_w8a8(build(family, float_dir), w8a8_dir)
    tensors = checkpoint_tensors(w8a8_dir)
    assert tensors["model.layers.0.mlp.down_proj.weight"].dtype == torch.int8
    assert any(bool((t == -128).any()) for t in tensors.values() if t.dtype == torch.int8)
    paged = PagedW8A8(w8a8_dir)
    kernels = load_native_kernels()
    int8 = dict((name, m) for name, m in paged.model.named_modules() if isinstance(m, Int8Linear))
    layers = json.loads((w8a8_dir / "config.json").read_text())["num_hidden_layers"]
    assert len(int8) == 4 * layers and isinstance(paged.model.lm_head, nn.Linear)
    parts = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    for name, module in int8.items():
        prefix, fused = name.rsplit(".", 1)
        names = [f"{prefix}.{p}" for p in parts.get(fused, (fused,))]
        q = torch.cat([tensors[f"{n}.weight"] for n in names])
        scales = torch.cat([tensors[f"{n}.weight_scale"].reshape(-1) for n in names])
        assert torch.equal(module.packed, kernels.int8_pack(q)), name
        assert torch.equal(module.weight_scales, scales.float()), name

    reference = w8a8_reference(float_dir, tensors)
    tokens = prompt(1, 13)
    (ours,) = paged.step([(tokens, [0, 1, 2, 3], 0, 13)])
    with torch.no_grad():
        expected = reference(torch.tensor([tokens])).logits[0]
    # float32 rounding apart (~1e-7 here), where the float model is ~3e-3 away
    assert (ours - expected).abs().max() < 1e-5


def test_layers_the_checkpoint_left_float_stay_float(tmp_path: Path) -> None:
    float_dir, w8a8_dir = tmp_path / "float", tmp_path / "w8a8"
    save_w8a8(build("qwen2", float_dir), w8a8_dir, ignore=("re:.*down_proj",))
    tensors = checkpoint_tensors(w8a8_dir)
    assert tensors["model.layers.0.mlp.down_proj.weight"].dtype == torch.float32
    paged = PagedW8A8(w8a8_dir)
    kinds = {
        name.rsplit(".", 1)[-1]: type(m).__name__
        for name, m in paged.model.named_modules()
        if name.endswith("_proj")
    }
    assert kinds["down_proj"] != "Int8Linear"
    assert {kinds[p] for p in ("qkv_proj", "o_proj", "gate_up_proj")} == {"Int8Linear"}
    tokens = prompt(2, 11)
    (ours,) = paged.step([(tokens, [0, 1, 2], 0, 11)])
    with torch.no_grad():
        expected = w8a8_reference(float_dir, tensors)(torch.tensor([tokens])).logits[0]
    assert (ours - expected).abs().max() < 1e-5


def test_what_the_format_allows_is_taken_and_the_rest_refused(tmp_path: Path) -> None:
    save_w8a8(build("llama", tmp_path / "float"), tmp_path / "w8a8")
    config = json.loads((tmp_path / "w8a8" / "config.json").read_text())
    q = config["quantization_config"]
    assert is_w8a8_checkpoint(config)
    # older saves: a dense sparsity config, a group without its own format
    older = {**q, "sparsity_config": {"format": "dense"}}
    older["config_groups"] = {"group_0": {**q["config_groups"]["group_0"], "format": None}}
    assert is_w8a8_checkpoint({"quantization_config": older})
    assert not is_w8a8_checkpoint({"quantization_config": {}})
    with pytest.raises(ValueError, match="sparsity or transforms"):
        is_w8a8_checkpoint({"quantization_config": {**q, "sparsity_config": {"format": "x"}}})
    with pytest.raises(ValueError, match="quant_method 'fp8' is not served"):
        is_w8a8_checkpoint({"quantization_config": {"quant_method": "fp8"}})
    quantizer = quantizer_for("none", str(tmp_path / "w8a8"))
    assert quantizer is not None
    with pytest.raises(ValueError, match=r"a W8A8 checkpoint \(compressed-tensors\) runs on"):
        load_model(tmp_path / "w8a8", torch.float32, torch.device("cpu"), None, None, quantizer)


def test_schemes_other_than_w8a8_are_refused_naming_the_field(tmp_path: Path) -> None:
    save_w8a8(build("llama", tmp_path / "float"), tmp_path / "w8a8")
    config_path = tmp_path / "w8a8" / "config.json"
    config = json.loads(config_path.read_text())
    group = config["quantization_config"]["config_groups"]["group_0"]
    changes = [
        ("weights", "strategy", "group", r"weights \{'strategy': 'group'\}"),
        ("weights", "num_bits", 4, r"weights \{'num_bits': 4\}"),
        ("input_activations", "symmetric", False, r"input_activations \{'symmetric': False\}"),
        ("input_activations", "dynamic", False, r"input_activations \{'dynamic': False\}"),
    ]
    for field, key, value, message in changes:
        changed = json.loads(json.dumps(config))
        changed["quantization_config"]["config_groups"]["group_0"][field] = {
            **group[field],
            key: value,
        }
        config_path.write_text(json.dumps(changed))
        with pytest.raises(ValueError, match=message):
            quantizer_for("none", str(tmp_path / "w8a8"))
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="has no compressed-tensors quantization_config"):
        quantizer_for("compressed-tensors", str(tmp_path / "float"))


def test_a_projection_quantized_in_part_or_a_quantized_lm_head_is_refused(
    tmp_path: Path,
) -> None:
    save_w8a8(build("llama", tmp_path / "float"), tmp_path / "w8a8")
    path = tmp_path / "w8a8" / "model.safetensors"
    tensors = checkpoint_tensors(tmp_path / "w8a8")
    k_scale = "model.layers.0.self_attn.k_proj.weight_scale"
    for name, change, message in [
        (k_scale, None, "quantizes .*q_proj.weight_scale.* but not all of"),
        ("lm_head.weight_scale", torch.ones(128, 1), "quantizes lm_head.weight_scale"),
    ]:
        changed = {n: t for n, t in tensors.items() if n != name}
        if change is not None:
            changed[name] = change
        save_file(changed, str(path), metadata={"format": "pt"})
        with pytest.raises(ValueError, match=message):
            PagedW8A8(tmp_path / "w8a8")
