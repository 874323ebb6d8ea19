"""The metric names the Grafana dashboard (deploy/grafana/tandem.json) queries."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

DASHBOARD = Path(__file__).parents[1] / "deploy" / "grafana" / "tandem.json"
_NAME = re.compile(r"\b(?:tandem:[a-z_]+|http_requests_total)\b")


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def metric_names(panels: list[dict[str, Any]] | None = None) -> set[str]:
    """Names in the given panels' queries (default: every panel and the model variable)."""
    board = dashboard()
    chosen = board["panels"] if panels is None else panels
    exprs = [t["expr"] for panel in chosen for t in panel.get("targets", [])]
    if panels is None:
        exprs += [v["query"] for v in board["templating"]["list"] if v["type"] == "query"]
    return {name for e in exprs for name in _NAME.findall(e)}


def split_row_panels() -> list[dict[str, Any]]:
    """The panels below the row about split pools (only a split service feeds them)."""
    panels = dashboard()["panels"]
    row = next(i for i, p in enumerate(panels) if p["type"] == "row" and "pool" in p["title"])
    return list(panels[row + 1 :])


def exported_names(exposition: str) -> set[str]:
    """Sample names in a /metrics page."""
    return {
        re.split(r"[{ ]", line, maxsplit=1)[0]
        for line in exposition.splitlines()
        if line and not line.startswith("#")
    }
