"""Weights moved into huge-page memory: each tensor keeps its identity and values, tensors
sharing a storage share the copy, and what cannot or need not move stays."""

from __future__ import annotations

import torch
from torch import nn

from common.model_files import resolve_model_dir
from tests.unit.smaps import mapping_of, thp_available
from worker.huge_pages import HUGE_PAGE, MIN_BYTES, move_to_huge_pages
from worker.models.decoder import DecoderLM
from worker.models.loader import load_model
from worker.native import load_native_kernels
from worker.ops import NativeOps
from worker.packed_linear import PackedLinear


def test_tensors_move_in_place_into_one_aligned_mapping() -> None:
    big = torch.randn(512, 576).to(torch.bfloat16)  # 576 KiB
    other = torch.randn(300, 100)  # 117 KiB, float32
    tied = big.detach()  # another tensor object over big's storage
    small = torch.randn(16)
    view = torch.randn(2, 512, 576)[1]  # a part of a larger storage
    values = {id(t): t.clone() for t in (big, other, small, view)}
    ptrs = {id(t): t.data_ptr() for t in (small, view)}

    moved = move_to_huge_pages([big, other, tied, small, view, big])

    assert moved == big.numel() * 2 + other.numel() * 4  # the shared storage once
    assert torch.equal(big, values[id(big)]) and torch.equal(other, values[id(other)])
    assert tied.data_ptr() == big.data_ptr()  # still one tensor, as a tied LM head is
    start = mapping_of(big.data_ptr()).start
    assert big.data_ptr() % HUGE_PAGE == 0 and mapping_of(other.data_ptr()).start == start
    assert other.data_ptr() - big.data_ptr() == 576 * 1024  # 4 KiB aligned, side by side
    assert small.data_ptr() == ptrs[id(small)] and small.numel() * 4 < MIN_BYTES
    assert view.data_ptr() == ptrs[id(view)] and torch.equal(view, values[id(view)])
    if thp_available():
        assert "hg" in mapping_of(big.data_ptr()).vm_flags


def test_nothing_to_move_allocates_nothing() -> None:
    assert move_to_huge_pages([torch.randn(4), torch.randn(8, 8)]) == 0


def test_a_loaded_bfloat16_model_streams_its_weights_from_huge_pages() -> None:
    """SmolLM2 in bfloat16 on the native kernels: every projection weight a step reads
    in plain layout (the GEMV's copies where this CPU has the GEMV, else the linears'
    own) and the embedding lie in one huge-page mapping, a tied LM head sharing the
    embedding's copy, and huge pages back it where THP is available."""
    ops = NativeOps(load_native_kernels())
    model = load_model(
        resolve_model_dir("smollm2-135m-instruct"), torch.bfloat16, torch.device("cpu"), ops=ops
    )
    assert isinstance(model, DecoderLM)
    embedding = model.model.embed_tokens.weight
    linears = [m for m in model.modules() if isinstance(m, PackedLinear | nn.Linear)]
    plain = [m.weight for m in linears if m.weight is not None]
    assert len(linears) == 4 * 30 + 1  # fused q/k/v, o, fused gate/up, down; the LM head
    if model.lm_head.weight is not None:  # tied: the embedding is the head's weight
        assert model.lm_head.weight.data_ptr() == embedding.data_ptr()
    arena = mapping_of(embedding.data_ptr())
    assert all(arena.start <= w.data_ptr() < arena.end for w in plain)
    if thp_available():
        assert "hg" in arena.vm_flags and arena.anon_huge_kib >= 50 * 1024
