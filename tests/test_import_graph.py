"""The package's modules import each other without cycles (also through function-level
imports), its layers point one way (local attention and the planner below the strategies, the
strategies below ContextParallel and the integrations), and the command-line demos stay out of
the import graph of `import cpattn`."""

from __future__ import annotations

import ast
import pathlib

import cpattn

PACKAGE = pathlib.Path(cpattn.__file__).parent
# The source tree (tests, benchmarks, docs): CI imports the installed package from elsewhere.
REPO = pathlib.Path(__file__).resolve().parent.parent
DEMOS = {"cpattn.__main__", "cpattn.cli.demo", "cpattn.cli.generate_demo"}


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


# Modules the build makes (an installed package holds _build_info.py; the source tree does not)
BUILT_MODULES = {"cpattn._C", "cpattn._build_info"}


def source_modules() -> dict[str, pathlib.Path]:
    """The package's Python modules written by us: name -> path."""
    found = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: path for name, path in found.items() if name not in BUILT_MODULES}


def import_graph() -> dict[str, set[str]]:
    """Module -> the cpattn modules it imports anywhere in its body."""
    files = source_modules()
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


# ---------------------------------------------------------------------------------------------
# Layers point one way (docs/design.md, "Layout of the source"): each rule names the modules
# (a name and everything under it) that must not reach, through imports at any depth, another
# set of modules.


def _under(module: str, names: tuple) -> bool:
    return any(module == n or module.startswith(n + ".") for n in names)


LAYER_RULES = [
    # local attention, the options, the layouts and the planner: below every strategy
    (("cpattn.attention", "cpattn.invariant", "cpattn.core", "cpattn.sharding", "cpattn.comm",
      "cpattn.max_logits", "cpattn.inference.kv_cache", "cpattn.plan"),
     ("cpattn.strategies",)),
    # the strategies: below the settings object, the whole-sequence entry and the integrations
    (("cpattn.strategies",),
     ("cpattn.parallel", "cpattn.context_attention", "cpattn.training", "cpattn.mixers",
      "cpattn.integrations", "cpattn.testing")),
    # the planner: below everything that runs attention over ranks
    (("cpattn.plan",),
     ("cpattn.parallel", "cpattn.context_attention", "cpattn.training", "cpattn.integrations")),
    # the integrations: the top, imported by nothing else of the library
    (("cpattn.attention", "cpattn.strategies", "cpattn.parallel", "cpattn.context_attention",
      "cpattn.inference", "cpattn.training", "cpattn.mixers", "cpattn.plan", "cpattn.testing",
      *sorted(DEMOS)),
     ("cpattn.integrations",)),
]
# Edges the rules let through for now, each with why (none today).
PENDING: set = set()


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """'module -> module it must not reach (through ...)' for every rule broken in graph."""
    allowed = {m: {t for t in e if (m, t) not in PENDING} for m, e in graph.items()}
    found = []
    for lower, upper in LAYER_RULES:
        for module in sorted(m for m in graph if _under(m, lower)):
            for target in sorted(reachable(allowed, module)):
                if _under(target, upper) and not _under(target, lower):
                    found.append(f"{module} -> {target}")
    return found


def test_layers_point_one_way():
    graph = import_graph()
    stale = [edge for edge in PENDING if edge[1] not in graph.get(edge[0], set())]
    assert not stale, f"PENDING holds edges no module has any more, drop them: {stale}"
    found = layer_violations(graph)
    assert not found, "imports against the layering:\n" + "\n".join(found)


def test_layer_rules_catch_a_wrong_import():
    """The rules can fail: the planner importing a strategy (as plan/work.py once imported
    strategies/allgather.py), local attention importing one, a strategy importing the
    integrations are each reported."""
    for module, target in (("cpattn.plan.work", "cpattn.strategies.allgather"),
                           ("cpattn.attention", "cpattn.strategies.ring"),
                           ("cpattn.strategies.ring", "cpattn.integrations.transformers")):
        graph = import_graph()
        graph[module] = graph[module] | {target}
        assert f"{module} -> {target}" in layer_violations(graph), (module, target)


