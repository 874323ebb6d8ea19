"""``common.lora.read_adapter`` against adapters PEFT itself saved: a good one is taken
with PEFT's scaling, and each thing that cannot be served is refused by an
``AdapterError`` naming it."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.lora import LORA_TARGETS, WEIGHTS_FILE, AdapterConfig, AdapterError, read_adapter

NUM_LAYERS = 2
# The tiny Llama below: hidden 64, 4 heads and 2 KV heads of 16, intermediate 128.
SHAPES = {
    "q_proj": (64, 64),
    "k_proj": (64, 32),
    "v_proj": (64, 32),
    "o_proj": (64, 64),
    "gate_proj": (64, 128),
    "up_proj": (64, 128),
    "down_proj": (128, 64),
}
Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
Q_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


def save_peft_adapter(path: Path, **lora_args: Any) -> Any:
    """A PEFT LoRA of a tiny random Llama, saved into ``path``; returns the PeftModel."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    peft_model = get_peft_model(
        LlamaForCausalLM(config), LoraConfig(init_lora_weights=False, **lora_args)
    )
    peft_model.save_pretrained(str(path))
    return peft_model


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("adapter")
    save_peft_adapter(path, r=8, lora_alpha=16, target_modules=list(LORA_TARGETS))
    return path


@pytest.fixture
def adapter(saved: Path, tmp_path: Path) -> Path:
    """A copy of the good adapter, for a test to break."""
    return Path(shutil.copytree(saved, tmp_path / "copy"))


def edit_config(path: Path, **changes: Any) -> None:
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**config, **changes}))


def edit_tensors(path: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(path / WEIGHTS_FILE)
    change(tensors)
    save_file(tensors, path / WEIGHTS_FILE)


def read(path: Path, max_rank: int = 64, num_layers: int = NUM_LAYERS) -> AdapterConfig:
    return read_adapter(path, SHAPES, num_layers, max_rank)


def test_a_peft_adapter_is_taken(saved: Path) -> None:
    names = load_file(saved / WEIGHTS_FILE).keys()
    assert Q_A in names and Q_B in names  # PEFT's saved names carry no adapter name
    assert read(saved) == AdapterConfig(
        rank=8, alpha=16.0, use_rslora=False, target_modules=frozenset(LORA_TARGETS)
    )
    assert read(saved).scaling == 2.0


@pytest.mark.parametrize("use_rslora", [False, True])
def test_scaling_is_peft_s(tmp_path: Path, use_rslora: bool) -> None:
    peft_model = save_peft_adapter(
        tmp_path, r=16, lora_alpha=8, use_rslora=use_rslora, target_modules=["q_proj", "v_proj"]
    )
    config = read(tmp_path)
    assert config.target_modules == {"q_proj", "v_proj"}
    assert config.scaling == (2.0 if use_rslora else 0.5)  # 8 / sqrt(16), 8 / 16
    q_proj = peft_model.base_model.model.model.layers[0].self_attn.q_proj
    assert config.scaling == q_proj.scaling["default"]


def test_a_regex_target_is_matched_as_peft_matches_it(tmp_path: Path) -> None:
    save_peft_adapter(tmp_path, r=4, target_modules=r"model\.layers\.1\.mlp\.(gate|down)_proj")
    config = read(tmp_path)
    assert config.target_modules == {"gate_proj", "down_proj"}
    assert config.alpha == 8.0  # PEFT's default


def test_a_regex_matching_the_output_layer_is_refused(adapter: Path) -> None:
    edit_config(adapter, target_modules=".*_proj|lm_head")
    with pytest.raises(AdapterError, match="matches lm_head"):
        read(adapter)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"r": 128}, "rank r=128 is above the server's maximum LoRA rank 64"),
        ({"r": 0}, "r must be a positive integer"),
        ({"target_modules": ["q_proj", "embed_tokens"]}, "'embed_tokens' is not supported"),
        ({"target_modules": ["lm_head"]}, "'lm_head' is not supported"),
        ({"target_modules": []}, "target_modules must be a non-empty list"),
        ({"target_modules": "("}, "target_modules '\\('"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"bias": "lora_only"}, "bias 'lora_only' is not supported"),
        ({"fan_in_fan_out": True}, "fan_in_fan_out"),
        ({"rank_pattern": {"q_proj": 4}}, "per-module ranks \\(rank_pattern\\) is not supported"),
        ({"alpha_pattern": {"q_proj": 4}}, "alpha_pattern\\) is not supported"),
        ({"use_dora": True}, "DoRA \\(use_dora\\) is not supported"),
        ({"lora_bias": True}, "lora_bias"),
        ({"peft_type": "IA3"}, "peft_type 'IA3' is not supported"),
    ],
)
def test_config_refusals_name_the_problem(
    adapter: Path, changes: dict[str, Any], message: str
) -> None:
    edit_config(adapter, **changes)
    with pytest.raises(AdapterError, match=message):
        read(adapter)


