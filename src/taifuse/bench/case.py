"""What a benchmark suite declares: cases, each with a candidate and the baselines it is compared with.

NOTE [ The code string is the code ]
A :class:`Variant` is given as source text (``prepare`` once, ``code`` per call, ``result`` to
return), and that text is compiled and run as written. So the baseline code printed in the report
is exactly what was timed, never a description of it.
"""

from __future__ import annotations

import importlib
import importlib.util
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# ``imports`` entries: "module" or "module as alias".
DEFAULT_IMPORTS = ("numpy as np",)


@dataclass(frozen=True)
class Variant:
    """One implementation of a case's operation.

    Attributes:
        label: short name shown in the report (``"numpy"``, ``"torch"``, ``"taifuse"``).
        code: statements run on every timed call; they see the case's inputs by name.
        result: expression whose value is the output (checked with ``allclose`` before timing).
        prepare: statements run once before the first call (scratch buffers, tensor views).
        imports: modules bound in the code's namespace, ``"module"`` or ``"module as alias"``.
        same_result: False for a bound that computes something else (a bare matrix product, a
            copy): it is timed but not checked, and its row says so.
        note: one line for the report (why this baseline, what a bound means).
        isolated: time this baseline in fresh processes of its own, never back to back with the
            candidate in one process (NOTE [ Isolated baselines ] in ``taifuse.bench.harness``).
        sync: statements that wait for the variant's device work (``torch.cuda.synchronize()``),
            run before each timer starts and before it stops (NOTE [ Timing device work ] in
            ``taifuse.bench.timing``); empty for work that is done when the call returns.
    """

    label: str
    code: str
    result: str = "out"
    prepare: str = ""
    imports: tuple[str, ...] = DEFAULT_IMPORTS
    same_result: bool = True
    note: str = ""
    isolated: bool = False
    sync: str = ""

    @property
    def modules(self) -> tuple[str, ...]:
        return tuple(spec.split(" as ")[0].strip() for spec in self.imports)

    @property
    def peer(self) -> bool:
        """Whether this is another library's implementation of the same function (NumPy's,
        PyTorch's): a row against it compares taifuse with a peer. A bound (``same_result=False``)
        or a variant of taifuse itself (pool off, finite check) is not one. ``taifuse.bench``'s
        own modules are the harness's helpers (a peer's training loop may import one), not taifuse."""
        return self.same_result and not any(_is_taifuse_code(m) for m in self.modules)

    def available(self) -> bool:
        """Whether every module the variant imports is installed (checked without importing)."""
        for name in self.modules:
            top = name.split(".")[0]
            if importlib.util.find_spec(top) is None:
                return False
        return True

    def build(self, inputs: dict[str, Any]) -> Callable[[], Any]:
        """Compile the variant into a zero-argument callable over ``inputs``."""
        namespace: dict[str, Any] = dict(inputs)
        for spec in self.imports:
            name, _, alias = spec.partition(" as ")
            name, alias = name.strip(), alias.strip()
            module = importlib.import_module(name)
            namespace[alias or name.split(".")[0]] = (
                module if alias else importlib.import_module(name.split(".")[0])
            )
        if self.prepare:
            exec(compile(textwrap.dedent(self.prepare), f"<prepare {self.label}>", "exec"), namespace)  # noqa: S102
        body = textwrap.indent(textwrap.dedent(self.code).strip(), "    ")
        # In-place statements such as `t *= x` must update the prepared buffers, not new locals.
        shared = sorted(k for k in namespace if k.isidentifier() and not k.startswith("__"))
        header = f"    global {', '.join(shared)}\n" if shared else ""
        source = f"def _bench_call():\n{header}{body}\n    return {self.result}\n"
        # See NOTE [ The code string is the code ]: the suite's own text, run as written.
        exec(compile(source, f"<bench {self.label}>", "exec"), namespace)  # noqa: S102
        call = namespace["_bench_call"]
        if self.sync:
            sync_source = f"def _bench_sync():\n{textwrap.indent(textwrap.dedent(self.sync).strip(), '    ')}\n"
            exec(compile(sync_source, f"<sync {self.label}>", "exec"), namespace)  # noqa: S102
            call.sync = namespace["_bench_sync"]
        return call

    def full_code(self) -> str:
        """The text shown in the report: imports, one-time preparation, then the timed statements."""
        parts = [f"import {spec}" for spec in self.imports]
        if self.prepare:
            parts += ["# once, before timing:", textwrap.dedent(self.prepare).strip()]
        parts += ["# timed, every call:", textwrap.dedent(self.code).strip()]
        if self.sync:
            parts += ["# before the clock starts and before it stops:", textwrap.dedent(self.sync).strip()]
        return "\n".join(parts)


