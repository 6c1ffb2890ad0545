"""Regression tests for reported bugs that have no more natural home; each says what was reported."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest

from taifuse.backends import reference as ref

f32 = np.float32

needs_numba = pytest.mark.skipif(importlib.util.find_spec("numba") is None, reason="numba is not installed")


# ----------------------------------------------------------------------------- out= overlapping a parameter
# functional.py rejects these (NOTE [ out= overlap ]); the numba kernels, like the reference, still
# compute them correctly when called directly, as they already did for out overlapping x.


@needs_numba
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_numba_linear_act_with_out_overlapping_bias(dtype):
    # Reported: x = w = ones((2, 3)), bias = out[0] gave [[6, 6], [9, 9]] on numba, [[13, 23]] * 2 on numpy.
    from taifuse.backends import numba as nb

    x = w = np.ones((2, 3), dtype)
    results = {}
    for name, kernels in (("numpy", ref), ("numba", nb)):
        out = np.zeros((2, 2), dtype)
        out[0] = [10, 20]
        kernels.linear_act(x, w, out[0], None, out)
        results[name] = out
    np.testing.assert_array_equal(results["numpy"], [[13, 23], [13, 23]])
    np.testing.assert_array_equal(results["numba"], results["numpy"])


@needs_numba
@pytest.mark.parametrize("param", ["weight", "bias"])
def test_numba_layer_norm_with_out_overlapping_a_parameter(param):
    from taifuse.backends import numba as nb

    x = np.array([[1, 2, 4], [3, 0, 1], [1, 1, 2]], f32)
    results = {}
    for name, kernels in (("numpy", ref), ("numba", nb)):
        out = np.zeros((3, 3), f32)
        out[0] = [1, 2, 3]
        args = (out[0], None) if param == "weight" else (None, out[0])
        kernels.layer_norm(x, *args, 1e-5, out, np.empty(3, f32), np.empty(3, f32))
        results[name] = out
    np.testing.assert_allclose(results["numba"], results["numpy"], rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- taifuse info


@pytest.mark.parametrize("var, value", [("TAIFUSE_BACKEND", "torch"), ("TAIFUSE_TAICHI_ARCH", "opengl")])
def test_info_with_a_bad_env_value_is_a_one_line_error(var, value):
    # Reported: `taifuse info` with TAIFUSE_BACKEND=torch printed a traceback.
    env = {k: v for k, v in os.environ.items() if not k.startswith("TAIFUSE_")}
    env[var] = value
    proc = subprocess.run(
        [sys.executable, "-m", "taifuse.cli", "info"],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and var in lines[0] and repr(value) in lines[0], proc.stderr
    # What does not depend on the backend is still printed: the point of `info` is diagnosis.
    assert "backends installed:" in proc.stdout and f"{var}={value}" in proc.stdout
