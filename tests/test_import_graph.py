"""The package's modules import each other without cycles (also through function-level
imports), and the command-line demos stay out of the import graph of `import cpattn`."""

from __future__ import annotations

import ast
import pathlib

import cpattn

PACKAGE = pathlib.Path(cpattn.__file__).parent
DEMOS = {"cpattn.__main__", "cpattn._demo", "cpattn._generate_demo"}


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the cpattn modules it imports anywhere in its body."""
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        edges = set()
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                    + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base
                           for a in node.names]
            else:
                continue
            edges |= {t for t in targets if t in files and t != name}
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle as a path [a, b, ..., a], or [] if there is none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return []


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo.extend(graph[node])
    return seen


def test_no_import_cycles():
    graph = import_graph()
    # `import cpattn` (the package itself) is imported by leaf modules such as the demos; what
    # matters is that no two modules of the package import each other.
    without_package = {m: e - {"cpattn"} for m, e in graph.items()}
    assert find_cycle(without_package) == []


def test_demos_are_not_imported_by_the_library():
    graph = import_graph()
    library = reachable(graph, "cpattn") - DEMOS
    assert not any(graph[m] & DEMOS for m in library), {m: graph[m] & DEMOS for m in library}
