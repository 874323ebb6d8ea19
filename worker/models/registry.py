"""Architecture name (``config.json`` ``architectures``) -> model class. Adding a family
is one file in this folder and one line here."""

from __future__ import annotations

from typing import Any

from worker.models.base import CausalLM
from worker.models.gemma3 import Gemma3ForCausalLM
from worker.models.llama import LlamaForCausalLM
from worker.models.qwen2 import Qwen2ForCausalLM
from worker.models.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
}


def model_class_for(hf_config: dict[str, Any]) -> type[CausalLM]:
    names = hf_config.get("architectures") or []
    for name in names:
        if name in MODEL_REGISTRY:
            return MODEL_REGISTRY[name]
    supported = ", ".join(sorted(MODEL_REGISTRY))
    raise ValueError(f"architectures {names} not supported; Tandem runs {supported}")
