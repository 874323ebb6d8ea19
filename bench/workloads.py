"""The serving benchmark's workloads: seeded lists of requests as token ids, so every
system (Tandem, llama-server, transformers) gets prompts of exactly the same lengths."""

from __future__ import annotations

import random
from dataclasses import dataclass

# Ordinary vocabulary ids of SmolLM2 (below are bytes and special tokens).
_TOKEN_RANGE = (1_000, 45_000)
WORKLOADS = ("single", "chat", "mixed", "shared-prefix", "long-prompt-interference", "long-context")


@dataclass(frozen=True)
class BenchRequest:
    prompt_ids: list[int]
    max_tokens: int
    kind: str = "normal"  # long-prompt-interference: "decode" streams or "long" prompts


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*_TOKEN_RANGE) for _ in range(n)]


def make_requests(workload: str, num_requests: int, seed: int = 0) -> list[BenchRequest]:
    """``num_requests`` requests of ``workload``, the same for the same seed."""
    rng = random.Random(seed)
    if workload == "single":
        return [BenchRequest(_tokens(rng, 256), 256) for _ in range(num_requests)]
    if workload == "chat":
        # Short distinct prompts (a templated chat turn's length), 128 tokens each: the
        # decode-bound workload of the performance issue.
        return [BenchRequest(_tokens(rng, rng.randint(24, 64)), 128) for _ in range(num_requests)]
    if workload == "mixed":
        return [
            BenchRequest(_tokens(rng, rng.randint(32, 1024)), rng.randint(64, 256))
            for _ in range(num_requests)
        ]
    if workload == "shared-prefix":
        prefix = _tokens(rng, 1000)
        return [
            BenchRequest(prefix + _tokens(rng, rng.randint(16, 64)), 64)
            for _ in range(num_requests)
        ]
    if workload == "long-prompt-interference":
        # A quarter are 2,000-token prompts; the rest short prompts with long outputs
        # that keep decoding while the long ones prefill.
        out = []
        for i in range(num_requests):
            if i % 4 == 3:
                out.append(BenchRequest(_tokens(rng, 2000), 16, "long"))
            else:
                out.append(BenchRequest(_tokens(rng, 32), 256, "decode"))
        return out
    if workload == "long-context":
        # A long document or conversation, then a long answer: decode steps where attention
        # over 3,000-4,000 tokens of context weighs as much as the weights.
        return [
            BenchRequest(_tokens(rng, rng.randint(3000, 4000)), 256) for _ in range(num_requests)
        ]
    raise ValueError(f"unknown workload {workload!r}; one of {', '.join(WORKLOADS)}")