@dataclass(frozen=True)
class Case:
    """One operation at one size, timed as candidate against each baseline.

    Attributes:
        suite, name: identify the case (``id`` is ``"suite/name"``).
        setup: ``seed -> inputs`` (a dict of arrays the variants' code refers to by name).
        setup_code: how ``setup`` draws the inputs, for the report.
        candidate: the taifuse implementation.
        baselines: what it is compared with, strongest reasonable first.
        dtype, shape: for the report.
        bytes_moved: bytes one call must read and write at least (inputs + output).
        flops: floating-point operations of one call when compute-bound (0 for memory-bound ops).
        bytes_written: the part of ``bytes_moved`` that is written (the output): the roofline counts
            it twice, as the hardware moves it (NOTE [ Traffic model ] in taifuse._ceilings).
        rtol, atol: ``numpy.allclose`` tolerance of the correctness check.
        min_loops: calls per timed sample, at least (the harness calibrates a sample to last
            ``MIN_SAMPLE_NS`` and takes the larger count): a call of a few microseconds needs
            many per sample for a narrow interval (the step suite's per-op rows, NOTE [ Per-op
            timing ] there). A row's times stay per call.
    """

    suite: str
    name: str
    setup: Callable[[int], dict[str, Any]]
    setup_code: str
    candidate: Variant
    baselines: tuple[Variant, ...]
    dtype: str
    shape: str
    bytes_moved: int
    flops: int = 0
    bytes_written: int = 0
    seed: int = 0
    rtol: float = 1e-5
    atol: float = 1e-6
    extra: dict = field(default_factory=dict)
    min_loops: int = 1

    @property
    def id(self) -> str:
        return f"{self.suite}/{self.name}"

    def variant(self, label: str) -> Variant:
        for v in (self.candidate, *self.baselines):
            if v.label == label:
                return v
        raise KeyError(f"case {self.id} has no variant {label!r}")


def to_host(value: Any) -> np.ndarray:
    """A NumPy copy of a variant's output (NumPy array, torch tensor, or a backend array)."""
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    elif not isinstance(value, np.ndarray) and hasattr(value, "numpy"):
        value = value.numpy()
    return np.array(value, copy=True)


def check_outputs(expected: Any, actual: Any, rtol: float, atol: float) -> dict:
    """Compare two outputs with ``numpy.allclose``; the verdict and the worst errors, as a dict."""
    e, a = to_host(expected), to_host(actual)
    report = {"ok": False, "rtol": rtol, "atol": atol, "max_abs_err": None, "max_rel_err": None, "reason": ""}
    if e.shape != a.shape:
        report["reason"] = f"shape {a.shape} != {e.shape}"
        return report
    if e.dtype != a.dtype:
        report["reason"] = f"dtype {a.dtype} != {e.dtype}"
        return report
    e64, a64 = e.astype(np.float64), a.astype(np.float64)
    err = np.abs(a64 - e64)
    if err.size:
        report["max_abs_err"] = float(np.nanmax(err)) if np.isfinite(err).any() else float("inf")
        report["max_rel_err"] = float(np.nanmax(err / np.maximum(np.abs(e64), atol)))
    report["ok"] = bool(np.allclose(a64, e64, rtol=rtol, atol=atol))
    if not report["ok"]:
        report["reason"] = f"not allclose (rtol={rtol}, atol={atol})"
    return report


def _is_taifuse_code(module: str) -> bool:
    """Whether ``module`` is taifuse's own computing code (not the bench harness's helpers)."""
    return module.split(".")[0] == "taifuse" and not module.startswith("taifuse.bench")
