"""``python -m bench.step_profile``: where one decode step's time goes at batch 1, 8 and 32,
beside the step's floor (``bench/floor.py``: weights and KV read at the memory's
bandwidth, or the batch's FLOPs at the matmul rate, whichever is longer).

The real ``EngineCore`` steps the real ``ModelRunner`` in-process (an inline pool: no
sockets), every sequence with a 128-token context. One step is split into:

- inside the worker's forward and sampling, by ``torch.profiler`` (self CPU time of each
  op, attributed to the nearest labelled range): *fused layers* (a decode step of as
  many rows as the fused stack takes runs every layer in one native call,
  ``worker/models/decode_stack.py``), matmuls (every linear projection and the LM head),
  attention (KV write and paged attention), norms, rotary, activation, sampling,
  other ops (embedding, adds, index/copy), and *Python and dispatch* (the step's time in
  no op at all: model code, metadata building, tensor creation);
- inside the fused layers, where ``decode_rows`` runs them, its own phases (projections,
  attention, rotary + KV write, norms + adds, activation), timed by the kernel in the
  unprofiled steps, with the rate the projections reached (TFLOP/s, against the matmul
  rate; weights read, GB/s) and the KV bytes attention read a second (against the read
  bandwidth);
- engine bookkeeping: ``EngineCore.step()`` minus the runner's time in it;
- worker <-> engine IPC: encoding and decoding the step's ``SchedulerOutput`` and
  ``ModelRunnerOutput`` with the wire codec, and both frames' round trip over ``ipc://``;
- API server: decoding the step's outputs frame, detokenizing each stream's token and
  writing its SSE chunk.

The profiled shares are applied to the unprofiled step time (the profiler's own overhead
is not charged to any part). Writes ``bench/results/step_profile-MODEL-DTYPE.json``.

    .venv/bin/python -m bench.step_profile [--quantization gguf] [--gguf-activations q8]
        [--batches 1 8 32] [--steps 30] [--name NAME]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import zmq
from tokenizers import Tokenizer
from torch.profiler import ProfilerActivity, profile, record_function

import worker.model_runner as model_runner_module
from api_server.detokenizer import IncrementalDetokenizer
from bench.floor import Machine, bandwidth_gb_s, matmul_tflops, model_cost
from bench.fused_phases import FusedLabel, layer_projection_params, phase_rates, run_timing_phases
from bench.harness import print_table, write_results
from common.config import (
    GGUF_ACTIVATIONS,
    QUANTIZATIONS,
    CacheConfig,
    GgufActivations,
    ModelConfig,
    Quantization,
    SchedulerConfig,
    TandemConfig,
)
from common.ipc import Codec
from common.messages import (
    EngineOutputs,
    EngineRequest,
    LoRARequest,
    ModelRunnerOutput,
    PoolRole,
    SamplingParams,
    SchedulerOutput,
    WorkerReady,
)
from common.model_files import resolve_model_dir
from engine_core.core import EngineCore
from engine_core.executor import PoolEvents
from worker.device import resolve_dtype
from worker.lora import LoRABatch
from worker.model_runner import ModelRunner
from worker.models.decoder import DecoderLM
from worker.models.quantizers import quantizer_for
from worker.packed_linear import ONEDNN, PackedLinear

CONTEXT = 128
PARTS = (
    "fused layers",  # decode steps of 1-4 rows: every layer in one native call
    "matmul",
    "attention",
    "norms",
    "rotary",
    "activation",
    "sampling",
    "lora",  # --lora: the adapters' deltas (worker/lora.py)
    "other ops",
    "python+dispatch",
)
_OPS_LABELS = {
    "write_kv": "attention",
    "decode_attention": "attention",
    "prefill_attention": "attention",
    "rms_norm": "norms",
    "add_rms_norm": "norms",
    "rotary": "rotary",
    "act_mul": "activation",
}
_MATMUL_OPS = ("aten::addmm", "aten::mm", "aten::bmm", "aten::matmul", "aten::linear")


class InlinePool:
    """The engine's view of a pool, running the real model runner synchronously."""

    role = PoolRole.UNIFIED

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.kv_addresses: list[str] = []  # unified: no hand-off
        self.busy = False
        self.last_step: SchedulerOutput | None = None
        self.last_result: ModelRunnerOutput | None = None  # until polled
        self.last_output: ModelRunnerOutput | None = None  # kept: the IPC and API parts
        self.runner_s = 0.0  # time spent in the runner during the last submit

    @property
    def num_threads(self) -> int:
        return torch.get_num_threads()  # the runner steps on this process's threads

    def wait_ready(self) -> WorkerReady:
        r = self.runner
        return WorkerReady(
            0, r.num_kv_blocks, r.block_size, r.model_info, PoolRole.UNIFIED, "", r.bytes_per_block
        )

    def submit(self, step: SchedulerOutput) -> None:
        start = time.perf_counter()
        self.last_result = self.last_output = self.runner.execute(step)
        self.runner_s = time.perf_counter() - start
        self.last_step = step

    def poll(self) -> PoolEvents:
        result, self.last_result = self.last_result, None
        return PoolEvents(result=result)

    def check_alive(self) -> None:
        return None


