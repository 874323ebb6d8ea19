"""``--quantization int8`` (W8A8) on tiny random checkpoints of every family: each
projection inside the layers an ``Int8Linear`` (the LM head kept float), the logits near
the float model's (the quality bounds themselves are ``bench.quality``'s, on the real
models), and a row's logits independent of the batch around it, bit for bit: per-token
activation scales make one request's arithmetic its own. SmoothQuant's rescaling leaves
the float model's function as it was (every family's norms, Gemma's sandwich included),
and on the real SmolLM2 brings the int8 logits nearer float32's than plain W8A8."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoTokenizer, PreTrainedModel

from bench.quality import TEXT, window_log_probs
from common.model_files import resolve_model_dir
from tests.parity.families import build
from tests.parity.test_family_logits import Paged, prompt, ref_logits
from worker.models import smooth_quant
from worker.models.base import CausalLM
from worker.models.decoder import DecoderLM
from worker.models.int8_linear import Int8Linear
from worker.models.loader import load_model
from worker.models.quantizers import Int8PerChannel
from worker.native import load_native_kernels
from worker.ops import NativeOps, TorchOps
from worker.parallel import TensorParallel

FAST = ["llama", "qwen2", "gemma3"]
SLOW = ["qwen3", "llama-gqa3", "gemma3-softcap"]


class PagedInt8(Paged):
    def __init__(self, checkpoint: Path, dtype: torch.dtype = torch.float32) -> None:
        ops = NativeOps(load_native_kernels())
        self.model = load_model(
            checkpoint,
            dtype,
            torch.device("cpu"),
            ops,
            None,
            Int8PerChannel(checkpoint, smooth=False),
        )
        self.caches = [
            torch.zeros(self.model.kv_cache_shape(64, 4), dtype=dtype)
            for _ in range(self.model.num_layers)
        ]


def check_family(family: str, path: Path) -> None:
    reference: PreTrainedModel = build(family, path)
    paged = PagedInt8(path)
    int8 = [m for m in paged.model.modules() if isinstance(m, Int8Linear)]
    assert len(int8) == 4 * reference.config.num_hidden_layers  # qkv, o, gate_up, down
    assert isinstance(paged.model.lm_head, nn.Linear)
    a, b = prompt(1, 13), prompt(2, 7)
    (alone,) = paged.step([(a, [0, 1, 2, 3], 0, 13)])
    together = PagedInt8(path).step([(b, [5, 6], 0, 7), (a, [0, 1, 2, 3], 0, 13)])[1]
    assert torch.equal(alone, together)
    expected = ref_logits(reference, a)
    # Near, not equal: the float model's logits move by the quantization's noise.
    log_p, log_q = expected.log_softmax(-1), alone.log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    assert float(kl.mean()) < 0.05, float(kl.mean())
    assert (alone - expected).abs().max() < 0.5
    assert not torch.equal(alone, expected)  # int8 really ran


@pytest.mark.parametrize("family", FAST)
def test_int8_families(family: str, tmp_path: Path) -> None:
    check_family(family, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("family", SLOW)
def test_int8_more_families(family: str, tmp_path: Path) -> None:
    check_family(family, tmp_path)


def test_bfloat16_models_take_int8_too(tmp_path: Path) -> None:
    build("llama", tmp_path)
    paged = PagedInt8(tmp_path, torch.bfloat16)
    (logits,) = paged.step([(prompt(3, 9), [0, 1, 2], 0, 9)])
    assert logits.isfinite().all() and logits.shape[0] == 9


def test_int8_refuses_what_it_cannot_serve(tmp_path: Path) -> None:
    build("llama", tmp_path)
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="--quantization int8 runs on the native CPU kernels"):
        load_model(tmp_path, torch.float32, cpu, TorchOps(), None, Int8PerChannel(tmp_path, False))
    with pytest.raises(ValueError, match="calibrates its smoothing on the model's tokenizer"):
        load_model(
            tmp_path,
            torch.float32,
            cpu,
            NativeOps(load_native_kernels()),
            None,
            Int8PerChannel(tmp_path),
        )  # a checkpoint without a tokenizer
    with pytest.raises(ValueError, match="int8 does not shard across tensor-parallel ranks"):
        Int8PerChannel(tmp_path).apply(
            load_model(tmp_path, torch.float32, cpu),
            {},
            NativeOps(load_native_kernels()),
            TensorParallel(rank=0, size=2),
            cpu,
        )


def float_logits(model: CausalLM, tokens: list[int]) -> torch.Tensor:
    return window_log_probs(model, tokens)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
def test_smoothing_leaves_the_float_model_as_it_was(family: str, tmp_path: Path) -> None:
    build(family, tmp_path)
    cpu, ops = torch.device("cpu"), NativeOps(load_native_kernels())
    model = load_model(tmp_path, torch.float32, cpu, ops)
    assert isinstance(model, DecoderLM)
    tokens = prompt(5, 40)
    before = float_logits(model, tokens)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    smooth_quant.smooth(model, prompt(6, 64))
    moved = [n for n, p in model.named_parameters() if not torch.equal(p, weights[n])]
    assert any("norm" in n for n in moved) and any("down_proj" in n for n in moved)
    assert (float_logits(model, tokens) - before).abs().max() < 1e-4


def test_smoothing_brings_smollm2_int8_nearer_float32() -> None:
    directory = resolve_model_dir("smollm2-135m-instruct")
    cpu, ops = torch.device("cpu"), NativeOps(load_native_kernels())
    ids = AutoTokenizer.from_pretrained(str(directory))(TEXT.read_text()).input_ids[:256]
    reference = float_logits(load_model(directory, torch.float32, cpu, ops), ids)
    kls = []
    for smooth in (False, True):
        quantizer = Int8PerChannel(directory, smooth=smooth)
        logits = float_logits(load_model(directory, torch.float32, cpu, ops, None, quantizer), ids)
        kls.append(float((reference.exp() * (reference - logits)).sum(-1).mean()))
    plain, smoothed = kls
    assert smoothed < 0.75 * plain, kls
