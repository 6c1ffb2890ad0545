"""The profiler suite's baseline: the hooked functions rebuilt without their hook lines."""

from __future__ import annotations

import dis
import importlib
import itertools

import numpy as np
import pytest

import taifuse
from taifuse import _array_ops, _engine, backends, pool
from taifuse.bench.suites import profiler as suite
from taifuse.nn import module
from taifuse.optim import optimizer

tensor = importlib.import_module("taifuse.tensor")  # the module (taifuse.tensor is also a function)


def _profiled_op(module_name: str, name: str):
    return getattr(importlib.import_module(f"taifuse.{module_name}"), name)


def _reads_active(fn) -> bool:
    """Whether ``fn`` reads the profiler's switch (``_profile_hook.ACTIVE``; the step compiler's
    ``_trace_hook.ACTIVE`` in ``BufferPool.acquire`` is not the profiler's hook)."""
    pairs = itertools.pairwise(dis.get_instructions(fn))
    return any(a.argval == "_profile_hook" and b.argval == "ACTIVE" for a, b in pairs)


@pytest.mark.parametrize(
    "fn",
    [tensor.Function.apply.__func__, _engine._walk, pool.BufferPool.acquire, module.Module.__call__,
     optimizer.Optimizer.step],
    ids=lambda f: f.__qualname__,
)  # fmt: skip
def test_strip_hooks_removes_the_hook_and_nothing_else(fn):
    assert _reads_active(fn)
    stripped = suite.strip_hooks(fn)
    assert not _reads_active(stripped)
    assert stripped.__name__ == fn.__name__ and stripped.__globals__ is fn.__globals__
    with pytest.raises(ValueError, match="no profiler hook"):
        suite.strip_hooks(tensor.is_grad_enabled)


def test_hook_switch_swaps_every_hooked_function_and_back():
    switch = suite.hook_switch()
    try:
        switch.use(False)
        assert not _reads_active(tensor.Function.__dict__["apply"].__func__)
        assert not _reads_active(_engine._walk)
        assert all(not hasattr(_profiled_op(m, n), "__wrapped__") for m, n in _array_ops.PROFILED_OPS)
    finally:
        switch.use(True)
    assert _reads_active(tensor.Function.__dict__["apply"].__func__)
    assert all(hasattr(_profiled_op(m, n), "__wrapped__") for m, n in _array_ops.PROFILED_OPS)


def test_both_variants_compute_the_same_step():
    with backends.preserved_choice():
        taifuse.set_backend("numpy")
        for case in suite.cases():
            inputs = case.setup(0)
            got = case.candidate.build(inputs)().numpy()
            want = case.baselines[0].build(inputs)().numpy()
            np.testing.assert_array_equal(got, want)
        suite.hook_switch().use(True)
