"""The layers of docs/architecture.md hold: imports only go downwards, and the services
talk only over NATS, so none imports another's code."""

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


#: the services, each a package of its own under services/
SERVICES = sorted(path.parent.name for path in (ROOT / "services").glob("*/__init__.py"))
#: the command line composes the services (``gpusched up`` runs them all in one process,
#: ``gpusched simulate`` runs the scheduler's policies), so it alone may import them
COMPOSERS = frozenset({"cli"})


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            # ``from gpusched.services import admission`` imports a package too
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
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


def test_libs_never_import_a_service():
    breaches = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in sorted((ROOT / "libs").rglob("*.py"))
        for name in sorted(imported_modules(path))
        if name == "gpusched.services" or name.startswith("gpusched.services.")
    ]
    assert not breaches, breaches


@pytest.mark.parametrize("service", [s for s in SERVICES if s not in COMPOSERS])
def test_no_service_imports_another_service(service: str):
    """What two services share lives in libs/ (wire schemas, the predictor's client,
    models read from its messages); between them there is only NATS."""
    own = f"gpusched.services.{service}"
    breaches = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in sorted((ROOT / "services" / service).rglob("*.py"))
        for name in sorted(imported_modules(path))
        if name.startswith("gpusched.services.") and not (name == own or name.startswith(own + "."))
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
