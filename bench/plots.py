"""PNG plots of a serving run: throughput against concurrency, and latency CDFs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display here
import matplotlib.pyplot as plt


def throughput_plot(points: list[dict[str, Any]], path: Path, title: str) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for system in dict.fromkeys(p["system"] for p in points):
        mine = sorted((p for p in points if p["system"] == system), key=lambda p: p["concurrency"])
        ax.plot(
            [p["concurrency"] for p in mine],
            [p["summary"]["output_tok_s"] for p in mine],
            marker="o",
            label=system,
        )
    ax.set_xscale("log", base=2)
    return _save(fig, ax, path, "concurrent clients", "output tokens / s", title)


def cdf_plot(series: dict[str, list[float]], path: Path, xlabel: str, title: str) -> Path:
    """One empirical CDF per system."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, values in series.items():
        if not values:
            continue
        ordered = sorted(values)
        n = len(ordered)
        ax.step(ordered, [(i + 1) / n for i in range(n)], where="post", label=name)
    ax.set_xscale("log")
    return _save(fig, ax, path, xlabel, "fraction of samples", title)


def _save(fig: Any, ax: Any, path: Path, xlabel: str, ylabel: str, title: str) -> Path:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
