"""A decoder-only transformer that each family configures (``llama.py``, ``qwen2.py``,
``qwen3.py``, ``gemma3.py``). Parameter names equal Hugging Face checkpoints', so
loading is a name lookup."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from worker.attention import AttentionMetadata, paged_attention
from worker.models.base import CausalLM
from worker.models.layers import (
    GatedMLP,
    GemmaRMSNorm,
    RMSNorm,
    RopeSpec,
    RotaryEmbedding,
    apply_rotary,
    fuse_linears,
)


@dataclass(frozen=True)
class DecoderArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    activation: str = "silu"
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3, Gemma3)
    norm: Literal["llama", "gemma"] = "llama"
    sandwich_norms: bool = False  # norms after attention and MLP too (Gemma3)
    embed_scale: float | None = None  # multiply embeddings (Gemma: sqrt(hidden))
    attn_scale: float | None = None  # None: head_dim ** -0.5
    final_softcap: float | None = None
    # Per layer: sliding window (None = full attention) and which RoPE it uses.
    layer_windows: tuple[int | None, ...] = ()
    layer_ropes: tuple[str, ...] = ()
    ropes: dict[str, RopeSpec] = field(default_factory=dict)

    @staticmethod
    def common(cfg: dict[str, Any]) -> dict[str, Any]:
        """The fields every family reads the same way from config.json."""
        num_heads = cfg["num_attention_heads"]
        num_layers = cfg["num_hidden_layers"]
        layer_types = cfg.get("layer_types") or ["full_attention"] * num_layers
        window = cfg.get("sliding_window")
        rope_params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        default_theta = float(cfg.get("rope_theta", 10000.0))
        return {
            "vocab_size": cfg["vocab_size"],
            "hidden_size": cfg["hidden_size"],
            "intermediate_size": cfg["intermediate_size"],
            "num_layers": num_layers,
            "num_heads": num_heads,
            "num_kv_heads": cfg.get("num_key_value_heads") or num_heads,
            "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
            "max_position_embeddings": int(cfg.get("max_position_embeddings", 2048)),
            "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
            "activation": cfg.get("hidden_act") or cfg.get("hidden_activation") or "silu",
            "layer_windows": tuple(
                window if t == "sliding_attention" else None for t in layer_types
            ),
            "layer_ropes": tuple("default" for _ in layer_types),
            "ropes": {"default": RopeSpec.from_params(rope_params, default_theta)},
        }


class Attention(nn.Module):
    def __init__(self, a: DecoderArgs, layer: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = a.num_heads, a.num_kv_heads, a.head_dim
        self.scale = a.attn_scale if a.attn_scale is not None else a.head_dim**-0.5
        self.window = a.layer_windows[layer] if a.layer_windows else None
        # Loaded as q/k/v_proj (checkpoint names); fuse() packs them into qkv_proj.
        self.q_proj: nn.Linear | None = nn.Linear(
            a.hidden_size, a.num_heads * a.head_dim, bias=a.qkv_bias
        )
        self.k_proj: nn.Linear | None = nn.Linear(
            a.hidden_size, a.num_kv_heads * a.head_dim, bias=a.qkv_bias
        )
        self.v_proj: nn.Linear | None = nn.Linear(
            a.hidden_size, a.num_kv_heads * a.head_dim, bias=a.qkv_bias
        )
        self.qkv_proj: nn.Linear | None = None
        self.o_proj = nn.Linear(a.num_heads * a.head_dim, a.hidden_size, bias=a.o_bias)
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None
        if a.qk_norm:
            norm = GemmaRMSNorm if a.norm == "gemma" else RMSNorm
            self.q_norm = norm(a.head_dim, a.rms_norm_eps)
            self.k_norm = norm(a.head_dim, a.rms_norm_eps)

    def fuse(self) -> None:
        assert (
            self.q_proj is not None and self.k_proj is not None and self.v_proj is not None
        )  # once
        self.qkv_proj = fuse_linears([self.q_proj, self.k_proj, self.v_proj])
        self.q_proj = self.k_proj = self.v_proj = None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        n, heads, kv_heads = x.shape[0], self.num_heads, self.num_kv_heads
        if self.qkv_proj is not None:
            qkv = self.qkv_proj(x).view(n, heads + 2 * kv_heads, self.head_dim)
        else:
            assert self.q_proj is not None and self.k_proj is not None and self.v_proj is not None
            qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], -1).view(
                n, -1, self.head_dim
            )
        q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
        if self.q_norm is not None and self.k_norm is not None:
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        else:
            qk = qkv[:, : heads + kv_heads]  # q and k in one go
        if meta.kernels is not None:
            meta.kernels.rotary_(qk, cos, sin, heads + kv_heads)  # in place
        else:
            qk = apply_rotary(qk, cos, sin)
        q, k = qk.split([heads, kv_heads], dim=1)
        out = paged_attention(q, k, v, kv_cache, meta, self.scale, self.window)
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, a: DecoderArgs, layer: int) -> None:
        super().__init__()
        norm = GemmaRMSNorm if a.norm == "gemma" else RMSNorm
        self.self_attn = Attention(a, layer)
        self.mlp = GatedMLP(a.hidden_size, a.intermediate_size, a.activation)
        self.input_layernorm = norm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = norm(a.hidden_size, a.rms_norm_eps)
        self.sandwich = a.sandwich_norms
        if a.sandwich_norms:
            self.pre_feedforward_layernorm = norm(a.hidden_size, a.rms_norm_eps)
            self.post_feedforward_layernorm = norm(a.hidden_size, a.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        if not self.sandwich:
            x, h = self.post_attention_layernorm.add_and_norm(x, attn)
            return x + self.mlp(h)
        x = x + self.post_attention_layernorm(attn)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class DecoderModel(nn.Module):
    def __init__(self, a: DecoderArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(a, i) for i in range(a.num_layers))
        self.norm = (GemmaRMSNorm if a.norm == "gemma" else RMSNorm)(a.hidden_size, a.rms_norm_eps)


class DecoderLM(CausalLM):
    """``forward`` takes the flattened tokens of the whole step and returns hidden states;
    ``compute_logits`` is applied only to the rows that are sampled."""

    @staticmethod
    def parse_config(cfg: dict[str, Any]) -> DecoderArgs:
        """Each family overrides this to read its config.json."""
        return DecoderArgs(**DecoderArgs.common(cfg))

    def __init__(self, hf_config: dict[str, Any]) -> None:
        super().__init__()
        self.args = a = self.parse_config(hf_config)
        self.model = DecoderModel(a)
        self.rotary = nn.ModuleDict(
            {name: RotaryEmbedding(a.head_dim, spec) for name, spec in a.ropes.items()}
        )
        self.lm_head = nn.Linear(a.hidden_size, a.vocab_size, bias=False)

    @property
    def num_layers(self) -> int:
        return self.args.num_layers

    def fuse(self) -> None:
        """After loading: pack q/k/v and gate/up projections into single matmuls."""
        for layer in self.model.layers:
            assert isinstance(layer, DecoderLayer)  # narrows ModuleList's item type
            layer.self_attn.fuse()
            layer.mlp.fuse()

    @property
    def tied_weights(self) -> dict[str, str]:
        return (
            {"lm_head.weight": "model.embed_tokens.weight"} if self.args.tie_word_embeddings else {}
        )

    def kv_cache_shape(self, num_slots: int) -> tuple[int, ...]:
        return (2, num_slots, self.args.num_kv_heads, self.args.head_dim)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        if self.args.embed_scale is not None:
            # float32 first, then the model dtype: the same rounding as transformers
            x = x * torch.tensor(self.args.embed_scale, dtype=torch.float32, device=x.device).to(
                x.dtype
            )
        rope = {name: emb(positions, x.dtype) for name, emb in self.rotary.items()}
        for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches, strict=True)):
            cos, sin = rope[self.args.layer_ropes[i]]
            x = layer(x, cos, sin, kv_cache, meta)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.args.final_softcap is not None:
            logits = torch.tanh(logits / self.args.final_softcap) * self.args.final_softcap
        return logits
