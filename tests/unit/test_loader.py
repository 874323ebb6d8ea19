from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.model_files import gguf_source, resolve_model_dir
from tests.parity.families import build
from worker.models.loader import load_model
from worker.models.quantizers import GgufBlocks
from worker.native import load_native_kernels
from worker.ops import NativeOps, TorchOps


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen2")
    build("qwen2", path)
    return path


def rewrite(src: Path, dst: Path, change: dict[str, torch.Tensor | None]) -> Path:
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(str(src / "model.safetensors"))
    for name, value in change.items():
        if value is None:
            del tensors[name]
        else:
            tensors[name] = value
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_missing_weight_names_tensor_and_shape(tiny_qwen2: Path, tmp_path: Path) -> None:
    broken = rewrite(tiny_qwen2, tmp_path / "m", {"model.layers.1.self_attn.k_proj.bias": None})
    with pytest.raises(
        ValueError,
        match=r"model\.layers\.1\.self_attn\.k_proj\.bias \(expected shape \(32,\)\) is missing",
    ):
        load_model(broken, torch.float32, torch.device("cpu"))


def test_misshaped_weight_names_both_shapes(tiny_qwen2: Path, tmp_path: Path) -> None:
    broken = rewrite(tiny_qwen2, tmp_path / "m", {"model.norm.weight": torch.ones(63)})
    with pytest.raises(
        ValueError, match=r"model\.norm\.weight .* has shape \(63,\), expected \(64,\)"
    ):
        load_model(broken, torch.float32, torch.device("cpu"))


def test_unknown_architecture_is_refused(tiny_qwen2: Path, tmp_path: Path) -> None:
    other = tmp_path / "m"
    other.mkdir()
    config = json.loads((tiny_qwen2 / "config.json").read_text())
    (other / "config.json").write_text(
        json.dumps({**config, "architectures": ["MambaForCausalLM"]})
    )
    with pytest.raises(ValueError, match=r"MambaForCausalLM.*not supported"):
        load_model(other, torch.float32, torch.device("cpu"))


def test_sharded_checkpoint_loads(tiny_qwen2: Path, tmp_path: Path) -> None:
    tensors = load_file(str(tiny_qwen2 / "model.safetensors"))
    names = sorted(tensors)
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text((tiny_qwen2 / "config.json").read_text())
    halves = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    weight_map = {}
    for file, part in halves.items():
        save_file({n: tensors[n] for n in part}, str(sharded / file))
        weight_map.update(dict.fromkeys(part, file))
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    a = load_model(tiny_qwen2, torch.float32, torch.device("cpu"))
    b = load_model(sharded, torch.float32, torch.device("cpu"))
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name


def test_gguf_quantization_refuses_what_it_cannot_serve(tiny_qwen2: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"needs a GGUF model .* is neither"):
        gguf_source(str(tiny_qwen2))  # safetensors, not converted from a GGUF
    garbage = tmp_path / "broken.gguf"
    garbage.write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(ValueError, match="is not a readable GGUF file"):
        resolve_model_dir(str(garbage))
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="cannot read GGUF file"):
        load_model(
            tiny_qwen2,
            torch.float32,
            cpu,
            NativeOps(load_native_kernels()),
            None,
            GgufBlocks(garbage),
        )
    with pytest.raises(ValueError, match="runs on the native CPU kernels; this worker has torch"):
        load_model(tiny_qwen2, torch.float32, cpu, TorchOps(), None, GgufBlocks(garbage))
