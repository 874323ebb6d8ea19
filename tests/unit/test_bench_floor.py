"""bench.floor's step floors: what a model's files say a decode step must read and
compute, and the floor as the longer of memory and compute."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from bench.floor import Machine, ModelCost, model_cost


def write_checkpoint(path: Path, *, tied: bool) -> Path:
    """A 2-layer llama-shaped checkpoint's shapes: hidden 8, 4 heads of 2, 2 KV heads."""
    tensors = {"model.embed_tokens.weight": torch.zeros(10, 8), "model.norm.weight": torch.zeros(8)}
    for i in range(2):
        tensors[f"model.layers.{i}.self_attn.q_proj.weight"] = torch.zeros(8, 8)
        tensors[f"model.layers.{i}.self_attn.k_proj.weight"] = torch.zeros(4, 8)
        tensors[f"model.layers.{i}.input_layernorm.weight"] = torch.zeros(8)
    if not tied:
        tensors["lm_head.weight"] = torch.zeros(10, 8)
    save_file(tensors, str(path / "model.safetensors"))
    config = {"num_attention_heads": 4, "hidden_size": 8, "num_key_value_heads": 2}
    (path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    return path


def test_tied_embedding_is_read_once_and_multiplied_as_the_lm_head(tmp_path: Path) -> None:
    cost = model_cost(str(write_checkpoint(tmp_path, tied=True)), torch.bfloat16)
    params = 80 + 8 + 2 * (64 + 32 + 8)
    assert cost == ModelCost(
        weight_bytes=2 * params,
        matmul_params=80 + 2 * (64 + 32),
        kv_bytes_per_position=2 * 2 * 2 * 2 * 2,  # layers, K and V, KV heads, dim, bytes
        # layers, 2 FLOPs for QK and 2 for PV, heads, dim
        attention_flops_per_position=2 * 4 * 4 * 2,
    )


def test_untied_embedding_is_a_lookup_not_a_matmul(tmp_path: Path) -> None:
    cost = model_cost(str(write_checkpoint(tmp_path, tied=False)), torch.float32)
    assert cost.matmul_params == 80 + 2 * (64 + 32)  # the lm_head, not the embedding
    assert cost.weight_bytes == 4 * (80 + 80 + 8 + 2 * (64 + 32 + 8))


def test_floor_is_the_longer_of_memory_and_compute() -> None:
    cost = ModelCost(
        weight_bytes=10**9,
        matmul_params=10**9,
        kv_bytes_per_position=1000,
        attention_flops_per_position=0,
    )
    machine = Machine(read_gb_s=10.0, matmul_tflops=1.0)
    small = cost.floors_ms(machine, batch=1, context=1000)
    assert small["weights_ms"] == pytest.approx(100.0)
    assert small["kv_ms"] == pytest.approx(0.1)
    assert small["compute_ms"] == pytest.approx(2.0)
    assert small["floor_ms"] == pytest.approx(100.1)  # memory-bound
    large = cost.floors_ms(machine, batch=100, context=1000)
    assert large["compute_ms"] == pytest.approx(200.0)
    assert large["floor_ms"] == pytest.approx(200.0)  # compute-bound: 110 ms of reads
