"""Qwen2 / Qwen2.5: Llama with biases on the q, k and v projections."""

from __future__ import annotations

from typing import Any

from worker.models.decoder import DecoderArgs, DecoderLM


class Qwen2ForCausalLM(DecoderLM):
    @staticmethod
    def parse_config(cfg: dict[str, Any]) -> DecoderArgs:
        common = DecoderArgs.common(cfg)
        if not cfg.get("use_sliding_window", False):
            common["layer_windows"] = tuple(None for _ in common["layer_windows"])
        return DecoderArgs(**common, qkv_bias=True, o_bias=False)
