"""Finding an embedded model's GGUF when several processes look at once (the workers of a
pool start together on a fresh cache), and what the cache of converted GGUF files keeps."""

from __future__ import annotations

import hashlib
import importlib
import json
import multiprocessing as mp
import os
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier
from pathlib import Path

import pytest

from common import gguf_convert, model_files
from common.model_files import EMBEDDED_MODELS, find_embedded_gguf

MODEL = EMBEDDED_MODELS["gemma-3-270m"]  # the embedded model that ships in parts
PROCESSES = 4


def _find_and_measure(barrier: Barrier, workdir: str, sizes: Queue[int | str]) -> None:
    barrier.wait()  # all at once, as a pool's workers do
    try:
        sizes.put(find_embedded_gguf(MODEL, Path(workdir)).stat().st_size)
    except Exception as e:  # reported to the test, which names it
        sizes.put(repr(e))


def test_processes_assembling_at_once_each_get_the_whole_file(tmp_path: Path) -> None:
    package = importlib.import_module(MODEL.package)
    whole = sum(part.stat().st_size for part in package.chunk_paths())
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(PROCESSES)
    queue: Queue[int | str] = ctx.Queue()
    procs = [
        ctx.Process(target=_find_and_measure, args=(barrier, str(tmp_path), queue))
        for _ in range(PROCESSES)
    ]
    for proc in procs:
        proc.start()
    sizes = [queue.get(timeout=60) for _ in procs]
    for proc in procs:
        proc.join(timeout=30)
        assert proc.exitcode == 0
    # Each saw the whole file the moment it was handed the path, never a part being written.
    assert sizes == [whole] * PROCESSES
    gguf = tmp_path / MODEL.gguf_filename
    assert hashlib.sha256(gguf.read_bytes()).hexdigest() == package.EXPECTED_SHA256
    # Nothing left behind but the file and its lock.
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [MODEL.gguf_filename, f".{MODEL.gguf_filename}.lock"]
    )


def test_a_changed_gguf_file_replaces_its_older_conversion(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each conversion is the float32 model's size: a file converted again (edited, or
    installed anew at the same path) leaves one conversion behind, not one per version,
    and a different file of the same name keeps its own."""
    converted: list[Path] = []

    def convert(gguf: Path, out: Path, architecture: str) -> None:  # the real one takes ~s
        converted.append(gguf)
        (out / "config.json").write_text(json.dumps({"architectures": [architecture]}))

    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(model_files, "gguf_architecture", lambda _: "LlamaForCausalLM")
    monkeypatch.setattr(gguf_convert, "convert_gguf", convert)
    mine, other = tmp_path / "a" / "model.gguf", tmp_path / "b" / "model.gguf"
    for path in (mine, other):
        path.parent.mkdir()
        path.write_bytes(b"GGUF v1")
    first = model_files.ensure_local_gguf_converted(mine)
    theirs = model_files.ensure_local_gguf_converted(other)
    assert model_files.ensure_local_gguf_converted(mine) == first  # cached: not again
    assert converted == [mine, other]

    os.utime(mine, ns=(0, mine.stat().st_mtime_ns + 10**9))  # the file changes
    second = model_files.ensure_local_gguf_converted(mine)
    assert second != first and converted == [mine, other, mine]
    models = tmp_path / "cache" / "models"
    assert sorted(p.name for p in models.iterdir()) == sorted(
        [second.name, theirs.name, f".{second.name}.lock", f".{theirs.name}.lock"]
    )
    assert (second / "config.json").is_file() and (theirs / "config.json").is_file()
