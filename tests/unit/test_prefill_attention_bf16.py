"""The native bfloat16 prefill attention (worker/csrc/prefill_attention_bf16.cpp) against
a float64 reference: first chunks and chunks after cached tokens, grouped heads, head
sizes 64 to 256, sliding windows, keys laid out as the step's K (token-major) and as
blocks gathered from the cache (head-major); a query's result does not depend on the
chunk it came in; a step's fresh chunks in one call give each chunk the bits it gets alone;
bad input is refused. Without AVX512-BF16 (the CPU, or a portable kernel build) there is no
kernel, and prefill attention stays on PyTorch's flash kernel."""

from __future__ import annotations

import pytest
import torch

from worker.native import load_native_kernels

kernels = load_native_kernels()
needs_kernel = pytest.mark.skipif(
    not kernels.has_bf16_prefill_attention(),
    reason="no AVX512-BF16 on this CPU or kernel build level",
)


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int, window: int = 0
) -> torch.Tensor:
    """``q`` [n, H, D] at positions offset.., ``k``/``v`` [KVH, offset + n, D], float64;
    with a window, the query at t sees keys (t - window, t]."""
    group = q.shape[1] // k.shape[0]
    keys, values = k.double().repeat_interleave(group, 0), v.double().repeat_interleave(group, 0)
    scores = q.double().transpose(0, 1) @ keys.transpose(1, 2) * q.shape[-1] ** -0.5
    query_pos = torch.arange(offset, offset + q.shape[0])[:, None]
    key_pos = torch.arange(k.shape[1])[None]
    hidden = key_pos > query_pos
    if window:
        hidden |= key_pos <= query_pos - window
    scores = scores.masked_fill(hidden, float("-inf"))
    return (scores.softmax(-1) @ values).transpose(0, 1)


def operands(
    queries: int, offset: int, heads: int, kv_heads: int, dim: int, token_major: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(queries * 7 + offset + heads + dim)
    q = torch.randn(queries, heads, dim, generator=gen).to(torch.bfloat16)
    keys = offset + queries
    if token_major:  # the step's own K and V: k[start:end].transpose(0, 1)
        kv = torch.randn(2, keys, kv_heads, dim, generator=gen).to(torch.bfloat16)
        return q, kv[0].transpose(0, 1), kv[1].transpose(0, 1)
    kv = torch.randn(2, kv_heads, keys + 5, dim, generator=gen).to(torch.bfloat16)
    return q, kv[0, :, :keys], kv[1, :, :keys]  # gathered blocks, cut to the context


@needs_kernel
@pytest.mark.parametrize(
    ("queries", "offset", "heads", "kv_heads", "dim", "token_major", "window"),
    [
        (1, 0, 9, 3, 64, True, 0),
        (13, 0, 9, 3, 64, True, 0),
        (300, 0, 9, 3, 64, True, 0),
        (77, 200, 9, 3, 64, False, 0),
        (1, 1000, 9, 3, 64, False, 0),
        (100, 33, 8, 2, 128, False, 0),
        (41, 0, 4, 1, 256, True, 0),
        (29, 3, 4, 4, 128, False, 0),
        (300, 0, 4, 1, 256, True, 100),  # Gemma 3's local layers: a window, head dim 256
        (77, 500, 9, 3, 64, False, 37),  # the window inside a group of 32 keys
        (50, 20, 9, 3, 64, False, 64),  # the window reaching back into the prefix
        (13, 0, 9, 3, 64, True, 1),  # each query sees itself alone
    ],
)
def test_matches_reference(
    queries: int,
    offset: int,
    heads: int,
    kv_heads: int,
    dim: int,
    token_major: bool,
    window: int,
) -> None:
    q, k, v = operands(queries, offset, heads, kv_heads, dim, token_major)
    ours = kernels.prefill_attention(q, k, v, offset, dim**-0.5, window)
    assert ours.shape == q.shape and ours.dtype == torch.bfloat16
    # bfloat16 output: one rounding of values below ~4 is at most 2^-7 off
    assert (ours.double() - reference(q, k, v, offset, window)).abs().max() < 1.6e-2


@needs_kernel
@pytest.mark.parametrize("window", [0, 70])
def test_a_query_does_not_depend_on_its_chunk(window: int) -> None:
    """Queries 130.. of a 400-token prompt, prefilled whole or as a chunk after 130 cached
    tokens, give the same bits: each row's scores, softmax and sums are its own."""
    q, k, v = operands(400, 0, 9, 3, 64, True)
    whole = kernels.prefill_attention(q, k, v, 0, 0.125, window)
    chunk = kernels.prefill_attention(q[130:], k, v, 130, 0.125, window)
    assert torch.equal(whole[130:], chunk)


@needs_kernel
def test_refuses_what_it_cannot_take() -> None:
    q, k, v = operands(5, 3, 4, 2, 64, False)
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernels.prefill_attention(q.float(), k, v, 3, 0.125, 0)
    with pytest.raises(RuntimeError, match="offset's and the queries' own"):
        kernels.prefill_attention(q, k, v, 2, 0.125, 0)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernels.prefill_attention(q[..., :48], k[..., :48], v[..., :48], 3, 0.125, 0)
    with pytest.raises(RuntimeError, match="heads by KV head"):
        kernels.prefill_attention(q[:, :3], k, v, 3, 0.125, 0)
    with pytest.raises(RuntimeError, match="window must be 0"):
        kernels.prefill_attention(q, k, v, 3, 0.125, -1)


def step_operands(
    lengths: list[int], heads: int, kv_heads: int, dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int], list[int]]:
    """A step's q, k and v as the model holds them (views of one qkv row per token:
    ``[tokens, heads or kv_heads, dim]``), with a decode token before each prompt."""
    gen = torch.Generator().manual_seed(sum(lengths) + heads)
    starts, ends, tokens = [], [], 0
    for n in lengths:
        starts.append(tokens + 1)  # one token of another request first
        ends.append(tokens + 1 + n)
        tokens += 1 + n
    qkv = torch.randn(tokens, heads + 2 * kv_heads, dim, generator=gen).to(torch.bfloat16)
    q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
    return q, k, v, starts, ends


