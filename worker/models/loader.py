"""Load a Hugging Face directory (config.json + safetensors, single or sharded) into one
of our model classes, checking every tensor's name and shape."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from common.model_files import read_hf_config
from worker.huge_pages import move_to_huge_pages
from worker.models.base import CausalLM
from worker.models.decode_stack import DecodeStack
from worker.models.decoder import DecoderLM
from worker.models.quant_linear import QuantLinear
from worker.models.quantizers import WeightQuantizer
from worker.models.registry import model_class_for
from worker.ops import Ops, TorchOps
from worker.packed_linear import ONEDNN, can_pack, pack_linears
from worker.parallel import TensorParallel

logger = logging.getLogger(__name__)


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        with open(index) as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        return sorted({model_dir / name for name in weight_map.values()})
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors in {model_dir}")
    return files


@contextmanager
def _open_weights(path: Path) -> Iterator[Any]:
    """``safe_open``, with a corrupt or truncated file named in the error."""
    try:
        handle = safe_open(str(path), framework="pt")
    except Exception as e:  # safetensors raises its own error types
        raise ValueError(f"cannot read weights from {path} (corrupt or truncated?): {e}") from None
    with handle as f:
        yield f


def _read_tensor(
    f: Any, name: str, path: Path, shard: tuple[int, int, int] | None = None
) -> torch.Tensor:
    """The tensor, or only this rank's slice of it (read from disk as a slice)."""
    try:
        if shard is None:
            tensor: torch.Tensor = f.get_tensor(name)
        else:
            dim, start, length = shard
            view = f.get_slice(name)
            index = (slice(None),) * dim + (slice(start, start + length),)
            tensor = view[index]
    except Exception as e:
        raise ValueError(f"cannot read weight {name} from {path} (truncated?): {e}") from None
    return tensor


def load_model(
    model_dir: Path,
    dtype: torch.dtype,
    device: torch.device,
    ops: Ops | None = None,
    tp: TensorParallel | None = None,
    quantizer: WeightQuantizer | None = None,
) -> CausalLM:
    """Build the model named by ``architectures`` on ``ops`` (default: PyTorch ops) and
    fill every parameter from disk (with ``tp``, this rank's shard of each). With a
    ``quantizer`` (``--quantization``), the projections are then kept as it keeps them.

    Raises ``ValueError`` naming the tensor when one is missing or mis-shaped.
    """
    config = read_hf_config(model_dir)
    with torch.device("meta"):  # no time spent on random init of weights we overwrite
        model = model_class_for(config)(config, ops or TorchOps(), tp or TensorParallel())
    _materialize(model, device, dtype)
    expected = dict(model.named_parameters())
    tied = model.tied_weights
    loaded: set[str] = set()
    with torch.no_grad():
        for path in safetensors_files(model_dir):
            with _open_weights(path) as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    param = expected.get(name)
                    if param is None:
                        continue  # e.g. rotary inv_freq buffers saved by old exports
                    tensor = _read_tensor(f, name, path, model.shard_of(name))
                    if tuple(tensor.shape) != tuple(param.shape):
                        raise ValueError(
                            f"weight {name} in {path.name} has shape {tuple(tensor.shape)}, "
                            f"expected {tuple(param.shape)}"
                        )
                    param.copy_(tensor)
                    loaded.add(name)
        for name, source in tied.items():
            if name not in loaded:
                expected[name].data = expected[source].data  # one tensor, as in training
                loaded.add(name)
    missing = [n for n in expected if n not in loaded]
    if missing:
        shape = tuple(expected[missing[0]].shape)
        raise ValueError(
            f"weight {missing[0]} (expected shape {shape}) is missing from {model_dir}"
            + (f", and {len(missing) - 1} more" if len(missing) > 1 else "")
        )
    model.drop_replicated_biases()
    model.fuse()
    if quantizer is not None:
        quantizer.apply(model, config, ops, tp or TensorParallel(), device)
    packing = ops.packing if ops is not None else ONEDNN
    if can_pack(dtype, device, packing):
        gemv = ops.small_batch_linear if ops is not None else None
        logger.info(
            "prepacked %d linear layers for %s (bfloat16)%s",
            pack_linears(model, gemv, packing),
            packing.name,
            "; a few rows on the AVX512-BF16 GEMV" if gemv else "",
        )
    if device.type == "cpu":
        moved = move_to_huge_pages(_streamed_weights(model))
        logger.info("weights on huge pages: %.0f MiB", moved / 2**20)
    if isinstance(model, DecoderLM) and ops is not None:
        model.fused_decode = DecodeStack.build(model, ops)
        if model.fused_decode is not None:
            logger.info("decode-only steps run every layer in one native call")
    return model.eval()


def _materialize(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Give every meta parameter and buffer uninitialized storage on ``device``,
    floating-point ones in ``dtype``: ``to_empty(device).to(dtype)`` without its meta
    ``empty_like``, whose first call imports sympy and torch.fx (~0.9 s of every start).
    A tensor registered in two modules stays one tensor."""
    params: dict[int, nn.Parameter] = {}
    buffers: dict[int, torch.Tensor] = {}

    def empty(t: torch.Tensor) -> torch.Tensor:
        kind = dtype if t.is_floating_point() else t.dtype
        return torch.empty(t.shape, dtype=kind, device=device)

    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                if id(p) not in params:
                    params[id(p)] = nn.Parameter(empty(p), p.requires_grad)
                module._parameters[name] = params[id(p)]
        for name, b in module._buffers.items():
            if b is not None:
                if id(b) not in buffers:
                    buffers[id(b)] = empty(b)
                module._buffers[name] = buffers[id(b)]


def _streamed_weights(model: CausalLM) -> Iterator[torch.Tensor]:
    """Every weight tensor a step reads, in the model's order: parameters, buffers (the
    GEMV's plain copies) and GGUF blocks."""
    for module in model.modules():
        yield from module.parameters(recurse=False)
        yield from module.buffers(recurse=False)  # None buffers are skipped
        if isinstance(module, QuantLinear):
            yield from module.block_tensors()
