"""The layers of docs/architecture.md hold: imports only go downwards, and the services
talk only over NATS, so none imports another's code."""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
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


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(("gpusched", *(parts[:-1] if parts[-1] == "__init__" else parts)))


def runtime_imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """The imports a module runs, at its top or in a function: not those under ``if
    TYPE_CHECKING:``, which only a type checker reads."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            yield from (n for orelse in node.orelse for n in runtime_imports(orelse))
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        yield from runtime_imports(node)


@functools.cache
def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of the project it imports when it runs. ``from p import x``
    imports the module p.x where there is one, else p (a name p defines)."""
    files = {
        module_name(path): path
        for folder in ("libs", "services")
        for path in sorted((ROOT / folder).rglob("*.py"))
    }
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        targets: set[str] = set()
        for node in runtime_imports(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names if alias.name in files)
            elif node.module and node.level == 0:
                for alias in node.names:
                    inner = f"{node.module}.{alias.name}"
                    targets.add(inner if inner in files else node.module)
        graph[name] = (targets & files.keys()) - {name}
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The modules that import each other, directly or through others (the strongly
    connected components of more than one module, by Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in sorted(graph[module]):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while (member := stack.pop()) != module:
                component.append(member)
            if component:
                circles.append(sorted([module, *component]))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return circles


#: libs/core, libs/common, libs/sdk and each service
PACKAGES = [*sorted(FORBIDDEN), *(f"services/{service}" for service in SERVICES)]


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_circle_within_a_package(package: str):
    """Two modules that import each other (at once or inside a function) are one
    concept split in two, or a third concept both need; move it into a module both
    import. Imports only a type checker runs (``if TYPE_CHECKING:``) do not count."""
    prefix = "gpusched." + package.replace("/", ".")
    circles = [
        circle
        for circle in import_circles(import_graph())
        if all(module == prefix or module.startswith(prefix + ".") for module in circle)
    ]
    assert not circles, circles


def test_the_circle_finder_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_circles(graph) == [["a", "b", "c"]]


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


#: a module past this many lines holds more than one concept: split it along them
MOST_LINES = 700


def test_no_module_of_libs_or_services_is_over_700_lines():
    modules = [p for root in ("libs", "services") for p in (ROOT / root).rglob("*.py")]
    assert len(modules) > 100
    too_long = {
        str(p.relative_to(ROOT)): lines
        for p in modules
        if (lines := len(p.read_text(encoding="utf-8").splitlines())) > MOST_LINES
    }
    assert too_long == {}, f"split these along their concepts: {too_long}"
