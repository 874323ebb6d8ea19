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
from worker.models.layers import GatedMLP, RMSNorm, RopeSpec, RotaryEmbedding, fuse_linears
from worker.ops import Ops


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
    def __init__(self, args: DecoderArgs, layer: int, ops: Ops) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = args.num_heads, args.num_kv_heads
        self.head_dim = args.head_dim
        self.scale = args.attn_scale if args.attn_scale is not None else args.head_dim**-0.5
        self.window = args.layer_windows[layer] if args.layer_windows else None
        self.ops = ops
        # Loaded as q/k/v_proj (checkpoint names); fuse() packs them into qkv_proj.
        self.q_proj: nn.Linear | None = nn.Linear(
            args.hidden_size, args.num_heads * args.head_dim, bias=args.qkv_bias
        )
        self.k_proj: nn.Linear | None = nn.Linear(
            args.hidden_size, args.num_kv_heads * args.head_dim, bias=args.qkv_bias
        )
        self.v_proj: nn.Linear | None = nn.Linear(
            args.hidden_size, args.num_kv_heads * args.head_dim, bias=args.qkv_bias
        )
        self.qkv_proj: nn.Linear | None = None
        self.o_proj = nn.Linear(args.num_heads * args.head_dim, args.hidden_size, bias=args.o_bias)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if args.qk_norm:
            gemma = args.norm == "gemma"
            self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps, ops, gemma)
            self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps, ops, gemma)

    def fuse(self) -> None:
        """Once, after loading: q, k and v in one matmul."""
        if self.q_proj is None or self.k_proj is None or self.v_proj is None:
            raise RuntimeError("Attention.fuse() runs once, after loading")
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
        if self.qkv_proj is None:
            raise RuntimeError("Attention runs after fuse()")
        n, heads, kv_heads = x.shape[0], self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(n, heads + 2 * kv_heads, self.head_dim)
        q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
        if self.q_norm is not None and self.k_norm is not None:
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        else:
            qk = qkv[:, : heads + kv_heads]  # q and k in one go
        q, k = self.ops.rotary(qk, cos, sin).split([heads, kv_heads], dim=1)
        out = paged_attention(q, k, v, kv_cache, meta, self.ops, self.scale, self.window)
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, args: DecoderArgs, layer: int, ops: Ops) -> None:
        super().__init__()
        gemma = args.norm == "gemma"

        def norm() -> RMSNorm:
            return RMSNorm(args.hidden_size, args.rms_norm_eps, ops, gemma)

        self.self_attn = Attention(args, layer, ops)
        self.mlp = GatedMLP(args.hidden_size, args.intermediate_size, args.activation, ops)
        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        self.sandwich = args.sandwich_norms
        if args.sandwich_norms:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()

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
    def __init__(self, args: DecoderArgs, ops: Ops) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, i, ops) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, ops, args.norm == "gemma")


class DecoderLM(CausalLM):
    """``forward`` takes the flattened tokens of the whole step and returns hidden states;
    ``compute_logits`` is applied only to the rows that are sampled."""

    @staticmethod
    def parse_config(cfg: dict[str, Any]) -> DecoderArgs:
        """Each family overrides this to read its config.json."""
        return DecoderArgs(**DecoderArgs.common(cfg))

    def __init__(self, hf_config: dict[str, Any], ops: Ops) -> None:
        super().__init__(hf_config, ops)
        self.args = args = self.parse_config(hf_config)
        self.model = DecoderModel(args, ops)
        self.rotary = nn.ModuleDict(
            {name: RotaryEmbedding(args.head_dim, spec) for name, spec in args.ropes.items()}
        )
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

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
