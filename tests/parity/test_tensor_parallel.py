"""Tensor parallelism at size 2 against size 1 and transformers, every family (tiny
random checkpoints, float32): each rank a real process in a gloo group, holding only its
shard; logits within 1e-4 through a mixed batch of prefills and decodes over paged KV."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from common.ipc import free_tcp_port
from tests.parity.families import FAMILIES, build
from worker.attention import build_metadata
from worker.models.loader import load_model
from worker.native import load_native_kernels
from worker.ops import NativeOps, Ops, TorchOps
from worker.parallel import TensorParallel, destroy_group, init_group

BLOCK = 4
TOL = 1e-4
A, B = [5, 17, 99, 3, 42, 8, 64, 1, 77, 23, 11], [120, 4, 56, 9, 31, 2]


def run_scenario(
    checkpoint: Path, ops_name: str, tp: TensorParallel
) -> tuple[list[torch.Tensor], dict[str, list[int]]]:
    """Prefill A whole with B's first chunk, then B's rest, then three greedy decode steps
    of both; returns every step's logits and the final sequences."""
    ops: Ops = NativeOps(load_native_kernels()) if ops_name == "native" else TorchOps()
    model = load_model(checkpoint, torch.float32, torch.device("cpu"), ops, tp)
    caches = [torch.zeros(model.kv_cache_shape(32, BLOCK)) for _ in range(model.num_layers)]
    blocks = {"a": [9, 2, 14, 5, 20], "b": [7, 30, 1, 11]}
    seqs = {"a": list(A), "b": list(B)}

    def step(parts: list[tuple[str, int, int]]) -> torch.Tensor:
        ids = [t for name, start, n in parts for t in seqs[name][start : start + n]]
        pos = [p for _, start, n in parts for p in range(start, start + n)]
        meta = build_metadata(
            [blocks[name] for name, _, _ in parts],
            [start for _, start, _ in parts],
            [n for _, _, n in parts],
            BLOCK,
            torch.device("cpu"),
        )
        with torch.inference_mode():
            return model.compute_logits(model(torch.tensor(ids), torch.tensor(pos), caches, meta))

    out = [step([("a", 0, len(A)), ("b", 0, 3)]), step([("b", 3, len(B) - 3)])]
    last = {"a": out[0][len(A) - 1], "b": out[1][-1]}
    for _ in range(3):
        for name in ("a", "b"):
            seqs[name].append(int(last[name].argmax()))
        out.append(step([("a", len(seqs["a"]) - 1, 1), ("b", len(seqs["b"]) - 1, 1)]))
        last = {"a": out[-1][0], "b": out[-1][1]}
    return out, seqs


def rank_main(rank: int, address: str, checkpoint: str, ops_name: str, out: str) -> None:
    torch.set_num_threads(1)
    tp = init_group(rank, 2, address, torch.device("cpu"))
    try:
        logits, _ = run_scenario(Path(checkpoint), ops_name, tp)
        if rank == 0:
            torch.save(logits, out)
    finally:
        destroy_group(tp)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, PreTrainedModel]:
    path = tmp_path_factory.mktemp(request.param)
    return path, build(request.param, path)


@pytest.mark.parametrize("ops_name", ["native", "torch"])
def test_two_ranks_equal_one_and_transformers(
    family: tuple[Path, PreTrainedModel], ops_name: str, tmp_path: Path
) -> None:
    checkpoint, reference = family
    address = f"tcp://127.0.0.1:{free_tcp_port()}"
    out = tmp_path / "logits.pt"
    spawn = multiprocessing.get_context("spawn")
    ranks = [
        spawn.Process(target=rank_main, args=(r, address, str(checkpoint), ops_name, str(out)))
        for r in range(2)
    ]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(timeout=300)
    assert [p.exitcode for p in ranks] == [0, 0]
    sharded = torch.load(out)
    whole, seqs = run_scenario(checkpoint, ops_name, TensorParallel())
    assert len(sharded) == len(whole) == 5
    for s, w in zip(sharded, whole, strict=True):
        assert s.shape == w.shape and (s - w).abs().max() < TOL
    # Against transformers on the final sequences: every position each side computed.
    with torch.no_grad():
        ref = {n: reference(torch.tensor([seq])).logits[0] for n, seq in seqs.items()}
    assert (sharded[0][: len(A)] - ref["a"][: len(A)]).abs().max() < TOL
    b_prompt = torch.cat([sharded[0][len(A) :], sharded[1]])
    assert (b_prompt - ref["b"][: len(B)]).abs().max() < TOL
    for i, decoded in enumerate(sharded[2:]):
        assert (decoded[0] - ref["a"][len(A) + i]).abs().max() < TOL
        assert (decoded[1] - ref["b"][len(B) + i]).abs().max() < TOL
