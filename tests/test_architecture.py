"""The import rule of docs/architecture.md, checked on the source: no import circle inside
``src/taifuse``, no import that goes up a layer, and no module that reads or writes another
module's ``_``-prefixed names (``python tests/test_architecture.py --private-reach`` lists and
counts those).

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
     "taifuse._autocast_state", "taifuse._trace_hook"),  # import nothing of taifuse
    ("taifuse.backends._host", "taifuse.backends.reference", "taifuse._ceilings"),
    ("taifuse.backends",),  # the dispatch: the package's __init__ only (see _EXACT)
    ("taifuse.pool",),
    ("taifuse._random", "taifuse.backends.numba", "taifuse.backends.taichi", "taifuse.backends.metal_check",
     "taifuse.backends._metal_selftest"),
    ("taifuse._array_ops", "taifuse._tensor_math"),
    ("taifuse._internal",),  # the Tensor's fields and their accessors: the internal API
    ("taifuse._engine", "taifuse._grad_slots"),  # grad mode, Function, run_backward; optimizer slots
    ("taifuse._tensor_functions",),  # the Functions of the Tensor methods, dtype promotion, autocast casts
    ("taifuse.tensor",),
    ("taifuse._autograd_ops", "taifuse._batch_norm_ops", "taifuse._conv_ops", "taifuse._conv_bn_ops", "taifuse.functional",
     "taifuse.checkpoint"),
    ("taifuse.nn", "taifuse.optim", "taifuse.amp", "taifuse.monitor", "taifuse.profiler",
     "taifuse.serialization", "taifuse.data", "taifuse.utils",
     "taifuse.distributed", "taifuse.library"),
    ("taifuse.compiler",),  # the step compiler: wraps the optimizers' and GradScaler's host segments
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


# ----------------------------------------------------------------------------- private reach
# A ``_``-prefixed name belongs to its module: no other module reads or writes it, so that a module
# can change its internals without breaking another (issue 27). Counted from the source with
# ``ast``; a reach is
#   * ``from taifuse.x import _name`` (a private function, class or constant of another module);
#   * ``mod._name`` where ``mod`` is another taifuse module (bound by an import, or looked up in
#     ``sys.modules``);
#   * ``obj._name`` on anything but ``self``/``cls``/``super()`` (also ``getattr``/``setattr``/
#     ``hasattr`` with a constant name), read or written, where ``_name`` is not one of this
#     module's own (a def, class or assigned name, or an attribute its classes use on ``self``)
#     and, for a read, is one of another taifuse module's (so ``sys._getframe`` or a namedtuple's
#     ``_replace`` are not counted); a write into a private attribute this module does not own
#     always counts.
# The Tensor's fields are reached through ``taifuse._internal`` (``data(t)``, ``wrap(array,
# backend)``, ``attach(t, node)``, ...), an optimizer's gradient buffers through
# ``Optimizer.grad_buffers()``, a pool's counters through ``pool.bytes_in_use()``.

# (reaching module, reached name) pairs that may stay, each with its reason. Empty: nothing does.
PRIVATE_REACH_ALLOWED: dict[tuple[str, str], str] = {}

# Packages whose modules may read each other's private names: a backend is one unit split in files
# around its bottom module (numba's ``_jit``, taichi's ``_runtime``, the reference's ``forward``),
# whose helpers and constants the others build on; nothing outside the package reads them.
_PRIVATE_PACKAGES = ("taifuse.backends.numba", "taifuse.backends.taichi", "taifuse.backends.reference")


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_names_defined(tree: ast.AST) -> set[str]:
    """The private names a module owns: its functions, classes and assigned names (module, class
    or local), its parameters, ``__slots__`` entries, and attributes its classes use on ``self``
    or ``cls``."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                names.add(node.attr)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif (
            isinstance(node, ast.Assign) and any(ast.unparse(t) == "__slots__" for t in node.targets)
            and isinstance(node.value, (ast.Tuple, ast.List))
        ):  # fmt: skip
            names.update(e.value for e in node.value.elts if isinstance(e, ast.Constant))
    return {n for n in names if _is_private(n)}


def _package_of(name: str, is_init: bool) -> list[str]:
    return name.split(".") if is_init else name.split(".")[:-1]


def _from_base(node: ast.ImportFrom, package: list[str]) -> str:
    if not node.level:
        return node.module or ""
    return ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))


