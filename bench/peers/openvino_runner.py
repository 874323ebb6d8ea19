"""OpenVINO GenAI's ``ContinuousBatchingPipeline`` (the engine behind OpenVINO Model
Server) on a list of token-id prompts: the engine-level peer of ``bench/offline.py``.

Runs in the OpenVINO venv that ``bench/peers/build_openvino.sh`` makes, not in Tandem's
(it imports nothing of Tandem): ``python openvino_runner.py SPEC.json`` reads the spec,
prints one JSON line of results. Spec keys: ``model_dir``, ``prompts`` (lists of ids),
``max_tokens``, ``concurrency`` (a list), ``precision`` ("bf16" or "f32", for both
compute and the KV cache), ``threads``, ``cache_gb``.

At concurrency ``c`` the prompts go in waves of ``c`` at once (``c = 1``: one at a time),
each generating exactly ``max_tokens`` greedily (``ignore_eos``).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import numpy as np
import openvino as ov
import openvino_genai as ov_genai


class _TokenClock(ov_genai.StreamerBase):
    """When each token of a lone request was produced (its inter-token latencies)."""

    def __init__(self) -> None:
        super().__init__()
        self.times: list[float] = []

    def write(self, token: int | list[int]) -> ov_genai.StreamingStatus:
        now = time.perf_counter()
        self.times.extend([now] * (len(token) if isinstance(token, list) else 1))
        return ov_genai.StreamingStatus.RUNNING

    def end(self) -> None:
        pass


def _config(max_tokens: int) -> Any:
    config = ov_genai.GenerationConfig()
    config.max_new_tokens = max_tokens
    config.min_new_tokens = max_tokens
    config.ignore_eos = True
    config.do_sample = False
    return config


def _pipeline(spec: dict[str, Any]) -> Any:
    scheduler = ov_genai.SchedulerConfig()
    scheduler.cache_size = int(spec["cache_gb"])
    scheduler.enable_prefix_caching = False  # every point reruns the same prompts
    precision = spec["precision"]
    properties = {
        "INFERENCE_PRECISION_HINT": precision,
        "KV_CACHE_PRECISION": "bf16" if precision == "bf16" else "f32",
        "INFERENCE_NUM_THREADS": int(spec["threads"]),
    }
    return ov_genai.ContinuousBatchingPipeline(spec["model_dir"], scheduler, "CPU", properties)


def run(spec: dict[str, Any]) -> dict[str, Any]:
    load_start = time.perf_counter()
    pipe = _pipeline(spec)
    load_s = time.perf_counter() - load_start
    prompts = [ov.Tensor(np.array([ids], dtype=np.int64)) for ids in spec["prompts"]]
    config = _config(int(spec["max_tokens"]))
    pipe.generate(prompts[:1], [_config(8)])  # warm-up: compiles the shapes once
    points = []
    for c in spec["concurrency"]:
        tokens = 0
        itls: list[float] = []
        outputs: list[list[int]] = []
        start = time.perf_counter()
        for i in range(0, len(prompts), c):
            wave = prompts[i : i + c]
            clock = _TokenClock() if c == 1 else None
            results = pipe.generate(wave, [config] * len(wave), clock)
            for result in results:
                ids = list(result.m_generation_ids[0])
                tokens += len(ids)
                outputs.append(ids)
            if clock is not None:
                itls += [b - a for a, b in zip(clock.times, clock.times[1:], strict=False)]
        wall_s = time.perf_counter() - start
        points.append(
            {
                "concurrency": c,
                "wall_s": wall_s,
                "output_tokens": tokens,
                "output_tok_s": tokens / wall_s,
                "itl_s": itls,
                "outputs": outputs,
            }
        )
    return {"version": ov_genai.__version__, "load_s": load_s, "points": points}


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(json.dumps(run(json.load(f))))
