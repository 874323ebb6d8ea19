"""A decoder-only transformer that each family configures (``llama.py``, ``qwen2.py``,
``qwen3.py``, ``gemma3.py``). Parameter names equal Hugging Face checkpoints', so
loading is a name lookup."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch
from torch import nn

from worker.attention import AttentionMetadata
from worker.models.base import CausalLM
from worker.models.layers import GatedMLP, RMSNorm, RopeSpec, RotaryEmbedding, fuse_linears
from worker.ops import Ops
from worker.paged_attention import paged_attention
from worker.parallel import TensorParallel


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
    """This rank's heads (all of them without tensor parallelism); the output projection
    sums over every rank's heads."""

    def __init__(self, args: DecoderArgs, layer: int, ops: Ops, tp: TensorParallel) -> None:
        super().__init__()
        heads = tp.heads(args.num_heads, args.num_kv_heads)
        self.num_heads, self.num_kv_heads = heads.q_count, heads.kv_count
        self.head_dim = args.head_dim
        self.tp = tp
        self.scale = args.attn_scale if args.attn_scale is not None else args.head_dim**-0.5
        self.window = args.layer_windows[layer] if args.layer_windows else None
        self.ops = ops
        # Loaded as q/k/v_proj (checkpoint names); fuse() packs them into qkv_proj.
        q_size, kv_size = self.num_heads * args.head_dim, self.num_kv_heads * args.head_dim
        self.q_proj: nn.Linear | None = nn.Linear(args.hidden_size, q_size, bias=args.qkv_bias)
        self.k_proj: nn.Linear | None = nn.Linear(args.hidden_size, kv_size, bias=args.qkv_bias)
        self.v_proj: nn.Linear | None = nn.Linear(args.hidden_size, kv_size, bias=args.qkv_bias)
        self.qkv_proj: nn.Linear | None = None
        self.o_proj = nn.Linear(q_size, args.hidden_size, bias=args.o_bias)
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
        return self.tp.all_reduce(self.o_proj(out.reshape(n, self.num_heads * self.head_dim)))


class DecoderLayer(nn.Module):
    def __init__(self, args: DecoderArgs, layer: int, ops: Ops, tp: TensorParallel) -> None:
        super().__init__()
        gemma = args.norm == "gemma"
        self.tp = tp

        def norm() -> RMSNorm:
            return RMSNorm(args.hidden_size, args.rms_norm_eps, ops, gemma)

        self.self_attn = Attention(args, layer, ops, tp)
        intermediate = tp.rows(args.intermediate_size)[1]
        self.mlp = GatedMLP(args.hidden_size, intermediate, args.activation, ops)
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
            return x + self._mlp(h)
        x = x + self.post_attention_layernorm(attn)
        return x + self.post_feedforward_layernorm(self._mlp(self.pre_feedforward_layernorm(x)))

    def _mlp(self, h: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.mlp(h))  # down_proj's rows summed over the ranks


class DecoderModel(nn.Module):
    def __init__(self, args: DecoderArgs, ops: Ops, tp: TensorParallel) -> None:
        super().__init__()
        vocab = tp.split(args.vocab_size, "vocabulary")
        # An empty weight (every model is built on the meta device and loaded from disk):
        # nn.Embedding's own random init would import torch._dynamo there, ~1 s a start.
        self.embed_tokens = nn.Embedding(
            vocab, args.hidden_size, _weight=torch.empty(vocab, args.hidden_size)
        )
        self.layers = nn.ModuleList(DecoderLayer(args, i, ops, tp) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, ops, args.norm == "gemma")