@needs_kernel
@pytest.mark.parametrize(
    ("lengths", "heads", "kv_heads", "dim", "window"),
    [
        ([24, 64, 1, 37, 15, 50], 9, 3, 64, 0),  # the chat workload's short prompts
        ([300, 13, 100], 8, 2, 128, 0),
        ([41, 200], 4, 1, 256, 100),  # Gemma 3's local layers
        ([7], 4, 4, 128, 0),
    ],
)
def test_chunks_in_one_call_are_each_what_it_gets_alone(
    lengths: list[int], heads: int, kv_heads: int, dim: int, window: int
) -> None:
    q, k, v, starts, ends = step_operands(lengths, heads, kv_heads, dim)
    out = torch.full(q.shape, 7.0, dtype=torch.bfloat16)
    kernels.prefill_attention_chunks_(out, q, k, v, starts, ends, dim**-0.5, window)
    covered = torch.zeros(q.shape[0], dtype=torch.bool)
    for first, last in zip(starts, ends, strict=True):
        alone = kernels.prefill_attention(
            q[first:last], k[first:last].transpose(0, 1), v[first:last].transpose(0, 1), 0,
            dim**-0.5, window,
        )  # fmt: skip
        assert torch.equal(out[first:last], alone)
        covered[first:last] = True
    assert (out[~covered] == 7.0).all()  # the other tokens' rows are left as they were


@needs_kernel
def test_chunks_in_one_call_refuses_what_it_cannot_take() -> None:
    q, k, v, starts, ends = step_operands([5, 6], 4, 2, 64)
    out = torch.empty(q.shape, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"chunk 1 is tokens \[7, 14\) of 13"):
        kernels.prefill_attention_chunks_(out, q, k, v, starts, [6, 14], 0.125, 0)
    with pytest.raises(RuntimeError, match="a start and an end a chunk"):
        kernels.prefill_attention_chunks_(out, q, k, v, starts, ends[:1], 0.125, 0)
    with pytest.raises(RuntimeError, match="out must be contiguous and shaped like q"):
        kernels.prefill_attention_chunks_(out[:-1], q, k, v, starts, ends, 0.125, 0)
    with pytest.raises(RuntimeError, match="k and v must be q's tokens'"):
        kernels.prefill_attention_chunks_(out, q, k[:-1], v[:-1], starts, ends, 0.125, 0)
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernels.prefill_attention_chunks_(out.float(), q, k, v, starts, ends, 0.125, 0)


def test_built_exactly_where_the_cpu_has_avx512_bf16() -> None:
    # the AVX512-BF16 GEMV is built under the same condition; the GEMM from AVX2 up
    assert kernels.has_bf16_prefill_attention() == kernels.has_bf16_gemv()
