"""The fused optimizer update kernels in plain NumPy: the specification every backend implements.

Each kernel updates one flat run of parameters in place, together with its optimizer state, in
one pass: ``param``, ``grad`` and every state array are C-contiguous 1-D arrays of the same length
and dtype (``taifuse.optim`` keeps a parameter group's tensors as views into such flat buffers, so
one call covers a whole group). Kernels only compute: they never allocate a result and never
check their inputs (``taifuse.optim`` validates hyperparameters before it calls them).

Precision: float16 is storage only (loaded into float32, computed, stored back rounded once);
float32 computes in float32 and float64 in float64. Scalars enter the arithmetic in the compute
precision, as PyTorch's CPU kernels take them. Each formula follows the order of operations of
``torch.optim``'s single-tensor implementation, so a float32 trajectory stays within rounding of
PyTorch's.

Signatures (the kernel table ``taifuse.backends.OPTIM_KERNEL_NAMES``)::

    sgd_step(param, grad, momentum_buffer, lr, momentum, dampening, weight_decay, nesterov,
             maximize, first_step)
    adam_step(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, step, lr, beta1, beta2, eps,
              weight_decay, decoupled, amsgrad, maximize)
    lion_step(param, grad, exp_avg, lr, beta1, beta2, weight_decay)
    all_finite(arrays) -> bool

``momentum_buffer`` is ``None`` when ``momentum == 0`` and ``max_exp_avg_sq`` is ``None`` unless
``amsgrad``; ``step`` is the 1-based number of the step being taken (for Adam's bias correction).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def compute_dtype(dtype: np.dtype) -> np.dtype:
    """The precision the update is computed in: float32 for float16/float32 storage, else float64."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def lerp_weight_is_small(weight: float) -> bool:
    """Which of torch's two lerp formulas applies: ``a + w * (b - a)`` when |w| < 0.5."""
    return abs(weight) < 0.5


def adam_scalars(step: int, lr: float, beta1: float, beta2: float) -> tuple[float, float]:
    """(step_size, sqrt(bias_correction2)) of Adam's step ``step``, in float64 as PyTorch's host code."""
    bias_correction1 = 1.0 - beta1**step
    bias_correction2 = 1.0 - beta2**step
    return lr / bias_correction1, math.sqrt(bias_correction2)


def _lerp(a: np.ndarray, b: np.ndarray, weight: float, ct: np.dtype) -> np.ndarray:
    w = ct.type(weight)
    if lerp_weight_is_small(weight):
        return a + w * (b - a)
    return b - (b - a) * ct.type(1.0 - weight)


# NOTE: non-finite values propagate through the kernels (as through PyTorch's); NumPy's warnings
# about them would only be noise when a caller opted out of the optimizer's finiteness check.
_QUIET = np.errstate(invalid="ignore", over="ignore", divide="ignore")


@_QUIET
def sgd_step(
    param: np.ndarray,
    grad: np.ndarray,
    momentum_buffer: np.ndarray | None,
    lr: float,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    maximize: bool,
    first_step: bool,
) -> None:
    """Stochastic gradient descent with momentum, in place.

    With ``d = (-g if maximize else g) + weight_decay * p``::

        buf = d                                   (first step)
        buf = momentum * buf + (1 - dampening) * d (later steps)
        p  -= lr * (d + momentum * buf if nesterov else buf)

    and ``p -= lr * d`` when ``momentum == 0`` (no buffer).
    """
    ct = compute_dtype(param.dtype)
    p = param.astype(ct)
    d = grad.astype(ct)
    if maximize:
        d = -d
    if weight_decay != 0:
        d = d + ct.type(weight_decay) * p
    if momentum != 0:
        assert momentum_buffer is not None
        if first_step:
            buf = d
        else:
            buf = momentum_buffer.astype(ct) * ct.type(momentum) + ct.type(1.0 - dampening) * d
        momentum_buffer[...] = buf
        # NOTE: what follows reads the stored (for float16, rounded) state, as PyTorch does.
        buf = momentum_buffer.astype(ct)
        d = d + ct.type(momentum) * buf if nesterov else buf
    param[...] = p + ct.type(-lr) * d


@_QUIET
def adam_step(
    param: np.ndarray,
    grad: np.ndarray,
    exp_avg: np.ndarray,
    exp_avg_sq: np.ndarray,
    max_exp_avg_sq: np.ndarray | None,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
    amsgrad: bool,
    maximize: bool,
) -> None:
    """Adam (Kingma & Ba) in place; ``decoupled=True`` is AdamW (Loshchilov & Hutter).

    With ``g = -grad if maximize else grad``, L2 decay ``g += weight_decay * p`` (Adam) or
    decoupled decay ``p *= 1 - lr * weight_decay`` (AdamW)::

        m = lerp(m, g, 1 - beta1)
        v = beta2 * v + (1 - beta2) * g * g
        v_max = max(v_max, v)                      (amsgrad; then v_max replaces v below)
        p += -lr / (1 - beta1**step) * m / (sqrt(v) / sqrt(1 - beta2**step) + eps)
    """
    ct = compute_dtype(param.dtype)
    p = param.astype(ct)
    g = grad.astype(ct)
    if maximize:
        g = -g
    if weight_decay != 0:
        if decoupled:
            p = p * ct.type(1.0 - lr * weight_decay)
        else:
            g = g + ct.type(weight_decay) * p
    m = _lerp(exp_avg.astype(ct), g, 1.0 - beta1, ct)
    v = exp_avg_sq.astype(ct) * ct.type(beta2) + ct.type(1.0 - beta2) * g * g
    exp_avg[...] = m
    exp_avg_sq[...] = v
    # NOTE: the rest reads the stored (for float16, rounded) moments, as PyTorch does.
    m, v = exp_avg.astype(ct), exp_avg_sq.astype(ct)
    if amsgrad:
        assert max_exp_avg_sq is not None
        max_exp_avg_sq[...] = np.maximum(max_exp_avg_sq.astype(ct), v)
        v = max_exp_avg_sq.astype(ct)
    step_size, bias_correction2_sqrt = adam_scalars(step, lr, beta1, beta2)
    denom = np.sqrt(v) / ct.type(bias_correction2_sqrt) + ct.type(eps)
    param[...] = p + ct.type(-step_size) * m / denom


@_QUIET
def lion_step(
    param: np.ndarray,
    grad: np.ndarray,
    exp_avg: np.ndarray,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
) -> None:
    """Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms") in place.

    The update::

        p *= 1 - lr * weight_decay
        p -= lr * sign(beta1 * m + (1 - beta1) * g)
        m  = beta2 * m + (1 - beta2) * g
    """
    ct = compute_dtype(param.dtype)
    p = param.astype(ct)
    g = grad.astype(ct)
    m = exp_avg.astype(ct)
    if weight_decay != 0:
        p = p * ct.type(1.0 - lr * weight_decay)
    update = np.sign(m * ct.type(beta1) + ct.type(1.0 - beta1) * g)
    param[...] = p + ct.type(-lr) * update
    exp_avg[...] = m * ct.type(beta2) + ct.type(1.0 - beta2) * g


def all_finite(arrays: Sequence[np.ndarray]) -> bool:
    """Whether every element of every array in ``arrays`` is finite (no NaN, no infinity).

    One call covers a whole step's gradients, so a device backend answers with one read-back.
    """
    return all(bool(np.isfinite(a).all()) for a in arrays)
