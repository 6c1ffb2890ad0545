"""The import rule of docs/architecture.md, checked on the source: no import circle inside
``src/taifuse``, and no import that goes up a layer.

Imports are read with ``ast`` from every module, including the lazy ones inside functions (a
circle behind a lazy import is still a circle) and those under ``TYPE_CHECKING``. Modules a
backend imports by name at run time (``importlib``) are not edges: that is how the dispatch reaches
the backends without depending on them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "taifuse"

# Layers from the bottom (docs/architecture.md, "The import rule"): the first prefix that matches a
# module's name gives its layer. A module may import its own layer (without a circle) or lower.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("taifuse.backends._spec", "taifuse._profile_hook", "taifuse._costs",
     "taifuse._autocast_state"),  # import nothing of taifuse
    ("taifuse.backends._host", "taifuse.backends.reference"),
    ("taifuse.backends",),  # the dispatch: the package's __init__ only (see _EXACT)
    ("taifuse.pool",),
    ("taifuse._random", "taifuse.backends.numba", "taifuse.backends.taichi", "taifuse.backends.metal_check",
     "taifuse.backends._metal_selftest"),
    ("taifuse._array_ops", "taifuse._tensor_math"),
    ("taifuse.tensor",),
    ("taifuse._autograd_ops", "taifuse._conv_ops", "taifuse.functional", "taifuse.checkpoint"),
    ("taifuse.nn", "taifuse.optim", "taifuse.amp", "taifuse.monitor", "taifuse.profiler"),
    ("taifuse.bench", "taifuse.cli", "taifuse.__main__", "taifuse"),
)  # fmt: skip


def _modules() -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (path, is a package __init__) for every module of the package."""
    found = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        is_init = parts[-1] == "__init__"
        if is_init:
            parts.pop()
        found[".".join(parts)] = (path, is_init)
    return found


MODULES = _modules()


def _imports(name: str) -> set[str]:
    """The taifuse modules ``name`` imports anywhere in its source."""
    path, is_init = MODULES[name]
    package = name.split(".") if is_init else name.split(".")[:-1]
    deps = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            # `from pkg import sub` imports the submodule when there is one, else a name of pkg.
            targets = [
                f"{origin}.{a.name}" if f"{origin}.{a.name}" in MODULES else origin for a in node.names
            ]
        else:
            continue
        for target in targets:
            # `import a.b.c` depends on the deepest module that exists.
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != name:
                deps.add(target)
                deps.update(_packages_run_first(name, target))
    return deps


def _packages_run_first(name: str, target: str) -> set[str]:
    """The package ``__init__`` modules that importing ``target`` from ``name`` runs first.

    Python runs ``a/__init__`` and ``a/b/__init__`` before ``a.b.c``. The packages that hold
    ``name`` itself are left out: they ran (or are running) before ``name`` did, so importing a
    sibling runs nothing new there (and ``taifuse/__init__``, which holds every module, is never an
    edge this way)."""
    parts = target.split(".")
    mine = name.split(".") if MODULES[name][1] else name.split(".")[:-1]
    return {
        package
        for package in (".".join(parts[:i]) for i in range(1, len(parts)))
        if package != ".".join(mine[: package.count(".") + 1])
    }


GRAPH = {name: _imports(name) for name in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root, children_of_root in graph.items():
        if root in index:
            continue
        work = [(root, iter(sorted(children_of_root)))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


# Packages whose own __init__ is meant, not their submodules.
_EXACT = ("taifuse", "taifuse.backends")


def _layer(name: str) -> int:
    for level, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if name == prefix or (prefix not in _EXACT and name.startswith(prefix + ".")):
                return level
    raise AssertionError(f"{name} is in no layer of LAYERS: add it (and to docs/architecture.md)")


def test_the_walk_sees_the_imports_it_should():
    # Guards the checker itself: known edges of every kind (absolute, relative-free `from x import
    # sub`, lazy inside a function) are found.
    assert "taifuse.backends._spec" in GRAPH["taifuse.backends"]
    assert "taifuse.tensor" in GRAPH["taifuse._autograd_ops"]
    assert "taifuse.backends" in GRAPH["taifuse.pool"]  # a lazy import inside get_pool
    # A package's __init__, which Python runs before the module imported from it...
    assert "taifuse.optim" in GRAPH["taifuse.amp.grad_scaler"]  # from taifuse.optim.optimizer import
    # ...but not the packages that hold the importer, which ran before it.
    assert "taifuse.backends" not in GRAPH["taifuse.backends._host"]
    assert "taifuse" not in GRAPH["taifuse.tensor"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_in_the_package():
    cycles = _cycles(GRAPH)
    assert not cycles, "import circles (each line: modules that import each other):\n" + "\n".join(
        " <-> ".join(c) for c in cycles
    )


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_go_down_the_layers(name):
    mine = _layer(name)
    upward = sorted(dep for dep in GRAPH[name] if _layer(dep) > mine)
    assert not upward, f"{name} (layer {mine}) imports from higher layers: {upward} (docs/architecture.md)"
