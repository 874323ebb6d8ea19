"""A tiny random Qwen2 written as a GGUF file the way llama.cpp's converter writes one
(Qwen2.5's GGUFs: q/k/v biases in float32, projections in 4-bit blocks, a Q8_0 token
embedding the tied LM head reads), with SmolLM2's GGUF tokenizer (a real byte-level BPE,
so transformers converts the file as it converts a downloaded one)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

from common.model_files import EMBEDDED_MODELS, find_embedded_gguf

VOCAB = 49152  # SmolLM2's tokenizer
HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS = 64, 128, 2, 4, 2
CONTEXT = 256
ROPE_THETA, RMS_EPS = 1_000_000.0, 1e-6
# Copied from SmolLM2's GGUF: everything transformers reads to rebuild the tokenizer.
TOKENIZER_FIELDS = (
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.unknown_token_id",
    "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.add_bos_token",
    "tokenizer.chat_template",
)


def _copy_tokenizer(writer: gguf.GGUFWriter) -> None:
    source = gguf.GGUFReader(str(find_embedded_gguf(EMBEDDED_MODELS["smollm2-135m-instruct"])))
    for key in TOKENIZER_FIELDS:
        field = source.fields[key]
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), value_type, sub_type)


def write_tiny_qwen2_gguf(path: Path, projection_type: Q = Q.Q4_0) -> Path:
    """Write the model to ``path``; weights drawn with a fixed seed, scaled so that greedy
    choices are clear (no near-ties for parity to trip on)."""
    gen = torch.Generator().manual_seed(0)

    def normal(*shape: int, std: float) -> np.ndarray:
        return (torch.randn(*shape, generator=gen) * std).numpy().astype(np.float32)

    head_dim = HIDDEN // HEADS
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_block_count(LAYERS)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(ROPE_THETA)
    writer.add_layer_norm_rms_eps(RMS_EPS)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    _copy_tokenizer(writer)

    def blocks(name: str, weight: np.ndarray, qtype: Q) -> None:
        writer.add_tensor(name, quantize(weight, qtype), raw_dtype=qtype)

    blocks("token_embd.weight", normal(VOCAB, HIDDEN, std=0.2), Q.Q8_0)
    writer.add_tensor("output_norm.weight", 1.0 + normal(HIDDEN, std=0.1))
    shapes = {
        "attn_q": (HEADS * head_dim, HIDDEN),
        "attn_k": (KV_HEADS * head_dim, HIDDEN),
        "attn_v": (KV_HEADS * head_dim, HIDDEN),
        "attn_output": (HIDDEN, HEADS * head_dim),
        "ffn_gate": (INTERMEDIATE, HIDDEN),
        "ffn_up": (INTERMEDIATE, HIDDEN),
        "ffn_down": (HIDDEN, INTERMEDIATE),
    }
    for layer in range(LAYERS):
        prefix = f"blk.{layer}"
        writer.add_tensor(f"{prefix}.attn_norm.weight", 1.0 + normal(HIDDEN, std=0.1))
        writer.add_tensor(f"{prefix}.ffn_norm.weight", 1.0 + normal(HIDDEN, std=0.1))
        for name, (out, width) in shapes.items():
            blocks(
                f"{prefix}.{name}.weight", normal(out, width, std=2 * width**-0.5), projection_type
            )
            if name in ("attn_q", "attn_k", "attn_v"):
                writer.add_tensor(f"{prefix}.{name}.bias", normal(out, std=0.5))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