def test_a_target_the_model_lacks_is_refused(saved: Path) -> None:
    shapes = {k: v for k, v in SHAPES.items() if k != "gate_proj"}
    with pytest.raises(AdapterError, match="the model has no gate_proj"):
        read_adapter(saved, shapes, NUM_LAYERS, 64)


def test_a_layer_the_model_lacks_is_refused(saved: Path) -> None:
    with pytest.raises(AdapterError, match="is for layer 1; the model has 1"):
        read(saved, num_layers=1)


@pytest.mark.parametrize(
    ("shapes", "message"),
    [
        ({"q_proj": (32, 64)}, "q_proj.lora_A.weight has shape \\[8, 64\\], expected \\[8, 32\\]"),
        (
            {"down_proj": (128, 96)},
            "down_proj.lora_B.weight has shape \\[64, 8\\], expected \\[96, 8\\]",
        ),
    ],
)
def test_factors_of_another_shape_are_refused(
    saved: Path, shapes: dict[str, tuple[int, int]], message: str
) -> None:
    with pytest.raises(AdapterError, match=message):
        read_adapter(saved, {**SHAPES, **shapes}, NUM_LAYERS, 64)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        # An adapter name left in (as in PEFT's in-memory state dict): not a saved name.
        (
            lambda t: t.__setitem__(Q_A.replace("lora_A.", "lora_A.default."), t.pop(Q_A)),
            "lora_A.default.weight is not a LoRA factor",
        ),
        (
            lambda t: t.__setitem__("base_model.model.lm_head.lora_A.weight", t[Q_A].clone()),
            "lm_head.lora_A.weight is not a LoRA factor",
        ),
        (
            lambda t: t.__setitem__(Q_A.replace("self_attn", "mlp"), t[Q_A].clone()),
            "is for mlp.q_proj, not a target module",
        ),
        (lambda t: t.pop(Q_B), "layer 0 q_proj has no lora_B weight"),
        (lambda t: t.__setitem__(Q_A, t[Q_A].to(torch.int32)), "dtype I32, not a float type"),
        (lambda t: t.clear(), "holds no LoRA weights"),
    ],
)
def test_tensor_refusals_name_the_tensor(
    adapter: Path, change: Callable[[dict[str, torch.Tensor]], None], message: str
) -> None:
    edit_tensors(adapter, change)
    with pytest.raises(AdapterError, match=message):
        read(adapter)


def test_a_target_list_without_the_saved_module_is_refused(adapter: Path) -> None:
    edit_config(adapter, target_modules=["q_proj", "k_proj"])
    with pytest.raises(
        AdapterError, match="not a target module of the adapter \\(k_proj, q_proj\\)"
    ):
        read(adapter)


@pytest.mark.parametrize("missing", ["adapter_config.json", WEIGHTS_FILE])
def test_missing_files_are_named(adapter: Path, missing: str) -> None:
    (adapter / missing).unlink()
    with pytest.raises(AdapterError, match=f"{missing} is missing"):
        read(adapter)


def test_a_missing_folder_is_named(tmp_path: Path) -> None:
    with pytest.raises(AdapterError, match=r"folder .*nowhere does not exist"):
        read(tmp_path / "nowhere")


def test_corrupt_json_is_named(adapter: Path) -> None:
    (adapter / "adapter_config.json").write_text('{"r": 8,')
    with pytest.raises(AdapterError, match=r"adapter_config\.json is not valid JSON"):
        read(adapter)


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda data: b"\x01\x02", "not a safetensors file"),
        (lambda data: b"\xff" * 64, "not a safetensors file"),  # a header longer than the file
        (lambda data: data[:8] + b"[" + data[9:], "corrupt safetensors header"),
        (lambda data: data[:-16], "corrupt safetensors entry for .* \\(truncated\\?\\)"),
    ],
)
def test_corrupt_safetensors_is_named(
    adapter: Path, corrupt: Callable[[bytes], bytes], message: str
) -> None:
    file = adapter / WEIGHTS_FILE
    file.write_bytes(corrupt(file.read_bytes()))
    with pytest.raises(AdapterError, match=message):
        read(adapter)
