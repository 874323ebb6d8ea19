"""``python -m bench.floor``: this machine's memory bandwidth and the decode-step floor
it implies. A decode step must read every weight once, so no step of a batch can take
less than weight bytes / bandwidth; step times elsewhere read as a multiple of it."""

from __future__ import annotations

import argparse
import time

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


def weight_bytes(model: str, dtype: torch.dtype) -> int:
    """Bytes of the model's parameters in ``dtype`` (tied embeddings counted once)."""
    from safetensors import safe_open

    total = 0
    for path in sorted(resolve_model_dir(model).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has keys(), not iteration
                shape = f.get_slice(name).get_shape()
                count = 1
                for d in shape:
                    count *= d
                total += count * torch.empty((), dtype=dtype).element_size()
    return total


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.floor", description=__doc__)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--size-mib", type=int, default=512)
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    bw = bandwidth_gb_s(args.size_mib)
    weights = weight_bytes(args.model, dtype)
    rows = []
    for kind in ("read_gb_s", "copy_gb_s"):
        floor_ms = weights / (bw[kind] * 1e9) * 1000
        rows.append(
            [
                kind.replace("_gb_s", ""),
                f"{bw[kind]:.1f}",
                f"{weights / 2**20:.0f}",
                f"{floor_ms:.2f}",
            ]
        )
    print(f"{args.model}, {args.dtype}, {torch.get_num_threads()} torch threads")
    print_table(["bandwidth", "GB/s", "weights MiB", "decode-step floor ms"], rows)
    path = write_results(
        f"floor-{args.model}-{args.dtype}",
        {
            "model": args.model,
            "dtype": args.dtype,
            "weight_bytes": weights,
            "bandwidth": bw,
            "decode_step_floor_ms": weights / (bw["read_gb_s"] * 1e9) * 1000,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
