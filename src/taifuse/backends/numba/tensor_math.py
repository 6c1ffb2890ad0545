"""The numba backend's tensor arithmetic: ``taifuse._tensor_math.HostMath`` with the large
same-shape ``+``, ``-``, ``*`` and ``+=`` on Numba's threads (NOTE [ Numba tensor math ])."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from taifuse import _tensor_math
from taifuse.backends.numba import _jit, forward

# NOTE [ Numba tensor math ]
# A Tensor's ``+`` is NumPy's ufunc on the host backends, on one thread. In the GPT example's
# step the residual adds ((16, 128, 256) float32, 2 MiB per operand) were the largest
# memory-bound row of the profile after layer norm, at a fifth of the copy bandwidth. Where both
# operands are C-contiguous float32 or float64 arrays of one shape and large enough for a
# parallel kernel (``_jit._parallel``), the numba backend adds, subtracts and multiplies them
# with its own kernels (``forward.add``: 512-bit vectors, its threads), and so sums gradients in
# place (``add_``: the autograd engine's sums of the residual stream's gradients). Everything
# else (broadcasting, scalars, strided views, mixed dtypes, float16, small arrays) stays NumPy's.
# Each element is one IEEE operation rounded once either way, so the results are NumPy's to the
# bit. Measured at (2048, 256) float32 with the operands rotated over 24 pairs (out of L2, as in
# the step), one thread each, on a loaded 2-core machine: the kernel took 0.75x np.add's CPU time
# [0.68, 0.80] (median [quartiles] of 15 interleaved rounds).
_THREADED_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def _threaded(a: Any, b: Any) -> bool:
    """Whether ``a op b`` runs on the numba kernels (NOTE [ Numba tensor math ])."""
    return (
        type(a) is np.ndarray
        and type(b) is np.ndarray
        and a.shape == b.shape
        and a.dtype == b.dtype
        and a.dtype in _THREADED_DTYPES
        and _jit._parallel(a.size)
        and a.flags.c_contiguous
        and b.flags.c_contiguous
    )


def _binary(kernel: Callable[..., None], ufunc: np.ufunc, a: Any, b: Any) -> np.ndarray:
    if not _threaded(a, b):
        return _tensor_math._binary(ufunc, a, b)
    out = _tensor_math._buffer(a.shape, a.dtype)
    kernel(a, b, out)
    return out


class NumbaMath(_tensor_math.HostMath):
    """Tensor arithmetic for the numba backend: HostMath's, large same-shape ``+ - *`` and ``+=`` threaded."""

    @staticmethod
    def add(a: Any, b: Any) -> np.ndarray:
        return _binary(forward.add, np.add, a, b)

    @staticmethod
    def sub(a: Any, b: Any) -> np.ndarray:
        return _binary(forward.sub, np.subtract, a, b)

    @staticmethod
    def mul(a: Any, b: Any) -> np.ndarray:
        return _binary(forward.mul, np.multiply, a, b)

    @staticmethod
    def add_(acc: np.ndarray, a: Any) -> None:
        """acc += a, in place (the autograd engine's gradient sums among others)."""
        if _threaded(acc, a):
            forward.add(acc, a, acc)
        else:
            _tensor_math.HostMath.add_(acc, a)


TENSOR_MATH = NumbaMath()
