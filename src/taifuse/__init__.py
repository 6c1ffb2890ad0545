"""taifuse: fused neural-network kernels for Apple's Metal GPU (Taichi), with Numba CPU kernels.

``import taifuse`` imports NumPy only; Numba and Taichi are imported and started on first use.

Example::

    >>> import numpy as np
    >>> import taifuse, taifuse.functional as F
    >>> taifuse.manual_seed(0)
    >>> F.gelu(np.zeros(3, dtype=np.float32))
    array([0., 0., 0.], dtype=float32)
"""

from taifuse._random import manual_seed
from taifuse.backends import available_backends, get_backend, set_backend, use_backend

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "available_backends",
    "get_backend",
    "manual_seed",
    "set_backend",
    "use_backend",
]