def _module_aliases(tree: ast.AST, package: list[str], known: set[str]) -> dict[str, str]:
    """Local names bound to taifuse modules (of ``known``) in a module's source."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in known:
                    aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(node, package)
            for a in node.names:
                if f"{base}.{a.name}" in known:
                    aliases[a.asname or a.name] = f"{base}.{a.name}"
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            # ``jit = sys.modules.get("taifuse.x")`` or ``sys.modules["taifuse.x"]``: a module too.
            value = node.value
            key = None
            if isinstance(value, ast.Call) and ast.unparse(value.func) == "sys.modules.get" and value.args:
                key = value.args[0]
            elif isinstance(value, ast.Subscript) and ast.unparse(value.value) == "sys.modules":
                key = value.slice
            if isinstance(key, ast.Constant) and key.value in known:
                aliases[node.targets[0].id] = key.value
    return aliases


def _is_self(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id in ("self", "cls")) or (
        isinstance(node, ast.Call) and ast.unparse(node.func) == "super"
    )


def private_reaches(sources: dict[str, tuple[str, bool]] | None = None) -> list[tuple[str, int, str]]:
    """``(module, line, what)`` for every reach into another taifuse module's private names, outside
    PRIVATE_REACH_ALLOWED. ``sources``: dotted name -> (source text, is a package ``__init__``);
    default, the package's own modules."""
    if sources is None:
        sources = {name: (path.read_text(), is_init) for name, (path, is_init) in MODULES.items()}
    known = set(sources)
    trees = {name: ast.parse(text, name) for name, (text, _) in sources.items()}
    defined = {name: _private_names_defined(tree) for name, tree in trees.items()}
    found = []
    for name, tree in trees.items():
        own = next((p for p in _PRIVATE_PACKAGES if name == p or name.startswith(p + ".")), None)

        def foreign(other: str, name: str = name, own: str | None = own) -> bool:
            return other != name and not (own and (other == own or other.startswith(own + ".")))

        def defined_elsewhere(attr: str, name: str = name) -> bool:
            return attr not in defined[name] and any(attr in names and foreign(o) for o, names in defined.items())

        package = _package_of(name, sources[name][1])
        aliases = _module_aliases(tree, package, known)
        for node in ast.walk(tree):
            hits: list[tuple[str, str]] = []  # (reached name, what)
            if isinstance(node, ast.ImportFrom):
                base = _from_base(node, package)
                if base in known and foreign(base):
                    hits += [(a.name, f"from {base} import {a.name}") for a in node.names
                             if _is_private(a.name) and f"{base}.{a.name}" not in known]  # fmt: skip
            elif isinstance(node, ast.Attribute) and _is_private(node.attr) and not _is_self(node.value):
                receiver, attr = node.value, node.attr
                if isinstance(receiver, ast.Name) and receiver.id in aliases:
                    if foreign(aliases[receiver.id]):
                        hits.append((attr, f"{aliases[receiver.id]}.{attr}"))
                elif isinstance(receiver, ast.Subscript) and ast.unparse(receiver.value) == "sys.modules":
                    hits.append((attr, ast.unparse(node)))
                elif isinstance(node.ctx, ast.Store):
                    if attr not in defined[name]:
                        hits.append((attr, f"{ast.unparse(receiver)}.{attr} = ..."))
                elif defined_elsewhere(attr):
                    hits.append((attr, f"{ast.unparse(receiver)}.{attr}"))
            elif (
                isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
                and _is_private(node.args[1].value) and not _is_self(node.args[0])
            ):  # fmt: skip
                attr = node.args[1].value
                if defined_elsewhere(attr) or (node.func.id == "setattr" and attr not in defined[name]):
                    hits.append((attr, f"{node.func.id}({ast.unparse(node.args[0])}, {attr!r})"))
            found += [(name, node.lineno, what) for attr, what in hits if (name, attr) not in PRIVATE_REACH_ALLOWED]
    return sorted(found)


def test_the_private_reach_check_sees_what_it_should():
    # Guards the checker: each form it counts is found in made-up modules, and the forms it
    # allows are not.
    owner = (
        "class T:\n    def __init__(self):\n        self._data = 1\n"
        "_LIMIT = 3\ndef _helper():\n    pass\n"
    )
    reacher = (
        "import sys\nfrom taifuse import owner\nfrom taifuse.owner import _helper\n"
        "def f(t, ctx):\n    x = t._data\n    ctx._sig = 1\n    y = owner._LIMIT\n"
        "    jit = sys.modules.get('taifuse.owner')\n    z = jit._helper\n    getattr(t, '_data')\n"
        "    return sys._getframe(), t._replace, x, y, z\n"
    )
    own = "class U:\n    def __init__(self):\n        self._data = 2\n    def g(self, o):\n        return o._data\n"
    found = private_reaches({"taifuse.owner": (owner, False), "taifuse.reacher": (reacher, False),
                             "taifuse.own": (own, False)})  # fmt: skip
    assert [(m, line, what) for m, line, what in found] == [
        ("taifuse.reacher", 3, "from taifuse.owner import _helper"),
        ("taifuse.reacher", 5, "t._data"),
        ("taifuse.reacher", 6, "ctx._sig = ..."),
        ("taifuse.reacher", 7, "taifuse.owner._LIMIT"),
        ("taifuse.reacher", 9, "taifuse.owner._helper"),
        ("taifuse.reacher", 10, "getattr(t, '_data')"),
    ]
    assert _is_private("_data") and not _is_private("__init__")


def test_no_module_reaches_into_another_modules_private_names():
    reaches = private_reaches()
    assert not reaches, f"{len(reaches)} reaches into another module's private names:\n" + "\n".join(
        f"{module}:{line}: {what}" for module, line, what in reaches
    )


if __name__ == "__main__":  # python tests/test_architecture.py --private-reach
    import sys

    if "--private-reach" in sys.argv:
        reaches = private_reaches()
        for module, line, what in reaches:
            print(f"{module}:{line}: {what}")
        print(f"{len(reaches)} private reaches outside the allowlist ({len(PRIVATE_REACH_ALLOWED)} allowed)")