# ---------------------------------------------------------------------------------------------
# No private names across modules: a module uses another cpattn module's public names only
# (modules whose own name starts with "_", such as cpattn.core.layout, are fine to import from).

# Compiled or generated at build time: modules without a .py file in the source tree.
def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_uses(path: pathlib.Path, modules: set[str], name: str) -> list[str]:
    """`from cpattn.x import _y` (relative imports too) and `cpattn.x._y` attribute uses (through
    any name a cpattn module is bound to) in the file at path, module `name`: one line each."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    bound: dict[str, str] = {}  # local name -> the cpattn module it refers to
    found = []

    def where(node) -> str:
        shown = path.relative_to(PACKAGE.parent) if path.is_relative_to(PACKAGE.parent) else path
        return f"{shown}:{node.lineno}"

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "cpattn" or a.name.startswith("cpattn."):
                    if a.asname:
                        bound[a.asname] = a.name
                    else:
                        bound["cpattn"] = "cpattn"
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            if base != "cpattn" and not base.startswith("cpattn."):
                continue
            for a in node.names:
                target = f"{base}.{a.name}"
                if target in modules:  # a module (private modules are fine)
                    bound[a.asname or a.name] = target
                elif _is_private(a.name) and base != name:
                    found.append(f"{where(node)}: from {base} import {a.name}")

    def resolve(expr) -> str | None:
        """The cpattn module an expression names (cpattn, cpattn.x, an alias of one), if any."""
        if isinstance(expr, ast.Name):
            return bound.get(expr.id)
        if isinstance(expr, ast.Attribute):
            outer = resolve(expr.value)
            if outer is not None and f"{outer}.{expr.attr}" in modules:
                return f"{outer}.{expr.attr}"
        return None

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            owner = resolve(node.value)
            if (owner is not None and owner != name
                    and f"{owner}.{node.attr}" not in modules):
                found.append(f"{where(node)}: {owner}.{node.attr}")
    return found


def test_no_private_names_across_modules():
    """No module under python/cpattn reaches into another cpattn module's underscore names."""
    files = source_modules()
    modules = set(files) | BUILT_MODULES
    found = [use for name, path in sorted(files.items())
             for use in private_uses(path, modules, name)]
    assert not found, "private names used across cpattn modules:\n" + "\n".join(found)


def test_tests_benchmarks_and_examples_use_public_names_only():
    """The same rule for the test suite, the benchmarks and the examples."""
    files = source_modules()
    modules = set(files) | BUILT_MODULES
    root = REPO
    found = []
    for folder in ("tests", "bench", "examples"):
        assert (root / folder).is_dir(), root / folder
        for path in sorted((root / folder).rglob("*.py")):
            source = path.read_text()
            for node in ast.walk(ast.parse(source)):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("cpattn"):
                    found += [f"{path.relative_to(root)}:{node.lineno}: from {node.module} "
                              f"import {a.name}" for a in node.names
                              if _is_private(a.name) and f"{node.module}.{a.name}" not in modules]
    assert not found, "private cpattn names imported:\n" + "\n".join(found)


def test_all_holds_no_testing_helpers():
    """cpattn.__all__ is the attention API: every name exists, none is private, none is a test
    helper (the emulated ring lives in cpattn.testing.emulation)."""
    assert len(set(cpattn.__all__)) == len(cpattn.__all__)
    missing = [n for n in cpattn.__all__ if not hasattr(cpattn, n)]
    assert not missing, missing
    assert not [n for n in cpattn.__all__ if n.startswith("_")]
    assert not [n for n in cpattn.__all__ if "emulated" in n]
    testing = [n for n in cpattn.__all__
               if (getattr(getattr(cpattn, n), "__module__", None) or "").startswith(
                   "cpattn.testing")
               or (getattr(getattr(cpattn, n), "__name__", None) or "").startswith(
                   "cpattn.testing")]
    assert not testing, testing
    assert not hasattr(cpattn, "ring_attention_emulated")


