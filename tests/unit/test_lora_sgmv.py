"""The native SGMV kernel (``lora_sgmv_``) against PEFT's arithmetic in PyTorch: each
group's rows get ``y + lora_B(lora_A(x)) * scaling``, other rows are untouched, a rank-0
group adds an exact zero; in float32 and bfloat16, on this CPU's build and the x86-64-v3
one. And ``LoRABatch`` takes the kernel for a few rows and the matmuls for many."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from common.lora import AdapterConfig
from common.messages import LoRARequest
from tests.avx2_build import assert_passes_on_the_avx2_build
from worker.lora import LoRABatch, LoRAFactors, LoRAWeights
from worker.native import NativeKernels, load_native_kernels

IN, OUT = 72, 200  # not multiples of any vector width


@pytest.fixture(scope="module")
def kernels() -> NativeKernels:
    return load_native_kernels()


def factors(rank: int, seed: int) -> LoRAFactors:
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(rank, IN, generator=g), torch.randn(OUT, rank, generator=g)
    return LoRAFactors.of(a, b, [(0, rank, 0, OUT)] if rank else [])


def reference(
    y: torch.Tensor, x: torch.Tensor, groups: list[tuple[LoRAFactors, float, list[int]]]
) -> torch.Tensor:
    out = y.clone()
    for f, scale, rows in groups:
        index = torch.tensor(rows)
        delta = F.linear(F.linear(x.index_select(0, index).float(), f.a), f.bt.t()) * scale
        out[index] = (y.index_select(0, index).float() + delta).to(y.dtype)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_group_gets_its_adapters_delta_and_no_other_row_changes(
    kernels: NativeKernels, dtype: torch.dtype
) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, IN, generator=g).to(dtype)
    y = torch.randn(9, OUT, generator=g).to(dtype)
    groups = [
        (factors(8, 1), 2.0, [4, 0, 7]),
        (factors(0, 2), 1.5, [2]),  # an adapter that leaves this projection alone
        (factors(24, 3), 0.25, [8, 1]),
    ]  # rows 3, 5 and 6: the base model's
    expected = reference(y, x, groups)
    rows = torch.tensor([r for _, _, rs in groups for r in rs])
    starts = torch.tensor([0, 3, 4, 6])
    got = y.clone()
    kernels.lora_sgmv_(
        got, x, rows, starts, [f.a for f, _, _ in groups], [f.bt for f, _, _ in groups],
        [f.blocks for f, _, _ in groups], [s for _, s, _ in groups],
    )  # fmt: skip
    for row in (2, 3, 5, 6):
        assert torch.equal(got[row], y[row])
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
    else:  # one rounding to bfloat16 at the end: within one bf16 ulp of the reference
        torch.testing.assert_close(got.float(), expected.float(), rtol=1e-2, atol=1e-2)


def test_only_the_nonzero_blocks_of_a_fused_projection_are_read(kernels: NativeKernels) -> None:
    """q and v targeted in a fused q/k/v projection: B is block-diagonal, k's outputs get
    nothing; the kernel reads only the blocks named, so garbage elsewhere is never seen."""
    g = torch.Generator().manual_seed(4)
    a_q, a_v = torch.randn(4, IN, generator=g), torch.randn(6, IN, generator=g)
    b_q, b_v = torch.randn(80, 4, generator=g), torch.randn(60, 6, generator=g)
    b = torch.block_diag(b_q, torch.zeros(60, 0), b_v)  # q 80, k 60, v 60 outputs
    fused = LoRAFactors.of(torch.cat([a_q, a_v]), b, [(0, 4, 0, 80), (4, 10, 140, 200)])
    x, y = torch.randn(3, IN, generator=g), torch.randn(3, OUT, generator=g)
    expected = reference(y, x, [(fused, 0.5, [0, 2])])
    garbage = dataclasses.replace(fused, bt=fused.bt.clone())
    garbage.bt[0:4, 80:200] = float("nan")  # off the blocks: must never be read
    got = y.clone()
    kernels.lora_sgmv_(
        got, x, torch.tensor([0, 2]), torch.tensor([0, 2]), [garbage.a], [garbage.bt],
        [garbage.blocks], [0.5],
    )  # fmt: skip
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
    assert torch.equal(got[:, 80:140], y[:, 80:140]) and torch.equal(got[1], y[1])
    with pytest.raises(RuntimeError, match="out of A's ranks"):
        bad = torch.tensor([[0, 11, 0, 80]])
        kernels.lora_sgmv_(
            got, x, torch.tensor([0]), torch.tensor([0, 1]), [fused.a], [fused.bt], [bad], [1.0]
        )


def test_bad_shapes_are_refused(kernels: NativeKernels) -> None:
    x, y, f = torch.randn(2, IN), torch.randn(2, OUT), factors(4, 0)
    rows, starts = torch.tensor([0, 1]), torch.tensor([0, 2])
    with pytest.raises(RuntimeError, match="A must be"):
        kernels.lora_sgmv_(
            y, x, rows, starts, [f.a[:, :-1].contiguous()], [f.bt], [f.blocks], [1.0]
        )
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.lora_sgmv_(y, x, torch.tensor([0, 5]), starts, [f.a], [f.bt], [f.blocks], [1.0])
    with pytest.raises(RuntimeError, match="float32"):
        kernels.lora_sgmv_(y, x, rows, starts, [f.a.double()], [f.bt], [f.blocks], [1.0])


def _weights(rank: int, seed: int, scale: float) -> LoRAWeights:
    config = AdapterConfig(
        rank=rank, alpha=scale * rank, use_rslora=False, target_modules=frozenset()
    )
    request = LoRARequest(f"a{seed}", seed, "/nowhere")
    return LoRAWeights(request, config, ({"o_proj": factors(rank, seed)},))


@pytest.mark.parametrize("num_rows", [5, 200])  # the kernel, then the matmuls
def test_the_batch_gives_the_same_deltas_on_either_path(
    kernels: NativeKernels, num_rows: int
) -> None:
    x = torch.randn(num_rows, IN)
    y = torch.randn(num_rows, OUT)
    first, second = _weights(8, 1, 2.0), _weights(16, 2, 0.5)
    rows = torch.randperm(num_rows)
    split = [rows[: num_rows // 3], rows[num_rows // 3 : num_rows - 1]]  # the last: base
    on_native, on_torch = LoRABatch(kernels), LoRABatch(None)
    results = []
    for batch in (on_native, on_torch):
        batch.set([(first, split[0]), (second, split[1])])
        got = y.clone()
        batch.add_deltas(got, x, 0, "o_proj")
        batch.add_deltas(got, x, 0, "qkv_proj")  # neither adapter has one: nothing
        results.append(got)
    torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=1e-4)
    assert torch.equal(results[0][rows[-1]], y[rows[-1]])
    assert not torch.equal(results[0], y)


def test_the_avx2_build_passes_these_tests() -> None:
    assert_passes_on_the_avx2_build(__file__)
