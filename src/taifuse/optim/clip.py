"""Gradient clipping by total norm, as ``torch.nn.utils.clip_grad_norm_``."""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

from taifuse.tensor import Tensor, no_grad


def clip_grad_norm_(
    parameters: Tensor | Iterable[Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
) -> Tensor:
    r"""Scale the gradients of ``parameters`` in place so that their total norm is at most ``max_norm``.

    The total norm is the ``norm_type``-norm of all gradients together (as if concatenated;
    ``float('inf')`` for the largest magnitude). Each gradient is multiplied by
    :math:`\min(1, \text{max\_norm} / (\text{total} + 10^{-6}))`, as PyTorch does. Parameters
    without a gradient are ignored.

    Args:
        parameters: a Tensor or an iterable of Tensors whose ``.grad`` to clip.
        max_norm: the largest allowed total norm, >= 0.
        norm_type: the p of the p-norm, > 0, or ``float('inf')``.
        error_if_nonfinite: raise ``RuntimeError`` when the total norm is NaN or infinite
            (the gradients are then left unchanged).

    Returns:
        The total norm of the gradients before clipping, as a 0-d float32 Tensor.

    Example::

        >>> import numpy as np, taifuse
        >>> from taifuse.optim import clip_grad_norm_
        >>> taifuse.set_backend("numpy")
        >>> w = taifuse.tensor(np.zeros(2, dtype=np.float32), requires_grad=True)
        >>> w.grad = taifuse.tensor(np.array([3.0, 4.0], dtype=np.float32))
        >>> clip_grad_norm_([w], max_norm=1.0).item()
        5.0
        >>> np.round(w.grad.numpy(), 4)
        array([0.6, 0.8], dtype=float32)
    """
    params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
    if not math.isfinite(float(max_norm)) or float(max_norm) < 0:
        raise ValueError(f"clip_grad_norm_ max_norm should be a finite number >= 0, got {max_norm!r}")
    norm_type = float(norm_type)
    if not (norm_type > 0):
        raise ValueError(f"clip_grad_norm_ norm_type should be > 0 or inf, got {norm_type}")
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return _scalar(0.0)
    be = grads[0]._be
    # Per-gradient norms in float64 on the host (the gradients are host arrays on numpy/numba).
    hosts = [np.asarray(be.to_numpy(g._data), dtype=np.float64).reshape(-1) for g in grads]
    if math.isinf(norm_type):
        # np.max, not Python's max(): Python's keeps a NaN only when it comes first (every
        # comparison with NaN is False), and a NaN anywhere must make the norm NaN, as in PyTorch.
        total = float(np.max([np.max(np.abs(h)) if h.size else 0.0 for h in hosts]))
    else:
        total = float(sum(float(np.sum(np.abs(h) ** norm_type)) for h in hosts) ** (1.0 / norm_type))
    if error_if_nonfinite and not math.isfinite(total):
        raise RuntimeError(
            f"clip_grad_norm_: the total norm of order {norm_type} of the gradients is non-finite ({total}), "
            "so it cannot be clipped; pass error_if_nonfinite=False to scale by it anyway"
        )
    coef = float(max_norm) / (total + 1e-6)
    coef = coef if (coef < 1.0 or math.isnan(coef)) else 1.0  # a NaN norm makes NaN gradients, as in PyTorch
    # NOTE: infinity * 0 and NaN * x are NaN, silently, as in PyTorch (the caller asked for them).
    # In place, as PyTorch's mul_: a reference to a gradient sees the clipped values.
    with np.errstate(invalid="ignore", over="ignore"), no_grad():
        for g in grads:
            g *= coef
    return Tensor._wrap(be.from_numpy(np.asarray(total, dtype=np.float32)), be)


def _scalar(value: float) -> Tensor:
    from taifuse import tensor

    return tensor(value)
