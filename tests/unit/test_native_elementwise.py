"""The native KV write, rotary and SwiGLU/GeGLU kernels against the PyTorch code they
replace: bit-equal where only roundings are involved, within a bfloat16 step or two for the
activations (their exp is not PyTorch's)."""

from __future__ import annotations

import pytest
import torch

from worker.native import load_native_kernels
from worker.ops import ACTIVATIONS, NATIVE_ACTIVATIONS, TorchOps


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_puts_each_head_row_in_its_block(dtype: torch.dtype) -> None:
    kernels = load_native_kernels()
    qkv = torch.randn(5, 9 + 2 * 3, 16).to(dtype)  # k and v are strided views, as in the model
    k, v = qkv[:, 9:12], qkv[:, 12:]
    slots = torch.tensor([40, 3, 17, 0, 63])
    ours = torch.zeros(2, 8, 3, 8, 16, dtype=dtype)  # 8 blocks of 8 slots, 3 KV heads
    kernels.write_kv(ours, slots, k, v)
    ref = torch.zeros_like(ours)
    for i, slot in enumerate(slots.tolist()):  # slot 40: block 5, row 0 of every head
        ref[0, slot // 8, :, slot % 8] = k[i]
        ref[1, slot // 8, :, slot % 8] = v[i]
    assert torch.equal(ours, ref)
    torch_path = torch.zeros_like(ours)
    TorchOps().write_kv(torch_path, slots, k, v)
    assert torch.equal(torch_path, ref)
    with pytest.raises(RuntimeError, match="slot out of range"):
        kernels.write_kv(ours, torch.tensor([0, 1, 2, 3, 64]), k, v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_in_place_equals_the_torch_rotary(dtype: torch.dtype) -> None:
    kernels = load_native_kernels()
    n, dim = 7, 64
    qkv = (torch.randn(n, 4 + 2 * 2, dim) * 4).to(dtype)
    angles = torch.arange(n).float()[:, None] * torch.rand(dim // 2)[None, :]
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    expected = TorchOps().rotary(qkv[:, :6], cos, sin)
    untouched = qkv[:, 6:].clone()
    kernels.rotary_(qkv, cos, sin, 6)
    assert torch.equal(qkv[:, :6], expected)
    assert torch.equal(qkv[:, 6:], untouched)  # v is not rotated


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", sorted(NATIVE_ACTIVATIONS))
def test_act_mul_matches_torch(activation: str, dtype: torch.dtype) -> None:
    """Every activation with a code, against PyTorch's own: 100 columns (six vectors and a
    scalar tail), values out to +-12 (where GeGLU's cubic term sends exp past float32's
    range) and exact zeros."""
    kernels = load_native_kernels()
    generator = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(6, 2 * 100, generator=generator) * 4).clamp(-12, 12)
    gate_up[0, :8] = torch.tensor([-12.0, -11.0, -9.5, 0.0, 12.0, 11.0, 9.5, -0.0])
    gate_up = gate_up.to(dtype)
    gate, up = gate_up.split(100, dim=-1)
    expected = ACTIVATIONS[activation](gate) * up
    ours = kernels.act_mul(gate_up, NATIVE_ACTIVATIONS[activation])
    if dtype == torch.float32:
        # Past x ~ -4 GELU is 0.5 x (1 + tanh(..)) with tanh near -1: both sides lose the
        # same digits to that cancellation and round them differently, so the bound is a
        # float32 step of x * up there (a fixed 1e-6 failed ~6% of random draws; the worst
        # of 500 seeds is a quarter of this bound).
        bound = 1e-5 * expected.abs() + 2.0**-23 * (gate * up).abs()
        assert ((ours - expected).abs() <= bound).all()
    else:  # the activation and the product each rounded: at most two bfloat16 steps
        step = 2.0**-7 * expected.float().abs().clamp_min(1e-3)
        assert ((ours.float() - expected.float()).abs() <= 2 * step).all()


def test_act_mul_refuses_an_unknown_activation() -> None:
    with pytest.raises(RuntimeError, match="unknown activation code 7"):
        load_native_kernels().act_mul(torch.zeros(2, 8), 7)


def test_every_kernel_refuses_tensors_off_the_cpu() -> None:
    kernels = load_native_kernels()
    meta = torch.empty(4, 2, 8, device="meta")
    calls = {
        "write_kv": lambda: kernels.write_kv(
            torch.empty(2, 1, 2, 8, 8, device="meta"), torch.zeros(4, dtype=torch.long), meta, meta
        ),
        "rotary": lambda: kernels.rotary_(meta, torch.ones(4, 8), torch.ones(4, 8), 2),
        "act_mul": lambda: kernels.act_mul(torch.empty(4, 16, device="meta"), 0),
        "rms_norm": lambda: kernels.rms_norm(meta, torch.ones(8), 1e-6, False),
        "decode_attention": lambda: kernels.decode_attention(
            meta, torch.zeros(2, 1, 2, 16, 8), torch.zeros(4, 1, dtype=torch.long),
            torch.ones(4, dtype=torch.long), 1.0, 0, 16,
        ),
    }  # fmt: skip
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match=f"{name} takes CPU tensors"):
            call()


@pytest.mark.parametrize("vocab", [70, 96, 100])
def test_token_bitmask_kernel_equals_the_torch_path(vocab: int) -> None:
    kernels = load_native_kernels()
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=gen)
    mask = torch.randint(-(2**31), 2**31 - 1, (5, 3), dtype=torch.int32, generator=gen)
    mask[1] = -1  # an unconstrained row
    ours, theirs = logits.clone(), logits.clone()
    kernels.apply_token_bitmask_(ours, mask)
    TorchOps().apply_token_bitmask(theirs, mask)
    assert torch.equal(ours, theirs)
    assert torch.equal(ours[1, :96], logits[1, :96])
    if vocab > 96:  # past the mask's 96 bits: never allowed
        assert bool((ours[:, 96:] == float("-inf")).all())
    bit = (mask[0, 0] >> 3) & 1
    assert (ours[0, 3] == logits[0, 3]) == bool(bit)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [1, 15, 16, 70, 49152])
def test_argmax_rows_is_torch_max_indices(dtype: torch.dtype, vocab: int) -> None:
    kernels = load_native_kernels()
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(6, vocab, generator=gen).to(dtype)
    # ties: the first maximum wins, wherever the copies fall (lanes, tail)
    x[1, vocab // 2 :] = float(x[1].max()) + 1
    x[2] = float("-inf")
    x[3, vocab - 1] = float(x[3].max()) + 1  # the maximum in the tail
    x[4, vocab // 3 :] = float("nan")  # NaN wins, as torch.max reports it
    ours, theirs = kernels.argmax_rows(x), x.max(dim=-1).indices
    assert ours.dtype == torch.int64 and torch.equal(ours, theirs)
    assert int(ours[1]) == vocab // 2 and int(ours[2]) == 0 and int(ours[3]) == vocab - 1
    assert int(ours[4]) == vocab // 3
    with pytest.raises(RuntimeError, match="contiguous"):
        kernels.argmax_rows(x.t() if vocab > 1 else x[:, :0])
