"""Prompt logprobs in the two shapes clients read: vLLM's ``prompt_logprobs`` (a map
per prompt token, completions and chat) and the legacy completions ``logprobs`` object
over an echoed prompt (``echo`` with ``logprobs``, what lm-evaluation-harness's
``local-completions`` scores loglikelihoods from). The engine computes them in the
prefill (``worker/prompt_logprobs.py``)."""

from __future__ import annotations

from typing import Any

from common.messages import TokenLogprobs


def echo_logprobs(
    tokenizer: Any, prompt_ids: list[int], logprobs: list[TokenLogprobs], k: int
) -> dict[str, Any]:
    """The legacy ``logprobs`` object over the echoed prompt: its first token has none
    (``null``), each later one its logprob under the positions before it, with its
    ``k`` most likely tokens."""
    tokens = [tokenizer.decode([t]) for t in prompt_ids]
    offsets, at = [], 0
    for token in tokens:
        offsets.append(at)
        at += len(token)
    top: list[dict[str, float] | None] = [None]
    top += [
        {
            tokenizer.decode([t]): v
            for t, v in zip(lp.top_token_ids[:k], lp.top_logprobs[:k], strict=True)
        }
        for lp in logprobs
    ]
    return {
        "tokens": tokens,
        "token_logprobs": [None, *(lp.logprob for lp in logprobs)],
        "top_logprobs": top,
        "text_offset": offsets,
    }


def joined(first: dict[str, Any] | None, then: dict[str, Any] | None) -> dict[str, Any] | None:
    """Two legacy ``logprobs`` objects, one after the other."""
    if first is None or then is None:
        return first or then
    return {key: first[key] + then[key] for key in first}


def vllm_prompt_logprobs(
    tokenizer: Any, prompt_ids: list[int], logprobs: list[TokenLogprobs], k: int
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: ``null`` for the first token, then per token a map
    from token id to ``logprob``, ``rank`` and ``decoded_token``: the prompt's own token
    and the top ``k``."""
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for token, lp in zip(prompt_ids[1:], logprobs, strict=True):
        entry = {
            str(token): {
                "logprob": lp.logprob,
                "rank": lp.rank,
                "decoded_token": tokenizer.decode([token]),
            }
        }
        pairs = zip(lp.top_token_ids[:k], lp.top_logprobs[:k], strict=True)
        for rank, (t, v) in enumerate(pairs, 1):
            entry.setdefault(
                str(t), {"logprob": v, "rank": rank, "decoded_token": tokenizer.decode([t])}
            )
        out.append(entry)
    return out
