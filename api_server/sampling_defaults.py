"""A model's own sampling defaults, from its ``generation_config.json``.

As vLLM does by default (``--generation-config auto``), a request that leaves out
``temperature``, ``top_p``, ``top_k``, ``min_p`` or ``repetition_penalty`` gets the
model's value when the model ships one, else OpenAI's default. ``--generation-config
vllm`` ignores the file; a directory path reads the file from there instead.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from pydantic import BaseModel, ConfigDict

logger = logging.getLogger(__name__)

GENERATION_CONFIG_NONE = "vllm"  # vLLM's name for "do not read generation_config.json"


class SamplingDefaults(BaseModel):
    """Sampling values a model ships; None = not set (OpenAI's default applies)."""

    model_config = ConfigDict(frozen=True)

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None

    def describe(self) -> str:
        values = self.model_dump(exclude_none=True)
        return ", ".join(f"{k}={v}" for k, v in values.items()) or "none (OpenAI's defaults)"


def load_sampling_defaults(model_dir: Path, setting: str = "auto") -> SamplingDefaults:
    """The defaults ``--generation-config`` asks for: ``auto`` (the model directory's
    file), ``vllm`` (none), or a directory holding a ``generation_config.json``."""
    if setting == GENERATION_CONFIG_NONE:
        return SamplingDefaults()
    folder = model_dir if setting == "auto" else Path(setting)
    path = folder / "generation_config.json"
    if not path.is_file():
        if setting != "auto":
            raise ValueError(f"--generation-config {setting}: no generation_config.json there")
        return SamplingDefaults()
    with open(path) as f:
        values = json.load(f)
    if values.get("do_sample") is False:
        # transformers' greedy switch: the sampling values in the file are not used.
        return SamplingDefaults(temperature=0.0)
    fields = SamplingDefaults.model_fields
    return SamplingDefaults(**{k: v for k, v in values.items() if k in fields and v is not None})
