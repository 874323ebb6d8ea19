"""Architecture name (``config.json`` ``architectures``) -> model class."""

from __future__ import annotations

from typing import Any

from worker.models.base import CausalLM
from worker.models.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
}


def model_class_for(hf_config: dict[str, Any]) -> type[CausalLM]:
    names = hf_config.get("architectures") or []
    for name in names:
        if name in MODEL_REGISTRY:
            return MODEL_REGISTRY[name]
    supported = ", ".join(sorted(MODEL_REGISTRY))
    raise ValueError(f"architectures {names} not supported; Tandem runs {supported}")
