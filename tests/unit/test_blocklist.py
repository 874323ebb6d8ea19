"""The ``--guard-blocklist`` file and its matching: words, patterns, case, word
boundaries, outputs scanned as they grow (a word split over chunks never leaks), and the
files refused at startup."""

from __future__ import annotations

from pathlib import Path

import pytest

from api_server.blocklist import (
    LOOKBACK_CHARS,
    Blocklist,
    BlocklistError,
    content_guard,
    parse_blocklist,
)
from api_server.content_guard import NoContentGuard
from common.cli_args import parse_config

FILE = """\
# words are whole words, any case
cat
bad   thing

  re:\\d{3}-\\d{4}
re:(?i)secret sauce
c++
"""


@pytest.fixture
def blocklist() -> Blocklist:
    return Blocklist(parse_blocklist(FILE))


def scanned(blocklist: Blocklist, chunks: list[str]) -> tuple[str, str | None]:
    """What a scan lets through of these chunks (then the end), and the rule it hit."""
    scan = blocklist.scan()
    out = "".join(scan.push(c) for c in chunks) + scan.finish()
    return out, scan.hit.rule if scan.hit else None


def test_comments_and_blank_lines_are_skipped_and_lines_are_numbered() -> None:
    entries = parse_blocklist(FILE)
    assert [e.line for e in entries] == [2, 3, 5, 6, 7]
    assert [e.word for e in entries] == ["cat", "bad thing", None, None, "c++"]


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("The Cat sat.", 2),
        ("CAT", 2),
        ("a cat's toy", 2),
        ("(cat)", 2),
        ("category", None),
        ("concat", None),
        ("cat_food", None),
        ("cats", None),
        ("a BAD \n\t thing", 3),
        ("bad things", None),
        ("call 555-1234 now", 5),
        ("call 5551234", None),
        ("the Secret Sauce", 6),
        ("I write C++ daily", 7),
        ("c++x", None),
        ("nothing here", None),
    ],
)
def test_words_match_whole_in_any_case_and_patterns_as_written(
    blocklist: Blocklist, text: str, line: int | None
) -> None:
    hit = blocklist.check(text)
    assert (hit.rule if hit else None) == (f"--guard-blocklist line {line}" if line else None)


def test_a_pattern_is_case_sensitive_unless_it_says_so() -> None:
    patterns = Blocklist(parse_blocklist("re:Forbidden\n"))
    assert patterns.check("Forbidden") is not None
    assert patterns.check("forbidden") is None


def test_the_hit_is_the_leftmost_match(blocklist: Blocklist) -> None:
    hit = blocklist.check("dial 555-1234 for the cat")
    assert hit is not None and hit.start == 5 and hit.rule.endswith("line 5")


def test_a_word_split_over_chunks_is_held_back_and_cut_before() -> None:
    words = Blocklist(parse_blocklist("paris\n"))
    scan = words.scan()
    assert scan.push("The capital is P") == "The capital is "  # "P" may begin the word
    assert scan.push("ar") == ""
    assert scan.push("is") == ""  # "Paris" -- or "Parisian": the next text decides
    assert scan.hit is None
    assert scan.push(".") == ""
    assert scan.hit is not None and scan.hit.rule == "--guard-blocklist line 1"
    assert scan.push(" more") == "" and scan.finish() == ""


def test_held_text_that_is_no_word_after_all_is_let_through() -> None:
    words = Blocklist(parse_blocklist("paris\n"))
    scan = words.scan()
    assert scan.push("Par") == ""
    assert scan.push("isian food") == "Parisian food"
    assert scan.finish("!") == "!"
    assert scan.hit is None


def test_the_end_of_the_output_ends_a_word(blocklist: Blocklist) -> None:
    assert scanned(blocklist, ["the ", "c", "at"]) == ("the ", "--guard-blocklist line 2")
    assert scanned(blocklist, ["the ", "c", "a"]) == ("the ca", None)


