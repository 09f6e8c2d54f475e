"""The layers of docs/architecture.md hold: imports only go downwards."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: package -> packages of the project it may not import
FORBIDDEN = {
    "libs/core": ("gpusched.libs.common", "gpusched.libs.sdk", "gpusched.services"),
    "libs/common": ("gpusched.libs.sdk", "gpusched.services"),
    "libs/sdk": ("gpusched.services",),
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


def test_every_import_of_the_project_uses_its_installed_name():
    """`libs` and `services` are installed as gpusched.libs and gpusched.services; an
    import by the bare folder name would load a second copy of a module from the
    checkout (or fail once installed)."""
    bare = [
        f"{path.relative_to(ROOT)} imports {name}"
        for folder in ("libs", "services", "tests", "bench")
        for path in sorted((ROOT / folder).rglob("*.py"))
        for name in sorted(imported_modules(path))
        if name.split(".")[0] in {"libs", "services"}
    ]
    assert not bare, bare
