"""The linear benchmark suite's backward case: registered in both modes, and its candidate computes
the weight gradient the NumPy reference does (and PyTorch's, when installed) on the case's inputs."""

from __future__ import annotations

import contextlib
import importlib.util
import warnings

import numpy as np
import pytest

import taifuse
from taifuse import backends
from taifuse.backends import reference
from taifuse.bench.case import check_outputs
from taifuse.bench.suites import linear, load_cases

BACKWARD = "linear/linear backward(activation='gelu')"


@contextlib.contextmanager
def _on_numba():
    """Numba in this thread for the block; the process's choice (backend and Taichi arch) untouched.

    Not ``set_backend("numba")`` then ``set_backend(previous)``: ``get_backend()`` names no arch, so
    after a taichi-vulkan test that put Taichi back on the default arch (and, before it was the best
    arch here, failed to start Metal on Linux and fell back to numba with a warning).
    """
    with taifuse.use_backend("numba"):
        yield


@pytest.fixture
def numba_backend():
    with _on_numba():
        yield


@pytest.mark.vulkan
def test_numba_fixture_leaves_the_backend_and_taichi_arch_as_they_were():
    pytest.importorskip("taichi")
    with backends.preserved_choice(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        taifuse.set_backend("taichi", arch="vulkan")
        if backends.active().describe()["arch"] != "vulkan":
            pytest.skip("taichi-vulkan unavailable")
        with _on_numba():
            assert taifuse.get_backend() == "numba"
        assert taifuse.get_backend() == "taichi"
        assert backends.active().describe()["arch"] == "vulkan"
    assert [str(w.message) for w in caught if "taifuse" in str(w.message)] == []


def _backward_case(compare_torch: bool = False):
    (case,) = [c for c in load_cases(["linear"], quick=True, compare_torch=compare_torch) if c.id == BACKWARD]
    return case


def test_backward_case_in_both_modes_at_the_parallel_size():
    for quick in (False, True):
        assert BACKWARD in {c.id for c in load_cases(["linear"], quick=quick)}
    # N x M at 4M outputs, the size where the parallel and serial epilogues were measured against
    # each other (NOTE [ Serial epilogue between BLAS calls ] in backends/numba/_jit.py).
    assert linear.BWD_BATCH * linear.BWD_OUT >= 1 << 22


def test_backward_candidate_matches_the_reference(numba_backend):
    case = _backward_case()
    inputs = case.setup(0)
    got = case.candidate.build(inputs)()
    x, w, pre, g = (inputs[k].astype(np.float64) for k in ("x", "w", "pre", "g"))
    want = np.empty(w.shape)
    reference.linear_act_backward(x, w, pre, g, "gelu", np.empty(g.shape), None, want, None)
    check = check_outputs(want.astype(np.float32), got, case.rtol, case.atol)
    assert check["ok"], check


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
def test_backward_candidate_matches_torch(numba_backend):
    case = _backward_case(compare_torch=True)
    inputs = case.setup(0)
    check = check_outputs(
        case.variant("torch").build(inputs)(), case.candidate.build(inputs)(), case.rtol, case.atol
    )
    assert check["ok"], check
