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

import numba
import numpy as np

from taifuse.backends import _spec
from taifuse.backends._host import ALLOCATOR, check_dtype, empty, from_numpy, is_array, to_numpy
from taifuse.backends.numba._jit import (
    _parallel_min_elements,
    _threading_layer,
)
from taifuse.backends.numba.tensor_math import TENSOR_MATH

NAME = "numba"
# The attention kernels take q, k, v and grad_out as (B, H, n, d) views of any row strides
# (NOTE [ Numba attention views ] in attention.py): _autograd_ops passes them without a copy.
ATTENTION_VIEWS = True


def init() -> None:
    """Start Numba's threads (NOTE [ OpenMP spin between BLAS calls ] in ``_jit.py``: before any
    parallel kernel runs); kernels compile on first use."""
    _threading_layer()


def describe() -> dict:
    """Numba version, threading layer and thread count."""
    return {
        "backend": NAME,
        "numba": numba.__version__,
        "numpy": np.__version__,
        "threading_layer": _threading_layer(),
        "threads": numba.get_num_threads(),
        "parallel_min_elements": _parallel_min_elements(),
    }


# The kernels: every name backends/_spec.py lists, from the module it names.
_KERNELS = _spec.kernel_table(NAME, __name__)
globals().update(_KERNELS)

__all__ = [
    "ALLOCATOR",
    "NAME",
    "TENSOR_MATH",
    "check_dtype",
    "describe",
    "empty",
    "from_numpy",
    "init",
    "is_array",
    "to_numpy",
] + list(_KERNELS)