def _label(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def labelled(*args: Any, **kwargs: Any) -> Any:
        with record_function(f"tandem::{name}"):
            return fn(*args, **kwargs)

    return labelled


def label_ops(runner: ModelRunner) -> None:
    """Name the runner's kernel calls and sampling in the profile (the native kernels
    are not torch ops: unlabelled, their time would look like Python)."""
    for method, part in _OPS_LABELS.items():
        setattr(runner.ops, method, _label(part, getattr(runner.ops, method)))
    model_runner_module.sample = _label("sampling", model_runner_module.sample)
    for module in runner.model.modules():  # each linear holds its GEMV and its packing
        if isinstance(module, PackedLinear):
            if module.gemv is not None:
                module.gemv = dataclasses.replace(
                    module.gemv, run=_label("matmul", module.gemv.run)
                )
            if module.packing is not ONEDNN:  # oneDNN's is a torch op: labelled already
                run = _label("matmul", module.packing.run)
                module.packing = dataclasses.replace(module.packing, run=run)
    model = runner.model
    if isinstance(model, DecoderLM) and isinstance(model.lora_batch, LoRABatch):
        batch = model.lora_batch
        batch.add_deltas = _label("lora", batch.add_deltas)  # type: ignore[method-assign]
    if isinstance(model, DecoderLM) and model.fused_decode is not None:
        # One call holds every layer's projections, attention, norms: not split further.
        fused = model.fused_decode
        model.fused_decode = FusedLabel(fused, _label("fused layers", fused.__call__))


def part_of(event: Any) -> str:
    """The part an op's self time belongs to: its nearest labelled range, else its name."""
    node = event
    while node is not None:
        if node.name.startswith("tandem::"):
            return str(node.name.removeprefix("tandem::"))
        node = node.cpu_parent
    if event.name in _MATMUL_OPS or "linear" in event.name:
        return "matmul"
    return "other ops"


def model_shares(step: Callable[[], object], steps: int) -> dict[str, float]:
    """Each part's share of a profiled step's wall time (they sum to 1)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        wall_us = (time.perf_counter() - start) * 1e6
    totals = dict.fromkeys(PARTS, 0.0)
    for event in prof.events():
        if event.name.startswith("tandem::"):
            # A labelled range's own self time is Python around its ops; charge it there.
            totals[event.name.removeprefix("tandem::")] += event.self_cpu_time_total
            continue
        totals[part_of(event)] += event.self_cpu_time_total
    in_ops = sum(totals.values())
    totals["python+dispatch"] = max(0.0, wall_us - in_ops)
    return {part: us / wall_us for part, us in totals.items()}


def median_time(fn: Callable[[], object], repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


class Setup:
    def __init__(
        self,
        model: str,
        dtype: torch.dtype,
        max_batch: int,
        quantization: Quantization,
        gguf_activations: GgufActivations,
        adapters: list[Path] | None = None,
    ) -> None:
        model_dir = resolve_model_dir(model)
        blocks = max_batch * ((CONTEXT + 512) // 16 + 2)
        cache = CacheConfig(num_kv_blocks=blocks)
        quantizer = quantizer_for(quantization, model, gguf_activations)
        # --lora N: requests spread round robin over N adapters, all resident
        self.adapters = [
            LoRARequest(f"adapter-{i}", i + 1, str(path)) for i, path in enumerate(adapters or [])
        ]
        self.runner = ModelRunner(
            model_dir,
            dtype,
            torch.device("cpu"),
            cache,
            None,
            quantizer=quantizer,
            lora_capacity=len(self.adapters),
        )
        label_ops(self.runner)
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        lora = {"enable_lora": True, "max_loras": len(self.adapters)} if self.adapters else {}
        self.config = TandemConfig(
            model=ModelConfig(**lora),  # type: ignore[arg-type]
            cache=cache,
            scheduler=SchedulerConfig(max_num_seqs=max_batch, max_num_batched_tokens=8192),
        )

    def decoding_core(self, batch: int) -> tuple[EngineCore, InlinePool]:
        """An engine whose ``batch`` requests are past their prompts: every step decodes."""
        self.runner.requests.clear()
        pool = InlinePool(self.runner)
        core = EngineCore(self.config, {PoolRole.UNIFIED: pool})
        core.start()
        greedy = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)
        for i in range(batch):
            prompt = [(7 * i + j) % 1000 + 10 for j in range(CONTEXT)]
            lora = self.adapters[i % len(self.adapters)] if self.adapters else None
            core.add_request(EngineRequest(f"r{i}", b"api", prompt, greedy, time.time(), lora=lora))
        while pool.last_step is None or pool.last_step.new_requests:
            core.step()  # the prompts' prefill
        core.step()
        return core, pool


def ipc_seconds(step: SchedulerOutput, result: ModelRunnerOutput, repeats: int) -> float:
    """Encode + send + receive + decode of both frames of one step over ipc://."""
    step_codec: Codec[SchedulerOutput] = Codec(SchedulerOutput)
    result_codec: Codec[ModelRunnerOutput] = Codec(ModelRunnerOutput)
    ctx: zmq.Context[Any] = zmq.Context()
    with tempfile.TemporaryDirectory() as tmp:
        address = f"ipc://{tmp}/bench.sock"
        engine, worker = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
        engine.bind(address)
        worker.connect(address)

        def round_trip() -> None:
            engine.send(step_codec.encode(step))
            step_codec.decode(worker.recv())
            worker.send(result_codec.encode(result))
            result_codec.decode(engine.recv())

        round_trip()
        seconds = median_time(round_trip, repeats)
        engine.close(linger=0)
        worker.close(linger=0)
    ctx.term()
    return seconds


def api_seconds(setup: Setup, result: ModelRunnerOutput, repeats: int) -> float:
    """What an API server does per step: decode the outputs frame, detokenize each
    stream's new token, write each stream's SSE chunk."""
    from common.messages import RequestOutput

    outputs = EngineOutputs(
        [
            RequestOutput(r, [t])
            for r, t in zip(result.request_ids, result.sampled_token_ids, strict=True)
        ]
    )
    codec: Codec[EngineOutputs] = Codec(EngineOutputs)
    frame = codec.encode(outputs)
    streams = {r: IncrementalDetokenizer(setup.tokenizer) for r in result.request_ids}

    def one_step() -> None:
        for out in codec.decode(frame).outputs:
            text = streams[out.request_id].push(out.new_token_ids)
            chunk = {
                "id": out.request_id,
                "object": "text_completion",
                "choices": [{"index": 0, "text": text, "finish_reason": None}],
            }
            (b"data: " + json.dumps(chunk).encode() + b"\n\n").decode()

    return median_time(one_step, repeats)


def profile_batch(setup: Setup, batch: int, steps: int, floors: dict[str, float]) -> dict[str, Any]:
    core, pool = setup.decoding_core(batch)
    walls, runners = [], []

    def timed_step() -> None:
        start = time.perf_counter()
        core.step()
        walls.append(time.perf_counter() - start)
        runners.append(pool.runner_s)

    phases = run_timing_phases(setup.runner.model.fused_decode, timed_step, steps)
    runner_s = statistics.median(runners)
    engine_s = max(0.0, statistics.median(w - r for w, r in zip(walls, runners, strict=True)))
    shares = model_shares(core.step, steps)
    result = pool.last_output
    assert pool.last_step is not None and result is not None
    assert len(result.request_ids) == batch  # a decode step: every stream sampled
    ipc_s = ipc_seconds(pool.last_step, result, steps)
    api_s = api_seconds(setup, result, steps)
    parts = {part: share * runner_s for part, share in shares.items()}
    parts.update({"engine": engine_s, "ipc": ipc_s, "api": api_s})
    total = sum(parts.values())
    return {
        "batch": batch,
        "step_ms": total * 1e3,
        "worker_ms": runner_s * 1e3,
        "floors_ms": floors,
        "parts_ms": {k: v * 1e3 for k, v in parts.items()},
        "fused_phases": phases,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.step_profile", description=__doc__)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", choices=QUANTIZATIONS, default="none")
    p.add_argument("--gguf-activations", choices=GGUF_ACTIVATIONS, default="auto")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--name", default=None, help="results name (default: step_profile-MODEL-DTYPE)")
    p.add_argument(
        "--lora",
        type=int,
        default=0,
        help="spread the requests over this many random rank-16 adapters (bench.lora's)",
    )
    args = p.parse_args(argv)
    dtype = resolve_dtype(args.dtype, torch.device("cpu"))
    adapters = None
    if args.lora:
        from bench.lora import make_adapters

        cache = Path.home() / ".cache/tandem/lora-bench"
        adapters = make_adapters(resolve_model_dir(args.model), cache, args.lora)
    setup = Setup(
        args.model, dtype, max(args.batches), args.quantization, args.gguf_activations, adapters
    )
    machine = Machine(bandwidth_gb_s()["read_gb_s"], matmul_tflops(dtype))
    cost = model_cost(args.model, dtype)
    with torch.inference_mode():
        rows = [
            profile_batch(setup, b, args.steps, cost.floors_ms(machine, b, CONTEXT))
            for b in args.batches
        ]
    order = [*PARTS, "engine", "ipc", "api"]
    headers = ["part", *(f"batch {r['batch']}" for r in rows)]
    table = [
        [
            part,
            *(
                f"{r['parts_ms'][part]:.2f} ms ({100 * r['parts_ms'][part] / r['step_ms']:.0f}%)"
                for r in rows
            ),
        ]
        for part in order
    ]
    phase_names = next(
        (list(r["fused_phases"]["phases_ms"]) for r in rows if r["fused_phases"]), []
    )
    for i, phase in enumerate(phase_names):  # under "fused layers": decode_rows' own clock
        table.insert(
            1 + i,
            [
                f"  {phase}",
                *(
                    f"{r['fused_phases']['phases_ms'][phase]:.2f} ms" if r["fused_phases"] else "-"
                    for r in rows
                ),
            ],
        )
    table.append(["step (sum)", *(f"{r['step_ms']:.1f} ms" for r in rows)])
    floors = [r["floors_ms"] for r in rows]
    table.append(
        ["floor: weights + KV read", *(f"{f['weights_ms'] + f['kv_ms']:.1f} ms" for f in floors)]
    )
    table.append(["floor: matmul compute", *(f"{f['compute_ms']:.1f} ms" for f in floors)])
    table.append(
        ["step / floor", *(f"{r['step_ms'] / r['floors_ms']['floor_ms']:.2f}x" for r in rows)]
    )
    print(
        f"read {machine.read_gb_s:.1f} GB/s, matmul {machine.matmul_tflops:.2f} TFLOP/s, "
        f"context {CONTEXT}"
    )
    print_table(headers, table)
    model = setup.runner.model
    projection_params = layer_projection_params(model) if isinstance(model, DecoderLM) else 0
    for r in rows:
        if r["fused_phases"] and projection_params:
            print(phase_rates(r, projection_params, cost, machine, dtype.itemsize))
    name = args.name or f"step_profile-{args.model}-{str(dtype).removeprefix('torch.')}"
    name += f"-lora{args.lora}" if args.lora else ""
    write_results(
        name,
        {"args": vars(args), "context": CONTEXT, "machine": vars(machine), "rows": rows},
    )


if __name__ == "__main__":
    main()
