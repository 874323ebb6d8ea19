"""Only common/ is shared between processes; the engine core and the terminal client never
import torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROCESS_PACKAGES = ("api_server", "engine_core", "worker")


def imported_modules(package: str) -> set[tuple[str, str]]:
    found = set()
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {(str(path.relative_to(ROOT)), a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add((str(path.relative_to(ROOT)), node.module))
    return found


def test_process_packages_never_import_each_other() -> None:
    crossings = [
        (where, module)
        for package in PROCESS_PACKAGES
        for where, module in imported_modules(package)
        if module.split(".")[0] in PROCESS_PACKAGES and module.split(".")[0] != package
    ]
    assert crossings == []


def test_common_imports_no_process_package() -> None:
    assert [m for m in imported_modules("common") if m[1].split(".")[0] in PROCESS_PACKAGES] == []


def test_engine_core_does_not_import_torch() -> None:
    source = [
        m
        for m in imported_modules("engine_core")
        if m[1].split(".")[0] in ("torch", "transformers")
    ]
    assert source == []
    # And at run time, through everything it imports from common/.
    code = (
        "import sys, engine_core.core, engine_core.__main__, engine_core.scheduler; "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.strip() == "[]"


def test_the_terminal_client_does_not_import_torch() -> None:
    """`tandem chat` starts in a fraction of a second: nothing heavy on its import path."""
    code = (
        "import sys, common.cli, common.client_cli, common.client_chat, common.client_status; "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.strip() == "[]"
