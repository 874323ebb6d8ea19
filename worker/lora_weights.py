"""One LoRA adapter's factors, loaded for this rank and laid out for our fused projections.

A decoder layer computes q/k/v in one matmul (``qkv_proj``) and gate/up in another
(``gate_up_proj``), so an adapter's per-module factors are packed to match: the parts'
A stacked along the rank, ``[r_q + r_k + r_v, in]``, and their B block-diagonal,
``[out_q + out_k + out_v, r_q + r_k + r_v]``, zero rows for a part the adapter leaves
alone. ``((x @ A.T) @ B.T) * scaling`` is then each part's ``lora_B(lora_A(x)) *
scaling`` side by side, as PEFT computes it (the zeros add exact zeros).

Under tensor parallelism each factor is cut as its base weight is (``shard_of``):
column-split projections (q/k/v, gate/up) keep their B rows of this rank's outputs;
row-split ones (o_proj, down_proj) keep their A columns of this rank's inputs, so their
delta is a partial sum that the layer's all-reduce completes with the base output.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from common.lora import PARENTS, WEIGHTS_FILE, AdapterConfig, AdapterError, read_adapter
from common.messages import LoRARequest
from worker.models.decoder import DecoderLM

# Each fused projection of a layer and the checkpoint modules it holds, in its order.
PROJECTIONS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}


@dataclass(frozen=True)
class LoRAFactors:
    """One fused projection's factors on this rank, in float32 whatever the model's
    dtype (small matmuls are slow in bfloat16 here, and the delta is rounded once, when
    added): ``a`` [r_total, in] and ``bt``, B [out, r_total] transposed and contiguous,
    as the native SGMV kernel reads it and a matmul takes it (in and out as this rank's
    projection takes and gives them)."""

    a: torch.Tensor
    bt: torch.Tensor
    # int64 [parts, 4]: each part's (first rank, end rank, first output, end output), the
    # only blocks of B that are not zero.
    blocks: torch.Tensor

    @staticmethod
    def of(
        a: torch.Tensor, b: torch.Tensor, blocks: list[tuple[int, int, int, int]]
    ) -> LoRAFactors:
        """From A and B as PEFT holds them (B [out, r_total])."""
        return LoRAFactors(
            a, b.t().contiguous(), torch.tensor(blocks, dtype=torch.long).reshape(-1, 4)
        )


@dataclass(frozen=True)
class LoRAWeights:
    """One adapter loaded for this rank: per layer, the factors of each fused projection
    it changes (a projection it leaves alone is absent)."""

    request: LoRARequest
    config: AdapterConfig
    layers: tuple[dict[str, LoRAFactors], ...]

    @property
    def scaling(self) -> float:
        return self.config.scaling


def lora_module_shapes(model: DecoderLM) -> dict[str, tuple[int, int]]:
    """Full (unsharded) (in_features, out_features) of each projection LoRA may target."""
    a = model.args
    q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    hidden, inter = a.hidden_size, a.intermediate_size
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def load_lora_weights(request: LoRARequest, model: DecoderLM) -> LoRAWeights:
    """Read ``request``'s adapter (checked again here: cheap, header only) and cut, pack
    and cast its factors to ``model``'s rank, layout, dtype and device.

    Raises ``AdapterError`` where the adapter does not fit the model or cannot be read.
    """
    path = Path(request.path)
    shapes = lora_module_shapes(model)
    # The rank limit is the engine's policy, checked where the adapter is registered.
    config = read_adapter(path, shapes, model.num_layers, max_rank=sys.maxsize)
    try:
        tensors = load_file(path / WEIGHTS_FILE)
    except Exception as e:  # safetensors raises its own error types
        raise AdapterError(f"cannot read {path / WEIGHTS_FILE} (truncated?): {e}") from None
    like = model.model.embed_tokens.weight
    layers = []
    for layer in range(model.num_layers):
        fused = {}
        for projection, parts in PROJECTIONS.items():
            factors = _fuse(tensors, model, shapes, layer, parts)
            if factors is not None:
                a, b, blocks = factors
                a, b = a.to(like.device).contiguous(), b.to(like.device).contiguous()
                fused[projection] = LoRAFactors.of(a, b, blocks)
        layers.append(fused)
    return LoRAWeights(request, config, tuple(layers))


def _fuse(
    tensors: dict[str, torch.Tensor],
    model: DecoderLM,
    shapes: dict[str, tuple[int, int]],
    layer: int,
    parts: tuple[str, ...],
) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int, int, int]]] | None:
    """(A stacked, B block-diagonal, B's nonzero blocks) of ``parts`` of ``layer``, this
    rank's shard; None where the adapter changes none of them."""
    a_parts, b_parts = [], []
    for part in parts:
        path = f"model.layers.{layer}.{PARENTS[part]}.{part}"
        a = tensors.get(f"base_model.model.{path}.lora_A.weight")
        b = tensors.get(f"base_model.model.{path}.lora_B.weight")
        shard = model.shard_of(f"{path}.weight")
        if a is None or b is None:
            if a is not None or b is not None:
                raise AdapterError(f"LoRA adapter: {path} has only one of lora_A and lora_B")
            # A part left alone: zero rows of its (this rank's) outputs, no rank.
            out = shard[2] if shard is not None and shard[0] == 0 else shapes[part][1]
            a_parts.append(torch.zeros(0, shapes[part][0]))
            b_parts.append(torch.zeros(out, 0))
            continue
        if shard is not None:
            dim, start, length = shard
            if dim == 0:  # column-split: this rank's outputs
                b = b.narrow(0, start, length)
            else:  # row-split: this rank's inputs
                a = a.narrow(1, start, length)
        a_parts.append(a.float())
        b_parts.append(b.float())
    if all(a.shape[0] == 0 for a in a_parts):
        return None
    blocks, rank, first = [], 0, 0
    for a, b in zip(a_parts, b_parts, strict=True):
        if a.shape[0]:
            blocks.append((rank, rank + a.shape[0], first, first + b.shape[0]))
        rank, first = rank + a.shape[0], first + b.shape[0]
    return torch.cat(a_parts), torch.block_diag(*b_parts), blocks
