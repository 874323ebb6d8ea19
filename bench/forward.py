"""Tandem's forward pass against transformers', same weights and dtype, in one run:
decode step time at batch 1, 8 and 32 (each sequence with a 128-token context), and
prefill throughput of one 512-token prompt. Both sides include picking the next token
(greedy) so a step is a whole step.

    .venv/bin/python -m bench.forward [--model smollm2-135m-instruct] [--dtype auto]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from bench.harness import print_table, write_results
from common.config import CacheConfig
from common.messages import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput
from common.model_files import resolve_model_dir
from worker.device import resolve_dtype
from worker.model_runner import ModelRunner
from worker.parallel import TensorParallel

CONTEXT = 128
PREFILL = 512
GREEDY = SamplingParams(max_tokens=10**6, temperature=0.0, ignore_eos=True)


def timed_pair(
    first: Callable[[], object], second: Callable[[], object], repeats: int
) -> tuple[float, float]:
    """Median seconds of each after one warm-up call, calls alternating: this host's
    speed drifts by tens of percent within minutes, and alternation shares the drift."""
    first()
    second()
    samples: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for fn, out in ((first, samples[0]), (second, samples[1])):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return statistics.median(samples[0]), statistics.median(samples[1])


class TandemSide:
    def __init__(
        self, model_dir: str, dtype: torch.dtype, tp: TensorParallel | None = None
    ) -> None:
        """``tp``: this process is one rank (``bench/tensor_parallel.py``); ranks > 0 do
        not learn the sampled tokens here, so they recompute the last position: the same
        shapes and collectives as rank 0, which is all the timing needs."""
        cache = CacheConfig(num_kv_blocks=((CONTEXT + 64) // 16 + 1) * 32 + PREFILL // 16 + 8)
        self.runner = ModelRunner(
            resolve_model_dir(model_dir), dtype, torch.device("cpu"), cache, None, tp=tp
        )
        self.step_id = 0

    def _step(
        self, new: list[NewRequestData], cached: list[CachedRequestData], tokens: dict[str, int]
    ) -> None:
        self.step_id += 1
        self.runner.execute(SchedulerOutput(self.step_id, new, cached, tokens, []))

    def decode_step(self, batch: int) -> Callable[[], object]:
        self.runner.requests.clear()
        per_seq = (CONTEXT + 64) // 16 + 1
        new = [
            NewRequestData(
                f"r{i}",
                [(7 * i + j) % 1000 + 10 for j in range(CONTEXT)],
                GREEDY,
                list(range(i * per_seq, (i + 1) * per_seq)),
                0,
                CONTEXT,
            )
            for i in range(batch)
        ]
        self._step(new, [], {n.request_id: CONTEXT for n in new})

        def step() -> None:
            states = self.runner.requests
            cached = [CachedRequestData(r, [], len(states[r].token_ids) - 1) for r in states]
            self._step([], cached, dict.fromkeys(states, 1))

        return step

    def prefill(self) -> Callable[[], object]:
        base = 32 * ((CONTEXT + 64) // 16 + 1)

        def run() -> None:
            self.runner.requests.clear()
            new = NewRequestData(
                "p",
                [(3 * j) % 1000 + 10 for j in range(PREFILL)],
                GREEDY,
                list(range(base, base + PREFILL // 16 + 1)),
                0,
                PREFILL,
            )
            self._step([new], [], {"p": PREFILL})

        return run


class TransformersSide:
    def __init__(self, model_dir: str, dtype: torch.dtype) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(
            str(resolve_model_dir(model_dir)), dtype=dtype
        ).eval()

    @torch.inference_mode()
    def decode_step(self, batch: int) -> Callable[[], object]:
        ids = torch.tensor(
            [[(7 * i + j) % 1000 + 10 for j in range(CONTEXT)] for i in range(batch)]
        )
        cache = DynamicCache()
        out = self.model(input_ids=ids, past_key_values=cache, use_cache=True)
        state = {"next": out.logits[:, -1].argmax(-1, keepdim=True), "pos": CONTEXT}

        @torch.inference_mode()
        def step() -> None:
            position = torch.full((batch, 1), state["pos"])
            out = self.model(
                input_ids=state["next"],
                past_key_values=cache,
                position_ids=position,
                use_cache=True,
            )
            state["next"] = out.logits[:, -1].argmax(-1, keepdim=True)
            state["pos"] += 1

        return step

    def prefill(self) -> Callable[[], object]:
        ids = torch.tensor([[(3 * j) % 1000 + 10 for j in range(PREFILL)]])

        @torch.inference_mode()
        def run() -> None:
            self.model(input_ids=ids, use_cache=True).logits[:, -1].argmax(-1)

        return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument(
        "--tp",
        type=int,
        nargs="+",
        help="instead: Tandem's decode step at these tensor-parallel sizes, with the time "
        "spent in collectives (bench/tensor_parallel.py)",
    )
    args = parser.parse_args()
    dtype = resolve_dtype(args.dtype, torch.device("cpu"))
    if args.tp:
        report_tensor_parallel(args.model, dtype, args.tp, args.repeats)
        return
    tandem, hf = TandemSide(args.model, dtype), TransformersSide(args.model, dtype)
    rows, results = [], {}
    for batch in (1, 8, 32):
        t, h = timed_pair(tandem.decode_step(batch), hf.decode_step(batch), args.repeats)
        results[f"decode_b{batch}"] = {"tandem_s": t, "transformers_s": h}
        rows.append([f"decode step, batch {batch}", 1000 * t, 1000 * h, h / t])
    t, h = timed_pair(tandem.prefill(), hf.prefill(), max(3, args.repeats // 4))
    results["prefill_512"] = {"tandem_s": t, "transformers_s": h}
    rows.append([f"prefill {PREFILL} tokens (tok/s)", PREFILL / t, PREFILL / h, h / t])
    dtype_name = str(dtype).removeprefix("torch.")
    path = write_results(
        f"forward-{args.model}-{dtype_name}",
        {
            "model": args.model,
            "dtype": dtype_name,
            "context": CONTEXT,
            "native_kernels": tandem.runner.ops.name == "native",
            "results": results,
        },
    )
    backend = "native kernels" if tandem.runner.ops.name == "native" else "PyTorch ops only"
    print(
        f"\n{args.model}, {dtype_name}, {torch.get_num_threads()} threads; decode with {CONTEXT}-token contexts; Tandem: {backend}\n"
    )
    print_table(["measure", "Tandem (ms | tok/s)", "transformers", "Tandem speedup"], rows)
    print(f"\nJSON: {path}")


def report_tensor_parallel(model: str, dtype: torch.dtype, sizes: list[int], repeats: int) -> None:
    from bench.tensor_parallel import measure

    found = measure(model, dtype, sizes, repeats)
    rows = [
        [
            f"TP {size}, batch {batch}",
            1000 * r["step_s"],
            1000 * r["comm_s"],
            f"{100 * r['comm_s'] / r['step_s']:.0f}%",
            f"{found[sizes[0]][batch]['step_s'] / r['step_s']:.2f}x",
        ]
        for size, by_batch in found.items()
        for batch, r in by_batch.items()
    ]
    dtype_name = str(dtype).removeprefix("torch.")
    path = write_results(
        f"forward-tp-{model}-{dtype_name}",
        {"model": model, "dtype": dtype_name, "context": CONTEXT, "results": found},
    )
    print(
        f"\n{model}, {dtype_name}; decode with {CONTEXT}-token contexts; threads = cores / ranks\n"
    )
    print_table(["measure", "step ms", "collectives ms", "share", f"speed vs TP {sizes[0]}"], rows)
    print(f"\nJSON: {path}")


if __name__ == "__main__":
    main()
