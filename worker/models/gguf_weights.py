"""The quantized projection weights of a GGUF file, found by the names our models give
their linear layers (the Hugging Face names), still in the file's blocks.

The file is memory-mapped (``common.gguf_header``, which opens it without building the
tokenizer's metadata); a weight is copied out of the map once, when it is taken, so the
worker holds each projection once and quantized. Names map as
``transformers`` maps them when it loads a GGUF (gguf-py's tensor name map), and a
llama GGUF's q and k rows are put back in Hugging Face's order (llama.cpp's converter
interleaves each head's two rotary halves; a row holds whole blocks, so whole rows
move).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from common.gguf_header import GgufHeader

# ggml types stored as plain floats: such a projection is loaded like a safetensors one.
_FLOAT_TYPES = {"F32", "F16", "BF16", "F64"}


@dataclass(frozen=True)
class GgufWeight:
    """One projection as GGUF blocks: ``data`` is uint8 ``[out_features, row_bytes]``."""

    name: str
    type: int  # the ggml type id (gguf.GGMLQuantizationType)
    type_name: str
    data: torch.Tensor
    in_features: int

    @property
    def out_features(self) -> int:
        return int(self.data.shape[0])


class GgufFile:
    """A GGUF checkpoint's tensors by name, for ``weight(hf_module_name)``."""

    def __init__(self, path: Path, num_layers: int, num_heads: int, num_kv_heads: int) -> None:
        import gguf  # transformers' GGUF dependency; imported here to keep it off other paths

        self.path = path
        try:
            self._header = GgufHeader(path)
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read GGUF file {path}: {e}") from None
        architecture = self._header.metadata.get("general.architecture")
        if not isinstance(architecture, str):
            raise ValueError(f"{path} names no general.architecture")
        self.architecture = architecture
        arch = next((k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == self.architecture), None)
        if arch is None:
            raise ValueError(f"{path}: gguf-py knows no architecture {self.architecture!r}")
        self._names = gguf.get_tensor_name_map(arch, num_layers)
        self._heads = {"attn_q": num_heads, "attn_k": num_kv_heads}

    def gguf_name(self, module_name: str) -> str | None:
        """The GGUF tensor (``blk.3.attn_q.weight``) holding a module's weight."""
        base = self._names.get_name(module_name)
        return None if base is None else f"{base}.weight"

    def weight(self, module_name: str, fallback: str | None = None) -> GgufWeight | None:
        """The module's weight as blocks, or None where the file holds it as plain floats
        (or not at all, and no ``fallback`` GGUF name is given or found)."""
        import gguf

        tensors = self._header.tensors
        name = self.gguf_name(module_name)
        tensor = tensors.get(name) if name is not None else None
        if tensor is None and fallback is not None:
            name, tensor = fallback, tensors.get(fallback)
        if tensor is None or name is None:
            return None
        type_name = gguf.GGMLQuantizationType(tensor.type).name
        if type_name in _FLOAT_TYPES:
            return None
        rows = self._header.rows(tensor)
        heads = self._heads.get(name.split(".")[-2]) if self.architecture == "llama" else None
        if heads is not None:
            rows = _unpermute_rows(rows, heads)
        return GgufWeight(
            name=name,
            type=tensor.type,
            type_name=type_name,
            data=torch.from_numpy(np.array(rows, dtype=np.uint8, copy=True)),
            in_features=tensor.shape[0],
        )


def _unpermute_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order back to Hugging Face's (as transformers undoes it)."""
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)
