"""Llama 2/3.x (incl. ``llama3`` RoPE scaling) and SmolLM2: GQA, RoPE, RMSNorm, SwiGLU."""

from __future__ import annotations

from typing import Any

from worker.models.decoder import DecoderArgs, DecoderLM


class LlamaForCausalLM(DecoderLM):
    @staticmethod
    def parse_config(cfg: dict[str, Any]) -> DecoderArgs:
        bias = bool(cfg.get("attention_bias", False))
        return DecoderArgs(**DecoderArgs.common(cfg), qkv_bias=bias, o_bias=bias)
