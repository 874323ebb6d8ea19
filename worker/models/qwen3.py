"""Qwen3: Llama with a per-head RMSNorm of q and k before RoPE."""

from __future__ import annotations

from typing import Any

from worker.models.decoder import DecoderArgs, DecoderLM


class Qwen3ForCausalLM(DecoderLM):
    @staticmethod
    def parse_config(cfg: dict[str, Any]) -> DecoderArgs:
        common = DecoderArgs.common(cfg)
        if not cfg.get("use_sliding_window", False):
            common["layer_windows"] = tuple(None for _ in common["layer_windows"])
        bias = bool(cfg.get("attention_bias", False))
        return DecoderArgs(**common, qkv_bias=bias, o_bias=bias, qk_norm=True)
