"""The API server's tokenizer without torch gives what ``transformers`` gives with it:
the same class, tokens, chat template text and decoded text, each loaded in a fresh
process (torch is imported once per process, so only a fresh one shows what loads)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

PROBE = """
import json, sys
from pathlib import Path
if sys.argv[1] == "loader":
    from api_server.tokenizer_loader import load_tokenizer
    tok = load_tokenizer(Path(sys.argv[2]))
else:
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(sys.argv[2])
messages = [
    {"role": "system", "content": "Answer in one word."},
    {"role": "user", "content": "Which colour is the sky? ünïcödé 😀"},
]
print(json.dumps({
    "torch": sys.modules.get("torch") is not None,
    "class": type(tok).__name__,
    "chat": tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
    "chat_ids": list(tok.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]),
    "plain": tok.encode("Hello world 😀  spaced", add_special_tokens=False),
    "special": tok.encode("Hello", add_special_tokens=True),
    "decoded": tok.decode(list(range(0, 400, 7))),
    "skipped": tok.decode([1, 2, 3, 500, 9000], skip_special_tokens=True),
    "eos": tok.eos_token_id,
}))
"""


def probe(mode: str, model_dir: Path) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode, str(model_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert "PyTorch was not found" not in out.stderr  # transformers' advisory is kept quiet
    result: dict[str, object] = json.loads(out.stdout)
    return result


def test_the_tokenizer_without_torch_equals_the_one_with_it(smollm2_dir: Path) -> None:
    ours, theirs = probe("loader", smollm2_dir), probe("transformers", smollm2_dir)
    assert ours.pop("torch") is False
    assert theirs.pop("torch") is True
    assert ours == theirs
