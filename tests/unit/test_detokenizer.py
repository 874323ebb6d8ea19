from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer

from api_server.detokenizer import IncrementalDetokenizer, StopStringMatcher


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))


def test_multibyte_characters_are_never_split(tokenizer: Tokenizer) -> None:
    text = " Paris 😀 café 日本語 ok"
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push([i]) for i in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces  # some tokens ended inside a character and were held back


def test_special_tokens_are_skipped(tokenizer: Tokenizer) -> None:
    im_end = tokenizer.token_to_id("<|im_end|>")
    assert im_end is not None
    ids = [*tokenizer.encode(" done", add_special_tokens=False).ids, im_end]
    assert IncrementalDetokenizer(tokenizer).push(ids) == " done"


def test_stop_string_across_pieces_is_cut() -> None:
    m = StopStringMatcher(["STOP", "\n\n"])
    assert m.push("hello S") == "hello "
    assert m.push("T") == ""
    assert m.push("OP and more") == ""
    assert m.hit and m.push("later") == "" and m.flush() == ""


def test_false_start_is_released() -> None:
    m = StopStringMatcher(["STOP"])
    assert m.push("a ST") == "a "
    assert m.push("ART") == "START"
    assert m.push(" S") == " "
    assert m.flush() == "S"
    assert not m.hit


def test_no_stops_passes_through() -> None:
    m = StopStringMatcher([])
    assert m.push("abc") == "abc" and m.flush() == ""
