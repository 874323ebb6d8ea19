"""``python -m bench.floor``: this machine's memory bandwidth and bf16/f32 matmul
FLOP/s, and the decode-step floors they imply. A decode step of ``batch`` sequences must
read every weight once and every sequence's K and V once, and must multiply every
weight ``batch`` times: no step can take less than the larger of bytes / bandwidth and
FLOPs / matmul rate. Step times elsewhere (``bench.step_profile``) read as a multiple
of it."""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass

import torch

from bench.harness import print_table, write_results
from common.model_files import resolve_model_dir


def bandwidth_gb_s(size_mib: int = 512, repeats: int = 10) -> dict[str, float]:
    """Best-of copy and read bandwidth over buffers far larger than the caches. A copy
    moves each byte twice (read + write)."""
    n = size_mib * 2**20 // 4
    src = torch.rand(n)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch the pages
    copy_best = read_best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        copy_best = min(copy_best, time.perf_counter() - t)
        t = time.perf_counter()
        src.sum()
        read_best = min(read_best, time.perf_counter() - t)
    nbytes = n * 4
    return {"copy_gb_s": 2 * nbytes / copy_best / 1e9, "read_gb_s": nbytes / read_best / 1e9}


def matmul_tflops(dtype: torch.dtype, size: int = 2048, repeats: int = 10) -> float:
    """Best-of rate of one square ``size``³ matmul in ``dtype`` on all torch threads (the
    kernels the projections use: oneDNN, AMX where the CPU has it)."""
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    torch.nn.functional.linear(a, b)  # warm-up: oneDNN picks and caches its kernel
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        torch.nn.functional.linear(a, b)
        best = min(best, time.perf_counter() - t)
    return 2 * size**3 / best / 1e12


@dataclass(frozen=True)
class Machine:
    read_gb_s: float
    matmul_tflops: float


@dataclass(frozen=True)
class ModelCost:
    """What one decode step of a model must read and compute, from its files."""

    weight_bytes: int  # every parameter in the serving dtype, tied embeddings once
    matmul_params: int  # weights each token multiplies (the LM head; not a lookup)
    kv_bytes_per_position: int  # one context position's K and V, all layers
    attention_flops_per_position: int  # QK and PV of one query over one position

    def floors_ms(self, machine: Machine, batch: int, context: int) -> dict[str, float]:
        """The step's memory floor (weights, and the batch's KV at ``context``), its
        compute floor, and the floor itself: the larger of the two."""
        weights = self.weight_bytes / (machine.read_gb_s * 1e9) * 1e3
        kv = batch * context * self.kv_bytes_per_position / (machine.read_gb_s * 1e9) * 1e3
        flops = batch * (2 * self.matmul_params + context * self.attention_flops_per_position)
        compute = flops / (machine.matmul_tflops * 1e12) * 1e3
        return {
            "weights_ms": weights,
            "kv_ms": kv,
            "compute_ms": compute,
            "floor_ms": max(weights + kv, compute),
        }


def model_cost(model: str, dtype: torch.dtype) -> ModelCost:
    """Read from the checkpoint's tensor shapes and config.json (no weights loaded)."""
    from safetensors import safe_open

    model_dir = resolve_model_dir(model)
    shapes: dict[str, list[int]] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has keys(), not iteration
                shapes[name] = list(f.get_slice(name).get_shape())
    itemsize = dtype.itemsize
    counts = {name: math.prod(shape) for name, shape in shapes.items()}
    untied = any(name.endswith("lm_head.weight") for name in shapes)
    matmul = sum(
        counts[name]
        for name, shape in shapes.items()
        if len(shape) == 2 and not (untied and name.endswith("embed_tokens.weight"))
    )
    config = json.loads((model_dir / "config.json").read_text())
    text = config.get("text_config", config)
    heads = text["num_attention_heads"]
    head_dim = text.get("head_dim") or text["hidden_size"] // heads
    kv_heads = text.get("num_key_value_heads", heads)
    layers = text["num_hidden_layers"]
    return ModelCost(
        weight_bytes=sum(counts.values()) * itemsize,
        matmul_params=matmul,
        kv_bytes_per_position=layers * 2 * kv_heads * head_dim * itemsize,
        attention_flops_per_position=layers * 4 * heads * head_dim,
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.floor", description=__doc__)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--size-mib", type=int, default=512)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--context", type=int, default=128, help="each sequence's KV positions")
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    bw = bandwidth_gb_s(args.size_mib)
    tflops = {
        str(t).removeprefix("torch."): matmul_tflops(t) for t in (torch.bfloat16, torch.float32)
    }
    cost = model_cost(args.model, dtype)
    machine = Machine(read_gb_s=bw["read_gb_s"], matmul_tflops=tflops[args.dtype])
    floors = {b: cost.floors_ms(machine, b, args.context) for b in args.batches}
    print(f"{args.model}, {args.dtype}, {torch.get_num_threads()} torch threads")
    print(
        f"read {bw['read_gb_s']:.1f} GB/s, copy {bw['copy_gb_s']:.1f} GB/s; matmul "
        + ", ".join(f"{k} {v:.2f} TFLOP/s" for k, v in tflops.items())
        + f"; weights {cost.weight_bytes / 2**20:.0f} MiB"
    )
    print_table(
        [
            "batch",
            "weights read ms",
            f"KV read ms (ctx {args.context})",
            "compute ms",
            "step floor ms",
        ],
        [
            [
                b,
                f"{f['weights_ms']:.2f}",
                f"{f['kv_ms']:.2f}",
                f"{f['compute_ms']:.2f}",
                f"{f['floor_ms']:.2f}",
            ]
            for b, f in floors.items()
        ],
    )
    path = write_results(
        f"floor-{args.model}-{args.dtype}",
        {
            "model": args.model,
            "dtype": args.dtype,
            "cost": vars(cost),
            "bandwidth": bw,
            "matmul_tflops": tflops,
            "context": args.context,
            "floors_ms": {str(b): f for b, f in floors.items()},
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
