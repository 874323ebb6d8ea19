"""The sampler's lazy masking rests on one property of a step's grammars: a row accepts a
token exactly when the token's bit is set in the mask llguidance computes, EOS and
forced text included. Checked over SmolLM2's vocabulary along random
walks through JSON schemas' grammars, to the end of each."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from common.messages import StructuredOutput, StructuredOutputKind
from worker.structured import StructuredOutputs

VOCAB, EOS = 49152, 2
SCHEMA = {
    "type": "object",
    "properties": {"a": {"enum": ['x"}', "</tool_call>"]}, "b": {"type": "integer"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}

WORDS = {
    "type": "object",
    "properties": {
        "w": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3}
    },
    "required": ["w"],
    "additionalProperties": False,
}


def allowed(mask: torch.Tensor) -> list[int]:
    bits = (mask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.view(-1)[:VOCAB].nonzero().flatten().tolist()


@pytest.mark.parametrize("schema,seed", [(SCHEMA, 0), (SCHEMA, 1), (WORDS, 0)])
def test_a_grammar_accepts_exactly_the_tokens_its_mask_allows(
    smollm2_dir: Path, schema: dict[str, Any], seed: int
) -> None:
    outputs = StructuredOutputs(smollm2_dir, VOCAB, [EOS])
    spec = StructuredOutput(kind=StructuredOutputKind.JSON_SCHEMA, spec=json.dumps(schema))
    matcher = outputs.matcher(spec, "r")
    rng = random.Random(seed)
    texts = AutoTokenizer.from_pretrained(smollm2_dir).batch_decode([[t] for t in range(VOCAB)])
    for _ in range(80):
        step = outputs.step([None, matcher])
        assert list(step.rows) == [1]
        ok = allowed(step.bitmask([1])[0])
        # Every allowed token, EOS, and a sample of the rest (all 49,152 take ~0.2 s a step).
        some = sorted({*ok, EOS, *rng.sample(range(VOCAB), 3000)})
        assert [t for t in some if step.accepts(1, t)] == ok
        if ok == [EOS]:
            return  # complete: only EOS, and the check says the same
        # The grammar allows any whitespace between tokens: walk through the rest.
        solid = [t for t in ok if t != EOS and texts[t].strip()]
        token = rng.choice(solid or ok)
        matcher.advance(token)
    raise AssertionError("the grammar never completed")
