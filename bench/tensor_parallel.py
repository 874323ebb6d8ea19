"""Decode step time at tensor-parallel sizes 1, 2, ... (``python -m bench.forward --tp 1
2``): each size's ranks are real processes in a gloo group running the same decode steps
in lockstep (the model runner, as a served pool runs it), with the time each step spends
in collectives (the all-reduces after attention and MLP, the embedding's all-reduce, the
logits gather) measured on rank 0. Threads per rank: cores / ranks, as served."""

from __future__ import annotations

import json
import multiprocessing
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from common.ipc import free_tcp_port

BATCHES = (1, 32)


@dataclass(frozen=True)
class _Clock:
    """Seconds spent in collectives, accumulated (a list: the dataclass stays frozen)."""

    spent: list[float]


def _timed_parallel(rank: int, size: int, clock: _Clock) -> Any:
    """A ``TensorParallel`` whose collectives add their time to ``clock``."""
    from worker.parallel import TensorParallel

    class Timed(TensorParallel):
        def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
            start = time.perf_counter()
            out = super().all_reduce(x)
            clock.spent[0] += time.perf_counter() - start
            return out

        def gather_columns(self, x: torch.Tensor) -> torch.Tensor:
            start = time.perf_counter()
            out = super().gather_columns(x)
            clock.spent[0] += time.perf_counter() - start
            return out

    return Timed(rank, size)


def _rank_main(
    rank: int, size: int, address: str, model: str, dtype: str, repeats: int, out: str
) -> None:
    from bench.forward import TandemSide
    from worker.parallel import destroy_group, init_group

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    init_group(rank, size, address, torch.device("cpu"))  # the group the runner's tp uses
    clock = _Clock([0.0])
    side = TandemSide(model, getattr(torch, dtype), _timed_parallel(rank, size, clock))
    results = {}
    for batch in BATCHES:
        step = side.decode_step(batch)
        step()  # warm-up
        samples, comm = [], []
        for _ in range(repeats):
            clock.spent[0] = 0.0
            start = time.perf_counter()
            step()
            samples.append(time.perf_counter() - start)
            comm.append(clock.spent[0])
        results[batch] = {"step_s": statistics.median(samples), "comm_s": statistics.median(comm)}
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    destroy_group(side.runner.tp)


def measure(model: str, dtype: torch.dtype, sizes: list[int], repeats: int) -> dict[int, Any]:
    """{size: {batch: {"step_s", "comm_s"}}}, one size after another."""
    name = str(dtype).removeprefix("torch.")
    spawn = multiprocessing.get_context("spawn")
    found: dict[int, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for size in sizes:
            out = f"{tmp}/tp{size}.json"
            address = f"tcp://127.0.0.1:{free_tcp_port()}"
            ranks = [
                spawn.Process(target=_rank_main, args=(r, size, address, model, name, repeats, out))
                for r in range(size)
            ]
            for p in ranks:
                p.start()
            for p in ranks:
                p.join()
            if any(p.exitcode for p in ranks):
                raise RuntimeError(f"a rank of size {size} failed: {[p.exitcode for p in ranks]}")
            found[size] = {int(b): v for b, v in json.loads(Path(out).read_text()).items()}
    return found
