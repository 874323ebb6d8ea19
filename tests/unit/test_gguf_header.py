"""``common.gguf_header`` reads what gguf-py's ``GGUFReader`` reads (every scalar and
string of the metadata, every tensor's type, shape, place and bytes) without building
the arrays, and refuses a broken file with a ValueError that says where it broke."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V
from gguf.quants import quantize

from common.gguf_header import GgufHeader
from common.model_files import EMBEDDED_MODELS, find_embedded_gguf


def write_sample(path: Path, alignment: int) -> Path:
    """A GGUF with a value of every type, arrays of numbers, strings and arrays, and
    tensors in floats and in blocks, at ``alignment``."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_custom_alignment(alignment)
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -100)
    writer.add_uint16("t.u16", 60_000)
    writer.add_int16("t.i16", -30_000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.25)
    writer.add_bool("t.bool", True)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", -1.5e300)
    writer.add_string("t.string", "héllo")
    writer.add_array("t.ints", [1, 2, 3])
    writer.add_array("t.strings", ["a", "", "ccc" * 50])
    writer.add_key_value("t.nested", [[1, 2], [3]], V.ARRAY, V.ARRAY)
    rng = np.random.default_rng(0)
    writer.add_tensor("norm.weight", rng.standard_normal(64).astype(np.float32))
    for name, shape, qtype in (
        ("blk.0.attn_q.weight", (32, 64), Q.Q8_0),
        ("blk.0.ffn_up.weight", (3, 32), Q.Q4_1),
    ):
        weight = rng.standard_normal(shape).astype(np.float32)
        writer.add_tensor(name, quantize(weight, qtype), raw_dtype=qtype)
    # gguf-py cannot quantize to K-quants: 64 rows of one Q4_K block (144 bytes) each.
    k_blocks = rng.integers(0, 256, (64, 144), dtype=np.uint8)
    writer.add_tensor("blk.0.ffn_down.weight", k_blocks, raw_dtype=Q.Q4_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def assert_reads_as_gguf_py(path: Path) -> GgufHeader:
    ours, theirs = GgufHeader(path), gguf.GGUFReader(str(path))
    assert list(ours.tensors) == [t.name for t in theirs.tensors]
    for t in theirs.tensors:
        mine = ours.tensors[t.name]
        assert (mine.type, mine.shape) == (int(t.tensor_type), tuple(map(int, t.shape)))
        assert (mine.offset, mine.num_bytes) == (t.data_offset, t.n_bytes)
        rows = ours.rows(mine)
        assert rows.shape == (mine.num_rows, t.n_bytes // mine.num_rows)
        assert rows.tobytes() == np.asarray(t.data).tobytes()
    fields = {k: f for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.metadata) == list(fields)
    for key, field in fields.items():
        if field.types[0] == V.ARRAY:
            assert ours.metadata[key] is None
        elif field.types[0] == V.STRING:
            assert ours.metadata[key] == bytes(field.parts[-1]).decode()
        else:
            assert ours.metadata[key] == field.parts[-1][0], key
    return ours


@pytest.mark.parametrize("alignment", [32, 64, 4096])
def test_reads_every_value_type_and_tensor_as_gguf_py(tmp_path: Path, alignment: int) -> None:
    header = assert_reads_as_gguf_py(write_sample(tmp_path / "sample.gguf", alignment))
    assert header.metadata["t.string"] == "héllo"
    assert header.metadata["t.u64"] == 2**63 + 5 and header.metadata["t.bool"] is True
    assert header.tensors["blk.0.ffn_down.weight"].shape == (256, 64)  # ggml order
    assert all(t.offset % alignment == 0 for t in header.tensors.values())


def test_reads_the_embedded_model_as_gguf_py() -> None:
    path = find_embedded_gguf(EMBEDDED_MODELS["smollm2-135m-instruct"])
    header = assert_reads_as_gguf_py(path)
    assert header.metadata["general.architecture"] == "llama"
    assert header.metadata["tokenizer.ggml.tokens"] is None  # 49,152 strings, skipped


def test_a_broken_file_is_a_value_error_naming_the_problem(tmp_path: Path) -> None:
    whole = write_sample(tmp_path / "sample.gguf", 32).read_bytes()
    header = GgufHeader(tmp_path / "sample.gguf")
    data_start = min(t.offset for t in header.tensors.values())
    cases = {
        b"GGML" + whole[4:]: "not a GGUF file",
        whole[:4] + (1).to_bytes(4, "little") + whole[8:]: "GGUF version 1 is not read",
        whole[:40]: "ends early",
        whole[: data_start // 2]: "ends early",
        whole[: data_start + 8]: None,  # the header whole, a tensor cut short
    }
    for i, (content, problem) in enumerate(cases.items()):
        path = tmp_path / f"broken-{i}.gguf"
        path.write_bytes(content)
        if problem is not None:
            with pytest.raises(ValueError, match=problem):
                GgufHeader(path)
            continue
        cut = GgufHeader(path)
        with pytest.raises(ValueError, match="runs past the end of the file"):
            for tensor in cut.tensors.values():
                cut.rows(tensor)
