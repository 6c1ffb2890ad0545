"""taifuse: fused neural-network kernels for Apple's Metal GPU (Taichi), with Numba CPU kernels.

``import taifuse`` imports NumPy only; Numba and Taichi are imported and started on first use.
The subpackages (``taifuse.nn``, ``taifuse.optim``, ``taifuse.functional``, ``taifuse.checkpoint``,
``taifuse.pool``, ``taifuse.data``, ``taifuse.utils``, ...) are imported the first time they are
reached as attributes, and so are ``taifuse.save`` and ``taifuse.load`` (safetensors checkpoints).

Example::

    >>> import numpy as np
    >>> import taifuse, taifuse.functional as F
    >>> taifuse.manual_seed(0)
    >>> F.gelu(np.zeros(3, dtype=np.float32))
    array([0., 0., 0.], dtype=float32)
"""

import importlib as _importlib
import importlib.util as _importlib_util
from typing import Any as _Any

from taifuse._random import manual_seed
from taifuse.backends import available_backends, get_backend, set_backend, use_backend

# NOTE: after this import ``taifuse.tensor`` is the function, not the module (as ``torch.tensor``);
# import the module's other names with ``from taifuse.tensor import ...``.
from taifuse.tensor import Tensor, cat, enable_grad, is_grad_enabled, no_grad, stack, tensor

__version__ = "0.1.0"

__all__ = [
    "Tensor",
    "__version__",
    "available_backends",
    "cat",
    "compile",
    "enable_grad",
    "get_backend",
    "is_grad_enabled",
    "load",
    "manual_seed",
    "no_grad",
    "save",
    "set_backend",
    "stack",
    "tensor",
    "use_backend",
]

# Subpackages and modules reachable as ``taifuse.<name>`` without importing them at ``import
# taifuse`` (PEP 562), which must stay light: nn, optim and functional import the autograd layer.
# Names whose module does not exist (yet) are simply absent attributes. ``tensor`` is not here:
# ``taifuse.tensor`` is the function (the NOTE above); ``taifuse.checkpoint`` is the module,
# whose function is ``taifuse.checkpoint.checkpoint``, as ``torch.utils.checkpoint``.
_LAZY_SUBMODULES = (
    "nn", "optim", "functional", "checkpoint", "pool", "amp", "profiler", "monitor", "data", "utils",
    "distributed",  # imports mpi4py (the ``distributed`` extra) on first use only
    "library",
)  # fmt: skip
# Functions reachable as ``taifuse.<name>``, imported from their module on first use (the module
# imports its heavy dependency, safetensors, only when called).
_LAZY_FUNCTIONS = {"save": "serialization", "load": "serialization", "compile": "compiler"}


def __getattr__(name: str) -> _Any:
    if name in _LAZY_FUNCTIONS:
        value = getattr(_importlib.import_module(f"{__name__}.{_LAZY_FUNCTIONS[name]}"), name)
        globals()[name] = value
        return value
    if name in _LAZY_SUBMODULES:
        try:
            # Importing a submodule also binds it in this namespace, so this runs once per name.
            return _importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise  # the module exists, and something it imports is missing: say that
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    present = [n for n in _LAZY_SUBMODULES if _importlib_util.find_spec(f"{__name__}.{n}") is not None]
    return sorted(set(globals()) | set(present) | set(_LAZY_FUNCTIONS))