def test_every_split_of_a_text_cuts_right_before_the_word(blocklist: Blocklist) -> None:
    text = "Our bad idea: a bad \nthing for the category, said the cat."
    cut = text.index("bad \nthing")
    for size in (1, 2, 3, 5, 8):
        chunks = [text[i : i + size] for i in range(0, len(text), size)]
        assert scanned(blocklist, chunks) == (text[:cut], "--guard-blocklist line 3"), size
    clean = "Our bad idea: the category, said the catalogue."
    for size in (1, 2, 3, 5, 8):
        chunks = [clean[i : i + size] for i in range(0, len(clean), size)]
        assert scanned(blocklist, chunks) == (clean, None), size


def test_a_phrase_is_held_back_across_a_long_run_of_whitespace() -> None:
    phrase = Blocklist(parse_blocklist("bad thing\n"))
    scan = phrase.scan()
    assert scan.push("a bad") == "a "
    assert all(scan.push(" ") == "" for _ in range(100))  # still "bad thing"'s start
    assert scan.push("thing") == "" and scan.push(".") == ""
    assert scan.hit is not None and scan.hit.start == 2
    far = phrase.scan()  # a run past the look-back is no longer held: "bad" goes out
    assert "".join(far.push(c) for c in ["a bad", " " * LOOKBACK_CHARS, "thing", "."]) == (
        "a bad" + " " * LOOKBACK_CHARS + "thing."
    )


def test_a_pattern_across_chunks_is_caught_but_what_was_sent_stays_sent(
    blocklist: Blocklist,
) -> None:
    scan = blocklist.scan()
    assert scan.push("call 555-") == "call 555-"  # patterns are not held back
    assert scan.push("1234 now") == ""
    assert scan.hit is not None and scan.hit.rule.endswith("line 5")


def test_a_pattern_is_seen_only_within_the_lookback() -> None:
    spans = Blocklist(parse_blocklist(r"re:begin.*end" + "\n"))
    near = spans.scan()
    near.push("begin" + "x" * 100)
    near.push(" end")
    assert near.hit is not None
    far = spans.scan()
    far.push("begin" + "x" * LOOKBACK_CHARS)
    assert far.push(" end") == " end" and far.hit is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("ok\nre:[unclosed\n", "line 2: 're:[unclosed' is not a valid regular expression"),
        ("\n\nre:\n", "line 3: 're:' without a pattern"),
        ("re:x*\n", "line 1: 're:x*' matches empty text"),
        ("word\nre:\\b\n", "line 2: 're:\\\\b' matches empty text"),
    ],
)
def test_bad_entries_are_refused_naming_the_line(text: str, message: str) -> None:
    with pytest.raises(BlocklistError) as e:
        parse_blocklist(text, "--guard-blocklist words.txt")
    assert str(e.value).startswith(f"--guard-blocklist words.txt {message}"), str(e.value)


def test_a_file_that_cannot_be_read_is_refused(tmp_path: Path) -> None:
    with pytest.raises(BlocklistError, match=r"missing\.txt: cannot read it"):
        content_guard(str(tmp_path / "missing.txt"))
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\xe9\n".encode("latin-1"))
    with pytest.raises(BlocklistError, match=r"latin1\.txt: cannot read it"):
        content_guard(str(latin1))
    with pytest.raises(BlocklistError, match="cannot read it"):
        content_guard(str(tmp_path))  # a directory


def test_the_flag_chooses_the_guard_once(tmp_path: Path) -> None:
    path = tmp_path / "words.txt"
    path.write_text("cat\n")
    config = parse_config(["--guard-blocklist", str(path)])
    assert config.server.guard_blocklist == str(path)
    assert parse_config(config.to_cli_args()) == config  # children get the same flag
    guard = content_guard(config.server.guard_blocklist)
    assert isinstance(guard, Blocklist) and guard.check("a cat") is not None
    assert guard.checks_prompts
    none = content_guard(parse_config([]).server.guard_blocklist)
    assert isinstance(none, NoContentGuard)
    assert none.check("a cat") is None and not none.checks_prompts
    scan = none.scan()
    assert scan.push("a c") == "a c" and scan.finish("at") == "at" and scan.hit is None
