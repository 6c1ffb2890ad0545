"""The Numba CPU backend: JIT-compiled, multithreaded kernels on NumPy arrays.

Its kernel table is this package: the kernels ``backends/_spec.py`` lists, each from the module it
names (the forward kernels in ``forward.py``, the backward and loss kernels in ``backward.py``,
attention's pair in ``attention.py``, the fused optimizer kernels in ``optim.py``), all built on
``_jit.py`` (jit options, intrinsics, scalar math, the serial-or-parallel choice), which imports
nothing else of the package. Signatures and semantics are the reference backend's (``backends/reference``).

Importing it imports Numba, so it is imported only when the backend is chosen
(``taifuse.backends`` does that lazily; ``import taifuse`` never imports Numba). Kernels compile
on first use per dtype and are cached on disk (``cache=True``).
"""

from __future__ import annotations

from types import SimpleNamespace

import numba
import numpy as np

from taifuse.backends import _spec
from taifuse.backends._host import ALLOCATOR, check_dtype, empty, from_numpy, is_array, to_numpy
from taifuse.backends.numba import _blas
from taifuse.backends.numba import forward as _forward
from taifuse.backends.numba._jit import (
    _parallel_min_elements,
    _threading_layer,
)

NAME = "numba"
# The attention kernels take q, k, v and grad_out as (B, H, n, d) views of any row strides
# (NOTE [ Numba attention views ] in attention.py): _autograd_ops passes them without a copy.
ATTENTION_VIEWS = True


def init() -> None:
    """Start Numba's threads (NOTE [ OpenMP spin between BLAS calls ] in ``_jit.py``: before any
    parallel kernel runs) and shorten OpenBLAS's spin (NOTE [ OpenBLAS spin after a product ] in
    ``_blas.py``), once; kernels compile on first use."""
    global _started
    _threading_layer()
    if not _started:
        _started = True
        _blas.shorten_spin()


_started = False


def describe() -> dict:
    """Numba version, threading layer and thread count."""
    return {
        "backend": NAME,
        "numba": numba.__version__,
        "numpy": np.__version__,
        "threading_layer": _threading_layer(),
        "threads": numba.get_num_threads(),
        "parallel_min_elements": _parallel_min_elements(),
        "openblas_spin_log2": _blas.spin_log2(),
    }


# The same-shape arithmetic the host tensor math runs on this backend's kernels (NOTE [ Host
# tensor math on a backend's kernels ] in taifuse/_tensor_math.py).
HOST_MATH_KERNELS = SimpleNamespace(
    add=_forward.add, sub=_forward.sub, mul=_forward.mul, runs_parallel=_forward.runs_parallel
)

# The kernels: every name backends/_spec.py lists, from the module it names.
_KERNELS = _spec.kernel_table(NAME, __name__)
globals().update(_KERNELS)

__all__ = [
    "ALLOCATOR",
    "NAME",
    "HOST_MATH_KERNELS",
    "check_dtype",
    "describe",
    "empty",
    "from_numpy",
    "init",
    "is_array",
    "to_numpy",
] + list(_KERNELS)
