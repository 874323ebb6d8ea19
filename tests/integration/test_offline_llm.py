"""The offline API: ``from api_server import LLM`` starts its own engine and workers,
gives the server's greedy outputs, and leaves no process behind."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from api_server import LLM, SamplingParams
from tests.stack import TandemStack, completion

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


def test_generate_matches_the_server_and_stops_cleanly(
    server: TandemStack, smollm2_dir: Path
) -> None:
    before = set(psutil.Process().children(recursive=True))
    with LLM(dtype="float32", max_model_len=1024) as llm:
        started = set(psutil.Process().children(recursive=True)) - before
        assert {p.cmdline()[2] for p in started if "-m" in p.cmdline()} >= {"engine_core"}
        assert len(started) >= 2  # the engine core and its worker
        engine = psutil.Process(llm.engine_pid)
        assert engine in started and "engine_core" in engine.cmdline()
        assert set(engine.children(recursive=True)) == started - {engine}
        results = llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0.0))
        one = llm.generate(PROMPTS[0], SamplingParams(max_tokens=24, temperature=0.0), stop=["."])
        ids = llm.tokenizer.encode(PROMPTS[1])
        by_ids = llm.generate(ids, SamplingParams(max_tokens=24, temperature=0.0))
        # Bad prompts fail with the server's messages, as ValueError, and nothing is sent.
        refusals: list[tuple[str | list[int], str]] = [
            ("", "empty"),
            ([10**7], "outside the vocabulary"),
            ("word " * 1100, "context length is 1024"),
        ]
        for prompt, message in refusals:
            with pytest.raises(ValueError, match=message):
                llm.generate(prompt, SamplingParams(max_tokens=8))
        after = llm.generate(PROMPTS[0], SamplingParams(max_tokens=24, temperature=0.0))
    assert [r.prompt for r in results] == PROMPTS
    for r in results:
        served = completion(server.url, r.prompt, max_tokens=24, temperature=0)
        assert r.outputs[0].text == served["choices"][0]["text"]
        assert r.outputs[0].finish_reason == served["choices"][0]["finish_reason"]
        assert len(r.outputs[0].token_ids) == served["usage"]["completion_tokens"]
    assert "." not in one[0].outputs[0].text and one[0].outputs[0].finish_reason == "stop"
    assert results[0].outputs[0].text.startswith(one[0].outputs[0].text)
    assert by_ids[0].outputs[0].text == results[1].outputs[0].text
    assert after[0].outputs[0].text == results[0].outputs[0].text
    _, alive = psutil.wait_procs(list(started), timeout=10)
    assert not alive, f"left behind: {[p.cmdline() for p in alive]}"
    with pytest.raises(RuntimeError, match="closed"):
        _ = llm.engine_pid


def test_bfloat16_runs_on_every_cpu(smollm2_dir: Path) -> None:
    """bfloat16 weights start and generate whatever the CPU: where oneDNN cannot prepack
    them (no AVX512BW/VL/DQ: AMD Zen 2/3) the worker keeps plain linears instead of dying
    at load."""
    with LLM(dtype="bfloat16", max_model_len=1024) as llm:
        result = llm.generate(PROMPTS[0], SamplingParams(max_tokens=8, temperature=0.0))
    output = result[0].outputs[0]
    assert len(output.token_ids) == 8 and output.finish_reason == "length"
    assert output.text.startswith(" Paris")
