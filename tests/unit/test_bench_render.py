"""bench.render: every results file in bench/results/ prints as something readable, and a
small file prints exactly as documented (tables, dotted columns, constant columns, lists)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.harness import RESULTS
from bench.render import main, render_file

RESULT_FILES = sorted(RESULTS.glob("*.json"))


def test_there_are_results_to_render() -> None:
    assert RESULT_FILES, f"no JSON in {RESULTS}"


@pytest.mark.parametrize("path", RESULT_FILES, ids=lambda p: p.name)
def test_every_results_file_renders(path: Path) -> None:
    lines = render_file(path)
    assert lines[0] == f"== {path} =="
    assert any(line.strip() for line in lines[1:]), f"{path.name} rendered nothing"


def test_a_small_file_renders_exactly(tmp_path: Path) -> None:
    path = tmp_path / "tiny.json"
    path.write_text(
        json.dumps(
            {
                "machine": {"cpu": "X", "cores": 2},
                "points": [
                    {
                        "system": "a",
                        "concurrency": 1,
                        "summary": {"tok_s": 1.5, "itl_s": {"p50": 0.01}},
                        "errors": 0,
                    },
                    {
                        "system": "b",
                        "concurrency": 8,
                        "summary": {"tok_s": 1234.56, "itl_s": {"p50": 0.02}},
                        "errors": 0,
                    },
                ],
                "gaps_s": [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1],
            }
        )
    )
    assert render_file(path) == [
        f"== {path} ==",
        "machine: cpu=X, cores=2",
        "",
        "points (2):",
        "system  concurrency   tok_s  itl_s.p50",
        "------  -----------  ------  ---------",
        "a                 1     1.5       0.01",
        "b                 8  1234.6       0.02",
        "same in every row: errors=0",
        "",
        "gaps_s: n=11, median 0.6, max 1.1",
    ]


def test_a_bad_file_is_reported_and_the_rest_still_print(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"x": [')
    good = tmp_path / "good.json"
    good.write_text('{"tokens": 7}')
    assert main([str(bad), str(good)]) == 1
    out = capsys.readouterr().out
    assert "cannot render: JSONDecodeError" in out
    assert out.rstrip().endswith("tokens: 7")
