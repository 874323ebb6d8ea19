"""The ops a model step is made of, behind one object chosen once per worker.

``TorchOps`` runs everything as PyTorch ops (any device); ``NativeOps`` runs Tandem's C++
CPU kernels (``worker/csrc``, built by ``worker/native.py``) for decode attention,
bfloat16 prefill attention (AVX512-BF16 without AMX), KV writes, RoPE, RMSNorm (with the
residual add before it), SwiGLU and GeGLU, falling back to the PyTorch code where it has
no kernel (another activation). ``pick_ops`` chooses by ``--attention-backend`` and device; the
model is constructed with the result and every layer calls it, so the choice lives in
one place.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

import torch
from torch import nn

from common.config import AttentionBackend
from worker.attention import AttentionMetadata, PrefillChunk
from worker.native import NativeKernels, load_native_kernels, try_load_native_kernels
from worker.packed_linear import BF16_GEMM_CODE, ONEDNN, Gemv, Packing
from worker.structured import apply_bitmask_torch
from worker.torch_attention import decode_attention_torch, prefill_attention_torch

logger = logging.getLogger(__name__)


class Ops(Protocol):
    name: str

    def write_kv(
        self, kv_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Each token's K and V rows into its slot (``worker/attention.py``'s layout)."""

    def decode_attention(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None,
    ) -> torch.Tensor:
        """One query per decode (``[n, heads, dim]``) over its cached context."""
        ...

    def prefill_attention(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        chunk: PrefillChunk,
        scale: float,
        window: int | None,
    ) -> torch.Tensor:
        """One prefill chunk's queries ``[q, heads, dim]`` over its context's keys and
        values ``[kv_heads, context_end, dim]``, causal (and windowed): ``[q, heads, dim]``."""
        ...

    def fresh_prefill_attention(
        self,
        out: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        chunks: Sequence[PrefillChunk],
        scale: float,
        window: int | None,
    ) -> None:
        """Prefill chunks with nothing cached before them (``context_start`` 0), into their
        rows of ``out``: each chunk's queries (its rows of ``q`` ``[tokens, heads, dim]``)
        over its own keys and values (its rows of ``k`` and ``v`` ``[tokens, kv_heads,
        dim]``), causal (and windowed)."""
        ...

    def rotary(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE over every head of ``qk`` ``[n, heads, dim]`` (may work in place)."""
        ...

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool
    ) -> torch.Tensor:
        """Llama style ``w * T(x * r)`` or Gemma style ``T(x * r * (1 + w))``."""
        ...

    def add_rms_norm(
        self, x: torch.Tensor, add: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x + add, rms_norm(x + add))``: a residual add and the norm after it."""
        ...

    def act_mul(self, gate_up: torch.Tensor, activation: str) -> torch.Tensor:
        """``act(gate) * up`` of a fused ``[n, 2 * d]`` gate/up projection."""
        ...

    def apply_token_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        """Structured outputs: float32 ``logits`` to -inf where the bitmask forbids, in place."""

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Greedy tokens: each row's first maximum of ``[n, vocab]`` logits, in their own
        dtype (``logits.max(dim=-1).indices``)."""
        ...

    @property
    def small_batch_linear(self) -> Gemv | None:
        """A bfloat16 GEMV for projections of a few rows (``PackedLinear``), if there is one."""

    @property
    def packing(self) -> Packing:
        """How ``PackedLinear`` packs bfloat16 weights, and its matmul past the GEMV's rows."""
        ...


ACTIVATIONS = {
    "silu": nn.functional.silu,
    "gelu_pytorch_tanh": lambda x: nn.functional.gelu(x, approximate="tanh"),
    "gelu_tanh": lambda x: nn.functional.gelu(x, approximate="tanh"),
}
# The activations the native act_mul computes, by its code (worker/csrc/kernels.h's
# Activation): silu, and GeGLU's tanh-approximated gelu as x * sigmoid(2 c (x + 0.044715 x^3)).
NATIVE_ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1, "gelu_tanh": 1}


