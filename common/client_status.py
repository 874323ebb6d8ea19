"""``tandem status``: one screen of a running server, from the routes it already has:
``/health`` and ``/readyz`` (open to all), ``/v1/models`` and ``/stats`` (behind the API
key, when keys are on). A model router's ``/stats`` holds each model's own; split pools
add a line per pool. Exit 0 when ``/health`` is 200, else 1, so scripts can wait on it."""

from __future__ import annotations

import sys
from typing import Any, TextIO

import httpx

from common.client_http import ClientError, TandemClient

_LABEL_WIDTH = 14


def show_status(client: TandemClient, out: TextIO = sys.stdout) -> int:
    health = client.get("/health")  # ClientError here: the server cannot be reached
    lines = [f"Tandem at {client.url}"]
    lines.append(_row("health", _describe(health)))
    lines.append(_row("readiness", _describe(client.get("/readyz"))))
    try:
        lines.append(_row("models", _models(client.get_json("/v1/models"))))
        lines += _stats_rows(client.get_json("/stats"))
    except ClientError as e:  # e.g. 401: the routes behind the key
        lines.append(_row("models, stats", f"not shown: {e}"))
    out.write("\n".join(lines) + "\n")
    return 0 if health.status_code == 200 else 1


def _row(label: str, text: str, indent: str = "") -> str:
    return f"{indent}{label:<{_LABEL_WIDTH}}{text}"


def _describe(reply: httpx.Response) -> str:
    """``/health``'s or ``/readyz``'s body in a few words: status, role, reason."""
    try:
        body = reply.json()
    except ValueError:
        return f"{reply.status_code} {reply.text.strip()[:80]}"
    notes = [str(body["role"])] if body.get("role") else []
    if "model_loaded" in body:
        notes.append("model loaded" if body["model_loaded"] else "model not loaded")
    text = str(body.get("status", reply.status_code))
    text += f" ({', '.join(notes)})" if notes else ""
    return text + (f": {body['reason']}" if body.get("reason") else "")


def _models(listing: dict[str, Any]) -> str:
    cards = []
    for card in listing.get("data") or []:
        notes = []
        if card.get("status"):  # a model router's: loaded, loading, unloaded
            notes.append(str(card["status"]))
        if card.get("max_model_len"):
            notes.append(f"context {card['max_model_len']}")
        if card.get("parent"):  # a LoRA adapter
            notes.append(f"adapter of {card['parent']}")
        cards.append(f"{card['id']}" + (f" ({', '.join(notes)})" if notes else ""))
    return ", ".join(cards) or "none"


def _stats_rows(stats: dict[str, Any]) -> list[str]:
    if "models" in stats:  # a model router: each loaded model's own figures
        rows = []
        for name, entry in stats["models"].items():
            rows.append(f"{name}: {entry.get('status')}, {entry.get('in_flight', 0)} in flight")
            if "stats" in entry:
                rows += _service_rows(entry["stats"], indent="  ")
        return rows
    return _service_rows(stats)


def _service_rows(s: dict[str, Any], indent: str = "") -> list[str]:
    rows = [
        _row(
            "requests",
            f"{s['active_requests']} running, {s['waiting_requests']} waiting, "
            f"{s['total_requests']} served, {s['tokens_generated']} tokens generated",
            indent,
        ),
        _row("KV cache", _kv(s), indent),
        _row(
            "prefix cache",
            f"{s['prefix_cache_hit_rate']:.1%} hit rate "
            f"({s['prefix_cache_hits']} of {s['prefix_cache_queries']} tokens)",
            indent,
        ),
    ]
    for name, pool in (s.get("pools") or {}).items():
        rows.append(
            _row(
                f"pool {name}",
                f"{pool['active_requests']} running, {pool['waiting_requests']} waiting, "
                f"KV {_kv(pool)}",
                indent,
            )
        )
    if s.get("kv_transfers"):
        transfers = s["kv_transfers"]
        outcomes = ", ".join(f"{k} {v}" for k, v in (transfers.get("outcomes") or {}).items())
        rows.append(
            _row("KV hand-off", f"{outcomes or 'none'}; {transfers.get('bytes', 0)} bytes", indent)
        )
    return rows


def _kv(s: dict[str, Any]) -> str:
    return (
        f"{s['num_kv_blocks_in_use']} / {s['num_kv_blocks_total']} blocks in use "
        f"({s['cache_usage']:.1%})"
    )
