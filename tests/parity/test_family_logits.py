"""Each family against transformers on a tiny random checkpoint, in float32: the same
logits (max abs diff < 1e-4) whatever the batch, chunking or block placement, with
decode attention by PyTorch ops and by the native CPU kernel."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from tests.parity.families import FAMILIES, WINDOW, build
from worker.attention import build_metadata
from worker.models.loader import load_model
from worker.native import load_native_kernels
from worker.ops import NativeOps, Ops, TorchOps

BLOCK = 4
TOL = 1e-4


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, PreTrainedModel]:
    path = tmp_path_factory.mktemp(request.param)
    return path, build(request.param, path)


@pytest.fixture
def checkpoint(family: tuple[Path, PreTrainedModel]) -> Path:
    return family[0]


@pytest.fixture
def reference(family: tuple[Path, PreTrainedModel]) -> PreTrainedModel:
    return family[1]


class Paged:
    """Our model plus a KV cache, fed step by step like the model runner does."""

    def __init__(self, checkpoint: Path, ops: Ops, num_blocks: int = 64) -> None:
        self.model = load_model(checkpoint, torch.float32, torch.device("cpu"), ops)
        self.caches = [
            torch.zeros(self.model.kv_cache_shape(num_blocks, BLOCK))
            for _ in range(self.model.num_layers)
        ]

    @torch.inference_mode()
    def step(self, seqs: list[tuple[list[int], list[int], int, int]]) -> list[torch.Tensor]:
        """``seqs``: (all token ids, block ids, start, length) per request. Returns each
        request's logits for its computed tokens."""
        ids, pos = [], []
        for tokens, _, start, length in seqs:
            ids += tokens[start : start + length]
            pos += list(range(start, start + length))
        meta = build_metadata(
            [s[1] for s in seqs],
            [s[2] for s in seqs],
            [s[3] for s in seqs],
            BLOCK,
            torch.device("cpu"),
        )
        logits = self.model.compute_logits(
            self.model(torch.tensor(ids), torch.tensor(pos), self.caches, meta)
        )
        return list(torch.split(logits, [s[3] for s in seqs]))


@pytest.fixture(params=["torch", "native"])
def make_paged(request: pytest.FixtureRequest, checkpoint: Path) -> Callable[[], Paged]:
    """Every op by PyTorch (gather + SDPA for decode attention) or by the native kernels."""
    ops: Ops = NativeOps(load_native_kernels()) if request.param == "native" else TorchOps()
    return lambda: Paged(checkpoint, ops)


def ref_logits(reference: PreTrainedModel, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return reference(torch.tensor([tokens])).logits[0]


def prompt(seed: int, length: int) -> list[int]:
    return torch.randint(0, 128, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_one_sequence(make_paged: Callable[[], Paged], reference: PreTrainedModel) -> None:
    tokens = prompt(1, 13)
    (ours,) = make_paged().step([(tokens, [0, 1, 2, 3], 0, 13)])
    assert (ours - ref_logits(reference, tokens)).abs().max() < TOL


def test_mixed_batch_of_prefills_and_decodes(
    make_paged: Callable[[], Paged], reference: PreTrainedModel
) -> None:
    paged = make_paged()
    a, b, c = prompt(2, 9), prompt(3, 5), prompt(4, 17)
    paged.step([(a, [10, 11, 12], 0, 8), (b, [20, 21], 0, 4)])  # a and b partly prefilled
    # One forward: a and b decode their last token while c prefills whole.
    la, lb, lc = paged.step(
        [(a, [10, 11, 12], 8, 1), (b, [20, 21], 4, 1), (c, [30, 31, 32, 33, 34], 0, 17)]
    )
    assert (la[0] - ref_logits(reference, a)[-1]).abs().max() < TOL
    assert (lb[0] - ref_logits(reference, b)[-1]).abs().max() < TOL
    assert (lc - ref_logits(reference, c)).abs().max() < TOL


def test_prompt_prefilled_in_three_chunks(
    make_paged: Callable[[], Paged], reference: PreTrainedModel
) -> None:
    tokens = prompt(5, 23)
    paged = make_paged()
    blocks = [7, 3, 9, 1, 5, 2]
    chunks = [paged.step([(tokens, blocks, s, n)])[0] for s, n in ((0, 6), (6, 10), (16, 7))]
    assert (torch.cat(chunks) - ref_logits(reference, tokens)).abs().max() < TOL


def test_twenty_decode_steps_over_scattered_blocks(
    make_paged: Callable[[], Paged], reference: PreTrainedModel
) -> None:
    tokens = prompt(6, 7)
    blocks = [41, 3, 17, 60, 8, 29, 50]  # deliberately non-contiguous and unordered
    paged = make_paged()
    (logits,) = paged.step([(tokens, blocks, 0, len(tokens))])
    for _ in range(20):
        ref = ref_logits(reference, tokens)[-1]
        assert (logits[-1] - ref).abs().max() < TOL
        tokens = [*tokens, int(ref.argmax())]
        (logits,) = paged.step([(tokens, blocks, len(tokens) - 1, 1)])
    assert (logits[-1] - ref_logits(reference, tokens)[-1]).abs().max() < TOL


def test_long_sequences_past_the_sliding_window(
    make_paged: Callable[[], Paged], reference: PreTrainedModel
) -> None:
    """Longer than Gemma3's window (8), prefilled in chunks then decoded, in a batch."""
    tokens, other = prompt(7, 5 * WINDOW), prompt(8, 3 * WINDOW + 3)
    paged = make_paged()
    blocks_a, blocks_b = list(range(40, 52)), list(range(20, 30))
    a1, b1 = paged.step([(tokens, blocks_a, 0, 2 * WINDOW + 1), (other, blocks_b, 0, len(other))])
    (a2,) = paged.step([(tokens, blocks_a, 2 * WINDOW + 1, len(tokens) - 2 * WINDOW - 1)])
    assert (torch.cat([a1, a2]) - ref_logits(reference, tokens)).abs().max() < TOL
    assert (b1 - ref_logits(reference, other)).abs().max() < TOL
    for _ in range(6):
        tokens = [*tokens, int(ref_logits(reference, tokens)[-1].argmax())]
        other = [*other, int(ref_logits(reference, other)[-1].argmax())]
        la, lb = paged.step(
            [(tokens, blocks_a, len(tokens) - 1, 1), (other, blocks_b, len(other) - 1, 1)]
        )
        assert (la[-1] - ref_logits(reference, tokens)[-1]).abs().max() < TOL
        assert (lb[-1] - ref_logits(reference, other)[-1]).abs().max() < TOL
