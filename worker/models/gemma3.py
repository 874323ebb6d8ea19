"""Gemma3 (text): interleaved sliding-window and global layers with their own RoPE
bases, four (1 + w)-scaled norms per layer, q/k norms, scaled embeddings,
``query_pre_attn_scalar``, GeGLU, final-logit soft-capping, tied embeddings.

``attn_logit_softcapping`` is read but not applied: transformers' Gemma3 does not apply
it either (Gemma2 did), and transformers is the reference for parity."""

from __future__ import annotations

from typing import Any

from worker.models.decoder import DecoderArgs, DecoderLM
from worker.models.layers import RopeSpec


class Gemma3ForCausalLM(DecoderLM):
    @staticmethod
    def parse_config(cfg: dict[str, Any]) -> DecoderArgs:
        cfg = {"hidden_activation": "gelu_pytorch_tanh", **cfg}
        cfg.pop("hidden_act", None)  # Gemma3 names its activation hidden_activation
        common = DecoderArgs.common(cfg)
        num_layers = common["num_layers"]
        layer_types = cfg.get("layer_types") or [
            "full_attention"
            if (i + 1) % cfg.get("sliding_window_pattern", 6) == 0
            else "sliding_attention"
            for i in range(num_layers)
        ]
        params = cfg.get("rope_parameters") or {}
        if "sliding_attention" in params:  # transformers 5: one entry per layer type
            ropes = {t: RopeSpec.from_params(p) for t, p in params.items() if p is not None}
        else:  # older configs: rope_theta (+ rope_scaling) global, rope_local_base_freq local
            ropes = {
                "full_attention": RopeSpec.from_params(
                    {
                        **(cfg.get("rope_scaling") or {}),
                        "rope_theta": cfg.get("rope_theta", 1_000_000.0),
                    }
                ),
                "sliding_attention": RopeSpec(
                    theta=float(cfg.get("rope_local_base_freq", 10_000.0))
                ),
            }
        common.update(
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
            layer_windows=tuple(
                cfg.get("sliding_window") if t == "sliding_attention" else None for t in layer_types
            ),
            layer_ropes=tuple(layer_types),
            ropes=ropes,
        )
        return DecoderArgs(
            **common,
            qkv_bias=bool(cfg.get("attention_bias", False)),
            o_bias=bool(cfg.get("attention_bias", False)),
            qk_norm=True,
            norm="gemma",
            sandwich_norms=True,
            embed_scale=common["hidden_size"] ** 0.5,
            attn_scale=float(cfg.get("query_pre_attn_scalar", common["head_dim"])) ** -0.5,
            final_softcap=cfg.get("final_logit_softcapping"),
        )
