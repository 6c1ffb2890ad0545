"""Batch norm kernels of the numba backend (signatures and math: ``backends/reference/batch_norm.py``).

Every input is viewed as ``(N, C, S)``. Per-channel reductions are two-level (NOTE [ Batch norm
statistics in one pass ]): a parallel first level writes float64 partial sums per ``(n, c)`` plane
(``S > 1``) or per block of rows (``S == 1``, where a channel's values are strided by ``C``), and
a serial second level adds a channel's partials in a fixed order, so the result has the same bits
on every run and thread count. The elementwise passes run over ``(n, c)`` planes with the
per-channel factors computed once (``_channel_factors``).

# NOTE [ Batch norm statistics in one pass ]
# One read of x gives both moments: each first-level partial sums d = x - K[c] and d * d, with the
# shift K[c] = x[0, c, 0], the channel's first value (conv2d_stats: the convolution's first output
# value computed in float64 and rounded as stored, known before its items run); then mean = K + sum(d) / M and
# var = sum(d^2) / M - (sum(d) / M)^2. Without the shift this is E[x^2] - E[x]^2, which loses every
# digit when |mean| >> std (a channel at 1000 +- 1 in float32); shifted by a value of the channel
# itself the cancellation is bounded by ((mean - K) / std)^2, which is small unless K is an
# outlier. Why not Welford: its update divides per element (no vectorization on the CPU, a slow
# path on GPUs), while the shifted sums are two fused multiply-adds. Sums accumulate in float64 on
# this backend (the taichi backend sums float32 in bounded blocks: Metal has no float64).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from taifuse import pool
from taifuse.backends.numba import _jit
from taifuse.backends.numba._jit import (
    _FMA,
    _FMA_PARALLEL,
    _FMA_REDUCE,
    _bits,
    _like,
    _narrow,
    _relu,
    _widen,
)

# Rows per first-level work item of the S == 1 reductions, and elements per work item of the
# elementwise passes.
_ROWS = 256
_ELEMENTS = 16384


def _activation_flag(activation: str | None) -> bool:
    return activation == "relu"


# The parallel first-level reductions keep the serial ones' reassociation, so they vectorize too.
_REDUCE_PARALLEL = dict(_FMA_REDUCE, parallel=True)


# NOTE [ The ReLU mask in the backward ]
# Recomputed, not saved: pre = (x - mean) * scale + shift with the forward's factors, rounded to the
# output's dtype as the output was, and g' = 0 where pre <= 0, else g (PyTorch's threshold_backward
# on ReLU's output: a NaN output passes its gradient). Written in each loop as a plain select: a
# helper function around it kept LLVM from vectorizing the loop (about 4x slower, measured).


# ----------------------------------------------------------------------------- first level


@njit(**_FMA_REDUCE)
def _stats_planes(x, shift, s1, s2, p0, p1):
    # x (N * C, S); per plane p: sum(x - K) and sum((x - K)^2), K = shift[p % C].
    channels = shift.size
    for p in range(p0, p1):
        k = np.float64(shift[p % channels])
        a = 0.0
        b = 0.0
        for s in range(x.shape[1]):
            d = np.float64(_widen(x[p, s])) - k
            a += d
            b += d * d
        s1[p] = a
        s2[p] = b


@njit(**_REDUCE_PARALLEL)
def _stats_planes_parallel(x, shift, s1, s2, per):
    n = x.shape[0]
    for i in prange((n + per - 1) // per):
        _stats_planes(x, shift, s1, s2, i * per, min(n, i * per + per))


@njit(**_FMA_REDUCE)
def _stats_rows(x, shift, s1, s2, blk):
    # x (N, C): block blk of _ROWS rows adds into row blk of s1, s2 (K, C), vectorised over C.
    channels = x.shape[1]
    for c in range(channels):
        s1[blk, c] = 0.0
        s2[blk, c] = 0.0
    for r in range(blk * _ROWS, min(x.shape[0], blk * _ROWS + _ROWS)):
        for c in range(channels):
            d = np.float64(_widen(x[r, c])) - np.float64(shift[c])
            s1[blk, c] += d
            s2[blk, c] += d * d


@njit(**_REDUCE_PARALLEL)
def _stats_rows_parallel(x, shift, s1, s2):
    for blk in prange(s1.shape[0]):
        _stats_rows(x, shift, s1, s2, np.int64(blk))  # NOTE [ One integer type per helper argument ]


@njit(**_FMA_REDUCE)
def _backward_planes(x, g, mean, scale, shift, relu, t1, t2, p0, p1):
    # Per plane: sum(g') and sum(g' * (x - mean)), g' = g masked by the forward's ReLU.
    channels = mean.size
    for p in range(p0, p1):
        c = p % channels
        m, a, b = mean[c], scale[c], shift[c]
        u = 0.0
        v = 0.0
        if relu:
            for s in range(x.shape[1]):
                xv = _widen(x[p, s])
                pre = _widen(_narrow((xv - m) * a + b, g))
                gv = np.float64(_like(0.0, xv) if pre <= 0 else _widen(g[p, s]))
                u += gv
                v += gv * np.float64(xv - m)
        else:
            for s in range(x.shape[1]):
                xv = _widen(x[p, s])
                gv = np.float64(_widen(g[p, s]))
                u += gv
                v += gv * np.float64(xv - m)
        t1[p] = u
        t2[p] = v


@njit(**_REDUCE_PARALLEL)
def _backward_planes_parallel(x, g, mean, scale, shift, relu, t1, t2, per):
    n = x.shape[0]
    for i in prange((n + per - 1) // per):
        _backward_planes(x, g, mean, scale, shift, relu, t1, t2, i * per, min(n, i * per + per))


@njit(**_FMA_REDUCE)
def _backward_rows(x, g, mean, scale, shift, relu, t1, t2, blk):
    channels = x.shape[1]
    for c in range(channels):
        t1[blk, c] = 0.0
        t2[blk, c] = 0.0
    for r in range(blk * _ROWS, min(x.shape[0], blk * _ROWS + _ROWS)):
        for c in range(channels):
            xv = _widen(x[r, c])
            gv = _widen(g[r, c])
            if relu and _widen(_narrow((xv - mean[c]) * scale[c] + shift[c], g)) <= 0:
                gv = _like(0.0, gv)
            t1[blk, c] += np.float64(gv)
            t2[blk, c] += np.float64(gv) * np.float64(xv - mean[c])


@njit(**_REDUCE_PARALLEL)
def _backward_rows_parallel(x, g, mean, scale, shift, relu, t1, t2):
    for blk in prange(t1.shape[0]):
        _backward_rows(x, g, mean, scale, shift, relu, t1, t2, np.int64(blk))  # as _stats_rows_parallel


# ----------------------------------------------------------------------------- second level


@njit(**_FMA)
def _finish_stats(s1, s2, shift, count, mean, var):
    # s1, s2 (K, C) partials of the shifted sums: mean and biased variance per channel.
    for c in range(mean.size):
        a = 0.0
        b = 0.0
        for k in range(s1.shape[0]):
            a += s1[k, c]
            b += s2[k, c]
        m = a / count
        mean[c] = np.float64(shift[c]) + m
        var[c] = max(b / count - m * m, 0.0)


@njit(**_FMA)
def _finish_sums(t1, t2, out1, out2):
    for c in range(out1.size):
        a = 0.0
        b = 0.0
        for k in range(t1.shape[0]):
            a += t1[k, c]
            b += t2[k, c]
        out1[c] = a
        out2[c] = b


@njit(**_FMA)
def _update(mean, var, count, eps, momentum, running_mean, running_var, has_running, invstd):
    # In float64 for the C values, rounded once into each buffer, as the reference.
    for c in range(invstd.size):
        v = np.float64(var[c])
        invstd[c] = 1.0 / np.sqrt(v + eps)
        if has_running:
            rm = np.float64(_widen(running_mean[c]))
            rv = np.float64(_widen(running_var[c]))
            running_mean[c] = _narrow((1.0 - momentum) * rm + momentum * np.float64(mean[c]), running_mean)
            running_var[c] = _narrow(
                (1.0 - momentum) * rv + momentum * v * (count / (count - 1.0)), running_var
            )


# ----------------------------------------------------------------------------- elementwise passes


@njit(**_FMA)
def _elemt_planes(x, mean, scale, shift, relu, out, p0, p1):
    # out = act((x - mean) * scale + shift), scale = invstd * weight and shift = bias per channel.
    channels = mean.size
    for p in range(p0, p1):
        c = p % channels
        m, a, b = mean[c], scale[c], shift[c]
        # NOTE: the branch outside the loops, so that each loop vectorizes.
        if relu:
            for s in range(x.shape[1]):
                out[p, s] = _narrow(_relu((_widen(x[p, s]) - m) * a + b), out)
        else:
            for s in range(x.shape[1]):
                out[p, s] = _narrow((_widen(x[p, s]) - m) * a + b, out)


@njit(**_FMA_PARALLEL)
def _elemt_planes_parallel(x, mean, scale, shift, relu, out, per):
    n = x.shape[0]
    for i in prange((n + per - 1) // per):
        _elemt_planes(x, mean, scale, shift, relu, out, i * per, min(n, i * per + per))


@njit(**_FMA)
def _grad_planes(x, g, mean, scale, shift, relu, training, k1, k2, k3, gx, p0, p1):
    # gx = k1 * (g' - k2 - (x - mean) * k3) per channel in training, k1 * g' in evaluation (where
    # a NaN x must not reach an element's gradient through a zero k3, as in PyTorch).
    channels = mean.size
    for p in range(p0, p1):
        c = p % channels
        m, a, b = mean[c], scale[c], shift[c]
        f1, f2, f3 = k1[c], k2[c], k3[c]
        if relu and training:
            for s in range(x.shape[1]):
                xv = _widen(x[p, s])
                pre = _widen(_narrow((xv - m) * a + b, g))
                gv = _like(0.0, xv) if pre <= 0 else _widen(g[p, s])
                gx[p, s] = _narrow(f1 * (gv - f2 - (xv - m) * f3), gx)
        elif relu:
            for s in range(x.shape[1]):
                pre = _widen(_narrow((_widen(x[p, s]) - m) * a + b, g))
                gx[p, s] = _narrow(f1 * (_like(0.0, pre) if pre <= 0 else _widen(g[p, s])), gx)
        elif training:
            for s in range(x.shape[1]):
                xv = _widen(x[p, s])
                gx[p, s] = _narrow(f1 * (_widen(g[p, s]) - f2 - (xv - m) * f3), gx)
        else:
            for s in range(x.shape[1]):
                gx[p, s] = _narrow(f1 * _widen(g[p, s]), gx)


@njit(**_FMA_PARALLEL)
def _grad_planes_parallel(x, g, mean, scale, shift, relu, training, k1, k2, k3, gx, per):
    n = x.shape[0]
    for i in prange((n + per - 1) // per):
        _grad_planes(x, g, mean, scale, shift, relu, training, k1, k2, k3, gx, i * per, min(n, i * per + per))


# ----------------------------------------------------------------------------- host side


def _planes(x: np.ndarray) -> np.ndarray:
    n, c, s = x.shape
    return _bits(x.reshape(n * c, s))


def _per(s: int) -> int:
    """Planes per parallel work item."""
    return max(1, _ELEMENTS // max(s, 1))


def _compute_dtype(x: np.ndarray) -> np.dtype:
    return np.dtype(np.float64) if x.dtype == np.float64 else np.dtype(np.float32)


def _channel_factors(
    x: np.ndarray, mean: np.ndarray, invstd: np.ndarray, weight: np.ndarray | None, bias: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(mean, invstd * weight, bias) per channel in x's compute precision, from the pool: the one
    place the forward and the backward's ReLU mask get them, so both round alike."""
    dtype = _compute_dtype(x)
    scratch = pool.host_pool()
    m = scratch.acquire(mean.shape, dtype)
    a = scratch.acquire(mean.shape, dtype)
    b = scratch.acquire(mean.shape, dtype)
    np.copyto(m, mean, casting="unsafe")
    np.copyto(a, invstd, casting="unsafe")
    if weight is not None:
        np.multiply(a, weight, out=a, casting="unsafe")
    if bias is None:
        b.fill(0)
    else:
        np.copyto(b, bias, casting="unsafe")
    return m, a, b


