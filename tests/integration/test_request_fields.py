"""The parameters real clients send: unknown and inapplicable fields are served and
reported (vLLM's way) or refused under --strict-request-fields; vLLM's extensions;
the model's generation_config.json sampling defaults; guidellm end to end."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.stack import TandemStack, completion

MODEL = "smollm2-135m-instruct"
HEADER = "x-tandem-ignored-fields"


def post(url: str, path: str, **body: Any) -> httpx.Response:
    return httpx.post(f"{url}{path}", json={"model": MODEL, **body}, timeout=60)


def test_unknown_and_inapplicable_fields_are_served_and_named(server: TandemStack) -> None:
    r = post(
        server.url,
        "/v1/chat/completions",
        messages=[{"role": "user", "content": "Hi", "cache_control": {"type": "x"}}],
        max_tokens=2,
        store=True,
        service_tier="auto",
        reasoning_effort="low",
        frobnicate=1,
        stop=None,  # guidellm sends it
    )
    assert r.status_code == 200, r.text
    assert r.headers[HEADER].split(",") == [
        "store",
        "service_tier",
        "reasoning_effort",
        "frobnicate",
        "messages.0.cache_control",
    ]
    assert "ignored fields" in server.log() and "frobnicate" in server.log()
    plain = post(server.url, "/v1/completions", prompt="Hi", max_tokens=2)
    assert plain.status_code == 200 and HEADER not in plain.headers


def test_strict_request_fields_refuses_unknown_but_not_openai_fields(
    smollm2_dir: Path,
) -> None:
    with TandemStack("--strict-request-fields", "--num-kv-blocks", "64") as stack:
        r = post(stack.url, "/v1/completions", prompt="Hi", max_tokens=2, frobnicate=1)
        assert r.status_code == 422 and r.json()["error"]["param"] == "frobnicate"
        r = post(stack.url, "/v1/completions", prompt="Hi", max_tokens=2, store=True)
        assert r.status_code == 200 and r.headers[HEADER] == "store"


def test_continuous_usage_stats_put_usage_in_every_chunk(server: TandemStack) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Count to ten"}],
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(e) for e in events[:-1]]
    assert events[-1] == "[DONE]"
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts[0] == 0 and counts[-1] == 6 and counts == sorted(counts)
    assert all(c["usage"]["prompt_tokens"] == chunks[0]["usage"]["prompt_tokens"] for c in chunks)


def test_include_stop_str_in_output_and_logit_bias(server: TandemStack) -> None:
    full = completion(server.url, "The capital of France is", max_tokens=12, temperature=0)
    text = full["choices"][0]["text"]
    word = text.split()[1]
    cut = completion(
        server.url, "The capital of France is", max_tokens=12, temperature=0, stop=[word]
    )
    kept = completion(
        server.url,
        "The capital of France is",
        max_tokens=12,
        temperature=0,
        stop=[word],
        include_stop_str_in_output=True,
    )
    assert kept["choices"][0]["text"] == cut["choices"][0]["text"] + word
    forced = completion(
        server.url, "The capital of France is", max_tokens=3, temperature=0, logit_bias={"42": 100}
    )
    ids = completion(
        server.url,
        "The capital of France is",
        max_tokens=3,
        temperature=0,
        logit_bias={"42": 100},
        return_token_ids=True,
    )["choices"][0]["token_ids"]
    assert ids == [42, 42, 42] and forced["choices"][0]["text"]
    only = completion(
        server.url,
        "Pick:",
        max_tokens=4,
        temperature=1.0,
        allowed_token_ids=[314, 315],
        return_token_ids=True,
    )
    assert set(only["choices"][0]["token_ids"]) <= {314, 315}


# ------------------------------------------------------------ generation_config defaults

PROMPT = "I like to eat"  # the top next token has p = 0.18 at temperature 1, ~0.9 at 0.3
SAMPLES = 64


@pytest.fixture(scope="module")
def cool_model(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2 whose generation_config.json asks for temperature 0.3."""
    path = tmp_path_factory.mktemp("cool-model")
    for name in os.listdir(smollm2_dir):
        if name != "generation_config.json" and not name.startswith("."):
            (path / name).symlink_to(smollm2_dir / name)
    with open(smollm2_dir / "generation_config.json") as f:
        config = json.load(f)
    (path / "generation_config.json").write_text(
        json.dumps({**config, "do_sample": True, "temperature": 0.3})
    )
    return path


