"""``--attention-backend``: the flag reaches the worker, and the PyTorch-only path serves
the same greedy tokens as the native kernels (float32) through the whole stack, with
several sequences decoding in one batch."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tests.stack import TandemStack, completion

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at", "Once upon a"]


def greedy_batch(url: str) -> list[dict[str, Any]]:
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # at once: one decode batch
        return list(
            pool.map(
                lambda p: completion(url, p, max_tokens=32, temperature=0, ignore_eos=True),
                PROMPTS,
            )
        )


def test_torch_backend_serves_the_native_backends_tokens(server: TandemStack) -> None:
    native = greedy_batch(server.url)
    assert "native CPU kernels" in server.log()
    with TandemStack("--dtype", "float32", "--attention-backend", "torch") as stack:
        torch_only = greedy_batch(stack.url)
        assert "PyTorch ops only" in stack.log()
        assert "native CPU kernels" not in stack.log()
    for a, b in zip(native, torch_only, strict=True):
        assert a["choices"][0]["text"] == b["choices"][0]["text"]
        assert a["usage"]["completion_tokens"] == b["usage"]["completion_tokens"] == 32
