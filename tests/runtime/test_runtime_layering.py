"""The runtime sits below the api: no runtime module imports decode_server.api (the api imports the runtime)."""

from __future__ import annotations

import ast
from pathlib import Path

import decode_server.runtime

RUNTIME_DIR = Path(decode_server.runtime.__file__).parent


def _imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_runtime_imports_nothing_of_the_api() -> None:
    files = sorted(RUNTIME_DIR.glob("*.py"))
    assert len(files) >= 5
    offenders = {path.name: sorted(m for m in _imported_modules(path) if m.split(".")[:2] == ["decode_server", "api"])
                 for path in files}
    assert not {name: mods for name, mods in offenders.items() if mods}
