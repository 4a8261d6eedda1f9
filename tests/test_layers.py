"""The layers, as imports: what each package of llmgw may import (DESIGN.md §2).

Read from the source with ``ast``, so a rule broken anywhere — even inside a function — fails
here with the file, the line and the rule, before it becomes a cycle or a server that needs torch.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "llmgw"

# Libraries the pure core must not touch: I/O, event loops, stores, hardware.
IMPURE = {"trio", "h11", "h2", "httptools", "apsw", "psycopg", "pynvml", "socket", "select", "subprocess"}
# Per package: the other llmgw packages it must not import.
FORBIDDEN = {
    "core": {"wire", "gateway", "server", "agent", "ctl", "cli", "config", "http_probe", "procfs", "tracing"},
    "wire": {"gateway", "server", "agent", "ctl", "cli"},
    "gateway": {"wire", "server", "agent", "ctl", "cli"},
    "server": {"agent", "ctl", "cli"},
    "agent": {"server", "gateway", "ctl", "cli"},
    "ctl": {"server", "agent"},  # its bench drives HTTP with the gateway's h11 stream
}
# Heavy or hardware libraries, each with the only modules that may import it.
SOLE_IMPORTERS = {
    "apsw": {"server/store/sqlite.py"},
    "psycopg": {"server/store/postgres.py"},
    "psycopg_pool": {"server/store/postgres.py"},
    "pynvml": {"agent/discovery/nvml.py"},
    "torch": {"agent/train_child.py"},
    "peft": {"agent/train_child.py"},
    "transformers": {"agent/train_child.py"},
    "opentelemetry": {"tracing.py"},
}


def imports(root: Path) -> list[tuple[str, int, str]]:
    """(module path under ``root``, line, imported module) for every import in the package."""
    found = []
    for path in sorted(root.rglob("*.py")):
        where = path.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                found += [(where, node.lineno, alias.name) for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found += [(where, node.lineno, node.module)]
    return found


def package_of(where: str) -> str:
    first = where.split("/")[0]
    return first.removesuffix(".py")


def broken_rules(root: Path = PACKAGE) -> list[str]:
    broken = []
    for where, line, module in imports(root):
        package, parts = package_of(where), module.split(".")
        if parts[0] == "llmgw" and len(parts) > 1 and parts[1] in FORBIDDEN.get(package, ()):
            broken.append(f"{where}:{line}: {package} imports {module}")
        if package == "core" and parts[0] in IMPURE:
            broken.append(f"{where}:{line}: the core imports {module}")
        allowed = SOLE_IMPORTERS.get(parts[0])
        if allowed is not None and where not in allowed:
            broken.append(f"{where}:{line}: only {', '.join(sorted(allowed))} may import {parts[0]}")
    return broken


def test_every_package_imports_only_what_its_layer_allows():
    assert broken_rules() == []


def test_the_rules_see_a_broken_one(tmp_path):
    """The check itself: a core module importing trio and the wire is caught, line and all."""
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "bad.py").write_text("import trio\n\n\ndef f():\n    from llmgw.wire import codec\n")
    assert broken_rules(tmp_path) == [
        "core/bad.py:1: the core imports trio",
        "core/bad.py:5: core imports llmgw.wire",
    ]


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_each_layer_exists(package):
    assert (PACKAGE / package).is_dir()


def module_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Which llmgw modules each llmgw module imports (``from pkg import submodule`` names the
    submodule: Python then needs the package only partly initialised)."""
    names = {}
    for path in root.rglob("*.py"):
        parts = ("llmgw", *path.relative_to(root).with_suffix("").parts)
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {name: set() for name in names}
    for name, path in names.items():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [t for t in (f"{node.module}.{a.name}" for a in node.names) if t in names]
                targets = targets or [node.module]
            else:
                continue
            graph[name].update(t for t in targets if t in names and t != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while (member := stack.pop()) != node:
                group.append(member)
            if group:
                found.append(sorted([node, *group]))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_module_imports_itself_by_way_of_others():
    assert cycles(module_graph()) == []


def test_the_cycle_check_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