def test_private_use_detector_finds_each_form(tmp_path: pathlib.Path):
    """The detector above can fail: each form of a private use is reported, public ones not."""
    files = source_modules()
    modules = set(files) | BUILT_MODULES
    source = tmp_path / "probe.py"
    source.write_text(
        "import cpattn\n"
        "import cpattn.sharding.sequences as sh\n"
        "from cpattn import plan\n"
        "from cpattn.core import layout as _layout\n"
        "from cpattn.inference.kv_cache import _hidden\n"  # reported
        "from cpattn.core.layout import LAYOUTS\n"  # a private module's public name: fine
        "from .options import _secret\n"  # reported (relative)
        "cpattn.sharding.sequences._unshard_by\n"  # reported
        "sh._group_info\n"  # reported
        "plan._internal\n"  # reported
        "_layout.LAYOUTS, cpattn._C, cpattn.__version__, sh.positions\n")  # fine
    # as if it were the module cpattn.strategies.probe (the relative import resolves from there)
    uses = private_uses(source, modules, "cpattn.strategies.probe")
    assert [u.split(": ", 1)[1] for u in uses] == [
        "from cpattn.inference.kv_cache import _hidden",
        "from cpattn.strategies.options import _secret", "cpattn.sharding.sequences._unshard_by",
        "cpattn.sharding.sequences._group_info", "cpattn.plan._internal"
    ], uses


# ---------------------------------------------------------------------------------------------
# The layers drawn in docs/design.md are computed from the code: each part of the package (a
# sub-package or a top-level module) sits one layer above the highest part it imports.

DESIGN = REPO / "docs" / "design.md"
LAYERS_BEGIN, LAYERS_END = "<!-- import layers (from the code) -->", "<!-- end of import layers -->"


def part_layers(graph: dict[str, set[str]]) -> list[list[str]]:
    """The package's parts in layers, the lowest first (the demos' entry `__main__` left out:
    it only starts them)."""
    def part(module: str):
        pieces = module.split(".")
        return pieces[1] if len(pieces) > 1 and pieces[1] != "__main__" else None

    edges: dict[str, set[str]] = {}
    for module, imported in graph.items():
        if (a := part(module)) is not None:
            edges.setdefault(a, set()).update(b for m in imported
                                              if (b := part(m)) is not None and b != a)
    level: dict[str, int] = {}

    def of(node: str, path: tuple = ()) -> int:
        assert node not in path, f"parts import each other: {path + (node,)}"
        if node not in level:
            level[node] = 1 + max((of(d, path + (node,)) for d in edges[node]), default=-1)
        return level[node]

    for node in edges:
        of(node)
    return [sorted(n for n in level if level[n] == i) for i in range(max(level.values()) + 1)]


def drawn_layers(layers: list[list[str]]) -> str:
    rows = [f"{i}  " + ", ".join(f"{n}/" if (PACKAGE / n).is_dir() else f"{n}.py" for n in names)
            for i, names in enumerate(layers)]
    return "```\n" + "\n".join(reversed(rows)) + "\n```"


def test_design_doc_draws_the_layers_of_the_code():
    """docs/design.md's drawing of the import layers is the code's (regenerate it from this
    test's failure message when the package changes)."""
    text = DESIGN.read_text()
    drawn = text[text.index(LAYERS_BEGIN) + len(LAYERS_BEGIN):text.index(LAYERS_END)].strip()
    expected = drawn_layers(part_layers(import_graph()))
    assert drawn == expected, f"docs/design.md should draw:\n{expected}"


def test_part_layers_finds_an_upward_import():
    """The layering above can fail: an import from a lower part back into a higher one is a
    cycle between parts."""
    graph = import_graph()
    graph["cpattn.core.validation"] = graph["cpattn.core.validation"] | {"cpattn.parallel"}
    try:
        part_layers(graph)
    except AssertionError as e:
        assert "parts import each other" in str(e)
    else:
        raise AssertionError("an upward import was not found")
