"""The numba backend's scalar math, for users' ``@numba.njit`` kernels (docs/custom_ops.md).

``exp``, ``sigmoid`` and ``silu`` called inside a jitted function compile to the backend's own
float32 code (a Cephes polynomial with the power of two built from its bits, max relative error
8.5e-8: the functions below ``_exp_f32`` in ``_jit.py``), which LLVM vectorizes, where ``np.exp``
is a scalar call into libm; in float64 they are libm's. Called from Python they run NumPy's.

Example::

    >>> import numba, numpy as np
    >>> from taifuse.backends.numba.jitmath import sigmoid
    >>> @numba.njit
    ... def f(x):
    ...     return sigmoid(x)
    >>> round(float(f(np.float32(0.0))), 6), round(float(f(0.0)), 6)
    (0.5, 0.5)
"""

from __future__ import annotations

import numpy as np
from numba import types
from numba.extending import overload

from taifuse.backends.numba._jit import (
    _exp_f32,
    _sigmoid_f32,
    _sigmoid_f64,
    _silu_f32,
    _silu_f64,
)

__all__ = ["exp", "sigmoid", "silu"]


def exp(v):
    """e ** v."""
    return np.exp(v)


def sigmoid(v):
    """1 / (1 + exp(-v)), without overflow."""
    return 1.0 / (1.0 + np.exp(-v))


def silu(v):
    """v * sigmoid(v)."""
    return v * sigmoid(v)


def _by_dtype(f32, f64):
    def pick(v):
        if v == types.float32:
            return lambda v: f32(v)
        if isinstance(v, types.Float | types.Integer):
            return lambda v: f64(v)
        return None

    return pick


overload(exp, inline="always")(_by_dtype(_exp_f32, np.exp))
overload(sigmoid, inline="always")(_by_dtype(_sigmoid_f32, _sigmoid_f64))
overload(silu, inline="always")(_by_dtype(_silu_f32, _silu_f64))
