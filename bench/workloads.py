"""The serving benchmark's workloads: seeded lists of requests as token ids, so every
system (Tandem, llama-server, transformers) gets prompts of exactly the same lengths."""

from __future__ import annotations

import random
from dataclasses import dataclass

# Ordinary vocabulary ids of SmolLM2 (below are bytes and special tokens).
_TOKEN_RANGE = (1_000, 45_000)
WORKLOADS = (
    "single",
    "chat",
    "mixed",
    "shared-prefix",
    "long-prompt-interference",
    "long-context",
    "copy-heavy",
)


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
    if workload == "copy-heavy":
        return copy_heavy(rng, num_requests)
    raise ValueError(f"unknown workload {workload!r}; one of {', '.join(WORKLOADS)}")


_NAMES = ("total", "count", "items", "price", "rate", "result", "value", "index", "limit", "offset")
_BODIES = (
    "    {a} = 0\n    for {b} in {c}:\n        {a} += {b} * {d}\n    return {a}\n",
    "    if {a} > {d}:\n        {b} = {a} - {d}\n    else:\n        {b} = {d} - {a}\n    return {b}\n",
    "    {b} = [{a} for {a} in {c} if {a} % {d} == 0]\n    return len({b}), sum({b})\n",
    "    while {a} < {d}:\n        {a} = {a} * 2 + {b}\n        {c}.append({a})\n    return {c}\n",
)


def copy_heavy(rng: random.Random, num_requests: int) -> list[BenchRequest]:
    """Chat prompts of ~400-800 tokens asking for a rewrite of seeded Python code with
    one name renamed, 256 tokens each: answers that mostly reproduce a span of the
    prompt (what n-gram speculation is for). Tokenized by the embedded SmolLM2."""
    from transformers import AutoTokenizer

    from common.model_files import resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_dir("smollm2-135m-instruct")))
    requests = []
    for _ in range(num_requests):
        target = rng.randint(400, 800)
        code, ids = "", []
        while True:
            a, b, c, d = rng.sample(_NAMES, 4)
            name = f"{rng.choice(_NAMES)}_{rng.randrange(1000)}"
            body = rng.choice(_BODIES).format(a=a, b=b, c=c, d=d)
            code += f"def {name}({a}, {b}, {c}, {d}):\n{body}\n\n"
            old, new = rng.sample(_NAMES, 2)
            ask = f"Rewrite this code with `{old}` renamed to `{new}`. Reply with the code only.\n\n{code}"
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": ask}], add_generation_prompt=True, tokenize=False
            )
            ids = tokenizer.encode(str(text), add_special_tokens=False)
            if len(ids) >= target:
                break
        requests.append(BenchRequest(list(ids), 256))
    return requests
