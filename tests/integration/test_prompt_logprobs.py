"""Prompt logprobs over HTTP: the legacy completions ``echo`` with ``logprobs`` (what
lm-evaluation-harness's ``local-completions`` scores with, ``max_tokens`` 0 or 1) and
vLLM's ``prompt_logprobs``, against ``transformers``' own logits in float32: through a
chunked prefill (a prompt over the step's 512 tokens), and with the prompt cached
(such a request is prefilled whole again, so nothing is missing)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tests.stack import TandemStack

MODEL = "smollm2-135m-instruct"
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def reference(smollm2_dir: Path) -> tuple[Any, Callable[[list[int]], torch.Tensor]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), torch_dtype=torch.float32)
    model.eval()

    @torch.no_grad()
    def logprobs(ids: list[int]) -> torch.Tensor:
        """[len(ids) - 1]: each token's logprob after the ones before it; and the argmax."""
        out = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        return out[:-1].gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)

    return tok, logprobs


Reference = tuple[Any, Callable[[list[int]], torch.Tensor]]


def ids_of(tok: Any, text: str) -> list[int]:
    return list(tok.encode(text))


def complete(server: TandemStack, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(
        f"{server.url}/v1/completions", json={"model": MODEL, "temperature": 0, **body}, timeout=300
    )
    assert r.status_code == 200, r.text
    reply: dict[str, Any] = r.json()
    return reply


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_with_logprobs_scores_the_prompt_as_transformers_does(
    server: TandemStack, reference: Reference, max_tokens: int
) -> None:
    tok, logprobs_of = reference
    text = "The capital of France is Paris, and the capital of Italy is Rome."
    ids = ids_of(tok, text)
    reply = complete(server, {"prompt": ids, "echo": True, "logprobs": 1, "max_tokens": max_tokens})
    (choice,) = reply["choices"]
    lp = choice["logprobs"]
    assert len(lp["token_logprobs"]) == len(ids) + max_tokens
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    expected = logprobs_of(ids).tolist()
    got = lp["token_logprobs"][1 : len(ids)]
    assert max(abs(a - b) for a, b in zip(got, expected, strict=True)) < TOLERANCE
    for own, top in zip(got, lp["top_logprobs"][1 : len(ids)], strict=True):
        assert len(top) == 1 and max(top.values()) >= own - TOLERANCE
    assert lp["tokens"][: len(ids)] == [tok.decode([t]) for t in ids]
    assert choice["text"].startswith(tok.decode(ids))
    usage = reply["usage"]
    assert usage["completion_tokens"] == max_tokens
    if max_tokens == 0:
        assert choice["text"] == tok.decode(ids) and choice["finish_reason"] == "length"


def test_prompt_logprobs_through_chunks_and_with_the_prompt_cached(
    server: TandemStack,
    reference: Reference,
) -> None:
    tok, logprobs_of = reference
    long_text = " ".join(f"Item {i} is a number that follows {i - 1}." for i in range(1, 90))
    ids = ids_of(tok, long_text)
    assert len(ids) > 600  # two chunks of the 512-token step budget
    expected = logprobs_of(ids).tolist()
    for attempt in range(2):  # the second finds the prompt cached, and recomputes it
        reply = complete(server, {"prompt": ids, "prompt_logprobs": 2, "max_tokens": 2})
        (choice,) = reply["choices"]
        scored = choice["prompt_logprobs"]
        assert len(scored) == len(ids) and scored[0] is None
        got = [entry[str(t)]["logprob"] for t, entry in zip(ids[1:], scored[1:], strict=True)]
        assert max(abs(a - b) for a, b in zip(got, expected, strict=True)) < TOLERANCE, attempt
        for t, entry in zip(ids[1:], scored[1:], strict=True):
            assert entry[str(t)]["rank"] >= 1 and len(entry) <= 3  # its own and the top 2
            assert any(e["rank"] == 1 for e in entry.values())


def test_chat_prompt_logprobs_and_bad_requests(server: TandemStack) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say hi."}],
        "max_tokens": 2,
        "temperature": 0,
        "prompt_logprobs": 0,
    }
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    scored = r.json()["prompt_logprobs"]
    assert scored[0] is None and len(scored) == r.json()["usage"]["prompt_tokens"]
    assert all(len(entry) == 1 for entry in scored[1:])  # k = 0: the prompt's own token
    both = complete(
        server,
        {"prompt": "Hello there, friend.", "echo": True, "logprobs": 3, "prompt_logprobs": 1},
    )
    (choice,) = both["choices"]
    assert all(len(top) == 3 for top in choice["logprobs"]["top_logprobs"][1:])
    assert all(len(entry) <= 2 for entry in choice["prompt_logprobs"][1:])  # own + top 1
    refused = [
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),  # 0 without echo
        (
            {"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 1, "stream": True},
            "prompt_logprobs",
        ),
        ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ]
    for extra, param in refused:
        route = "chat/completions" if "messages" in extra else "completions"
        r = httpx.post(f"{server.url}/v1/{route}", json={"model": MODEL, **extra}, timeout=30)
        assert r.status_code in (400, 422), r.text
        assert param in r.text
