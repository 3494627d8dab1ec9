"""Imports point one way (DESIGN.md): ``crypto`` and ``training`` are leaves, ``protocol`` composes
them, ``tallier`` builds on ``protocol``, ``orchestration`` runs them, ``scripts`` sit on top; and no
module imports itself back through others, function-level imports included."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
LAYERS = {"crypto": 0, "training": 0, "protocol": 1, "tallier": 2, "orchestration": 3, "scripts": 4}


def _modules() -> dict[str, Path]:
    modules = {}
    for package in LAYERS:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(("consilium", *path.relative_to(ROOT).with_suffix("").parts))
            modules[name.removesuffix(".__init__")] = path
    return modules


def _imports(path: Path) -> set[str]:
    """Every absolute import in the file, anywhere in it, with ``from a import b`` also as ``a.b``."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def _package(module: str) -> str:
    return module.split(".")[1]


MODULES = _modules()
GRAPH = {
    name: {other for other in _imports(path) if other in MODULES and other != name} for name, path in MODULES.items()
}


@pytest.mark.parametrize("package", LAYERS)
def test_a_package_imports_only_the_layers_below_it(package):
    upward = sorted(
        f"{name} imports {other}"
        for name, imported in GRAPH.items()
        if _package(name) == package
        for other in imported
        if _package(other) != package and LAYERS[_package(other)] >= LAYERS[package]
    )
    assert not upward, "; ".join(upward)


def test_no_module_imports_itself_back():
    """Tarjan's strongly connected components of the import graph: each must be a single module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(name: str) -> None:
        index[name] = low[name] = len(index)
        stack.append(name)
        for other in GRAPH[name]:
            if other not in index:
                visit(other)
                low[name] = min(low[name], low[other])
            elif other in stack:
                low[name] = min(low[name], index[other])
        if low[name] == index[name]:
            component = [stack.pop()]
            while component[-1] != name:
                component.append(stack.pop())
            if len(component) > 1:
                cycles.append(sorted(component))

    for name in GRAPH:
        if name not in index:
            visit(name)
    assert not cycles, f"import cycles: {cycles}"


def test_every_import_of_the_project_goes_through_its_one_name():
    """Installed, only ``consilium`` exists: a bare ``import training`` works in the repository alone."""
    bare = sorted(
        f"{path.relative_to(ROOT)} imports {other}"
        for path in [*MODULES.values(), *(ROOT / "tests").rglob("*.py")]
        for other in _imports(path)
        if other.split(".")[0] in LAYERS
    )
    assert not bare, "; ".join(bare)