def batch_norm_stats(x: np.ndarray, mean: np.ndarray, var: np.ndarray) -> None:
    """Per-channel mean and biased variance of ``x (N, C, S)`` (NOTE [ Batch norm statistics in one pass ])."""
    n, c, s = x.shape
    scratch = pool.host_pool()
    shift = scratch.acquire((c,), np.float64)
    np.copyto(shift, x[0, :, 0], casting="unsafe")
    par = _jit._parallel(x.size)
    if s == 1:
        x2 = _bits(x.reshape(n, c))
        blocks = (n + _ROWS - 1) // _ROWS
        s1, s2 = scratch.acquire((blocks, c), np.float64), scratch.acquire((blocks, c), np.float64)
        if par and blocks > 1:
            _stats_rows_parallel(x2, shift, s1, s2)
        else:
            for blk in range(blocks):
                _stats_rows(x2, shift, s1, s2, blk)
    else:
        s1, s2 = scratch.acquire((n, c), np.float64), scratch.acquire((n, c), np.float64)
        planes, f1, f2 = _planes(x), s1.reshape(-1), s2.reshape(-1)
        if par:
            _stats_planes_parallel(planes, shift, f1, f2, _per(s))
        else:
            _stats_planes(planes, shift, f1, f2, 0, n * c)
    _finish_stats(s1, s2, shift, n * s, mean, var)


