"""The package's shape (docs/architecture.md): folders by concept, imports only downward, no cycles.

Every `import` and `from ... import` of every module is read with `ast` (those inside functions too: a
lazy import is still a dependency; not those under `if TYPE_CHECKING:`, which never run), resolved to the
module it names, and checked against the layering table below, which is the one the architecture document
draws.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "rollout_buffer"

# folder -> the folders it may import (besides itself and the package root's `__version__`)
MAY_IMPORT: dict[str, set[str]] = {
    "security": set(),
    "wire": set(),
    "tasks": {"wire"},
    "store": {"wire"},
    "metrics": {"store", "wire"},
    "runs": {"metrics", "store", "tasks", "wire", "security"},
    "runtime": {"runs", "metrics", "store", "tasks", "wire", "security", "settings", "logs"},
    "remote": {"runtime", "runs", "metrics", "store", "tasks", "wire", "security", "settings"},
    "testing": {"runtime", "tasks", "wire"},
    "api": {"remote", "runtime", "runs", "metrics", "store", "tasks", "wire", "security", "settings", "logs"},
    "settings": set(),
    "logs": {"security"},
}
# Edges across the table, each to a leaf module (one that imports nothing of the package, checked below)
LEAF_EDGES = {
    # `tokenizer_path: "test:<flavour>"` names the offline test tokenizer the package ships
    ("rollout_buffer.security.access", "rollout_buffer.testing.tokenizer"),
}
ENTRY_POINTS = {"__init__", "cli", "status", "demo"}  # may import anything of the package
ROOT_MODULES = ENTRY_POINTS | {"settings", "logs"}
MAX_LINES = 400


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imported_modules(path: Path) -> set[str]:
    """The modules of rollout_buffer a file imports: `from a.b import c` names a.b.c when that is a module."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in runtime_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if is_module(full) else base)
    return {m for m in found if m.split(".")[0] in ("rollout_buffer", "slime_adapter", "tests", "bench")}


def runtime_nodes(tree: ast.AST):
    """Every node but those under `if TYPE_CHECKING:` (imports for type hints only)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                todo.extend(child.orelse)
                continue
            todo.append(child)


def is_module(name: str) -> bool:
    base = REPO.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def package_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def folder_of(module: str) -> str:
    """`rollout_buffer.store.keys` -> "store"; a root module is its own folder ("settings", "cli")."""
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


GRAPH = {module_name(p): imported_modules(p) for p in package_files()}


def test_the_root_holds_only_entry_points_and_settings() -> None:
    loose = {p.stem for p in PACKAGE.glob("*.py")} - ROOT_MODULES
    assert not loose, f"modules loose at the package root: {sorted(loose)}"
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert folders == set(MAY_IMPORT) - {"settings", "logs"}, "every folder has a row in the layering table"


def test_every_folder_says_what_lives_there() -> None:
    for init in PACKAGE.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc) > 40, f"{init.parent.name}/__init__.py has no docstring"


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_imports_go_only_downward(module: str) -> None:
    folder = folder_of(module)
    if folder in ENTRY_POINTS:
        return
    allowed = MAY_IMPORT[folder] | {folder}
    for target in GRAPH[module]:
        assert target.startswith("rollout_buffer"), f"{module} imports {target}: product code imports no test code"
        if target == "rollout_buffer":
            continue  # the package's __version__
        if (module, target) in LEAF_EDGES:
            assert not GRAPH[target] - {"rollout_buffer"}, f"{target} is no leaf: {sorted(GRAPH[target])}"
            continue
        assert folder_of(target) in allowed, f"{module} imports {target}: {folder}/ may import {sorted(allowed)}"


def test_no_import_cycle() -> None:
    """Depth-first search over the module graph; a back edge is a cycle."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        stack.append(module)
        for target in sorted(GRAPH.get(module, ())):
            if target not in GRAPH:
                continue
            if state.get(target) == 1:
                cycle = stack[stack.index(target):] + [target]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target)
        stack.pop()
        state[module] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module)


def test_the_adapter_imports_only_the_wire_formats_and_the_token() -> None:
    for path in sorted((REPO / "slime_adapter").rglob("*.py")):
        for target in imported_modules(path):
            if target.startswith("rollout_buffer"):
                assert target.startswith("rollout_buffer.wire.") or target == "rollout_buffer.security.auth", \
                    f"{module_name(path)} imports {target}"


def test_no_module_is_over_the_size_limit() -> None:
    long = {str(p.relative_to(REPO)): n for p in package_files() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_the_layout_check_sees_a_violation() -> None:
    """The checks read what they claim: the API imports the store, and the store does not import the API."""
    assert "rollout_buffer.store.store" in GRAPH["rollout_buffer.api.state"]
    assert folder_of("rollout_buffer.api.state") not in MAY_IMPORT["store"]
    assert "rollout_buffer.remote.service" in GRAPH["rollout_buffer.api.routes.remote"]
