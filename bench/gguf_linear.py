"""``python -m bench.gguf_linear``: one step's projections held as the GGUF ships them
(``--quantization gguf``) against bfloat16 (the kernels its ``PackedLinear`` picks), beside
the weight-bandwidth floor of each.

The model is loaded twice, as the worker loads it (bfloat16, native kernels): once with
``--quantization gguf`` and once without, and every projection a step runs (fused
q/k/v, o, fused gate/up, down per layer, then the LM head) is timed over real weights,
one pass reading them all from memory as a decode step does. Quantized projections are
timed both ways the layer can run them: the fused kernels (the file's blocks, or from
``gguf_gemm_min_rows`` the GEMM over their repacked copy) and a dense matmul over the
weight dequantized for the call; and the fused kernels on 8-bit activations
(``--gguf-activations q8``: the rows quantized per block of 32, integer dots). The kinds
alternate pass by pass; each cell is the median. It decides ``FUSED_MAX_ROWS`` and ``GEMM_MAX_ROWS``
(``worker/models/quant_linear.py``).
Writes ``bench/results/gguf_linear-MODEL.json``.

    .venv/bin/python -m bench.gguf_linear [--rows 1 4 8 16 32 64] [--passes 9]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from torch import nn

from bench.floor import bandwidth_gb_s
from bench.harness import median_ms_interleaved, print_table, write_results
from common.model_files import gguf_source, resolve_model_dir
from worker.models.loader import load_model
from worker.models.quant_linear import QuantLinear
from worker.models.quantizers import GgufBlocks
from worker.native import load_native_kernels
from worker.ops import NativeOps
from worker.packed_linear import PackedLinear


def projections(model: nn.Module, kind: type[nn.Module]) -> list[nn.Module]:
    """The model's projections of one kind, in step order (layers, then the LM head)."""
    return [m for m in model.modules() if isinstance(m, kind)]


def time_rows(
    rows: int, dense: list[nn.Module], quant: list[QuantLinear], passes: int
) -> dict[str, float]:
    xs = {m.in_features: torch.randn(rows, m.in_features).to(torch.bfloat16) for m in quant}

    def run(fn: Callable[[QuantLinear, torch.Tensor], torch.Tensor]) -> Callable[[], None]:
        def one_pass() -> None:
            for m in quant:
                fn(m, xs[m.in_features])

        return one_pass

    def bf16() -> None:
        for m in dense:
            m(xs[m.in_features])  # type: ignore[index]

    def fused(m: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        # bfloat16 rows as QuantLinear passes them (the file's blocks below
        # gguf_gemm_min_rows, gguf_gemm.cpp from there, where the CPU has it)
        return torch.cat(
            [m.kernels.gguf_linear(x, s.data, s.type, None, s.gemm) for s in m.segments], 1
        ).to(x.dtype)

    def q8(m: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        # the same rows quantized to 8 bits per block of 32 (--gguf-activations q8)
        return torch.cat(
            [m.kernels.gguf_linear(x, s.data, s.type, None, None, False, True) for s in m.segments],
            1,
        ).to(x.dtype)

    def dequantized(m: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, m.dequantized(x.dtype))

    kinds = {"bf16": bf16, "fused": run(fused), "q8": run(q8), "dequant": run(dequantized)}
    medians = median_ms_interleaved(kinds, passes)
    return {"rows": rows, **{f"{k}_ms": ms for k, ms in medians.items()}}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.gguf_linear", description=__doc__)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64])
    p.add_argument("--passes", type=int, default=9)
    args = p.parse_args(argv)
    ops, cpu = NativeOps(load_native_kernels()), torch.device("cpu")
    directory = resolve_model_dir(args.model)
    quant_model = load_model(
        directory, torch.bfloat16, cpu, ops, None, GgufBlocks(gguf_source(args.model))
    )
    dense_model = load_model(directory, torch.bfloat16, cpu, ops)
    quant = [m for m in projections(quant_model, QuantLinear) if isinstance(m, QuantLinear)]
    dense = projections(dense_model, PackedLinear) + projections(dense_model, nn.Linear)
    quant_bytes = sum(m.nbytes for m in quant)
    dense_bytes = sum(m.in_features * m.out_features * 2 for m in quant)
    bw = bandwidth_gb_s()["read_gb_s"]
    floors = {"bf16": dense_bytes / (bw * 1e9) * 1e3, "gguf": quant_bytes / (bw * 1e9) * 1e3}
    types = sorted({t for m in quant for t in m.type_names})
    results = [time_rows(rows, dense, quant, args.passes) for rows in args.rows]
    print(
        f"{args.model}: {len(quant)} projections ({', '.join(types)}), "
        f"{quant_bytes / 2**20:.0f} MiB as shipped vs {dense_bytes / 2**20:.0f} MiB bf16, "
        f"{torch.get_num_threads()} threads; read {bw:.1f} GB/s -> floors "
        f"{floors['gguf']:.2f} / {floors['bf16']:.2f} ms"
    )
    print_table(
        [
            "rows",
            "bf16 ms",
            "gguf fused ms",
            "gguf q8 ms",
            "gguf dequant+matmul ms",
            "best float gguf / bf16",
            "q8 / best float gguf",
        ],
        [
            [
                r["rows"],
                f"{r['bf16_ms']:.2f}",
                f"{r['fused_ms']:.2f}",
                f"{r['q8_ms']:.2f}",
                f"{r['dequant_ms']:.2f}",
                f"{min(r['fused_ms'], r['dequant_ms']) / r['bf16_ms']:.2f}x",
                f"{r['q8_ms'] / min(r['fused_ms'], r['dequant_ms']):.2f}x",
            ]
            for r in results
        ],
    )
    path = write_results(
        f"gguf_linear-{args.model}",
        {
            "model": args.model,
            "types": types,
            "gguf_bytes": quant_bytes,
            "bf16_bytes": dense_bytes,
            "read_gb_s": bw,
            "floor_ms": floors,
            "threads": torch.get_num_threads(),
            "results": results,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