def batch_norm_update(
    mean: np.ndarray,
    var: np.ndarray,
    count: int,
    eps: float,
    momentum: float,
    running_mean: np.ndarray | None,
    running_var: np.ndarray | None,
    invstd: np.ndarray,
) -> None:
    """``invstd`` and the running statistics' update (see the reference), one loop over the channels."""
    has_running = running_mean is not None
    _update(
        mean,
        var,
        float(count),
        float(eps),
        float(momentum),
        _bits(running_mean) if has_running else invstd,
        _bits(running_var) if has_running else invstd,
        has_running,
        invstd,
    )


def batch_norm_elemt(
    x: np.ndarray,
    mean: np.ndarray,
    invstd: np.ndarray,
    weight: np.ndarray | None,
    bias: np.ndarray | None,
    activation: str | None,
    out: np.ndarray,
) -> None:
    """out = act((x - mean) * invstd * weight + bias) over ``x (N, C, S)``."""
    n, c, s = x.shape
    m, a, b = _channel_factors(x, mean, invstd, weight, bias)
    relu = _activation_flag(activation)
    xp, op = _planes(x), _planes(out)
    if _jit._parallel(x.size):
        _elemt_planes_parallel(xp, m, a, b, relu, op, _per(s))
    else:
        _elemt_planes(xp, m, a, b, relu, op, 0, n * c)