class FusedDecode(Protocol):
    """A decode step in one call (``worker/models/decode_stack.py``): the tokens embedded,
    every layer, the final norm."""

    def takes(self, meta: AttentionMetadata, num_tokens: int) -> bool: ...

    def __call__(
        self,
        input_ids: torch.Tensor,
        rope: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor: ...


class LoRARows(Protocol):
    """The step's LoRA adapter rows (``worker/lora.py``'s ``LoRABatch``)."""

    @property
    def active(self) -> bool: ...


class DecoderLM(CausalLM):
    """``forward`` takes the flattened tokens of the whole step and returns hidden states;
    ``compute_logits`` is applied only to the rows that are sampled. Once loaded, a
    ``fused_decode`` (set by the loader where one applies) takes decode-only steps without
    LoRA adapter rows (``lora_batch``, set by ``worker.lora.attach_lora``)."""

    @staticmethod
    def parse_config(cfg: dict[str, Any]) -> DecoderArgs:
        """Each family overrides this to read its config.json."""
        return DecoderArgs(**DecoderArgs.common(cfg))

    def __init__(
        self, hf_config: dict[str, Any], ops: Ops, tp: TensorParallel | None = None
    ) -> None:
        super().__init__(hf_config, ops, tp)
        self.args = args = self.parse_config(hf_config)
        self.tp = tp = tp or TensorParallel()
        self.model = DecoderModel(args, ops, tp)
        self.rotary = nn.ModuleDict(
            {name: RotaryEmbedding(args.head_dim, spec) for name, spec in args.ropes.items()}
        )
        self.vocab_per_rank = tp.split(args.vocab_size, "vocabulary")
        self.lm_head = nn.Linear(args.hidden_size, self.vocab_per_rank, bias=False)
        self.fused_decode: FusedDecode | None = None
        self.lora_batch: LoRARows | None = None

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

    def attention_shape(self) -> tuple[int, int, int]:
        return self.args.num_heads, self.args.num_kv_heads, self.args.head_dim

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        kv_heads = self.tp.heads(self.args.num_heads, self.args.num_kv_heads).kv_count
        return (2, num_blocks, kv_heads, block_size, self.args.head_dim)

    def shard_of(self, name: str) -> tuple[int, int, int] | None:
        """(dim, start, length) of this rank's slice of checkpoint tensor ``name``;
        None where every rank holds the whole tensor."""
        tp, a = self.tp, self.args
        if tp.size == 1:
            return None
        heads = tp.heads(a.num_heads, a.num_kv_heads)
        q = (heads.q_first * a.head_dim, heads.q_count * a.head_dim)
        kv = (heads.kv_first * a.head_dim, heads.kv_count * a.head_dim)
        inter = tp.rows(a.intermediate_size)
        suffix = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return 0, tp.rank * self.vocab_per_rank, self.vocab_per_rank
        if suffix == "q_proj":
            return 0, *q
        if suffix in ("k_proj", "v_proj"):
            return 0, *kv
        if suffix in ("gate_proj", "up_proj"):
            return 0, *inter
        if name.endswith("o_proj.weight"):
            return 1, *q
        if name.endswith("down_proj.weight"):
            return 1, *inter
        return None  # norms, and o_proj's bias (added once: on rank 0, see below)

    def drop_replicated_biases(self) -> None:
        """After loading: a bias after a row-split projection is added by rank 0 alone,
        or the all-reduce would add it once per rank."""
        if self.tp.rank == 0:
            return
        for layer in self.model.layers:
            assert isinstance(layer, DecoderLayer)  # narrows ModuleList's item type
            if layer.self_attn.o_proj.bias is not None:
                layer.self_attn.o_proj.bias.data.zero_()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        dtype = self.model.embed_tokens.weight.dtype
        rope = {
            name: emb(positions, dtype, meta.positions_end) for name, emb in self.rotary.items()
        }
        fused, lora = self.fused_decode, self.lora_batch
        # The fused path runs the base projections only: no adapter deltas.
        no_adapters = lora is None or not lora.active
        if fused is not None and no_adapters and fused.takes(meta, input_ids.shape[0]):
            return fused(input_ids, rope, kv_caches, meta)
        x = self.embed(input_ids)
        for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches, strict=True)):
            cos, sin = rope[self.args.layer_ropes[i]]
            x = layer(x, cos, sin, kv_cache, meta)
        return self.model.norm(x)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings, scaled where the model scales them."""
        x = self._embed(input_ids)
        if self.args.embed_scale is not None:
            # float32 first, then the model dtype: the same rounding as transformers
            x = x * torch.tensor(self.args.embed_scale, dtype=torch.float32, device=x.device).to(
                x.dtype
            )
        return x

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.model.embed_tokens(input_ids)
        # This rank's rows of the vocabulary; the others' tokens are zeros here and are
        # filled in by the all-reduce (exact: each row is one rank's value plus zeros).
        local = input_ids - self.tp.rank * self.vocab_per_rank
        mine = (local >= 0) & (local < self.vocab_per_rank)
        x = self.model.embed_tokens(local.clamp(0, self.vocab_per_rank - 1))
        return self.tp.all_reduce(x * mine.unsqueeze(-1).to(x.dtype))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.tp.gather_columns(self.lm_head(hidden))
        if self.args.final_softcap is not None:
            logits = torch.tanh(logits / self.args.final_softcap) * self.args.final_softcap
        return logits