def top_token_share(url: str, **params: Any) -> float:
    """Share of SAMPLES first tokens that are the greedy one."""
    greedy = completion(url, PROMPT, max_tokens=1, temperature=0, return_token_ids=True)
    top = greedy["choices"][0]["token_ids"][0]
    hits = 0
    for _ in range(SAMPLES // 16):
        out = completion(url, PROMPT, max_tokens=1, n=16, return_token_ids=True, **params)
        hits += sum(c["token_ids"][0] == top for c in out["choices"])
    return hits / SAMPLES


def expected_share(url: str, temperature: float) -> float:
    """The top token's probability at this temperature, from the top-20 logprobs."""
    out = completion(url, PROMPT, max_tokens=1, temperature=0, logprobs=20)
    values = sorted(out["choices"][0]["logprobs"]["top_logprobs"][0].values(), reverse=True)
    weights = [math.exp(v / temperature) for v in values]
    rest = max(0.0, 1.0 - sum(math.exp(v) for v in values))  # mass beyond the top 20
    return weights[0] / (sum(weights) + (rest if temperature == 1.0 else 0.0))


def test_generation_config_temperature_applies_when_omitted(cool_model: Path) -> None:
    with TandemStack("--model", str(cool_model), "--served-model-name", MODEL) as stack:
        card = httpx.get(f"{stack.url}/v1/models").json()["data"][0]
        assert card["sampling_defaults"] == {"temperature": 0.3}
        assert "temperature=0.3" in stack.log()
        p_cool, p_hot = expected_share(stack.url, 0.3), expected_share(stack.url, 1.0)
        assert p_cool > 0.8 and p_hot < 0.25  # the two hypotheses are far apart
        share = top_token_share(stack.url)  # temperature omitted
        sigma = math.sqrt(p_cool * (1 - p_cool) / SAMPLES)
        assert abs(share - p_cool) < 4 * sigma + 0.05, (share, p_cool)
        # An explicit temperature still wins.
        assert top_token_share(stack.url, temperature=1.0) < 0.5


def test_generation_config_vllm_turns_the_defaults_off(cool_model: Path) -> None:
    flags = ["--model", str(cool_model), "--served-model-name", MODEL]
    with TandemStack(*flags, "--generation-config", "vllm") as stack:
        card = httpx.get(f"{stack.url}/v1/models").json()["data"][0]
        assert card["sampling_defaults"] == {}
        p_hot = expected_share(stack.url, 1.0)
        share = top_token_share(stack.url)  # temperature omitted: OpenAI's 1.0
        sigma = math.sqrt(p_hot * (1 - p_hot) / SAMPLES)
        assert abs(share - p_hot) < 4 * sigma + 0.05, (share, p_hot)
        assert top_token_share(stack.url, temperature=0) == 1.0  # greedy


# ------------------------------------------------------------ guidellm, as users run it


@pytest.fixture(scope="module")
def guidellm() -> str:
    """The CLI the dev extra installs beside this interpreter."""
    return str(Path(sys.executable).parent / "guidellm")


def generated_tokens(url: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("tandem:generation_tokens_total{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no tandem:generation_tokens_total in /metrics")


@pytest.mark.slow  # the test budget puts guidellm under slow (../shared/WAVE2-NOTES.md)
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_guidellm_runs_without_errors(
    server: TandemStack, smollm2_dir: Path, guidellm: str, tmp_path: Path, route: str
) -> None:
    before = generated_tokens(server.url)
    report = tmp_path / "guidellm.json"
    run = subprocess.run(
        [
            guidellm,
            "run",
            "--backend",
            f"kind=openai_http,target={server.url},model={MODEL},request_format={route}",
            "--profile",
            "kind=concurrent,streams=8",
            "--data",
            "kind=synthetic_text,prompt_tokens=32,output_tokens=16",
            "--constraint",
            "kind=max_requests,count=24",
            "--tokenizer",
            f"kind=huggingface_auto,model={smollm2_dir}",
            "--output",
            f"kind=json,path={report}",
            "--disable-console-interactive",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    benchmark = json.loads(report.read_text())["benchmarks"][0]
    requests = benchmark["requests"]
    assert (len(requests["successful"]), len(requests["errored"])) == (24, 0)
    theirs = sum(r["output_tokens"] for r in requests["successful"])
    assert theirs == 24 * 16
    assert generated_tokens(server.url) - before == theirs  # Tandem counted the same
