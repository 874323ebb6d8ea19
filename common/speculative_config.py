"""``--speculative-config``: speculative decoding, spelled as vLLM's ``SpeculativeConfig``.

``{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
"prompt_lookup_max": 5}`` proposes, for each decoding request, the tokens that followed
the latest earlier occurrence of its last n tokens (n from ``prompt_lookup_max`` down to
``prompt_lookup_min``) in its own prompt and output; the model verifies them in the
request's next step (``engine_core/speculation.py``). As in vLLM, a missing window bound
takes the other's value, and both missing mean 5.

``disable_by_batch_size`` (vLLM's field): no drafts in a step that decodes more requests
than this; speculation pays where a step is bound by reading the weights, not where
many requests already share that read. Tandem's default is measured (docs/benchmarks.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from common.config_checks import json_object, refuse_unknown_fields, require

FLAG = "--speculative-config"
NGRAM_METHODS = ("ngram", "[ngram]")  # vLLM's older spelling too
NOT_YET = ("draft_model", "eagle", "eagle3", "medusa", "mlp_speculator", "mtp", "suffix")
# vLLM's fields that tune machinery Tandem does not have: accepted, without effect.
_INERT = ("disable_log_stats", "disable_logprobs")
# 8 rather than vLLM's unlimited: at 32 decoding requests on a CPU a step is bound by
# compute, and verifying drafts slows it (bench/serving.py --speculative-config).
DEFAULT_DISABLE_BY_BATCH_SIZE = 8


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 0
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE

    @property
    def enabled(self) -> bool:
        return self.num_speculative_tokens > 0


OFF = SpeculativeConfig()


def parse_speculative_config(text: str | None) -> SpeculativeConfig:
    """The flag's JSON as a checked config; ``OFF`` when absent. A ``ValueError`` names
    what is wrong."""
    if not text:
        return OFF
    raw: dict[str, Any] = json_object(text, FLAG)
    for key in _INERT:
        raw.pop(key, None)
    method = raw.get("method")
    if method is None and raw.get("model") in NGRAM_METHODS:
        method = raw.pop("model")  # vLLM's old {"model": "[ngram]"}
    require(method is not None, f'{FLAG} needs "method" (ngram)')
    require(
        method not in NOT_YET,
        f"{FLAG}: method {method!r} is not served yet; ngram is (docs/speculative.md)",
    )
    require(method in NGRAM_METHODS, f"{FLAG}: unknown method {method!r}; use ngram")
    raw["method"] = "ngram"
    refuse_unknown_fields(raw, SpeculativeConfig, FLAG)
    for key in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
        value = raw.get(key)
        require(
            value is None or (isinstance(value, int) and not isinstance(value, bool)),
            f"{FLAG}: {key} must be an integer, got {value!r}",
        )
    k = raw.get("num_speculative_tokens")
    if not isinstance(k, int) or not 1 <= k <= 16:
        raise ValueError(f"{FLAG}: num_speculative_tokens must be an integer in [1, 16], got {k!r}")
    low, high = raw.get("prompt_lookup_min"), raw.get("prompt_lookup_max")
    low, high = (low or high or 5), (high or low or 5)
    require(
        1 <= low <= high,
        f"{FLAG}: need 1 <= prompt_lookup_min <= prompt_lookup_max, got {low} and {high}",
    )
    batch = raw.get("disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE)
    require(
        isinstance(batch, int) and batch >= 1,
        f"{FLAG}: disable_by_batch_size must be a positive integer, got {batch!r}",
    )
    return SpeculativeConfig("ngram", k, low, high, batch)
