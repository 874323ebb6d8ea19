"""docs/architecture.md's module map names every module of the four packages, and only
those: a file added or removed without the map changing fails here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("api_server", "engine_core", "worker", "common")


def test_the_module_map_names_every_module_and_nothing_else() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text[text.index("## Module map") :]
    section = section[: section.find("\n## ", 3)] if "\n## " in section[3:] else section
    mapped = set(re.findall(r"^- `([\w/]+\.py)`: \S", section, flags=re.M))
    on_disk = {
        str(path.relative_to(ROOT))
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
        if "csrc" not in path.parts
    }
    assert mapped == on_disk, {
        "not in the map": sorted(on_disk - mapped),
        "gone from disk": sorted(mapped - on_disk),
    }
