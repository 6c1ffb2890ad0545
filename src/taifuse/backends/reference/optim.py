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
    unscale_check(grads, inv_scale) -> found_inf

``momentum_buffer`` is ``None`` when ``momentum == 0`` and ``max_exp_avg_sq`` is ``None`` unless
``amsgrad``; ``step`` is the 1-based number of the step being taken (for Adam's bias correction).

# NOTE [ bfloat16 optimizer state ]
# A state array (momentum, moments) may instead be a uint16 array of bfloat16 bit patterns, with
# float32 parameters (``state_dtype="bfloat16"`` in ``taifuse.optim``): NumPy and Taichi have no
# bfloat16, and bfloat16 is the upper half of a float32. A kernel widens each state element to
# float32 (a 16-bit shift: exact), computes in float32 as for float32 state, and stores it back
# rounded to nearest even (:func:`to_bfloat16_bits`), in the same pass; what follows the store
# reads the stored (rounded) value, as with float16 storage. The uint16 dtype alone marks the
# format: float16 state is stored as float16. Adam's parameter update then folds the bias
# correction of the second moment into its two scalars (:func:`adam_bf16_coefficients`): one
# division per element instead of two, which is what bounds this step on a CPU (its divider),
# while the extra rounding (a float32 ulp) is far below the bfloat16 moments' own (2**-9).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

# ----------------------------------------------------------------------------- bfloat16 bits

BFLOAT16_BITS = np.dtype(np.uint16)  # the storage dtype of bfloat16 state (NOTE [ bfloat16 optimizer state ])


def to_bfloat16_bits(x: np.ndarray) -> np.ndarray:
    """float32 values -> bfloat16 bit patterns (uint16), rounded to nearest, ties to even.

    The upper 16 bits of each float32, plus one when the lower 16 bits are above half of the
    last kept bit, or exactly half and the kept part is odd. Infinities stay infinite, a finite
    value past bfloat16's largest (``3.39e38``) rounds to infinity, subnormals round like any
    other value, and a NaN stays a NaN (the quiet bit set, the sign kept). Input of another
    float dtype is converted to float32 first.

    Example::

        >>> import numpy as np
        >>> from taifuse.backends.reference.optim import to_bfloat16_bits
        >>> [hex(b) for b in to_bfloat16_bits(np.array([1.0, -2.0, 1 + 2**-8, np.inf], np.float32))]
        ['0x3f80', '0xc000', '0x3f80', '0x7f80']
    """
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    upper = bits >> np.uint32(16)
    rounded = (bits + (np.uint32(0x7FFF) + (upper & np.uint32(1)))) >> np.uint32(16)
    is_nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    return np.where(is_nan, upper | np.uint32(0x0040), rounded).astype(np.uint16)


def from_bfloat16_bits(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32, exact (the bits become the upper half).

    Example::

        >>> import numpy as np
        >>> from taifuse.backends.reference.optim import from_bfloat16_bits
        >>> from_bfloat16_bits(np.array([0x3F80, 0xC000, 0x7F80], np.uint16))
        array([ 1., -2., inf], dtype=float32)
    """
    bits = np.ascontiguousarray(bits, dtype=np.uint16)
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def _load(state: np.ndarray, ct: np.dtype) -> np.ndarray:
    """A state array in compute precision ``ct`` (bfloat16 bits widened)."""
    if state.dtype == BFLOAT16_BITS:
        return from_bfloat16_bits(state).astype(ct)
    return state.astype(ct)


def _store(state: np.ndarray, values: np.ndarray) -> None:
    """Write ``values`` into a state array, rounding once to its storage (bfloat16 bits included)."""
    if state.dtype == BFLOAT16_BITS:
        state[...] = to_bfloat16_bits(values)
    else:
        state[...] = values


# ----------------------------------------------------------------------------- coefficients


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


class AdamHyper(NamedTuple):
    """Adam's hyperparameters (``taifuse.optim`` validates them; the kernels take them as they are)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    amsgrad: bool
    maximize: bool
    # AdamW is Adam with decoupled weight decay: p *= 1 - lr * wd instead of g += wd * p.
    decoupled: bool


class AdamCoefficients(NamedTuple):
    """Every number an Adam step uses besides the arrays, derived once per step (in float64, as
    PyTorch's host code; a kernel rounds each to its compute precision once: :func:`in_precision`)."""

    neg_step_size: float  # -lr / (1 - beta1**step)
    bias_correction2_sqrt: float  # sqrt(1 - beta2**step)
    eps: float
    weight_decay: float  # the L2 coefficient, used when l2
    decay: float  # 1 - lr * weight_decay, used when decoupled_decay
    lerp_weight: float  # 1 - beta1: m = lerp(m, g, lerp_weight)
    one_minus_lerp_weight: float
    lerp_small: bool  # which of torch's two lerp formulas (lerp_weight_is_small)
    beta2: float
    one_minus_beta2: float
    sign: float  # -1 when maximizing
    l2: bool  # Adam's weight decay: g += weight_decay * p
    decoupled_decay: bool  # AdamW's: p *= decay


def adam_coefficients(hyper: AdamHyper, step: int) -> AdamCoefficients:
    """The coefficients of Adam's step number ``step`` (1-based) under ``hyper``."""
    lr, beta1, beta2, eps, weight_decay = (
        float(v) for v in (hyper.lr, hyper.beta1, hyper.beta2, hyper.eps, hyper.weight_decay)
    )
    step_size, bias_correction2_sqrt = adam_scalars(step, lr, beta1, beta2)
    w = 1.0 - beta1
    decays = weight_decay != 0
    return AdamCoefficients(
        neg_step_size=-step_size,
        bias_correction2_sqrt=bias_correction2_sqrt,
        eps=eps,
        weight_decay=weight_decay,
        decay=1.0 - lr * weight_decay,
        lerp_weight=w,
        one_minus_lerp_weight=1.0 - w,
        lerp_small=lerp_weight_is_small(w),
        beta2=beta2,
        one_minus_beta2=1.0 - beta2,
        sign=-1.0 if hyper.maximize else 1.0,
        l2=decays and not hyper.decoupled,
        decoupled_decay=decays and bool(hyper.decoupled),
    )


def adam_bf16_coefficients(hyper: AdamHyper, step: int) -> AdamCoefficients:
    """:func:`adam_coefficients` for bfloat16 state: ``sqrt(1 - beta2**step)`` folded into the
    step size and eps, so that the update is ``p += neg_step_size * m / (sqrt(v) + eps)``
    (NOTE [ bfloat16 optimizer state ]); ``bias_correction2_sqrt`` is then 1 and unused."""
    c = adam_coefficients(hyper, step)
    return c._replace(
        neg_step_size=c.neg_step_size * c.bias_correction2_sqrt,
        eps=c.eps * c.bias_correction2_sqrt,
        bias_correction2_sqrt=1.0,
    )


def in_precision(coefficients: NamedTuple, dtype: np.dtype) -> NamedTuple:
    """``coefficients`` with every float rounded to ``dtype``'s compute precision (flags kept)."""
    ct = compute_dtype(dtype).type
    return type(coefficients)(*(ct(v) if isinstance(v, float) else v for v in coefficients))


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
            buf = _load(momentum_buffer, ct) * ct.type(momentum) + ct.type(1.0 - dampening) * d
        _store(momentum_buffer, buf)
        # NOTE: what follows reads the stored (for float16, rounded) state, as PyTorch does.
        buf = _load(momentum_buffer, ct)
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
    hyper = AdamHyper(lr, beta1, beta2, eps, weight_decay, amsgrad, maximize, decoupled)
    bf16 = exp_avg.dtype == BFLOAT16_BITS
    c = in_precision((adam_bf16_coefficients if bf16 else adam_coefficients)(hyper, step), param.dtype)
    p = param.astype(ct)
    g = grad.astype(ct)
    if maximize:
        g = -g
    if c.decoupled_decay:
        p = p * c.decay
    if c.l2:
        g = g + c.weight_decay * p
    if c.lerp_small:  # torch's lerp(m, g, w): two formulas, by the size of w
        m = _load(exp_avg, ct)
        m = m + c.lerp_weight * (g - m)
    else:
        m = g - (g - _load(exp_avg, ct)) * c.one_minus_lerp_weight
    v = _load(exp_avg_sq, ct) * c.beta2 + c.one_minus_beta2 * g * g
    _store(exp_avg, m)
    _store(exp_avg_sq, v)
    # NOTE: the rest reads the stored (for float16 or bfloat16, rounded) moments, as PyTorch does.
    m, v = _load(exp_avg, ct), _load(exp_avg_sq, ct)
    if amsgrad:
        assert max_exp_avg_sq is not None
        _store(max_exp_avg_sq, np.maximum(_load(max_exp_avg_sq, ct), v))
        v = _load(max_exp_avg_sq, ct)
    # With bfloat16 state the bias correction is folded into the scalars: one division less.
    denom = np.sqrt(v) + c.eps if bf16 else np.sqrt(v) / c.bias_correction2_sqrt + c.eps
    param[...] = p + c.neg_step_size * m / denom


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
    m = _load(exp_avg, ct)
    if weight_decay != 0:
        p = p * ct.type(1.0 - lr * weight_decay)
    update = np.sign(m * ct.type(beta1) + ct.type(1.0 - beta1) * g)
    param[...] = p + ct.type(-lr) * update
    _store(exp_avg, m * ct.type(beta2) + ct.type(1.0 - beta2) * g)


def all_finite(arrays: Sequence[np.ndarray]) -> bool:
    """Whether every element of every array in ``arrays`` is finite (no NaN, no infinity).

    One call covers a whole step's gradients, so a device backend answers with one read-back.
    """
    return all(bool(np.isfinite(a).all()) for a in arrays)


@_QUIET
def unscale_check(grads: Sequence[np.ndarray], inv_scale: float) -> bool:
    """Multiply every gradient in ``grads`` by ``inv_scale`` in place; whether any held a NaN or an infinity.

    The fused pass of ``taifuse.amp.GradScaler.unscale_`` (PyTorch's
    ``_amp_foreach_non_finite_check_and_unscale_``): each element is checked and scaled in one
    read and one write. ``inv_scale`` enters as a float32 (GradScaler's scale is a float32), the
    product is computed in the compute precision (float32 for float16 storage) and rounded once
    to the storage dtype. Every element is scaled, a non-finite one included (the step that follows
    is then skipped). One call covers a whole step's gradients, so a device backend answers with
    one read-back.
    """
    found_inf = False
    for g in grads:
        ct = compute_dtype(g.dtype)
        x = g.astype(ct)
        found_inf = found_inf or not bool(np.isfinite(x).all())
        g[...] = x * ct.type(np.float32(inv_scale))
    return found_inf