class TorchOps:
    """PyTorch ops only, written to round where transformers' eager code rounds."""

    name = "torch"

    def write_kv(
        self, kv_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        block_size = kv_cache.shape[3]
        blocks, rows = slots // block_size, slots % block_size
        kv_cache[0, blocks, :, rows] = k  # indices split by a slice: [n, kv_heads, dim]
        kv_cache[1, blocks, :, rows] = v

    def decode_attention(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None,
    ) -> torch.Tensor:
        return decode_attention_torch(q, kv_cache, meta, scale, window)

    def prefill_attention(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        chunk: PrefillChunk,
        scale: float,
        window: int | None,
    ) -> torch.Tensor:
        return prefill_attention_torch(q, keys, values, chunk, scale, window)

    def fresh_prefill_attention(
        self,
        out: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        chunks: Sequence[PrefillChunk],
        scale: float,
        window: int | None,
    ) -> None:
        for chunk in chunks:  # one call each: SDPA takes one sequence's mask at a time
            rows = slice(chunk.token_start, chunk.token_end)
            keys, values = k[rows].transpose(0, 1), v[rows].transpose(0, 1)  # [KVH, L, D]
            out[rows] = self.prefill_attention(q[rows], keys, values, chunk, scale, window)

    def rotary(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = qk.shape[-1] // 2
        rotated = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
        return qk * cos[:, None, :] + rotated * sin[:, None, :]

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool
    ) -> torch.Tensor:
        normed = nn.functional.rms_norm(x.float(), (x.shape[-1],), None, eps)  # one fused kernel
        if gemma:
            return (normed * (1.0 + weight.float())).type_as(x)
        return weight * normed.to(x.dtype)

    def add_rms_norm(
        self, x: torch.Tensor, add: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        total = x + add
        return total, self.rms_norm(total, weight, eps, gemma)

    def act_mul(self, gate_up: torch.Tensor, activation: str) -> torch.Tensor:
        gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
        return ACTIVATIONS[activation](gate) * up

    def apply_token_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        apply_bitmask_torch(logits, bitmask)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        # max(dim) gives the first maximum like argmax, and is much faster on CPU
        return logits.max(dim=-1).indices

    @property
    def small_batch_linear(self) -> Gemv | None:
        return None

    @property
    def packing(self) -> Packing:
        return ONEDNN


class NativeOps(TorchOps):
    """Tandem's C++ CPU kernels, each rounding as the PyTorch code it replaces."""

    name = "native"

    def __init__(self, kernels: NativeKernels) -> None:
        self.kernels = kernels
        # bfloat16 prefill attention on the GEMM's tiles where the GEMM packs (AVX512-BF16,
        # no AMX): 4-6x PyTorch's flash kernel on a Zen 5. On AMX hosts that kernel runs
        # on the tiles (oneDNN's brgemm), not measured against this one, so it stays.
        self.native_prefill = kernels.has_bf16_prefill_attention() and kernels.bf16_gemm_packs()

    def write_kv(
        self, kv_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        self.kernels.write_kv(kv_cache, slots, k, v)

    def decode_attention(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None,
    ) -> torch.Tensor:
        assert meta.decode_block_table is not None and meta.decode_context_lens is not None
        return self.kernels.decode_attention(
            q.contiguous(),
            kv_cache,
            meta.decode_block_table,
            meta.decode_context_lens,
            scale,
            window or 0,
            meta.block_size,
        )

    def prefill_attention(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        chunk: PrefillChunk,
        scale: float,
        window: int | None,
    ) -> torch.Tensor:
        if (
            self.native_prefill
            and q.dtype == torch.bfloat16
            and q.shape[-1] % 32 == 0
            and all(t.stride(-1) == 1 for t in (q, keys, values))
        ):
            return self.kernels.prefill_attention(
                q, keys, values, chunk.context_start, scale, window or 0
            )
        return super().prefill_attention(q, keys, values, chunk, scale, window)

    def fresh_prefill_attention(
        self,
        out: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        chunks: Sequence[PrefillChunk],
        scale: float,
        window: int | None,
    ) -> None:
        # One native call for them all: a step of 32 short prompts made 32 calls a layer,
        # ~28 us each in slicing, packing and two parallel regions, for ~2 us of work.
        if (
            self.native_prefill
            and q.dtype == torch.bfloat16
            and q.shape[-1] % 32 == 0
            and out.is_contiguous()
            and all(t.stride(-1) == 1 for t in (q, k, v))
        ):
            self.kernels.prefill_attention_chunks_(
                out,
                q,
                k,
                v,
                [c.token_start for c in chunks],
                [c.token_end for c in chunks],
                scale,
                window or 0,
            )
            return
        super().fresh_prefill_attention(out, q, k, v, chunks, scale, window)

    def rotary(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        self.kernels.rotary_(qk, cos, sin, qk.shape[1])
        return qk

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool
    ) -> torch.Tensor:
        return self.kernels.rms_norm(x.contiguous(), weight, eps, gemma)

    def add_rms_norm(
        self, x: torch.Tensor, add: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kernels.add_rms_norm(x.contiguous(), add.contiguous(), weight, eps, gemma)

    def act_mul(self, gate_up: torch.Tensor, activation: str) -> torch.Tensor:
        code = NATIVE_ACTIVATIONS.get(activation)
        if code is None:
            return super().act_mul(gate_up, activation)
        return self.kernels.act_mul(gate_up.reshape(-1, gate_up.shape[-1]), code).view(
            *gate_up.shape[:-1], gate_up.shape[-1] // 2
        )

    def apply_token_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        self.kernels.apply_token_bitmask_(logits, bitmask)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        # bfloat16 logits are read as they are: no float32 copy (~0.8 ms at 32 x 49,152)
        if logits.dim() != 2 or logits.shape[1] == 0:
            return super().argmax(logits)
        return self.kernels.argmax_rows(logits.contiguous())

    @property
    def small_batch_linear(self) -> Gemv | None:
        # Built only where the compiler targets AVX512-BF16 (not the portable levels).
        # Where the GEMM packs, it takes every batch, one row included: its one ascending
        # stream per 32 outputs, with no horizontal sum per output, reads SmolLM2's
        # projections at 1 row in 4.2 ms against the GEMV's 5.3 on an AMD EPYC (Zen 5)
        # reading 76 GB/s, and level with it (8.24 against 8.29) on the earlier AMD
        # EPYC hosts, whose memory and bf16 matmul were about half as fast (bench.gemv).
        # On a Zen 4 the GEMM was 12% slower at 1 row until it stopped fetching ahead below
        # 6 rows (bf16_gemm.cpp's kFetchFromRows): now 7.54 ms against 7.80.
        # No GEMV there also means no second, plain copy of the weights.
        if not self.kernels.has_bf16_gemv() or self.kernels.bf16_gemm_packs():
            return None
        return Gemv(self.kernels.bf16_gemv, self.kernels.bf16_gemv_max_rows)

    @property
    def packing(self) -> Packing:
        # One C++ predicate (bf16_gemm_packs: the GEMM built, AVX512-BF16 or AVX2 and FMA,
        # and no AMX) decides this and whether there is a small-batch GEMV, so the two agree.
        if not self.kernels.bf16_gemm_packs():
            return ONEDNN
        # Where there is no GEMV there is no AVX512-BF16: the GEMM's AVX2 tiles, float32 FMAs.
        isa = "AVX512-BF16" if self.kernels.has_bf16_gemv() else "AVX2, float32 FMAs"
        return Packing(
            f"bf16 GEMM ({isa})",
            BF16_GEMM_CODE,
            self.kernels.bf16_gemm_pack,
            self.kernels.bf16_gemm,
        )


def pick_ops(backend: AttentionBackend, device: torch.device) -> Ops:
    """Native kernels when ``backend`` asks for them on CPU and they build (``auto``
    falls back to PyTorch ops with a warning; ``native`` fails loudly instead)."""
    if backend == "torch" or device.type != "cpu":
        logger.info("PyTorch ops only (no native kernels) on %s", device)
        return TorchOps()
    kernels = load_native_kernels() if backend == "native" else try_load_native_kernels()
    if kernels is None:
        return TorchOps()
    ops = NativeOps(kernels)
    prefill = ", bf16 prefill attention" if ops.native_prefill else ""
    logger.info(
        "native CPU kernels: decode attention%s, KV writes, RoPE, RMSNorm, SwiGLU, GeGLU", prefill
    )
    return ops
