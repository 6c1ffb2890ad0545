"""``Checkpoint(module)``: a module whose activations are recomputed in the backward instead of kept."""

from __future__ import annotations

from typing import Any

from taifuse.checkpoint import checkpoint
from taifuse.nn.module import Module
from taifuse.tensor import Tensor


class Checkpoint(Module):
    """Wraps ``module`` so that each call is a :func:`taifuse.checkpoint.checkpoint` of it.

    Args:
        module: the module to checkpoint; it stays registered as ``.module``, so its parameters are
            the wrapper's (``state_dict`` names gain a ``module.`` prefix).
        preserve_rng_state: as in :func:`taifuse.checkpoint.checkpoint`.

    The wrapped module's outputs are the same as unwrapped (bitwise, and so are the gradients);
    between its forward and backward only its inputs are kept.

    Example::

        >>> import numpy as np, taifuse, taifuse.nn as nn
        >>> taifuse.set_backend("numpy")
        >>> taifuse.manual_seed(0)
        >>> block = nn.Sequential(nn.Linear(8, 8, activation="gelu"), nn.Linear(8, 8, activation="gelu"))
        >>> model = nn.Sequential(nn.Checkpoint(block), nn.Linear(8, 2))
        >>> [name for name, _ in model.named_parameters()][:2]
        ['0.module.0.weight', '0.module.0.bias']
        >>> model(taifuse.tensor(np.ones((3, 8), np.float32))).sum().backward()
        >>> block[0].weight.grad.shape
        (8, 8)
    """

    def __init__(self, module: Module, preserve_rng_state: bool = True) -> None:
        super().__init__()
        if not isinstance(module, Module):
            raise TypeError(f"Checkpoint: module should be a Module, got {type(module).__name__}")
        self.module = module
        self.preserve_rng_state = bool(preserve_rng_state)

    def forward(self, *args: Any) -> Tensor:
        return checkpoint(self.module, *args, preserve_rng_state=self.preserve_rng_state)

    def extra_repr(self) -> str:
        return "" if self.preserve_rng_state else "preserve_rng_state=False"
