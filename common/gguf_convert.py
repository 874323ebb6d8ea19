"""GGUF -> safetensors + config + tokenizer, exactly as ``transformers`` loads the GGUF.

``transformers`` dequantizes the GGUF (with the ``gguf`` package, shown with a progress
bar); what it holds in memory is what we save, so our weights equal the reference's.
"""

from __future__ import annotations

from pathlib import Path


def convert_gguf(gguf_path: Path, out_dir: Path, architecture: str) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, filename = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=filename)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=filename, dtype=torch.float32)
    config = model.config
    # The GGUF-derived config names no architecture and still describes the GGUF.
    config.architectures = [architecture]
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # save_pretrained refuses GGUF-quantized models, so write the dequantized tensors.
    state = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # the same tensor as the embeddings
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out_dir)
    model.generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)  # includes the chat template from GGUF metadata
