"""A GGUF file's header: its metadata and its tensors' names, types, shapes and places,
read without building every metadata value.

gguf-py's ``GGUFReader`` makes numpy views of every part of every metadata field as it
opens a file. Where the tokenizer's vocabulary is in the metadata (Gemma 3's 262,144
tokens, each with a score and a type) that took 27 s of a 32-s model load on a 2-core
AMD EPYC, at every worker start with ``--quantization gguf``. This reader walks the same
layout with ``struct`` and skips the arrays, so the file opens in a fraction of a
second; gguf-py still names the tensor types and their block sizes.

The layout (GGUF versions 2 and 3, little-endian): magic, version, tensor count,
metadata count; each metadata entry as key, value type, value (an array as element type,
count, elements); each tensor as name, dimension count, dimensions (ggml order: the
first is a row's length), type, offset; then the tensors' bytes from the next multiple
of ``general.alignment`` (32 unless the file says otherwise).
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_STRING, _ARRAY = 8, 9
# Metadata value types of a fixed size: their struct formats.
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_DEFAULT_ALIGNMENT = 32

MetadataValue = int | float | bool | str | None  # None: an array, skipped


@dataclass(frozen=True)
class GgufTensor:
    name: str
    type: int  # the ggml type id (gguf.GGMLQuantizationType)
    shape: tuple[int, ...]  # ggml order: shape[0] is the length of a row
    offset: int  # of its first byte in the file
    num_bytes: int

    @property
    def num_rows(self) -> int:
        return math.prod(self.shape[1:])


class GgufHeader:
    """``metadata`` holds every scalar and string value by key (arrays as None);
    ``tensors`` every tensor by name, in file order. ``rows(tensor)`` maps its bytes."""

    def __init__(self, path: Path) -> None:
        import gguf  # for the tensor types' block sizes

        self.path = path
        with open(path, "rb") as f:
            # Mapped, not read: only the header's pages and the tensors taken are touched.
            self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._pos = 0
        if self._take(4) != _MAGIC:
            raise ValueError(f"{path} is not a GGUF file (no GGUF magic)")
        version = self._unpack("I")
        if version not in _VERSIONS:
            raise ValueError(f"{path}: GGUF version {version} is not read (2 and 3 are)")
        num_tensors, num_entries = self._unpack("Q"), self._unpack("Q")
        self.metadata: dict[str, MetadataValue] = {}
        for _ in range(num_entries):
            key = self._string()
            self.metadata[key] = self._value(self._unpack("I"))
        infos = []
        for _ in range(num_tensors):
            name = self._string()
            shape = tuple(self._unpack("Q") for _ in range(self._unpack("I")))
            infos.append((name, shape, self._unpack("I"), self._unpack("Q")))
        alignment = self.metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"{path}: general.alignment {alignment!r} is not a power of two")
        start = -(-self._pos // alignment) * alignment
        self.tensors: dict[str, GgufTensor] = {}
        for name, shape, type_id, offset in infos:
            try:
                block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(type_id)]
            except ValueError:
                raise ValueError(
                    f"{path}: tensor {name} has an unknown ggml type {type_id}"
                ) from None
            num_bytes = math.prod(shape) // block * block_bytes
            self.tensors[name] = GgufTensor(name, type_id, shape, start + offset, num_bytes)

    def rows(self, tensor: GgufTensor) -> np.ndarray:
        """The tensor's bytes as ``uint8 [rows, row bytes]``, a view of the file's map
        (read-only, not copied)."""
        if tensor.offset + tensor.num_bytes > len(self._buf):
            raise ValueError(f"{self.path}: tensor {tensor.name} runs past the end of the file")
        data = np.frombuffer(self._buf, np.uint8, tensor.num_bytes, tensor.offset)
        return data.reshape(tensor.num_rows, -1)

    # ------------------------------------------------------------------ the header's parts

    def _take(self, n: int) -> bytes:
        if self._pos + n > len(self._buf):
            raise ValueError(f"{self.path}: the GGUF header ends early (at byte {self._pos})")
        out = self._buf[self._pos : self._pos + n]
        self._pos += n
        return out

    def _scalar(self, fmt: str) -> int | float | bool:
        value: int | float | bool = struct.unpack("<" + fmt, self._take(struct.calcsize(fmt)))[0]
        return value

    def _unpack(self, fmt: str) -> int:
        """An integer field of the layout (a count, a length, a type id)."""
        return int(self._scalar(fmt))

    def _string(self) -> str:
        return self._take(self._unpack("Q")).decode("utf-8", errors="replace")

    def _value(self, value_type: int) -> MetadataValue:
        if value_type == _STRING:
            return self._string()
        if value_type == _ARRAY:
            self._skip_array()
            return None
        fmt = _SCALARS.get(value_type)
        if fmt is None:
            raise ValueError(f"{self.path}: unknown GGUF value type {value_type}")
        return self._scalar(fmt)

    def _skip_array(self) -> None:
        element_type, count = self._unpack("I"), self._unpack("Q")
        fmt = _SCALARS.get(element_type)
        if fmt is not None:
            self._take(count * struct.calcsize(fmt))
        elif element_type == _STRING:  # each string's length, then its bytes
            buf, pos, unpack = self._buf, self._pos, struct.Struct("<Q").unpack_from
            try:
                for _ in range(count):
                    pos += 8 + unpack(buf, pos)[0]
            except struct.error:
                pos = len(buf) + 1
            if pos > len(buf):
                raise ValueError(f"{self.path}: the GGUF header ends early (in {count} strings)")
            self._pos = pos
        elif element_type == _ARRAY:
            for _ in range(count):
                self._skip_array()
        else:
            raise ValueError(f"{self.path}: unknown GGUF array element type {element_type}")
