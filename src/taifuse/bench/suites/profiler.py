"""The profiler's cost on a training step: examples/train_mlp.py's model (Linear(2, 64, gelu) ->
Linear(64, 64, gelu) -> Linear(64, 3)) at its batch of 64, with ``zero_grad``, cross entropy,
backward and an AdamW step: small ops, so per-call costs weigh the most here.

NOTE [ Hooks bypassed ]
The disabled profiler's cost is one read of ``taifuse._profile_hook.ACTIVE`` per hooked call
(NOTE [ Profiler hooks ]). Its baseline is the same step through the same functions with those
reads taken out: :class:`HookSwitch` rebuilds each hooked function from its own source with the
hook lines removed (the ``rec = _profile_hook.ACTIVE`` line dropped, ``X if rec is None else Y``
cut to ``X``) and the array path's wrappers replaced by the functions they wrap. Both variants set
the same attributes before every call (``use(True)`` or ``use(False)``) and put the shipped ones
back after it, so the switch costs both the same, they run interleaved in one process, and the
process is left as it was. ``inspect.getsource`` reads the files on disk: do not edit the hooked
modules while this suite runs.
"""

from __future__ import annotations
import __future__

import functools
import importlib
import inspect
import textwrap
from typing import Any

from taifuse.bench.case import Case, Variant
from taifuse.bench.suites.training import mlp_inputs, mlp_model_code, mlp_setup_code

SUITE = "profiler"
BATCH = 64
SIZES = (2, 64, 64, 3)  # examples/train_mlp.py: spiral points, two GELU hidden layers, classes
_HOOK_LINE = "_profile_hook.ACTIVE"
_HOOK_SPLIT = " if rec is None else "

# (module, owner attribute or None for a module-level function, function name)
_HOOKED = (
    ("taifuse._engine", "Function", "apply"),
    ("taifuse._engine", None, "_walk"),  # run_backward's walk, looked up in _engine's globals: swapped there
    ("taifuse.pool", "BufferPool", "acquire"),
    ("taifuse.nn.module", "Module", "__call__"),
    ("taifuse.optim.optimizer", "Optimizer", "step"),
)


def strip_hooks(fn: Any) -> Any:
    """``fn`` rebuilt from its source without its profiler hook lines (NOTE [ Hooks bypassed ])."""
    source = textwrap.dedent(inspect.getsource(fn))
    lines, removed = [], 0
    for line in source.splitlines():
        if _HOOK_LINE in line:
            removed += 1
            continue
        if _HOOK_SPLIT in line:
            line = line[: line.index(_HOOK_SPLIT)]
        lines.append(line)
    if removed == 0:
        raise ValueError(f"{fn.__qualname__} has no profiler hook to strip")
    decorated = lines[0].lstrip().startswith("@")
    body = "\n".join(lines[1:] if decorated else lines)  # @classmethod is re-applied by the caller
    code = compile(
        body, inspect.getsourcefile(fn), "exec", __future__.annotations.compiler_flag, dont_inherit=True
    )
    namespace: dict[str, Any] = {}
    exec(code, fn.__globals__, namespace)  # noqa: S102 - the package's own source, minus the hooks
    return namespace[fn.__name__]


class HookSwitch:
    """Sets the hooked functions to the shipped ones (``use(True)``) or to their stripped copies."""

    def __init__(self) -> None:
        from taifuse import _array_ops

        self._slots: list[tuple[Any, str, Any, Any]] = []  # (owner, name, hooked, bypassed)
        for module_name, owner_name, name in _HOOKED:
            module = importlib.import_module(module_name)
            owner = getattr(module, owner_name) if owner_name else module
            raw = owner.__dict__[name]
            is_classmethod = isinstance(raw, classmethod)
            stripped = strip_hooks(raw.__func__ if is_classmethod else raw)
            self._slots.append((owner, name, raw, classmethod(stripped) if is_classmethod else stripped))
        for module_name, name in _array_ops.PROFILED_OPS:
            module = importlib.import_module(f"taifuse.{module_name}")
            wrapper = getattr(module, name)
            self._slots.append((module, name, wrapper, wrapper.__wrapped__))

    def use(self, hooks: bool) -> None:
        for owner, name, hooked, bypassed in self._slots:
            setattr(owner, name, hooked if hooks else bypassed)


@functools.cache
def hook_switch() -> HookSwitch:
    """The process's one :class:`HookSwitch` (built while the shipped functions are installed)."""
    return HookSwitch()


_SETUP = mlp_setup_code(BATCH, SIZES)

_PREPARE = (
    mlp_model_code(SIZES)
    + """opt = optim.AdamW(params, lr=1e-3)
xt = taifuse.tensor(x)
hooks = suite.hook_switch()
loss = None
step = training.StepOutput(lambda: [loss.numpy()] + [p.numpy() for p in params])
"""
)

_STEP = """
opt.zero_grad()
loss = F.cross_entropy(model(xt), y)
loss.backward()
opt.step()
"""

_IMPORTS = (
    "numpy as np",
    "taifuse",
    "taifuse.nn as nn",
    "taifuse.optim as optim",
    "taifuse.functional as F",
    "taifuse.profiler as profiler",
    "taifuse.bench.suites.profiler as suite",
    "taifuse.bench.suites.training as training",
)


def _variant(label: str, code: str, note: str) -> Variant:
    return Variant(label, code, result="step", prepare=_PREPARE, imports=_IMPORTS, note=note)


def _indent(code: str) -> str:
    return textwrap.indent(code.strip(), "    ")


def cases(quick: bool = False, compare_torch: bool = False) -> list[Case]:
    """Two cases: the disabled hooks against the same step with them stripped, and the step under
    an active profiler against the step with none. The same in quick mode."""
    shape = "-".join(str(n) for n in SIZES)
    common = {
        "suite": SUITE,
        "setup": functools.partial(mlp_inputs, batch=BATCH, sizes=SIZES),
        "setup_code": _SETUP,
        "dtype": "float32",
        "shape": f"MLP {shape} (GELU hidden layers), batch {BATCH}, cross entropy, AdamW step",
        "bytes_moved": 0,  # a per-call cost, judged against no ceiling
        # The loss and the parameters after one step from the same start: identical code paths.
        "rtol": 1e-6,
        "atol": 1e-7,
    }
    disabled = Case(
        name=f"mlp_step({shape}, batch={BATCH}), profiler off: hooks vs hooks stripped",
        candidate=_variant(
            "hooks, no profiler",
            "hooks.use(True)\n" + _STEP + "hooks.use(True)\n",
            "as shipped: one ACTIVE read per hooked call",
        ),
        baselines=(
            _variant(
                "hooks stripped",
                "hooks.use(False)\n" + _STEP + "hooks.use(True)\n",
                "the hooked functions rebuilt from their source without the hook lines (NOTE [ Hooks bypassed ])",
            ),
        ),
        **common,
    )
    enabled = Case(
        name=f"mlp_step({shape}, batch={BATCH}), profiler on vs off",
        candidate=_variant(
            "profiler on",
            "hooks.use(True)\nwith profiler.profile():\n" + _indent(_STEP),
            "profile() entered and left around each step (record_shapes, profile_memory, sync: the defaults)",
        ),
        baselines=(
            _variant("profiler off", "hooks.use(True)\n" + _STEP, "the same step, no profiler active"),
        ),
        **common,
    )
    return [disabled, enabled]
