"""The NumPy reference backend: the living specification of every kernel.

Its table is this package: the kernels ``backends/_spec.py`` lists, each from the module it names
(the forward kernels in ``forward.py``, the backward and loss kernels in ``backward.py``,
attention's pair in ``attention.py``, the fused optimizer kernels in ``optim.py``), each written
for clarity in float64, never for speed. Every other backend is tested against it. The conventions every
backend's kernels follow are in ``forward.py``'s docstring.
"""

from __future__ import annotations

import numpy as np

from taifuse.backends import _spec
from taifuse.backends._host import ALLOCATOR, check_dtype, empty, from_numpy, is_array, to_numpy
from taifuse.backends._spec import ACTIVATIONS
from taifuse.backends.reference.backward import LOSS_REDUCTIONS
from taifuse.backends.reference.forward import dropout_key, dropout_scale, dropout_threshold, hash32

NAME = "numpy"


def init() -> None:
    """Nothing to start: NumPy is always there."""


def describe() -> dict:
    return {"backend": NAME, "numpy": np.__version__}


# The kernels: every name backends/_spec.py lists, from the module it names.
_KERNELS = _spec.kernel_table(NAME, __name__)
globals().update(_KERNELS)

__all__ = [
    "ACTIVATIONS",
    "ALLOCATOR",
    "LOSS_REDUCTIONS",
    "NAME",
    "check_dtype",
    "describe",
    "dropout_key",
    "dropout_scale",
    "dropout_threshold",
    "empty",
    "from_numpy",
    "hash32",
    "init",
    "is_array",
    "to_numpy",
] + list(_KERNELS)
