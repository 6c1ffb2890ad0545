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

# NOTE: after this import ``taifuse.tensor`` is the function, not the module (as ``torch.tensor``);
# import the module's other names with ``from taifuse.tensor import ...``.
from taifuse.tensor import Tensor, enable_grad, is_grad_enabled, no_grad, tensor

__version__ = "0.1.0"

__all__ = [
    "Tensor",
    "__version__",
    "available_backends",
    "enable_grad",
    "get_backend",
    "is_grad_enabled",
    "manual_seed",
    "no_grad",
    "set_backend",
    "tensor",
    "use_backend",
]
