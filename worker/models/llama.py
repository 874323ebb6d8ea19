"""Llama (Llama 2/3, SmolLM2): GQA, RoPE, RMSNorm, SwiGLU, optionally tied embeddings.

Parameter names equal the Hugging Face checkpoint's, so loading is a name lookup.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from worker.attention import AttentionMetadata, paged_attention
from worker.models.base import CausalLM
from worker.models.layers import RMSNorm, RotaryEmbedding, SwiGLU, apply_rotary


@dataclass(frozen=True)
class LlamaArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    attention_bias: bool
    max_position_embeddings: int

    @staticmethod
    def from_hf_config(cfg: dict[str, Any]) -> LlamaArgs:
        num_heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise ValueError(f"rope type {rope_type!r} is not supported yet")
        return LlamaArgs(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 10000.0)),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", False),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        )


class LlamaAttention(nn.Module):
    def __init__(self, a: LlamaArgs) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = a.num_heads, a.num_kv_heads, a.head_dim
        self.scale = a.head_dim**-0.5
        self.q_proj = nn.Linear(a.hidden_size, a.num_heads * a.head_dim, bias=a.attention_bias)
        self.k_proj = nn.Linear(a.hidden_size, a.num_kv_heads * a.head_dim, bias=a.attention_bias)
        self.v_proj = nn.Linear(a.hidden_size, a.num_kv_heads * a.head_dim, bias=a.attention_bias)
        self.o_proj = nn.Linear(a.num_heads * a.head_dim, a.hidden_size, bias=a.attention_bias)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        n = x.shape[0]
        q = apply_rotary(self.q_proj(x).view(n, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(self.k_proj(x).view(n, self.num_kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, kv_cache, meta, self.scale)
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, a: LlamaArgs) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(a)
        self.mlp = SwiGLU(a.hidden_size, a.intermediate_size)
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, a: LlamaArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(a) for _ in range(a.num_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)


class LlamaForCausalLM(CausalLM):
    def __init__(self, hf_config: dict[str, Any]) -> None:
        super().__init__()
        self.args = LlamaArgs.from_hf_config(hf_config)
        self.model = LlamaModel(self.args)
        self.rotary = RotaryEmbedding(self.args.head_dim, self.args.rope_theta)
        self.lm_head = nn.Linear(self.args.hidden_size, self.args.vocab_size, bias=False)

    @property
    def tied_weights(self) -> dict[str, str]:
        return (
            {"lm_head.weight": "model.embed_tokens.weight"} if self.args.tie_word_embeddings else {}
        )

    def kv_cache_shape(self, num_slots: int) -> tuple[int, ...]:
        return (2, num_slots, self.args.num_kv_heads, self.args.head_dim)

    @property
    def num_layers(self) -> int:
        return self.args.num_layers

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, kv_cache, meta)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
