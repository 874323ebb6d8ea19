"""``transformers`` on the same weights and dtype as Tandem, in this process, as three
peers: sequential ``generate``, padded static batches, and its own continuous batching
(``generate_batch``'s manager) where the installed version has it.

Each turns into the same ``RequestResult``s a client of a server would see, for ``c``
closed-loop clients: a client sends its next request when its last one ends, and the
time it waits for the model to take the request counts in its TTFT and latency.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.generation.streamers import BaseStreamer

from bench.stats import RequestResult
from bench.workloads import BenchRequest
from common.model_files import resolve_model_dir

MODEL = "smollm2-135m-instruct"


class _StepClock(BaseStreamer):
    """Records when each generation step's tokens exist (the first ``put`` is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: Any) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def load_model(dtype: torch.dtype) -> Any:
    model = AutoModelForCausalLM.from_pretrained(
        str(resolve_model_dir(MODEL)), dtype=dtype, attn_implementation="sdpa"
    )
    return model.eval()


def _closed_loop(
    services: Sequence[tuple[float, float, list[float]]], concurrency: int
) -> tuple[list[RequestResult], float]:
    """Results of a one-at-a-time server, from each request's service (start, end,
    token times, all on one clock), for ``concurrency`` clients in a closed loop."""
    results: list[RequestResult] = []
    done: list[float] = []
    t0 = services[0][0]
    for i, (_start, end, tokens) in enumerate(services):
        sent = t0 if i < concurrency else done[i - concurrency]
        results.append(
            RequestResult(
                sent - t0, tokens[0] - sent, [t - sent for t in tokens], end - sent, len(tokens)
            )
        )
        done.append(end)
    return results, services[-1][1] - t0


@torch.inference_mode()
def run_sequential(
    model: Any, requests: Sequence[BenchRequest]
) -> list[tuple[float, float, list[float]]]:
    """Each request alone through ``generate`` (greedy, EOS ignored). Returns services
    for ``closed_loop``: the same services hold for any number of clients."""
    services = []
    for r in requests:
        clock = _StepClock()
        ids = torch.tensor([r.prompt_ids])
        start = time.perf_counter()
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=r.max_tokens,
            min_new_tokens=r.max_tokens,
            do_sample=False,
            streamer=clock,
            pad_token_id=0,
        )
        services.append((start, time.perf_counter(), clock.times))
    return services


def sequential_results(
    services: Sequence[tuple[float, float, list[float]]], concurrency: int
) -> tuple[list[RequestResult], float]:
    return _closed_loop(services, concurrency)


@torch.inference_mode()
def run_static_batches(
    model: Any, requests: Sequence[BenchRequest], concurrency: int
) -> tuple[list[RequestResult], float]:
    """Batches of ``concurrency`` requests, left-padded to the longest prompt, each run
    until its longest output is done; the next batch starts after."""
    results: list[RequestResult] = []
    t0 = time.perf_counter()
    previous_end = t0
    client_free = [t0] * concurrency  # when each client's last request ended
    for b in range(0, len(requests), concurrency):
        batch = requests[b : b + concurrency]
        longest = max(len(r.prompt_ids) for r in batch)
        ids = torch.zeros(len(batch), longest, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, r in enumerate(batch):
            ids[j, longest - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
            mask[j, longest - len(r.prompt_ids) :] = 1
        steps = max(r.max_tokens for r in batch)
        clock = _StepClock()
        model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=steps,
            min_new_tokens=steps,
            do_sample=False,
            streamer=clock,
            pad_token_id=0,
        )
        previous_end = time.perf_counter()
        for j, r in enumerate(batch):
            sent = client_free[j]
            tokens = clock.times[: r.max_tokens]
            results.append(
                RequestResult(
                    sent - t0,
                    tokens[0] - sent,
                    [t - sent for t in tokens],
                    tokens[-1] - sent,
                    len(tokens),
                )
            )
            client_free[j] = tokens[-1]
    return results, previous_end - t0


def has_continuous_batching(model: Any) -> bool:
    return hasattr(model, "init_continuous_batching")


@torch.inference_mode()
def run_continuous(
    model: Any, requests: Sequence[BenchRequest], concurrency: int
) -> tuple[list[RequestResult], float]:
    """``transformers``' continuous batching manager, fed by ``concurrency`` closed-loop
    clients; per-token timestamps come from the manager."""
    config = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=256)
    manager = model.init_continuous_batching(generation_config=config)
    manager.start()
    try:
        # Warm-up outside the measurement (the first steps compile and allocate).
        manager.add_request(requests[0].prompt_ids[:16], max_new_tokens=4)
        manager.get_result(timeout=600)
        results: dict[str, RequestResult] = {}
        sent_at: dict[str, float] = {}
        pending = list(enumerate(requests))[::-1]
        t0 = time.perf_counter()

        def submit() -> None:
            i, r = pending.pop()
            rid = f"bench-{i}"
            sent_at[rid] = time.perf_counter()
            manager.add_request(
                r.prompt_ids, request_id=rid, max_new_tokens=r.max_tokens, record_timestamps=True
            )

        for _ in range(min(concurrency, len(pending))):
            submit()
        while len(results) < len(requests):
            out = manager.get_result(timeout=600)
            if out is None:
                raise RuntimeError("transformers continuous batching returned no result")
            sent = sent_at[out.request_id]
            stamps = list(out.timestamps or [])
            i = int(out.request_id.split("-")[1])
            stamps = stamps[: requests[i].max_tokens]
            results[out.request_id] = RequestResult(
                sent - t0,
                stamps[0] - sent,
                [t - sent for t in stamps],
                (stamps[-1] if stamps else time.perf_counter()) - sent,
                len(stamps),
            )
            if pending:
                submit()
        wall = time.perf_counter() - t0
    finally:
        manager.stop(block=True)
    return [results[f"bench-{i}"] for i in range(len(requests))], wall
