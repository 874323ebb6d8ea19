"""Print a readable table from any results JSON in ``bench/results/``.

    python -m bench.render bench/results/serving-chat-2026-12-01-zen5.json [MORE.json ...]

Generic, for every benchmark's shape. A list of records (a serving run's ``points``, an
offline run's ``runs``, a profile's ``rows``) or a dict of records (``results`` keyed by
setup) prints as a table, one row per record, nested dicts flattened into dotted columns
(``summary.itl_s.p50``, shown by their shortest unambiguous tail); a column with the same
value in every row is printed once below the table instead; where every record holds one
list of few or small records (an offline run's ``points``), each inner record is a row; a
list of numbers prints whole up to three in a cell (ten on a line), as its count, median and
max beyond. A table wider than 120 characters prints turned (a row per field) when it has few
rows, in slices of columns otherwise. Everything else prints as ``key: value`` lines. Values
are as the JSON holds them (seconds in ``*_s``, bytes in ``*_bytes``). A file that cannot be
read prints why, and the other files still print (exit status 1).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import statistics
import sys
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path

from bench.harness import print_table

WIDTH = 120  # a table wider than this is turned or sliced
TURN_MAX_ROWS = 8  # a wide table of at most this many rows prints a row per field
SHORT_LIST = 3  # lists of numbers up to this long print whole in a cell
SHORT_LINE_LIST = 10  # ... and on a key: value line
CELL_CHARS = 60  # longer strings are cut in a cell
ID_COLUMNS = 3  # leading naming columns repeated in every slice of a wide table
MEASURED = ("_s", "_ms", "_bytes", "_mib", "tokens", "requests")  # integers that are figures

Record = dict[str, object]


def fmt_number(value: float) -> str:
    """A float as a reader wants it: whole numbers without ``.0``, five significant
    digits below 1,000, one decimal above."""
    if math.isnan(value) or math.isinf(value):
        return str(value)
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    if abs(value) >= 1000:
        return f"{value:.1f}"
    return f"{value:.5g}"


def is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def fmt_scalar(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return fmt_number(value)
    return str(value)


def fmt_list(values: Sequence[object], short: int) -> str:
    """Up to ``short`` numbers whole; more as count, median and max; strings joined;
    lists of equal-length number lists as their count and per-position medians."""
    if not values:
        return "[]"
    if all(is_number(v) for v in values):
        nums = [float(v) for v in values if isinstance(v, int | float)]
        if len(nums) <= short:
            return ", ".join(fmt_number(v) for v in nums)
        median, top = fmt_number(statistics.median(nums)), fmt_number(max(nums))
        return f"n={len(nums)}, median {median}, max {top}"
    if all(isinstance(v, str) for v in values):
        return ", ".join(str(v) for v in values)
    inner = [v for v in values if isinstance(v, list)]
    if len(inner) == len(values) and all(
        inner_list and len(inner_list) == len(inner[0]) and all(is_number(x) for x in inner_list)
        for inner_list in inner
    ):
        medians = [statistics.median(float(x[i]) for x in inner) for i in range(len(inner[0]))]
        return f"n={len(inner)} x {len(inner[0])}, medians " + ", ".join(
            fmt_number(m) for m in medians
        )
    return f"{len(values)} items"


def fmt_cell(value: object) -> str:
    if isinstance(value, list):
        text = fmt_list(value, SHORT_LIST)
    elif isinstance(value, dict):
        text = "{}" if not value else f"{len(value)} keys"
    else:
        text = fmt_scalar(value)
    text = text.replace("\n", " ")
    return text if len(text) <= CELL_CHARS else text[: CELL_CHARS - 1] + "…"


def flatten(record: Mapping[str, object], prefix: str = "") -> Record:
    """Nested dicts into dotted keys; empty dicts and every other value stay as they are."""
    out: Record = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def is_small_record(value: object) -> bool:
    """A dict of scalars, short lists and such dicts: a summary, not raw samples."""
    if not isinstance(value, dict):
        return False
    for inner in value.values():
        if isinstance(inner, dict) and not is_small_record(inner):
            return False
        if isinstance(inner, list) and (
            len(inner) > SHORT_LIST or any(isinstance(x, dict | list) for x in inner)
        ):
            return False
    return True


def spread(records: Sequence[Mapping[str, object]]) -> list[Mapping[str, object]]:
    """Where every record holds one list of records under the same key (an offline run's
    ``points``), few or small ones, and no summary dict of its own, a row per inner record,
    the outer fields repeated."""

    def nested_key(record: Mapping[str, object]) -> str | None:
        keys = [
            k
            for k, v in record.items()
            if isinstance(v, list) and v and all(isinstance(x, dict) for x in v)
        ]
        return keys[0] if len(keys) == 1 else None

    keys = {nested_key(r) for r in records}
    if len(keys) != 1:
        return list(records)
    key = keys.pop()
    if key is None:
        return list(records)
    if any(isinstance(v, dict) and v for r in records for v in r.values()):
        return list(records)  # a record with its own summary keeps its raw list as a count
    inner_lists = [r[key] for r in records]
    small = all(isinstance(items, list) and len(items) <= TURN_MAX_ROWS for items in inner_lists)
    if not small and not all(
        isinstance(items, list) and all(is_small_record(x) for x in items) for items in inner_lists
    ):
        return list(records)
    rows: list[Mapping[str, object]] = []
    for record in records:
        outer = {k: v for k, v in record.items() if k != key}
        items = record[key]
        assert isinstance(items, list)
        for item in items:
            assert isinstance(item, dict)
            rows.append({**outer, **{f"{key}.{k}": v for k, v in item.items()}})
    return rows


def short_names(columns: Sequence[str]) -> dict[str, str]:
    """Each dotted column by its shortest tail that no other column ends with, two parts
    at least where it has three or more: ``summary.itl_s.p50`` prints as ``itl_s.p50``,
    ``summary.slo.ttft_s`` as ``slo.ttft_s``."""
    parts = {c: c.split(".") for c in columns}
    names: dict[str, str] = {}
    for column in columns:
        segments = parts[column]
        for k in range(2 if len(segments) >= 3 else 1, len(segments) + 1):
            tail = segments[-k:]
            if not any(other != column and parts[other][-k:] == tail for other in columns):
                names[column] = ".".join(tail)
                break
        else:
            names[column] = column
    return names


def table_lines(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        print_table(headers, rows)
    return [line.rstrip() for line in buffer.getvalue().splitlines()]


def width_of(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> int:
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    return sum(widths) + 2 * (len(widths) - 1)


def is_id_column(column: str, values: Sequence[object]) -> bool:
    """Names a row rather than measures it: strings, or integers not named as a quantity
    (a concurrency, a batch, a repetition; not ``peak_rss_bytes`` or ``output_tokens``)."""
    if all(isinstance(v, str) or v is None for v in values):
        return True
    return all(isinstance(v, int) for v in values) and not column.endswith(MEASURED)


def render_table(name: str, records: Sequence[Mapping[str, object]]) -> list[str]:
    rows_flat = [flatten(r) for r in spread(records)]
    if len(rows_flat) > 1 and not any(
        is_id_column(c, [r.get(c) for r in rows_flat]) for c in list(rows_flat[0])[:1]
    ):
        rows_flat = [{"#": i + 1, **row} for i, row in enumerate(rows_flat)]  # rounds, runs
    columns: list[str] = []
    for row in rows_flat:
        columns.extend(k for k in row if k not in columns)
    cells = {c: [fmt_cell(row.get(c)) for row in rows_flat] for c in columns}
    same: list[str] = []
    if len(rows_flat) > 1:
        same = [c for c in columns if len(set(cells[c])) == 1]
        columns = [c for c in columns if c not in same] or columns[:1]
        same = [c for c in same if c not in columns]
    names = short_names(columns + same)
    lines = [f"{name} ({len(rows_flat)}):"]
    ids: list[str] = []
    for column in columns[:ID_COLUMNS]:
        if not is_id_column(column, [row.get(column) for row in rows_flat]):
            break
        ids.append(column)
    headers = [names[c] for c in columns]
    body = [[cells[c][i] for c in columns] for i in range(len(rows_flat))]
    labels = [
        " ".join(cells[c][i] for c in ids) if ids else str(i + 1) for i in range(len(rows_flat))
    ]
    turned = [[names[c], *cells[c]] for c in columns if c not in ids]
    if width_of(headers, body) <= WIDTH:
        lines += table_lines(headers, body)
    elif len(rows_flat) <= TURN_MAX_ROWS and width_of(["field", *labels], turned) <= WIDTH:
        lines += table_lines(["field", *labels], turned)
    else:
        rest = [c for c in columns if c not in ids]
        while rest:
            chunk = [rest.pop(0)]
            while rest:
                trial = [*ids, *chunk, rest[0]]
                trial_body = [[cells[c][i] for c in trial] for i in range(len(rows_flat))]
                if width_of([names[c] for c in trial], trial_body) > WIDTH:
                    break
                chunk.append(rest.pop(0))
            part = [*ids, *chunk]
            lines += table_lines(
                [names[c] for c in part],
                [[cells[c][i] for c in part] for i in range(len(rows_flat))],
            )
            if rest:
                lines.append("")
    if same:
        text = "same in every row: " + ", ".join(f"{names[c]}={cells[c][0]}" for c in same)
        lines += textwrap.wrap(text, WIDTH, subsequent_indent="  ", break_on_hyphens=False)
    return lines


def is_scalar_or_short(value: object) -> bool:
    if isinstance(value, list):
        return len(value) <= SHORT_LIST and not any(isinstance(x, dict | list) for x in value)
    return not isinstance(value, dict)


def render_value(name: str, value: object) -> list[str]:
    """The lines for one key of a results file (or of a dict inside one)."""
    if isinstance(value, list) and value and all(isinstance(x, dict) for x in value):
        return ["", *render_table(name, value), ""]
    if isinstance(value, dict):
        if not value:
            return [f"{name}: {{}}"]
        inner = list(value.values())
        if all(isinstance(v, dict) and v for v in inner):
            records = [{name.rsplit(".", 1)[-1]: key, **v} for key, v in value.items()]
            return ["", *render_table(name, records), ""]
        if all(is_scalar_or_short(v) for v in inner):
            line = f"{name}: " + ", ".join(
                f"{k}=[{fmt_cell(v)}]" if isinstance(v, list) else f"{k}={fmt_cell(v)}"
                for k, v in value.items()
            )
            if len(line) <= WIDTH:
                return [line]
        lines: list[str] = []
        for key, v in value.items():
            lines += render_value(f"{name}.{key}", v)
        return lines
    if isinstance(value, list):
        if value and all(isinstance(x, str) for x in value) and sum(map(len, value)) > WIDTH:
            return [f"{name}:"] + [
                line
                for x in value
                for line in textwrap.wrap(
                    x,
                    WIDTH,
                    initial_indent="  - ",
                    subsequent_indent="    ",
                    break_on_hyphens=False,
                )
            ]
        return [f"{name}: {fmt_list(value, SHORT_LINE_LIST)}"]
    return [f"{name}: {fmt_scalar(value)}"]


def render(doc: object) -> list[str]:
    """Every line for one parsed results file, blank lines between blocks, none doubled."""
    raw = render_value("value", doc) if not isinstance(doc, dict) else []
    if isinstance(doc, dict):
        if not doc:
            raw = ["(an empty object)"]
        for key, value in doc.items():
            raw += render_value(str(key), value)
    lines: list[str] = []
    for line in raw:
        if line == "" and (not lines or lines[-1] == ""):
            continue
        lines.append(line)
    while lines and lines[-1] == "":
        lines.pop()
    return lines


def render_file(path: Path) -> list[str]:
    """The file's name, then its lines. Raises if it is not JSON."""
    return [f"== {path} ==", *render(json.loads(path.read_text()))]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.render", description="Print a results JSON as tables."
    )
    parser.add_argument("paths", nargs="+", type=Path, help="JSON files in bench/results/")
    args = parser.parse_args(argv)
    status = 0
    for i, path in enumerate(args.paths):
        if i:
            print()
        try:
            lines = render_file(path)
        except Exception as exc:  # one bad file must not stop the others
            print(f"== {path} ==\ncannot render: {type(exc).__name__}: {exc}")
            status = 1
            continue
        print("\n".join(lines))
    return status


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # the reader (``head``) stopped reading: not an error
        sys.stderr.close()
        sys.exit(0)
