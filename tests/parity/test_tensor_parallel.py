"""Tensor parallelism at size 2 against size 1 and transformers, every family (tiny
random checkpoints, float32): each rank a real process in a gloo group, holding only its
shard; logits within 1e-4 through a mixed batch of prefills and decodes over paged KV.
One group of two rank processes runs every case (family and kernel path) in turn."""

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


CASES = [(family, ops_name) for family in sorted(FAMILIES) for ops_name in ("native", "torch")]


def rank_main(rank: int, address: str, checkpoints: dict[str, str], out: str) -> None:
    """One rank of the group, through every case in turn (one spawn and one group for
    all of them: each start costs seconds). Rank 0 saves each case's logits, or what
    went wrong in it, so that one case's failure is that case's alone."""
    torch.set_num_threads(1)
    tp = init_group(rank, 2, address, torch.device("cpu"))
    results: dict[str, list[torch.Tensor] | str] = {}
    try:
        for family, ops_name in CASES:
            try:
                results[f"{family}-{ops_name}"], _ = run_scenario(
                    Path(checkpoints[family]), ops_name, tp
                )
            except Exception as e:  # reported by that case's test
                results[f"{family}-{ops_name}"] = repr(e)
        if rank == 0:
            torch.save(results, out)
    finally:
        destroy_group(tp)


@pytest.fixture(scope="module")
def families(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, PreTrainedModel]]:
    built = {}
    for name in sorted(FAMILIES):
        path = tmp_path_factory.mktemp(name)
        built[name] = (path, build(name, path))
    return built


@pytest.fixture(scope="module")
def sharded_logits(
    families: dict[str, tuple[Path, PreTrainedModel]], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, list[torch.Tensor] | str]:
    """Every case's logits from one group of two rank processes."""
    address = f"tcp://127.0.0.1:{free_tcp_port()}"
    out = tmp_path_factory.mktemp("tp") / "logits.pt"
    checkpoints = {name: str(path) for name, (path, _) in families.items()}
    spawn = multiprocessing.get_context("spawn")
    ranks = [
        spawn.Process(target=rank_main, args=(r, address, checkpoints, str(out))) for r in range(2)
    ]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(timeout=600)
    assert [p.exitcode for p in ranks] == [0, 0]
    results: dict[str, list[torch.Tensor] | str] = torch.load(out)
    return results


@pytest.mark.parametrize(("family", "ops_name"), CASES, ids=[f"{f}-{o}" for f, o in CASES])
def test_two_ranks_equal_one_and_transformers(
    families: dict[str, tuple[Path, PreTrainedModel]],
    sharded_logits: dict[str, list[torch.Tensor] | str],
    family: str,
    ops_name: str,
) -> None:
    checkpoint, reference = families[family]
    sharded = sharded_logits[f"{family}-{ops_name}"]
    assert not isinstance(sharded, str), f"the two ranks failed: {sharded}"
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
