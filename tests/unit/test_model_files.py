"""Finding an embedded model's GGUF when several processes look at once (the workers of a
pool start together on a fresh cache)."""

from __future__ import annotations

import hashlib
import importlib
import multiprocessing as mp
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier
from pathlib import Path

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
