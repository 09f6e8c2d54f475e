"""The layers of docs/architecture.md hold: imports only go downwards."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: package -> packages of the project it may not import
FORBIDDEN = {
    "libs/core": ("libs.common", "libs.sdk", "services"),
    "libs/common": ("libs.sdk", "services"),
    "libs/sdk": ("services",),
}


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_a_lower_layer_imports_nothing_from_the_layers_above_it(package: str):
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, package
    breaches = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in files
        for name in sorted(imported_modules(path))
        if any(name == banned or name.startswith(banned + ".") for banned in FORBIDDEN[package])
    ]
    assert not breaches, breaches