def batch_norm_backward(
    x: np.ndarray,
    grad_out: np.ndarray,
    mean: np.ndarray,
    invstd: np.ndarray,
    weight: np.ndarray | None,
    bias: np.ndarray | None,
    activation: str | None,
    training: bool,
    grad_x: np.ndarray | None,
    grad_weight: np.ndarray | None,
    grad_bias: np.ndarray | None,
) -> None:
    """Every gradient of :func:`batch_norm_elemt` from the saved statistics: one reduction pass
    (two-level, per channel: sum(g') and sum(g' * (x - mean))) and one elementwise pass."""
    n, c, s = x.shape
    count = n * s
    m, a, b = _channel_factors(x, mean, invstd, weight, bias)
    relu = _activation_flag(activation)
    scratch = pool.host_pool()
    par = _jit._parallel(x.size)
    need_sums = grad_weight is not None or grad_bias is not None or (training and grad_x is not None)
    sum_g = sum_gx = None
    if need_sums:
        if s == 1:
            x2, g2 = _bits(x.reshape(n, c)), _bits(grad_out.reshape(n, c))
            blocks = (n + _ROWS - 1) // _ROWS
            t1, t2 = scratch.acquire((blocks, c), np.float64), scratch.acquire((blocks, c), np.float64)
            if par and blocks > 1:
                _backward_rows_parallel(x2, g2, m, a, b, relu, t1, t2)
            else:
                for blk in range(blocks):
                    _backward_rows(x2, g2, m, a, b, relu, t1, t2, blk)
        else:
            t1, t2 = scratch.acquire((n, c), np.float64), scratch.acquire((n, c), np.float64)
            xp, gp, f1, f2 = _planes(x), _planes(grad_out), t1.reshape(-1), t2.reshape(-1)
            if par:
                _backward_planes_parallel(xp, gp, m, a, b, relu, f1, f2, _per(s))
            else:
                _backward_planes(xp, gp, m, a, b, relu, f1, f2, 0, n * c)
        sum_g, sum_gx = scratch.acquire((c,), np.float64), scratch.acquire((c,), np.float64)
        _finish_sums(t1, t2, sum_g, sum_gx)
        # sum(g' * xhat) = invstd * sum(g' * (x - mean)).
        np.multiply(sum_gx, invstd, out=sum_gx, casting="unsafe")
        if grad_bias is not None:
            np.copyto(grad_bias, sum_g, casting="unsafe")
        if grad_weight is not None:
            np.copyto(grad_weight, sum_gx, casting="unsafe")
    if grad_x is None:
        return
    dtype = _compute_dtype(x)
    k1, k2, k3 = (scratch.acquire((c,), dtype) for _ in range(3))
    np.copyto(k1, a)  # invstd * weight
    if training:
        np.divide(sum_g, count, out=k2, casting="unsafe")
        np.multiply(sum_gx, invstd, out=k3, casting="unsafe")
        np.divide(k3, count, out=k3)
    else:
        k2.fill(0)
        k3.fill(0)
    xp, gp, gxp = _planes(x), _planes(grad_out), _planes(grad_x)
    if par:
        _grad_planes_parallel(xp, gp, m, a, b, relu, bool(training), k1, k2, k3, gxp, _per(s))
    else:
        _grad_planes(xp, gp, m, a, b, relu, bool(training), k1, k2, k3, gxp, 0, n * c)
