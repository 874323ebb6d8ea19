"""Tiny random checkpoints of every family, built with transformers (no network)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

VOCAB = 128
WINDOW = 8  # Gemma3's sliding window in the tiny checkpoints

_BASE: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
}

FAMILIES: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    "llama": (LlamaConfig, LlamaForCausalLM, {"tie_word_embeddings": True}),
    "llama3-rope": (
        LlamaConfig,
        LlamaForCausalLM,
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
                "rope_theta": 500000.0,
            }
        },
    ),
    # One KV head for four q heads: at tensor-parallel size 2 every rank holds it.
    "llama-mqa": (LlamaConfig, LlamaForCausalLM, {"num_key_value_heads": 1}),
    # Three GQA groups of two (SmolLM2's shape in small): 2 ranks hold 1 and 2 groups.
    "llama-gqa3": (
        LlamaConfig,
        LlamaForCausalLM,
        {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 16},
    ),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 32}),
    "gemma3": (
        Gemma3TextConfig,
        Gemma3ForCausalLM,
        {
            "num_hidden_layers": 4,
            "head_dim": 32,
            "sliding_window": WINDOW,
            "query_pre_attn_scalar": 24,
            "layer_types": [
                "sliding_attention",
                "full_attention",
                "sliding_attention",
                "full_attention",
            ],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            },
        },
    ),
    "gemma3-softcap": (
        Gemma3TextConfig,
        Gemma3ForCausalLM,
        {
            "num_hidden_layers": 2,
            "head_dim": 32,
            "sliding_window": WINDOW,
            "attn_logit_softcapping": 20.0,
            "final_logit_softcapping": 15.0,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
}


def build(family: str, path: Path, **overrides: Any) -> PreTrainedModel:
    """Save a random checkpoint of ``family`` (safetensors) into ``path``, its config's
    fields changed by ``overrides``; return the reference model reloaded from it in
    float32."""
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    config = config_cls(**{**_BASE, **extra, **overrides})
    model = model_cls(config)
    with torch.no_grad():  # Gemma's norms start at zero: make them matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return model_cls.from_pretrained(path, dtype=torch.float32).eval()


def build_servable(family: str, path: Path, tokenizer_dir: Path, **overrides: Any) -> Path:
    """A random checkpoint of ``family`` a server can speak through: SmolLM2's tokenizer
    (and so its vocabulary) copied in beside the weights."""
    tokenizer_files = ("tokenizer.json", "tokenizer_config.json")
    vocab = {"vocab_size": 49152, "max_position_embeddings": 2048, "bos_token_id": 1}
    vocab |= {"eos_token_id": 2, "pad_token_id": 2}  # as SmolLM2 names its turn end
    build(family, path, **{**vocab, **overrides})
    for name in tokenizer_files:
        shutil.copy(tokenizer_dir / name, path / name)
    return path
