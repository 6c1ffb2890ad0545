"""The Numba backend's fused optimizer kernels (``taifuse.backends.OPTIM_KERNEL_NAMES``).

Same signatures and semantics as ``backends/reference/optim.py``, which specifies them. One call
is one pass over memory: every element's parameter, gradient and state are loaded once, updated
in registers and stored once. Conventions of ``_jit``: float16 arrays arrive as their uint16 bit
view and compute in float32, float64 computes in float64, inputs above the parallel threshold run
on every thread in blocks of ``_BLOCK`` elements.

No fast-math flags (``_EXACT`` in ``_jit``): without FMA contraction the float32 arithmetic rounds
exactly as the NumPy reference's, so the two agree to the last bit on the same operation order
(the tests compare 100-step trajectories), and these loops vectorize without it.

Each update is one scalar function (``_sgd_elem``, ``_adam_elem``, ``_lion_elem``); the loops
around it differ only in which state arrays they load and store, so that no store is conditional
inside a loop (a conditional store would keep LLVM from vectorizing it).

bfloat16 state (NOTE [ bfloat16 optimizer state ] in ``reference/optim.py``) reaches the loops as
an int16 view of its uint16 bits, so that the element type tells Numba which 16-bit format it
holds (uint16 is float16's): ``_load`` widens it with a shift and ``_store`` rounds it to
nearest even with integer operations, inline in the same loops, which Numba compiles once more
for that signature. No float32 copy of the state is made.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload

from taifuse.backends.numba import _jit
from taifuse.backends.numba._jit import (
    _BLOCK,
    _EXACT,
    _EXACT_INLINE,
    _EXACT_PARALLEL,
    _REASSOC,
    _REASSOC_PARALLEL,
    _bounds,
    _count,
    _flat,
    _like,
    _narrow,
    _widen,
)
from taifuse.backends.reference.optim import (
    BFLOAT16_BITS,
    AdamHyper,
    adam_bf16_coefficients,
    adam_coefficients,
    compute_dtype,
    in_precision,
)

# Serial or parallel: asked of _jit at each call, as in forward.py.


class LionCoefficients(NamedTuple):
    """Every number a Lion step uses besides the arrays, derived once per call in float64 (as
    ``adam_coefficients``); :func:`in_precision` rounds each to the compute precision once.

    NOTE: the kernels take it as an argument, so Numba's cache index names this class by its
    module path: after moving it, delete the stale ``optim.*.nbi`` files next to this module.
    """

    neg_lr: float  # -lr
    decay: float  # 1 - lr * weight_decay, used when decays
    decays: bool  # weight_decay != 0: p *= decay (decoupled, as AdamW's)
    beta1: float
    one_minus_beta1: float
    beta2: float
    one_minus_beta2: float


def lion_coefficients(lr: float, beta1: float, beta2: float, weight_decay: float) -> LionCoefficients:
    """The coefficients of a Lion step (``reference.optim.lion_step`` computes the same inline)."""
    lr, beta1, beta2, weight_decay = (float(v) for v in (lr, beta1, beta2, weight_decay))
    return LionCoefficients(
        neg_lr=-lr,
        decay=1.0 - lr * weight_decay,
        decays=weight_decay != 0,
        beta1=beta1,
        one_minus_beta1=1.0 - beta1,
        beta2=beta2,
        one_minus_beta2=1.0 - beta2,
    )


# ----------------------------------------------------------------------------- loads and stores


# NOTE: the conversions are LLVM intrinsics of 32-bit integer operations and a select: written
# with NumPy scalars, Numba widened the integers to 64 bits and the loops did not vectorize (the
# AdamW step over 5.12M values took 5.0 ms against 3.0 ms with float32 state).


@intrinsic
def _bf16_to_f32(typingctx, bits):
    """bfloat16 bits (int16) -> float32, exact: the bits become the upper half."""
    if bits != types.int16:
        return None

    def codegen(context, builder, sig, args):
        wide = builder.zext(args[0], ir.IntType(32))
        return builder.bitcast(builder.shl(wide, ir.Constant(ir.IntType(32), 16)), ir.FloatType())

    return types.float32(bits), codegen


@intrinsic
def _f32_to_bf16(typingctx, value):
    """float32 -> bfloat16 bits (int16), rounded to nearest even; a NaN stays a quiet NaN."""
    if value != types.float32:
        return None

    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)

        def const(v):
            return ir.Constant(i32, v)

        b = builder.bitcast(args[0], i32)
        upper = builder.lshr(b, const(16))
        # Wraps only for NaNs, which the select replaces.
        rounded = builder.lshr(
            builder.add(b, builder.add(const(0x7FFF), builder.and_(upper, const(1)))), const(16)
        )
        is_nan = builder.icmp_unsigned(">", builder.and_(b, const(0x7FFFFFFF)), const(0x7F800000))
        bits = builder.select(is_nan, builder.or_(upper, const(0x40)), rounded)
        return builder.trunc(bits, ir.IntType(16))

    return types.int16(value), codegen


def _load(v):
    """A stored state element in compute precision: bfloat16 bits (int16 view) -> float32,
    anything else as ``_jit._widen``."""
    raise NotImplementedError("jitted code only")


@overload(_load, jit_options=_EXACT)
def _load_impl(v):
    if v == types.int16:
        return lambda v: _bf16_to_f32(v)
    return lambda v: _widen(v)


def _store(v, out):
    """``v`` converted for storing into ``out``: bfloat16 bits, rounded to nearest even, for an
    int16 view (as ``reference.optim.to_bfloat16_bits``); anything else as ``_jit._narrow``."""
    raise NotImplementedError("jitted code only")


@overload(_store, jit_options=_EXACT)
def _store_impl(v, out):
    if out.dtype == types.int16:
        return lambda v, out: _f32_to_bf16(np.float32(v))
    return lambda v, out: _narrow(v, out)


def _state_flat(a: np.ndarray) -> np.ndarray:
    """A flat state array as the loops take it: bfloat16 bits as int16 (see the module's docstring)."""
    return a.reshape(-1).view(np.int16) if a.dtype == BFLOAT16_BITS else _flat(a)


# ----------------------------------------------------------------------------- the update math


@njit(**_EXACT_INLINE)
def _nan_max(a, b):
    """max(a, b) that propagates a NaN from either side, as ``np.maximum``."""
    return a if (a > b or math.isnan(a)) else b


@njit(**_EXACT_INLINE)
def _sign(c):
    """-1, 0 or +1 in c's precision (and NaN for NaN), as ``np.sign``."""
    one = _like(1.0, c)
    return one if c > 0 else (-one if c < 0 else c)


@njit(**_EXACT_INLINE)
def _sgd_elem(p, g, sign, weight_decay, l2):
    d = g * sign
    if l2:
        d = d + weight_decay * p
    return d


@njit(**_EXACT_INLINE)
def _adam_elem(p, g, m, v, c):
    """One element's Adam moments; ``c``: ``reference.optim.AdamCoefficients`` in compute precision."""
    g = g * c.sign
    if c.decoupled_decay:
        p = p * c.decay
    if c.l2:
        g = g + c.weight_decay * p
    if c.lerp_small:
        m = m + c.lerp_weight * (g - m)
    else:
        m = g - (g - m) * c.one_minus_lerp_weight
    v = v * c.beta2 + c.one_minus_beta2 * g * g
    return p, m, v


@njit(**_EXACT_INLINE)
def _adam_apply_f(p, m, v_hat, c):
    denom = math.sqrt(v_hat) / c.bias_correction2_sqrt + c.eps
    return p + c.neg_step_size * m / denom


def _adam_apply(p, m, v_hat, c):
    """The parameter update from the stored moments ``m`` and ``v_hat``: for bfloat16 state
    (int16 bits) with the bias correction folded into ``c`` (``reference.optim.adam_bf16_coefficients``)."""
    raise NotImplementedError("jitted code only")


@overload(_adam_apply, jit_options=_EXACT)
def _adam_apply_impl(p, m, v_hat, c):
    if m == types.int16:

        def bf16(p, m, v_hat, c):
            return p + c.neg_step_size * _bf16_to_f32(m) / (math.sqrt(_bf16_to_f32(v_hat)) + c.eps)

        return bf16
    return lambda p, m, v_hat, c: _adam_apply_f(p, _load(m), _load(v_hat), c)


@njit(**_EXACT_INLINE)
def _lion_elem(p, g, m, c):
    """One element's Lion update; ``c``: :class:`LionCoefficients` in compute precision."""
    if c.decays:
        p = p * c.decay
    p = p + c.neg_lr * _sign(m * c.beta1 + c.one_minus_beta1 * g)
    m = m * c.beta2 + c.one_minus_beta2 * g
    return p, m


# ----------------------------------------------------------------------------- spans and blocks
# NOTE [ Stored values in registers ]
# What follows a store of the state uses the stored (rounded) value, as the reference does, but
# widens it from the register that was stored rather than loading it back: LLVM cannot prove
# that the state arrays do not overlap, so a load after the next array's store stayed a load
# (for bfloat16 state a narrowing store then a widening load of the same bytes, which the store
# buffer does not forward). The value is the same bits either way.
#
# A span loops over whole 1-D slices indexed from 0 (NOTE [ Spans, blocks and in-place kernels ]
# in _jit.py: with an unknown start index Numba's negative-index wraparound hides the addresses
# from LLVM and the loop does not vectorize). A block slices [lo, hi) out of every array and runs
# the span on the slices.


@njit(**_EXACT_INLINE)
def _sgd_plain_span(p, g, neg_lr, sign, weight_decay, l2):
    for i in range(p.size):
        pi = _widen(p[i])
        d = _sgd_elem(pi, _widen(g[i]), sign, weight_decay, l2)
        p[i] = _narrow(pi + neg_lr * d, p)


@njit(**_EXACT_INLINE)
def _sgd_momentum_span(p, g, buf, neg_lr, sign, weight_decay, l2, momentum, one_minus_damp, nesterov, first):
    for i in range(p.size):
        pi = _widen(p[i])
        d = _sgd_elem(pi, _widen(g[i]), sign, weight_decay, l2)
        b = d if first else _load(buf[i]) * momentum + one_minus_damp * d
        stored = _store(b, buf)
        buf[i] = stored
        # NOTE: b continues as the stored (rounded) value: a float16 buffer stores b rounded, and
        # PyTorch's next op reads that stored tensor. Widened from the register, not re-read from
        # memory (NOTE [ Stored values in registers ]).
        b = _load(stored)
        step = d + momentum * b if nesterov else b
        p[i] = _narrow(pi + neg_lr * step, p)


@njit(**_EXACT_INLINE)
def _adam_span(p, g, m, v, c):
    for i in range(p.size):
        pi, mi, vi = _adam_elem(_widen(p[i]), _widen(g[i]), _load(m[i]), _load(v[i]), c)
        ms, vs = _store(mi, m), _store(vi, v)
        m[i] = ms
        v[i] = vs
        p[i] = _narrow(_adam_apply(pi, ms, vs, c), p)


@njit(**_EXACT_INLINE)
def _adam_amsgrad_span(p, g, m, v, vmax, c):
    for i in range(p.size):
        pi, mi, vi = _adam_elem(_widen(p[i]), _widen(g[i]), _load(m[i]), _load(v[i]), c)
        ms, vs = _store(mi, m), _store(vi, v)
        m[i] = ms
        v[i] = vs
        vmaxs = _store(_nan_max(_load(vmax[i]), _load(vs)), vmax)
        vmax[i] = vmaxs
        p[i] = _narrow(_adam_apply(pi, ms, vmaxs, c), p)


@njit(**_EXACT_INLINE)
def _lion_span(p, g, m, c):
    for i in range(p.size):
        pi, mi = _lion_elem(_widen(p[i]), _widen(g[i]), _load(m[i]), c)
        p[i] = _narrow(pi, p)
        m[i] = _store(mi, m)


@njit(**_REASSOC, inline="always")
def _nonfinite_span(x):
    acc = _widen(x[0]) - _widen(x[0])
    for i in range(1, x.size):
        v = _widen(x[i])
        acc += v - v
    return acc


@njit(**_EXACT)
def _sgd_plain_block(p, g, lo, hi, neg_lr, sign, weight_decay, l2):
    _sgd_plain_span(p[lo:hi], g[lo:hi], neg_lr, sign, weight_decay, l2)


@njit(**_EXACT)
def _sgd_momentum_block(
    p, g, buf, lo, hi, neg_lr, sign, weight_decay, l2, momentum, one_minus_damp, nesterov, first
):
    _sgd_momentum_span(
        p[lo:hi],
        g[lo:hi],
        buf[lo:hi],
        neg_lr,
        sign,
        weight_decay,
        l2,
        momentum,
        one_minus_damp,
        nesterov,
        first,
    )


@njit(**_EXACT)
def _adam_block(p, g, m, v, lo, hi, c):
    _adam_span(p[lo:hi], g[lo:hi], m[lo:hi], v[lo:hi], c)


@njit(**_EXACT)
def _adam_amsgrad_block(p, g, m, v, vmax, lo, hi, c):
    _adam_amsgrad_span(p[lo:hi], g[lo:hi], m[lo:hi], v[lo:hi], vmax[lo:hi], c)


@njit(**_EXACT)
def _lion_block(p, g, m, lo, hi, c):
    _lion_span(p[lo:hi], g[lo:hi], m[lo:hi], c)


@njit(**_REASSOC)
def _nonfinite_sum(x, lo, hi):
    return _nonfinite_span(x[lo:hi])


# ----------------------------------------------------------------------------- parallel drivers


@njit(**_EXACT_PARALLEL)
def _sgd_plain_parallel(p, g, neg_lr, sign, weight_decay, l2):
    n = p.size
    for item in prange(_count(n, _BLOCK)):
        lo, hi = _bounds(item, n, _BLOCK)
        _sgd_plain_block(p, g, lo, hi, neg_lr, sign, weight_decay, l2)


@njit(**_EXACT_PARALLEL)
def _sgd_momentum_parallel(
    p, g, buf, neg_lr, sign, weight_decay, l2, momentum, one_minus_damp, nesterov, first
):
    n = p.size
    for item in prange(_count(n, _BLOCK)):
        lo, hi = _bounds(item, n, _BLOCK)
        _sgd_momentum_block(
            p, g, buf, lo, hi, neg_lr, sign, weight_decay, l2,
            momentum, one_minus_damp, nesterov, first,
        )  # fmt: skip


@njit(**_EXACT_PARALLEL)
def _adam_parallel(p, g, m, v, c):
    n = p.size
    for item in prange(_count(n, _BLOCK)):
        lo, hi = _bounds(item, n, _BLOCK)
        _adam_block(p, g, m, v, lo, hi, c)


@njit(**_EXACT_PARALLEL)
def _adam_amsgrad_parallel(p, g, m, v, vmax, c):
    n = p.size
    for item in prange(_count(n, _BLOCK)):
        lo, hi = _bounds(item, n, _BLOCK)
        _adam_amsgrad_block(p, g, m, v, vmax, lo, hi, c)


@njit(**_EXACT_PARALLEL)
def _lion_parallel(p, g, m, c):
    n = p.size
    for item in prange(_count(n, _BLOCK)):
        lo, hi = _bounds(item, n, _BLOCK)
        _lion_block(p, g, m, lo, hi, c)


@njit(**_REASSOC_PARALLEL)
def _nonfinite_sum_parallel(x):
    n = x.size
    acc = 0.0
    for item in prange(_count(n, _BLOCK)):
        lo, hi = _bounds(item, n, _BLOCK)
        acc += np.float64(_nonfinite_sum(x, lo, hi))
    return acc


# ----------------------------------------------------------------------------- kernel table


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
    """SGD with momentum in one pass (see ``reference.optim.sgd_step``)."""
    ct = compute_dtype(param.dtype).type
    p, g = _flat(param), _flat(grad)
    common = (ct(-lr), ct(-1.0 if maximize else 1.0), ct(weight_decay), weight_decay != 0)
    parallel = _jit._parallel(p.size)
    if momentum == 0:
        if parallel:
            _sgd_plain_parallel(p, g, *common)
        else:
            _sgd_plain_block(p, g, 0, p.size, *common)
        return
    extra = (ct(momentum), ct(1.0 - dampening), bool(nesterov), bool(first_step))
    buf = _state_flat(momentum_buffer)
    if parallel:
        _sgd_momentum_parallel(p, g, buf, *common, *extra)
    else:
        _sgd_momentum_block(p, g, buf, 0, p.size, *common, *extra)


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
    """Adam / AdamW in one pass (see ``reference.optim.adam_step``)."""
    hyper = AdamHyper(lr, beta1, beta2, eps, weight_decay, amsgrad, maximize, decoupled)
    bf16 = exp_avg.dtype == BFLOAT16_BITS
    c = in_precision((adam_bf16_coefficients if bf16 else adam_coefficients)(hyper, step), param.dtype)
    p, g = _flat(param), _flat(grad)
    m, v = _state_flat(exp_avg), _state_flat(exp_avg_sq)
    parallel = _jit._parallel(p.size, transcendental=True)
    if amsgrad:
        vmax = _state_flat(max_exp_avg_sq)
        if parallel:
            _adam_amsgrad_parallel(p, g, m, v, vmax, c)
        else:
            _adam_amsgrad_block(p, g, m, v, vmax, 0, p.size, c)
    elif parallel:
        _adam_parallel(p, g, m, v, c)
    else:
        _adam_block(p, g, m, v, 0, p.size, c)


def lion_step(
    param: np.ndarray,
    grad: np.ndarray,
    exp_avg: np.ndarray,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
) -> None:
    """Lion in one pass (see ``reference.optim.lion_step``)."""
    c = in_precision(lion_coefficients(lr, beta1, beta2, weight_decay), param.dtype)
    p, g, m = _flat(param), _flat(grad), _state_flat(exp_avg)
    if _jit._parallel(p.size):
        _lion_parallel(p, g, m, c)
    else:
        _lion_block(p, g, m, 0, p.size, c)


def all_finite(arrays: Sequence[np.ndarray]) -> bool:
    """Whether every element of every array is finite (one vectorized read of each)."""
    for x in arrays:
        if x.size == 0:
            continue
        xf = _flat(x)
        total = _nonfinite_sum_parallel(xf) if _jit._parallel(xf.size) else _nonfinite_sum(xf, 0, xf.size)
        if math.isnan(total):
            return False
    return True


# ----------------------------------------------------------------------------- GradScaler's unscale


@njit(**_REASSOC, inline="always")
def _unscale_span(x, inv):
    # One read and one write per element: the product stored, the check folded into a sum of
    # v - v (0 for a finite v, NaN for an infinity or a NaN), as _nonfinite_span.
    v0 = _widen(x[0])
    acc = v0 - v0
    for i in range(x.size):
        v = _widen(x[i])
        acc += v - v
        x[i] = _narrow(v * inv, x)
    return acc


@njit(**_REASSOC)
def _unscale_block(x, lo, hi, inv):
    return _unscale_span(x[lo:hi], inv)


@njit(**_REASSOC_PARALLEL)
def _unscale_parallel(x, inv):
    n = x.size
    acc = 0.0
    for item in prange(_count(n, _BLOCK)):
        lo, hi = _bounds(item, n, _BLOCK)
        acc += np.float64(_unscale_block(x, lo, hi, inv))
    return acc


def unscale_check(grads: Sequence[np.ndarray], inv_scale: float) -> bool:
    """Scale every gradient by ``inv_scale`` in place and report a NaN or infinity, in one pass
    over each (see ``reference.optim.unscale_check``)."""
    found_inf = False
    for g in grads:
        if g.size == 0:
            continue
        xf = _flat(g)
        # inv_scale is a float32 (GradScaler's scale is); float64 gradients multiply by it widened.
        inv = compute_dtype(g.dtype).type(np.float32(inv_scale))
        total = _unscale_parallel(xf, inv) if _jit._parallel(xf.size) else _unscale_block(xf, 0, xf.size, inv)
        found_inf = found_inf or math.isnan(total)
    return found_inf
