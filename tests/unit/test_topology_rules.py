"""The pool topology is decided once, as objects: no pool role travels as a string past
parsing, no attribute is looked up by a built name, and the step loops never ask whether
a hand-off or a KV transport exists (``engine_core/topology.py``, ``worker/kv_transport.py``)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("api_server", "engine_core", "worker", "common")
ROLE_NAMES = {"unified", "prefill", "decode"}
# Where names become roles: the flags, the role enum's own spelling, the wire default.
PARSING = {"common/cli_args.py", "common/messages.py", "common/pool_config.py"}


def sources() -> list[tuple[str, ast.AST]]:
    found: list[tuple[str, ast.AST]] = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            found.append((str(path.relative_to(ROOT)), ast.parse(path.read_text())))
    return found


def test_no_pool_role_string_past_parsing() -> None:
    literals = [
        (where, node.lineno)
        for where, tree in sources()
        if where not in PARSING
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and node.value in ROLE_NAMES
    ]
    assert literals == []


def test_no_getattr_with_a_built_name() -> None:
    built = [
        (where, node.lineno)
        for where, tree in sources()
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("getattr", "setattr")
        and len(node.args) > 1
        and isinstance(node.args[1], ast.JoinedStr)
    ]
    assert built == []


def test_step_loops_never_ask_whether_a_handoff_or_transport_exists() -> None:
    asked = []
    for where in ("engine_core/core.py", "worker/model_runner.py"):
        for node in ast.walk(ast.parse((ROOT / where).read_text())):
            if not isinstance(node, ast.Compare) or not isinstance(node.left, ast.Attribute):
                continue
            none_test = any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops)
            name = node.left.attr
            if none_test and any(word in name for word in ("handoff", "router", "kv_")):
                asked.append((where, node.lineno, name))
    assert asked == []
