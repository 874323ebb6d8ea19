"""What a quantized mode costs in quality, measured as llama.cpp's ``perplexity
--kl-divergence`` does: each mode's next-token distributions against the float32 model's
over a fixed text, as perplexity (and its ratio to float32's), mean and p99 KL divergence
KL(float32 || mode), and top-1 agreement (the share of positions whose argmax is float32's).

    python -m bench.quality [--models smollm2-135m-instruct gemma-3-270m] [--modes int8 gguf]

The text is ``bench/data/genesis-kjv.txt`` (Genesis 1-30, King James Version: public
domain; ~27k tokens for either embedded model), cut into windows of ``--context`` tokens,
each scored from its second token. Modes: ``int8`` (W8A8, ``--quantization int8``) and
``int8-plain`` (the same without SmoothQuant's rescaling), ``gguf`` (the file's blocks,
float activations: ``--quantization gguf --gguf-activations float``) and ``gguf-q8`` (the
same blocks, activations quantized to 8 bits per block of 32: ``--gguf-activations q8``),
each on a float32 model, so the figure is the weights' and activations' quantization
alone. Bounds (issue #68): int8 perplexity ratio <= 1.03 and top-1 agreement >= 95%;
gguf-q8 perplexity within 1% of gguf's (where both run). Writes
``bench/results/quality-NAME.json``.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer

from bench.harness import print_table, write_results
from common.model_files import gguf_source, resolve_model_dir
from worker.attention import build_metadata
from worker.models.base import CausalLM
from worker.models.loader import load_model
from worker.models.quantizers import GgufBlocks, Int8PerChannel, WeightQuantizer
from worker.native import load_native_kernels
from worker.ops import NativeOps

TEXT = Path(__file__).parent / "data" / "genesis-kjv.txt"
BLOCK = 16
BOUNDS = {"int8": (1.03, 0.95)}  # (perplexity ratio at most, top-1 agreement at least)
Q8_OVER_FLOAT_GGUF = 1.01  # gguf-q8's perplexity over gguf's, at most


def quantizer(mode: str, model: str) -> WeightQuantizer | None:
    if mode == "int8":
        return Int8PerChannel(resolve_model_dir(model))
    if mode == "int8-plain":  # without SmoothQuant's rescaling
        return Int8PerChannel(resolve_model_dir(model), smooth=False)
    if mode == "gguf":
        return GgufBlocks(gguf_source(model), "float")
    if mode == "gguf-q8":
        return GgufBlocks(gguf_source(model), "q8")
    if mode == "float32":
        return None
    raise ValueError(f"unknown mode {mode!r}: float32, int8, int8-plain, gguf or gguf-q8")


@torch.inference_mode()
def window_log_probs(model: CausalLM, tokens: list[int]) -> torch.Tensor:
    """float32 log-probabilities ``[len - 1, vocab]`` of each next token of one window,
    one prefill through a fresh paged cache."""
    blocks = -(-len(tokens) // BLOCK)
    caches = [torch.zeros(model.kv_cache_shape(blocks, BLOCK)) for _ in range(model.num_layers)]
    meta = build_metadata([list(range(blocks))], [0], [len(tokens)], BLOCK, torch.device("cpu"))
    hidden = model(torch.tensor(tokens), torch.arange(len(tokens)), caches, meta)
    return model.compute_logits(hidden)[:-1].float().log_softmax(-1)


@dataclass
class Score:
    """Running sums over every scored position of one mode."""

    nll: float = 0.0
    agree: int = 0
    count: int = 0

    def __post_init__(self) -> None:
        self.kls: list[torch.Tensor] = []


def evaluate(model_name: str, modes: list[str], context: int) -> list[dict[str, object]]:
    directory = resolve_model_dir(model_name)
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    ids: list[int] = tokenizer(TEXT.read_text()).input_ids
    windows = [ids[i : i + context] for i in range(0, len(ids) - 1, context)]
    windows = [w for w in windows if len(w) > 1]
    ops, cpu = NativeOps(load_native_kernels()), torch.device("cpu")
    reference = load_model(directory, torch.float32, cpu, ops)
    models = {
        m: load_model(directory, torch.float32, cpu, ops, None, quantizer(m, model_name))
        for m in modes
    }
    base, scores = Score(), {m: Score() for m in modes}
    for window in windows:
        targets = torch.tensor(window[1:])
        ref = window_log_probs(reference, window)
        ref_top = ref.argmax(-1)
        base.nll -= float(ref.gather(1, targets[:, None]).sum())
        base.count += len(targets)
        for mode, model in models.items():
            ours, score = window_log_probs(model, window), scores[mode]
            score.nll -= float(ours.gather(1, targets[:, None]).sum())
            score.agree += int((ours.argmax(-1) == ref_top).sum())
            score.count += len(targets)
            score.kls.append((ref.exp() * (ref - ours)).sum(-1))
    base_ppl = math.exp(base.nll / base.count)
    rows: list[dict[str, object]] = [
        {
            "model": model_name,
            "mode": "float32",
            "tokens": base.count,
            "perplexity": base_ppl,
            "ppl_ratio": 1.0,
            "kl_mean": 0.0,
            "kl_p99": 0.0,
            "top1": 1.0,
        }
    ]
    for mode, score in scores.items():
        kl = torch.cat(score.kls)
        ppl = math.exp(score.nll / score.count)
        rows.append(
            {
                "model": model_name,
                "mode": mode,
                "tokens": score.count,
                "perplexity": ppl,
                "ppl_ratio": ppl / base_ppl,
                "kl_mean": float(kl.mean()),
                "kl_p99": float(kl.quantile(0.99)),
                "top1": score.agree / score.count,
            }
        )
    by_mode = {str(r["mode"]): r for r in rows}
    if "gguf" in by_mode and "gguf-q8" in by_mode:  # the 8-bit activations' own cost
        q8, exact = by_mode["gguf-q8"], by_mode["gguf"]
        q8["ppl_over_gguf"] = float(str(q8["perplexity"])) / float(str(exact["perplexity"]))
    return rows


def verdict(row: dict[str, object]) -> str:
    if "ppl_over_gguf" in row:
        over = float(str(row["ppl_over_gguf"]))
        return f"{over:.4f}x gguf's: {'met' if over <= Q8_OVER_FLOAT_GGUF else 'NOT met'}"
    bound = BOUNDS.get(str(row["mode"]))
    if bound is None:
        return "-"
    ratio, top1 = float(str(row["ppl_ratio"])), float(str(row["top1"]))
    return "met" if ratio <= bound[0] and top1 >= bound[1] else "NOT met"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.quality", description=__doc__)
    p.add_argument("--models", nargs="+", default=["smollm2-135m-instruct", "gemma-3-270m"])
    p.add_argument("--modes", nargs="+", default=["int8", "int8-plain", "gguf", "gguf-q8"])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--name", default="quality")
    args = p.parse_args(argv)
    rows = [r for m in args.models for r in evaluate(m, args.modes, args.context)]
    print(f"{TEXT.name}, windows of {args.context} tokens, {torch.get_num_threads()} threads")
    print_table(
        [
            "model",
            "mode",
            "tokens",
            "perplexity",
            "ppl ratio",
            "KL mean",
            "KL p99",
            "top-1",
            "bounds",
        ],
        [
            [
                r["model"],
                r["mode"],
                r["tokens"],
                f"{r['perplexity']:.3f}",
                f"{r['ppl_ratio']:.4f}",
                f"{r['kl_mean']:.5f}",
                f"{r['kl_p99']:.4f}",
                f"{100 * float(str(r['top1'])):.2f}%",
                verdict(r),
            ]
            for r in rows
        ],
    )
    path = write_results(args.name, {"text": TEXT.name, "context": args.context, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
