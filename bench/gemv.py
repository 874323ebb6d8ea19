"""``python -m bench.gemv``: one decode step's projections, oneDNN's prepacked matmul
against Tandem's GEMV (AVX512-BF16 to 2 rows, or 4; AMX to 32 where the CPU has it) and
its AVX512-BF16 GEMM (``bf16_gemm``, any rows), at 1-32 rows, beside the weight-bandwidth
floor. The GEMV's and the GEMM's weights lie in huge pages, as the worker puts them
(``worker/huge_pages.py``); the GEMV over a copy in ordinary 4 KiB pages shows what that
is worth.

Every projection of the model (fused q/k/v, o, fused gate/up, down, per layer, then the
LM head) gets its own random bfloat16 weight of the checkpoint's shape, so one pass reads
the model's projection bytes from memory, not from cache, as a decode step does. The
kernels alternate pass by pass (the host drifts); each cell is the median of the passes.
It decides how many rows the GEMV takes (``bf16_gemv_max_rows`` in
``worker/csrc/gemv.cpp``) and whether the GEMM replaces oneDNN (``bf16_gemm_packs``).
Writes ``bench/results/gemv-MODEL.json``.

    .venv/bin/python -m bench.gemv [--rows 1 2 3 4 8 16 32] [--passes 15]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from torch import nn

from bench.floor import bandwidth_gb_s
from bench.harness import median_ms_interleaved, print_table, write_results
from common.model_files import read_hf_config, resolve_model_dir
from worker.huge_pages import move_to_huge_pages
from worker.native import NativeKernels, load_native_kernels
from worker.packed_linear import PackedLinear


def projection_shapes(model: str) -> list[tuple[int, int]]:
    """(out, in) of every projection a decode step runs, in order."""
    cfg = read_hf_config(resolve_model_dir(model))
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or 0
    head_dim = cfg.get("head_dim") or hidden // heads
    q, kv = heads * head_dim, (kv_heads or heads) * head_dim
    layer = [(q + 2 * kv, hidden), (hidden, q), (2 * inter, hidden), (hidden, inter)]
    return layer * cfg["num_hidden_layers"] + [(cfg["vocab_size"], hidden)]


def time_rows(
    rows: int,
    shapes: list[tuple[int, int]],
    linears: list[PackedLinear],
    plain: list[torch.Tensor],
    small_pages: list[torch.Tensor],
    gemm_packed: list[torch.Tensor],
    kernels: NativeKernels,
    passes: int,
) -> dict[str, float]:
    """Median ms of one pass over every projection at ``rows`` rows, per kernel."""
    xs = {i: torch.randn(rows, i).to(torch.bfloat16) for _, i in shapes}

    def onednn() -> None:
        for linear, (_, i) in zip(linears, shapes, strict=True):
            linear(xs[i])

    def gemv_over(weights: list[torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            for weight, (_, i) in zip(weights, shapes, strict=True):
                kernels.bf16_gemv(xs[i], weight, None)

        return run

    def gemm() -> None:
        for packed, (_, i) in zip(gemm_packed, shapes, strict=True):
            kernels.bf16_gemm(xs[i], packed, None)

    kinds: dict[str, Callable[[], None]] = {"onednn": onednn, "gemm": gemm}
    if all(rows <= kernels.bf16_gemv_max_rows(o, i) for o, i in shapes):  # the kernel's limit
        kinds["gemv"] = gemv_over(plain)
        kinds["gemv_4k"] = gemv_over(small_pages)
    medians = median_ms_interleaved(kinds, passes)
    return {"rows": rows, **{f"{k}_ms": ms for k, ms in medians.items()}}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.gemv", description=__doc__)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 8, 16, 32])
    p.add_argument("--passes", type=int, default=15)
    args = p.parse_args(argv)
    kernels = load_native_kernels()
    if not kernels.has_bf16_gemv():
        raise SystemExit("this CPU (or kernel build level) has no AVX512-BF16 GEMV")
    torch.manual_seed(0)
    shapes = projection_shapes(args.model)
    linears = [PackedLinear(nn.Linear(i, o, bias=False).to(torch.bfloat16)) for o, i in shapes]
    small_pages = [torch.randn(o, i).to(torch.bfloat16) for o, i in shapes]
    plain = [w.clone() for w in small_pages]  # the GEMV's weights, moved as the worker does
    move_to_huge_pages(plain)
    gemm_packed = [kernels.bf16_gemm_pack(w) for w in small_pages]
    move_to_huge_pages(gemm_packed)
    weight_bytes = sum(o * i * 2 for o, i in shapes)
    bw = bandwidth_gb_s()["read_gb_s"]
    floor_ms = weight_bytes / (bw * 1e9) * 1e3
    results = [
        time_rows(rows, shapes, linears, plain, small_pages, gemm_packed, kernels, args.passes)
        for rows in args.rows
    ]
    print(
        f"{args.model}: {len(shapes)} projections, {weight_bytes / 2**20:.0f} MiB bf16, "
        f"{torch.get_num_threads()} threads; read {bw:.1f} GB/s -> floor {floor_ms:.2f} ms"
    )
    print_table(
        [
            "rows",
            "oneDNN ms",
            "GEMM ms",
            "GEMM speedup",
            "GEMV ms",
            "GEMV, 4 KiB pages",
            "GEMV speedup",
            "GEMV / floor",
        ],
        [
            [
                r["rows"],
                f"{r['onednn_ms']:.2f}",
                f"{r['gemm_ms']:.2f}",
                f"{r['onednn_ms'] / r['gemm_ms']:.2f}x",
                f"{r['gemv_ms']:.2f}" if "gemv_ms" in r else "-",
                f"{r['gemv_4k_ms']:.2f}" if "gemv_4k_ms" in r else "-",
                f"{r['onednn_ms'] / r['gemv_ms']:.2f}x" if "gemv_ms" in r else "-",
                f"{r['gemv_ms'] / floor_ms:.2f}x" if "gemv_ms" in r else "-",
            ]
            for r in results
        ],
    )
    path = write_results(
        f"gemv-{args.model}",
        {
            "model": args.model,
            "weight_bytes": weight_bytes,
            "read_gb_s": bw,
            "floor_ms": floor_ms,
            "threads": torch.get_num_threads(),
            "results": results,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
