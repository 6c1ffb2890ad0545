"""Gradient clipping by total norm, as ``torch.nn.utils.clip_grad_norm_``."""

from __future__ import annotations

import math
from collections.abc import Iterable
from types import ModuleType
from typing import Any

import numpy as np

from taifuse._internal import backend, data, wrap
from taifuse._tensor_math import astype, math_for
from taifuse.tensor import Tensor


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
    be = backend(grads[0])
    # Through the backend's tensor math, so that on a device nothing leaves it (the total stays a
    # 0-d array there); only error_if_nonfinite reads the total back, as PyTorch syncs then.
    m = math_for(be)
    # NOTE: infinity * 0 and NaN * x are NaN, silently, as in PyTorch (the caller asked for them).
    with np.errstate(invalid="ignore", over="ignore"):
        total = _total_norm(m, _accumulation_dtype(be), [data(g) for g in grads], norm_type)
    if error_if_nonfinite:
        value = m.item(total)
        if not math.isfinite(value):
            raise RuntimeError(
                f"clip_grad_norm_: the total norm of order {norm_type} of the gradients is non-finite "
                f"({value}), so it cannot be clipped; pass error_if_nonfinite=False to scale by it anyway"
            )
    with np.errstate(invalid="ignore", over="ignore"):
        # min(1, max_norm / (total + 1e-6)); minimum keeps a NaN: a NaN norm makes NaN gradients, as in PyTorch.
        coef = m.minimum(m.div(float(max_norm), m.add(total, 1e-6)), 1.0)
        coefs = {coef.dtype: coef}  # cast once per gradient dtype, not once per gradient
        for g in grads:
            # In place, as PyTorch's mul_: a reference to a gradient sees the clipped values.
            a = data(g)
            if a.dtype not in coefs:
                coefs[a.dtype] = astype(m, coef, a.dtype)
            m.mul_(a, coefs[a.dtype])
    if total.dtype != np.float32:
        total = astype(m, total, np.float32)
    return wrap(total, be)


def _accumulation_dtype(be: ModuleType) -> np.dtype:
    """float64 where the backend has it (the host backends); float32 on Taichi (Metal has no float64)."""
    try:
        be.check_dtype(np.dtype(np.float64), "clip_grad_norm_")
    except TypeError:
        return np.dtype(np.float32)
    return np.dtype(np.float64)


def _total_norm(m: Any, dtype: np.dtype, grads: list[Any], norm_type: float) -> Any:
    """The ``norm_type``-norm of ``grads`` together, a 0-d array of ``dtype`` computed by ``m``."""
    if (
        norm_type == 2
        and any(g.size for g in grads)
        and all(isinstance(g, np.ndarray) and g.dtype != dtype for g in grads)
    ):
        # Host gradients narrower than the accumulation dtype (float32 on the host backends: the
        # usual case): their float64 sums of squares, the same additions in the same order as the
        # loop below makes them, but on Python floats, not a backend 0-d array per gradient.
        return m.pow_scalar(m.sum_of_squares(grads, dtype), 0.5)  # one scratch block for all
    total = None
    for g in grads:
        if not g.size:
            continue  # adds 0 to a sum, nothing to a max
        if norm_type == 2 and isinstance(g, np.ndarray) and g.dtype != dtype:
            term = m.sum_of_squares(g, dtype)  # widened in blocks, not whole
            total = term if total is None else m.add(total, term)
            continue
        a = g if g.dtype == dtype else astype(m, g, dtype)
        if math.isinf(norm_type):
            # max, not a Python max(): a NaN anywhere must make the norm NaN, as in PyTorch.
            term = m.max(m.abs(a), None, False)
            total = term if total is None else m.maximum(total, term)
        else:
            powered = m.mul(a, a) if norm_type == 2 else m.pow_scalar(m.abs(a), norm_type)
            term = m.sum(powered, None, False)
            total = term if total is None else m.add(total, term)
    if total is None:
        return m.full((), 0.0, dtype)
    return total if math.isinf(norm_type) else m.pow_scalar(total, 1.0 / norm_type)


def _scalar(value: float) -> Tensor:
    from taifuse import tensor

    return tensor(value)
