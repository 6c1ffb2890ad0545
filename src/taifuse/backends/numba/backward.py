"""The Numba backend's backward and loss kernels (``taifuse.backends.BACKWARD_KERNEL_NAMES``).

Same signatures and semantics as ``backends/reference/backward.py``, which specifies them; the
conventions of ``_jit`` (float16 as uint16 bits, float32 math for float32/float16, libm float64
math for float64, serial and parallel variants, sums in float64). The derivatives reuse the
forward's float32 pieces from ``_jit``; ``dropout_backward`` is the forward dropout kernel.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import njit, prange

from taifuse import pool
from taifuse.backends import _host
from taifuse.backends._spec import activation_code, gelu_code
from taifuse.backends.numba import _jit
from taifuse.backends.numba._jit import (
    _BLOCK,
    _COL_TILE,
    _EXP2_HI,
    _EXP2_LO,
    _F32_ONE,
    _FMA,
    _FMA_INLINE,
    _FMA_PARALLEL,
    _FMA_REDUCE,
    _GELU,
    _GELU_TANH,
    _GT_A,
    _GT_B,
    _IDENTITY,
    _INV_SQRT2,
    _LEAKY_RELU,
    _RELU,
    _SIGMOID,
    _SILU,
    _SQRT_2_OVER_PI,
    _TANH,
    _bits,
    _bounds,
    _by_precision,
    _clamp,
    _count,
    _exp2_f32,
    _exp_neg,
    _flat,
    _gauss_f32,
    _like,
    _maxnum,
    _narrow,
    _prefer_wide_vectors,
    _sigmoid,
    _tail_ratio_f32,
    _widen,
)
from taifuse.backends.numba.forward import dropout

# Serial or parallel: asked of _jit at each call, as in forward.py.

# ----------------------------------------------------------------------------- derivatives (float32 forms)

_F32_INV_SQRT_2PI = np.float32(1.0 / math.sqrt(2.0 * math.pi))
# d/du of 2 u(v) = 2k (v + c v^3): 2k + 6kc v^2, k = sqrt(2 / pi), c = 0.044715.
_F32_GELU_TANH_D0 = np.float32(2.0 * math.sqrt(2.0 / math.pi))
_F32_GELU_TANH_D2 = np.float32(6.0 * math.sqrt(2.0 / math.pi) * 0.044715)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


@njit(**_FMA)
def _gelu_grad_f32(v):
    # Phi(v) + v * phi(v), with Phi(-|v|) as _jit's _gelu_f32 computes it (NOTE [ Exact GELU in
    # float32 ] there), whose exp(-v*v/2) is phi's too. NaN -> NaN; +-inf -> NaN (inf * phi(inf)
    # = inf * 0), as the reference.
    g = _gauss_f32(v)
    q = _tail_ratio_f32(v) * g
    return (q if v < 0 else np.float32(1.0) - q) + v * (_F32_INV_SQRT_2PI * g)


@njit(**_FMA)
def _gelu_grad_f64(v):
    return 0.5 * (1.0 + math.erf(v * _INV_SQRT2)) + v * _INV_SQRT_2PI * math.exp(-0.5 * v * v)


@njit(**_FMA)
def _gelu_tanh_grad_f32(v):
    # With s = sigmoid(2u) = (1 + tanh u) / 2, 1 - tanh(u)^2 = 4 s (1 - s): no tanh needed. s is
    # 1 / (1 + 2**w) with _gelu_tanh_f32's exponent w = -2u log2(e); its _exp2_f32 in place of
    # _sigmoid_f32's exp: 0.56 -> 0.44 ns per element (64K float32 in cache, one thread, shared
    # 2-core AMD EPYC, fastest tenth of 30 interleaved rounds), same error against float64.
    # s = 0 where 2**w is inf (v < -10.06), and s (1 - s) with it; +-inf -> NaN, as the reference.
    v2 = v * v
    s = _F32_ONE / (_F32_ONE + _exp2_f32(_clamp(v * (_GT_A + _GT_B * v2), _EXP2_LO, _EXP2_HI)))
    return s + (v * (s * (_F32_ONE - s))) * (_F32_GELU_TANH_D2 * v2 + _F32_GELU_TANH_D0)


@njit(**_FMA)
def _gelu_tanh_grad_f64(v):
    t = math.tanh(_SQRT_2_OVER_PI * (v + 0.044715 * v * v * v))
    return 0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044715 * v * v)


@njit(**_FMA)
def _silu_grad(v):
    s = _sigmoid(v)
    one = _like(1.0, v)
    return s * (one + v * (one - s))


_gelu_grad = _by_precision(_gelu_grad_f32, _gelu_grad_f64)
_gelu_tanh_grad = _by_precision(_gelu_tanh_grad_f32, _gelu_tanh_grad_f64)


# ----------------------------------------------------------------------------- elementwise


@njit(**_FMA)
def _unary_backward_span(x, g, out, op, param, lo, hi):
    # One loop per op, so that each loop body is branch-free and vectorizes. Where the
    # derivative has a flat tail (gelu, gelu_tanh, silu, sigmoid), results below the smallest
    # normal number are flushed to zero (NOTE [ Subnormal gradients ]).
    # NOTE: the loops run over slices indexed from 0. Indexed from `lo`, they ran ~4x slower in
    # the parallel kernel than in the serial one (gelu and gelu_tanh, one thread, 256K float32;
    # NOTE [ Spans, blocks and in-place kernels ] in _jit.py).
    xs, gs, os = x[lo:hi], g[lo:hi], out[lo:hi]
    n = hi - lo
    if op == _RELU:
        # Masked where x <= 0, so that a NaN x passes the gradient, as PyTorch's threshold backward.
        for i in range(n):
            gv = _widen(gs[i])
            os[i] = _narrow(_like(0.0, gv) if _widen(xs[i]) <= 0 else gv, out)
    elif op == _LEAKY_RELU:
        for i in range(n):
            gv = _widen(gs[i])
            # param is float64: the product rounds once into out, as in the reference.
            os[i] = _narrow(gv if _widen(xs[i]) > 0 else gv * param, out)
    elif op == _GELU:
        for i in range(n):
            os[i] = _narrow(_flush(_widen(gs[i]) * _gelu_grad(_widen(xs[i]))), out)
    elif op == _GELU_TANH:
        for i in range(n):
            os[i] = _narrow(_flush(_widen(gs[i]) * _gelu_tanh_grad(_widen(xs[i]))), out)
    elif op == _SILU:
        for i in range(n):
            os[i] = _narrow(_flush(_widen(gs[i]) * _silu_grad(_widen(xs[i]))), out)
    elif op == _SIGMOID:
        for i in range(n):
            y = _widen(xs[i])
            os[i] = _narrow(_flush(_widen(gs[i]) * y * (_like(1.0, y) - y)), out)
    else:  # _TANH
        for i in range(n):
            y = _widen(xs[i])
            os[i] = _narrow(_widen(gs[i]) * (_like(1.0, y) - y * y), out)


@njit(**_FMA)
def _unary_backward_serial(x, g, out, op, param):
    _unary_backward_span(x, g, out, op, param, np.int64(0), x.size)


@njit(**_FMA_PARALLEL)
def _unary_backward_parallel(x, g, out, op, param):
    n = x.size
    for item in prange(_count(n, _BLOCK)):
        lo, hi = _bounds(item, n, _BLOCK)
        _unary_backward_span(x, g, out, op, param, lo, hi)


def _unary_backward(x: np.ndarray, g: np.ndarray, out: np.ndarray, op: int, param: float = 0.0) -> None:
    xf, gf, of = _flat(x), _flat(g), _flat(out)
    kernel = _unary_backward_parallel if _jit._parallel(xf.size) else _unary_backward_serial
    kernel(xf, gf, of, op, float(param))


def gelu_backward(x: np.ndarray, grad_out: np.ndarray, grad_in: np.ndarray, approximate: str) -> None:
    """grad_in = grad_out * gelu'(x) (``reference.gelu_backward``)."""
    _unary_backward(x, grad_out, grad_in, int(gelu_code(approximate)))


def relu_backward(x: np.ndarray, grad_out: np.ndarray, grad_in: np.ndarray) -> None:
    """grad_in = 0 where x <= 0, else grad_out (a NaN x passes it, as in PyTorch)."""
    _unary_backward(x, grad_out, grad_in, _RELU)


def leaky_relu_backward(
    x: np.ndarray, grad_out: np.ndarray, grad_in: np.ndarray, negative_slope: float
) -> None:
    """grad_in = grad_out if x > 0 else negative_slope * grad_out."""
    _unary_backward(x, grad_out, grad_in, _LEAKY_RELU, negative_slope)


def silu_backward(x: np.ndarray, grad_out: np.ndarray, grad_in: np.ndarray) -> None:
    """grad_in = grad_out * s * (1 + x * (1 - s)), s = sigmoid(x)."""
    _unary_backward(x, grad_out, grad_in, _SILU)


def sigmoid_backward(y: np.ndarray, grad_out: np.ndarray, grad_in: np.ndarray) -> None:
    """grad_in = grad_out * y * (1 - y) from the forward output y."""
    _unary_backward(y, grad_out, grad_in, _SIGMOID)


def tanh_backward(y: np.ndarray, grad_out: np.ndarray, grad_in: np.ndarray) -> None:
    """grad_in = grad_out * (1 - y^2) from the forward output y."""
    _unary_backward(y, grad_out, grad_in, _TANH)


def add_relu_backward(y: np.ndarray, grad_out: np.ndarray, grad_in: np.ndarray) -> None:
    """grad_in = 0 where the forward output y <= 0, else grad_out (relu's mask on y)."""
    _unary_backward(y, grad_out, grad_in, _RELU)


@njit(**_FMA)
def _mul_relu_backward_span(a, b, g, ga, gb, lo, hi):
    for i in range(lo, hi):
        av, bv = _widen(a[i]), _widen(b[i])
        gv = _like(0.0, av) if av * bv <= 0 else _widen(g[i])  # NaN passes, as relu's
        if ga is not None:
            ga[i] = _narrow(gv * bv, ga)
        if gb is not None:
            gb[i] = _narrow(gv * av, gb)


@njit(**_FMA)
def _mul_relu_backward_serial(a, b, g, ga, gb):
    _mul_relu_backward_span(a, b, g, ga, gb, np.int64(0), a.size)


@njit(**_FMA_PARALLEL)
def _mul_relu_backward_parallel(a, b, g, ga, gb):
    n = a.size
    for item in prange(_count(n, _BLOCK)):
        lo, hi = _bounds(item, n, _BLOCK)
        _mul_relu_backward_span(a, b, g, ga, gb, lo, hi)


def mul_relu_backward(
    a: np.ndarray, b: np.ndarray, grad_out: np.ndarray, grad_a: np.ndarray | None, grad_b: np.ndarray | None
) -> None:
    """With gm = grad_out masked to 0 where a * b <= 0: grad_a = gm * b, grad_b = gm * a."""
    kernel = _mul_relu_backward_parallel if _jit._parallel(a.size) else _mul_relu_backward_serial
    kernel(
        _flat(a),
        _flat(b),
        _flat(grad_out),
        None if grad_a is None else _flat(grad_a),
        None if grad_b is None else _flat(grad_b),
    )


# ----------------------------------------------------------------------------- column sums
# Bias, scale and weight gradients are sums over rows. Each work item owns a tile of columns
# and walks the rows, accumulating in float64 into a small scratch, so threads never share an
# output and the inner loop runs along a contiguous row. That scratch (one tile or row wide) is
# the work item's own and is made inside the jitted code, which cannot reach the pool; the
# losses' per-block and per-row partial sums, sized by the input, come from the host pool through
# their wrappers.


@njit(**_FMA_REDUCE)
def _affine_cols(x, g, gs, gb, lo, hi):
    width = hi - lo
    acc_s = np.zeros(width, np.float64)
    acc_b = np.zeros(width, np.float64)
    for r in range(g.shape[0]):
        for j in range(width):
            gv = np.float64(_widen(g[r, lo + j]))
            acc_b[j] += gv
            acc_s[j] += gv * _widen(x[r, lo + j])
    for j in range(width):
        if gs is not None:
            gs[lo + j] = _narrow(acc_s[j], gs)
        if gb is not None:
            gb[lo + j] = _narrow(acc_b[j], gb)


@njit(**_FMA)
def _affine_rows(scale, g, gx, lo, hi):
    cols = g.shape[1]
    for r in range(lo, hi):
        for c in range(cols):
            gx[r, c] = _narrow(_widen(g[r, c]) * _widen(scale[c]), gx)


@njit(**_FMA)
def _affine_backward_serial(x, scale, g, gx, gs, gb):
    if gx is not None:
        _affine_rows(scale, g, gx, np.int64(0), g.shape[0])
    if gs is not None or gb is not None:
        _affine_cols(x, g, gs, gb, np.int64(0), g.shape[1])


@njit(**_FMA_PARALLEL)
def _affine_backward_parallel(x, scale, g, gx, gs, gb):
    rows, cols = g.shape
    if gx is not None:
        for r in prange(rows):
            _affine_rows(scale, g, gx, np.int64(r), r + 1)
    if gs is not None or gb is not None:
        tiles = _count(cols, _COL_TILE)
        for item in prange(tiles):
            lo, hi = _bounds(item, cols, _COL_TILE)
            _affine_cols(x, g, gs, gb, lo, hi)


def affine_backward(
    x: np.ndarray,
    scale: np.ndarray,
    grad_out: np.ndarray,
    grad_x: np.ndarray | None,
    grad_scale: np.ndarray | None,
    grad_bias: np.ndarray | None,
) -> None:
    """grad_x = grad_out * scale; grad_scale, grad_bias = column sums of grad_out * x and grad_out."""
    kernel = _affine_backward_parallel if _jit._parallel(x.size) else _affine_backward_serial
    kernel(
        _bits(x),
        _bits(scale),
        _bits(grad_out),
        None if grad_x is None else _bits(grad_x),
        None if grad_scale is None else _bits(grad_scale),
        None if grad_bias is None else _bits(grad_bias),
    )


# ----------------------------------------------------------------------------- fused linear backward


# NOTE [ Subnormal gradients ]
# g * act'(pre) underflows into subnormal numbers where the activation is flat (gelu' for pre
# below about -10, times a small g), and x86 multiplies subnormal operands in microcode: the
# two matrix products that read grad_pre then crawl. Measured on 2 cores, the 32-layer
# width-1024 GELU MLP at batch 512 with weights of std 1.6/sqrt(1024) (the checkpoint
# benchmark's model): ~0.5% of grad_pre subnormal in the later layers, the backward's products
# 0.99 s per step against 0.25 s with PyTorch's default initialisation. The epilogue therefore
# flushes results below the smallest normal number to a zero of the same sign, as the CPU's
# flush-to-zero mode would: a change below 1.2e-38 (float32) in a gradient. NaN and infinities
# pass unchanged. The elementwise backward kernels of the activations with a flat tail (gelu,
# gelu_tanh, silu, sigmoid on their own, as a model written with `x @ w.T + b` uses them) flush
# the same way, in their compute precision before the store, so that a product after them does
# not crawl either. That costs ~10% on those kernels alone (silu's backward over 4M float32 on 2
# threads: 3.0 against 2.75 ms), against the ~4x it saves the products when subnormals occur.
# relu, leaky_relu and tanh do not flush: their derivatives make no subnormal from a normal
# gradient.
_F32_TINY = np.float32(np.finfo(np.float32).tiny)
_F32_ZERO = np.float32(0.0)
_F64_TINY = float(np.finfo(np.float64).tiny)


@njit(**_FMA_INLINE)
def _flush_f32(v):
    return v if (v >= _F32_TINY or v <= -_F32_TINY) else v * _F32_ZERO


@njit(**_FMA_INLINE)
def _flush_f64(v):
    return v if (v >= _F64_TINY or v <= -_F64_TINY) else v * 0.0


_flush = _by_precision(_flush_f32, _flush_f64)


# NOTE [ Column tiles as spans from 0 ]
# The column-tiled kernels below (a tile of columns lo:hi across all rows, so that each tile's
# column sums stay in one thread) take each row of the tile as a 1-D slice and loop over it from
# 0. Loops over range(lo, hi) with 2-D indexing vectorized only where LLVM saw lo = 0, i.e. in
# the serial kernels: the parallel gelu epilogue over 256 x 1024 float32 took 2.1 ms of work per
# thread against 0.41 ms serial, so on 2 threads it ran 2.7x slower than on one.


@njit(**_FMA)
def _grad_pre_span(pre, g, op, gp):
    # gp = g * act'(pre) along one row segment, one loop per activation so that each vectorizes;
    # subnormal results are flushed to zero (NOTE [ Subnormal gradients ]).
    if op == _RELU:
        for c in range(gp.size):
            gv = _widen(g[c])
            gp[c] = _like(0.0, gv) if _widen(pre[c]) <= 0 else _flush(gv)
    elif op == _GELU:
        for c in range(gp.size):
            gp[c] = _flush(_widen(g[c]) * _gelu_grad(_widen(pre[c])))
    elif op == _GELU_TANH:
        for c in range(gp.size):
            gp[c] = _flush(_widen(g[c]) * _gelu_tanh_grad(_widen(pre[c])))
    else:  # _SILU
        for c in range(gp.size):
            gp[c] = _flush(_widen(g[c]) * _silu_grad(_widen(pre[c])))


@njit(**_FMA_REDUCE)
def _linear_epilogue_cols(pre, g, op, gp, gb, lo, hi):
    # gp[:, lo:hi] = g * act'(pre) and gb[lo:hi] = its column sums, in one pass over the tile
    # (NOTE [ Column tiles as spans from 0 ]).
    width = hi - lo
    acc = np.zeros(width, np.float64)
    for r in range(g.shape[0]):
        row = gp[r, lo:hi]
        _grad_pre_span(pre[r, lo:hi], g[r, lo:hi], op, row)
        if gb is not None:
            for j in range(width):
                acc[j] += row[j]
    if gb is not None:
        tile = gb[lo:hi]
        for j in range(width):
            tile[j] = _narrow(acc[j], gb)


@njit(**_FMA_REDUCE)
def _bias_cols(g, gb, lo, hi):
    # gb[lo:hi] = the column sums of g[:, lo:hi] (NOTE [ Column tiles as spans from 0 ]).
    width = hi - lo
    acc = np.zeros(width, np.float64)
    for r in range(g.shape[0]):
        row = g[r, lo:hi]
        for j in range(width):
            acc[j] += _widen(row[j])
    tile = gb[lo:hi]
    for j in range(width):
        tile[j] = _narrow(acc[j], gb)


@njit(**_FMA)
def _linear_epilogue_serial(pre, g, op, gp, gb):
    _linear_epilogue_cols(pre, g, op, gp, gb, np.int64(0), g.shape[1])


@njit(**_FMA_PARALLEL)
def _linear_epilogue_parallel(pre, g, op, gp, gb):
    cols = g.shape[1]
    tiles = _count(cols, _COL_TILE)
    for item in prange(tiles):
        lo, hi = _bounds(item, cols, _COL_TILE)
        _linear_epilogue_cols(pre, g, op, gp, gb, lo, hi)


@njit(**_FMA)
def _bias_grad_serial(g, gb):
    _bias_cols(g, gb, np.int64(0), g.shape[1])


@njit(**_FMA_PARALLEL)
def _bias_grad_parallel(g, gb):
    cols = g.shape[1]
    tiles = _count(cols, _COL_TILE)
    for item in prange(tiles):
        lo, hi = _bounds(item, cols, _COL_TILE)
        _bias_cols(g, gb, lo, hi)


def linear_act_backward(
    x: np.ndarray,
    w: np.ndarray,
    pre: np.ndarray | None,
    grad_out: np.ndarray,
    activation: str | None,
    grad_pre: np.ndarray | None,
    grad_x: np.ndarray | None,
    grad_w: np.ndarray | None,
    grad_b: np.ndarray | None,
) -> None:
    """One fused pass (grad_pre = grad_out * act'(pre), grad_b = its column sums), then two BLAS products.

    float16: grad_pre is formed in float32 a row chunk at a time and the products run in float32
    on blocks of ``x`` and ``w`` converted in scratch from the host pool (NOTE [ float16 products
    in blocks ]), and ``grad_pre`` is not written. With ``activation=None`` grad_pre is grad_out
    itself and ``grad_pre`` is left untouched. ``grad_pre=None``: scratch from the pool only where
    it is written.
    """
    op = int(activation_code(activation))
    if x.dtype == np.float16:
        _linear_backward_half(x, w, pre, grad_out, op, grad_x, grad_w, grad_b)
        return
    gp = grad_pre
    if op == _IDENTITY:
        gp = grad_out
    elif gp is None:
        gp = pool.host_pool().acquire(grad_out.shape, grad_out.dtype)
    par = _jit._epilogue_parallel(grad_out.size)  # NOTE [ Serial epilogue between BLAS calls ] in _jit.py
    if op != _IDENTITY:
        epilogue = _linear_epilogue_parallel if par else _linear_epilogue_serial
        epilogue(_bits(pre), _bits(grad_out), op, gp, None if grad_b is None else _bits(grad_b))
    elif grad_b is not None:
        (_bias_grad_parallel if par else _bias_grad_serial)(_bits(grad_out), _bits(grad_b))
    if grad_x is not None:
        np.matmul(gp, w, out=grad_x)
    if grad_w is not None:
        np.matmul(gp.T, x, out=grad_w)


def _grad_pre_chunk(pre, grad_out, op, gp, gb) -> None:
    """gp = grad_out * act'(pre) in float32 and, unless ``gb`` is None, gb = its float64 column sums."""
    par = _jit._epilogue_parallel(grad_out.size)  # NOTE [ Serial epilogue between BLAS calls ] in _jit.py
    if op != _IDENTITY:
        epilogue = _linear_epilogue_parallel if par else _linear_epilogue_serial
        epilogue(_bits(pre), _bits(grad_out), op, gp, gb)
        return
    _jit._convert(gp, grad_out)
    if gb is not None:
        (_bias_grad_parallel if par else _bias_grad_serial)(_bits(grad_out), gb)


def _linear_backward_half(x, w, pre, grad_out, op, grad_x, grad_w, grad_b) -> None:
    """linear_act_backward for float16 storage, in blocks (NOTE [ float16 products in blocks ])."""
    rows, k = x.shape
    m = w.shape[0]
    # The scratch goes back to the pool when this call drops it (NOTE [ Buffer ownership ]).
    scratch = pool.host_pool()
    chunk = _host.f16_rows(rows, max(k, m))
    wrows = _host.f16_weight_rows(m, k)
    whole = wrows == m  # the weight (and grad_w's float32 sum) fits the budget in one block
    gp = scratch.acquire((chunk, m), np.float32)
    gb = None if grad_b is None else scratch.acquire((m,), np.float64, zero=True)
    gb_chunk = None if grad_b is None else scratch.acquire((m,), np.float64)
    x32 = scratch.acquire((chunk, k), np.float32) if grad_w is not None else None
    if grad_x is not None:
        w32 = scratch.acquire((wrows, k), np.float32)
        gx = scratch.acquire((chunk, k), np.float32)
        gx_part = None if whole else scratch.acquire((chunk, k), np.float32)
        if whole:
            _jit._convert(w32, w)
    if grad_w is not None and whole:
        gw = scratch.acquire((m, k), np.float32)
        # The second chunk's product, added to the first's: only when there are chunks to sum.
        gw_part = scratch.acquire((m, k), np.float32) if chunk < rows else None
    for lo in range(0, rows, chunk):
        hi = min(lo + chunk, rows)
        n = hi - lo
        g = gp[:n]
        _grad_pre_chunk(None if pre is None else pre[lo:hi], grad_out[lo:hi], op, g, gb_chunk)
        if gb is not None:
            gb += gb_chunk
        if grad_x is not None:
            if whole:
                np.matmul(g, w32, out=gx[:n])
            else:  # grad_x's rows summed over the weight's blocks
                for m0 in range(0, m, wrows):
                    m1 = min(m0 + wrows, m)
                    _jit._convert(w32[: m1 - m0], w[m0:m1])
                    np.matmul(g[:, m0:m1], w32[: m1 - m0], out=gx[:n] if m0 == 0 else gx_part[:n])
                    if m0:
                        gx[:n] += gx_part[:n]
            _jit._convert(grad_x[lo:hi], gx[:n])
        if grad_w is not None and whole:
            _jit._convert(x32[:n], x[lo:hi])
            np.matmul(g.T, x32[:n], out=gw if lo == 0 else gw_part)
            if lo:
                gw += gw_part
    if grad_w is not None:
        if whole:
            _jit._convert(grad_w, gw)
        else:
            _weight_grad_half_blocks(x, pre, grad_out, op, grad_w, wrows, chunk, gp, x32)
    if grad_b is not None:
        np.copyto(grad_b, gb)


def _weight_grad_half_blocks(x, pre, grad_out, op, grad_w, wrows, chunk, gp, x32) -> None:
    """grad_w for a float16 weight larger than the budget: one block of its rows at a time, summed
    in float32 over all the chunks (NOTE [ float16 products in blocks ])."""
    rows, k = x.shape
    m = grad_w.shape[0]
    scratch = pool.host_pool()
    gw = scratch.acquire((wrows, k), np.float32)
    gw_part = scratch.acquire((wrows, k), np.float32) if chunk < rows else None
    # A tile of pre and grad_out is gathered contiguous (float16, half the size of gp's tile) so
    # that the epilogue kernels see the layout they were compiled for.
    tiles = [None if a is None else scratch.acquire((chunk * wrows,), np.float16) for a in (pre, grad_out)]
    for m0 in range(0, m, wrows):
        m1 = min(m0 + wrows, m)
        mm = m1 - m0
        for lo in range(0, rows, chunk):
            hi = min(lo + chunk, rows)
            n = hi - lo
            parts = []
            for a, t in zip((pre, grad_out), tiles):
                if a is not None:
                    t = t[: n * mm].reshape(n, mm)
                    np.copyto(t, a[lo:hi, m0:m1])
                parts.append(t)
            g = gp.reshape(-1)[: n * mm].reshape(n, mm)
            _grad_pre_chunk(parts[0], parts[1], op, g, None)
            _jit._convert(x32[:n], x[lo:hi])
            np.matmul(g.T, x32[:n], out=gw[:mm] if lo == 0 else gw_part[:mm])
            if lo:
                gw[:mm] += gw_part[:mm]
        _jit._convert(grad_w[m0:m1], gw[:mm])


# ----------------------------------------------------------------------------- softmax backward


@njit(**_FMA_REDUCE)
def _softmax_backward_row(y, g, out, r, log):
    cols = y.shape[1]
    s = 0.0
    if log:
        for c in range(cols):
            s += _widen(g[r, c])
        for c in range(cols):
            yv = _widen(y[r, c])
            out[r, c] = _narrow(_widen(g[r, c]) - _exp_neg(yv) * _like(s, yv), out)
    else:
        for c in range(cols):
            s += _widen(g[r, c]) * _widen(y[r, c])
        for c in range(cols):
            yv = _widen(y[r, c])
            out[r, c] = _narrow(yv * (_widen(g[r, c]) - _like(s, yv)), out)


@njit(**_FMA)
def _softmax_backward_rows_serial(y, g, out, log):
    for r in range(y.shape[0]):
        _softmax_backward_row(y, g, out, r, log)


@njit(**_FMA_PARALLEL)
def _softmax_backward_rows_parallel(y, g, out, log):
    for r in prange(y.shape[0]):
        _softmax_backward_row(y, g, out, np.int64(r), log)


@njit(**_FMA_REDUCE)
def _softmax_backward_strided(y, g, out, a, log):
    # Reduce over axis 1 of (A, C, B) with one running sum per inner position b.
    channels, inner = y.shape[1], y.shape[2]
    s = np.zeros(inner, np.float64)
    for c in range(channels):
        for j in range(inner):
            if log:
                s[j] += _widen(g[a, c, j])
            else:
                s[j] += _widen(g[a, c, j]) * _widen(y[a, c, j])
    for c in range(channels):
        for j in range(inner):
            yv = _widen(y[a, c, j])
            if log:
                out[a, c, j] = _narrow(_widen(g[a, c, j]) - _exp_neg(yv) * _like(s[j], yv), out)
            else:
                out[a, c, j] = _narrow(yv * (_widen(g[a, c, j]) - _like(s[j], yv)), out)


@njit(**_FMA)
def _softmax_backward_strided_serial(y, g, out, log):
    for a in range(y.shape[0]):
        _softmax_backward_strided(y, g, out, a, log)


@njit(**_FMA_PARALLEL)
def _softmax_backward_strided_parallel(y, g, out, log):
    for a in prange(y.shape[0]):
        _softmax_backward_strided(y, g, out, np.int64(a), log)


def _softmax_like_backward(y: np.ndarray, g: np.ndarray, out: np.ndarray, log: bool) -> None:
    outer, channels, inner = y.shape
    par = _jit._parallel(y.size) and outer > 1
    if inner == 1:
        args = (
            _bits(y.reshape(outer, channels)),
            _bits(g.reshape(outer, channels)),
            _bits(out.reshape(outer, channels)),
        )
        (_softmax_backward_rows_parallel if par else _softmax_backward_rows_serial)(*args, log)
    else:
        (_softmax_backward_strided_parallel if par else _softmax_backward_strided_serial)(
            _bits(y), _bits(g), _bits(out), log
        )


def softmax_backward(y: np.ndarray, grad_out: np.ndarray, grad_in: np.ndarray) -> None:
    """grad_in = y * (grad_out - sum_c(grad_out * y)) over axis 1 of ``(A, C, B)``."""
    _softmax_like_backward(y, grad_out, grad_in, False)


def log_softmax_backward(y: np.ndarray, grad_out: np.ndarray, grad_in: np.ndarray) -> None:
    """grad_in = grad_out - exp(y) * sum_c(grad_out) over axis 1 of ``(A, C, B)``."""
    _softmax_like_backward(y, grad_out, grad_in, True)


# ----------------------------------------------------------------------------- layer norm backward


# NOTE [ Numba layer norm backward ]
# One pass over the rows computes everything: the rows are cut into a fixed number of chunks
# (``_ln_chunks``, from the shape alone), and a chunk's rows each read x and the output gradient
# once (the second pass over the row, which writes grad_x, finds it in L1) while adding the row's
# g * xhat and g into the chunk's own column sums; the chunks' sums are added in chunk order, in
# float64, at the end. The weight and bias gradients thus need no second sweep over x and g, and
# as the chunks do not depend on the thread count, the serial and parallel kernels give the same
# bits. The row sums and the column sums accumulate in compute precision (float32 for float32 and
# float16, as NOTE [ Numba layer norm ] in forward.py): a chunk adds its rows' g * xhat and g into
# running sums in that precision, and every _LN_RUN rows (and at the chunk's end) adds those into
# its float64 sums and restarts them, so that no float32 sum has more than _LN_RUN terms however
# many rows a chunk has. That keeps the loops over a row free of float32 -> float64 conversions;
# with them the kernel was compute-bound: at (2048, 256) float32 on one thread it took 1.60x the
# CPU time of a kernel reading two such arrays and writing one, now 1.16x (measured as in NOTE
# [ Numba layer norm ]).
_LN_CHUNKS = 32  # row chunks of the weight and bias gradient sums, at most
_LN_PARTIAL_BYTES = 1 << 22  # their float64 partial sums, at most (past one chunk)
_LN_RUN = 64  # rows a chunk's compute-precision running sums add before they go into its float64 sums


def _ln_chunks(rows: int, cols: int) -> int:
    """Row chunks of layer_norm_backward's column sums (NOTE [ Numba layer norm backward ])."""
    return max(1, min(_LN_CHUNKS, rows, _LN_PARTIAL_BYTES // max(1, 16 * cols)))


@njit(**_FMA_REDUCE)
def _layer_norm_backward_rows(x, weight, mean, rstd, g, gx, run, c, r0, r1):
    # Rows r0 .. r1: grad_x, and run[c, 0] += g * xhat, run[c, 1] += g over the columns.
    _prefer_wide_vectors()
    cols = x.shape[1]
    v0 = _widen(x[r0, 0])
    inv_cols = _like(1.0 / cols, v0)
    for r in range(r0, r1):
        mu_c, rs_c = _like(mean[r], v0), _like(rstd[r], v0)
        if gx is not None:
            s_gy = _like(0.0, v0)
            s_gyx = _like(0.0, v0)
            for k in range(cols):
                gv = _widen(g[r, k])
                xh = (_widen(x[r, k]) - mu_c) * rs_c
                gy = gv * _widen(weight[k]) if weight is not None else gv
                s_gy += gy
                s_gyx += gy * xh
                if run is not None:
                    run[c, 0, k] += gv * xh
                    run[c, 1, k] += gv
            a = s_gy * inv_cols
            b = s_gyx * inv_cols
            for k in range(cols):
                gy = _widen(g[r, k]) * _widen(weight[k]) if weight is not None else _widen(g[r, k])
                xh = (_widen(x[r, k]) - mu_c) * rs_c
                gx[r, k] = _narrow(rs_c * (gy - a - xh * b), gx)
        elif run is not None:
            for k in range(cols):
                gv = _widen(g[r, k])
                run[c, 0, k] += gv * ((_widen(x[r, k]) - mu_c) * rs_c)
                run[c, 1, k] += gv


@njit(**_FMA)
def _layer_norm_backward_chunk(x, weight, mean, rstd, g, gx, part, run, c, r0, r1):
    # Chunk c's rows r0 .. r1, their column sums into part[c] through runs of _LN_RUN rows in run[c].
    if part is None:
        _layer_norm_backward_rows(x, weight, mean, rstd, g, gx, None, c, r0, r1)
        return
    cols = x.shape[1]
    part[c] = 0.0
    for lo in range(r0, r1, _LN_RUN):
        run[c] = 0.0
        _layer_norm_backward_rows(x, weight, mean, rstd, g, gx, run, c, lo, min(lo + _LN_RUN, r1))
        for k in range(cols):
            part[c, 0, k] += run[c, 0, k]
            part[c, 1, k] += run[c, 1, k]


@njit(**_FMA_REDUCE)
def _layer_norm_param_sums(part, gw, gb):
    for k in range(part.shape[2]):
        sw = 0.0
        sb = 0.0
        for c in range(part.shape[0]):
            sw += part[c, 0, k]
            sb += part[c, 1, k]
        if gw is not None:
            gw[k] = _narrow(sw, gw)
        if gb is not None:
            gb[k] = _narrow(sb, gb)


@njit(**_FMA)
def _layer_norm_backward_serial(x, weight, mean, rstd, g, gx, gw, gb, part, run, chunks):
    rows = x.shape[0]
    per = _count(rows, chunks)
    for c in range(chunks):
        lo, hi = _bounds(c, rows, per)
        _layer_norm_backward_chunk(x, weight, mean, rstd, g, gx, part, run, c, lo, hi)
    if part is not None:
        _layer_norm_param_sums(part, gw, gb)


@njit(**_FMA_PARALLEL)
def _layer_norm_backward_parallel(x, weight, mean, rstd, g, gx, gw, gb, part, run, chunks):
    rows = x.shape[0]
    per = _count(rows, chunks)
    for c in prange(chunks):
        ci = np.int64(c)  # NOTE [ One integer type per helper argument ] in _jit.py
        lo, hi = _bounds(ci, rows, per)
        _layer_norm_backward_chunk(x, weight, mean, rstd, g, gx, part, run, ci, lo, hi)
    if part is not None:
        _layer_norm_param_sums(part, gw, gb)


def layer_norm_backward(
    x: np.ndarray,
    weight: np.ndarray | None,
    mean: np.ndarray,
    rstd: np.ndarray,
    grad_out: np.ndarray,
    grad_x: np.ndarray | None,
    grad_weight: np.ndarray | None,
    grad_bias: np.ndarray | None,
) -> None:
    """grad_x per row from the saved mean/rstd; grad_weight, grad_bias as column sums (``reference``),
    all in one pass over the rows (NOTE [ Numba layer norm backward ])."""
    rows, cols = x.shape
    chunks = _ln_chunks(rows, cols)
    part = run = None
    if grad_weight is not None or grad_bias is not None:
        # Each chunk zeroes its own sums; the running sums are in compute precision.
        part = np.empty((chunks, 2, cols), np.float64)
        run = np.empty((chunks, 2, cols), np.float64 if x.dtype == np.float64 else np.float32)
    if rows == 0 or cols == 0:
        if part is not None:
            part.fill(0.0)
            _layer_norm_param_sums(part, grad_weight, grad_bias)
        return
    kernel = (
        _layer_norm_backward_parallel
        if _jit._parallel(x.size) and chunks > 1
        else _layer_norm_backward_serial
    )
    opt = [None if a is None else _bits(a) for a in (weight, grad_x, grad_weight, grad_bias)]
    kernel(_bits(x), opt[0], mean, rstd, _bits(grad_out), opt[1], opt[2], opt[3], part, run, chunks)


# ----------------------------------------------------------------------------- rms norm backward


@njit(**_FMA_REDUCE)
def _rms_norm_backward_row(x, weight, rstd, g, gx, r):
    cols = x.shape[1]
    rs = np.float64(rstd[r])
    s_gyx = 0.0
    for c in range(cols):
        gy = np.float64(_widen(g[r, c]))
        if weight is not None:
            gy *= _widen(weight[c])
        s_gyx += gy * _widen(x[r, c]) * rs
    v0 = _widen(x[r, 0])
    rs_c, b_c = _like(rs, v0), _like(s_gyx / cols, v0)
    for c in range(cols):
        gyc = _widen(g[r, c])
        if weight is not None:
            gyc = gyc * _widen(weight[c])
        gx[r, c] = _narrow(rs_c * (gyc - _widen(x[r, c]) * rs_c * b_c), gx)


@njit(**_FMA_REDUCE)
def _rms_norm_weight_cols(x, rstd, g, gw, lo, hi):
    width = hi - lo
    acc = np.zeros(width, np.float64)
    for r in range(x.shape[0]):
        rs = np.float64(rstd[r])
        for j in range(width):
            acc[j] += np.float64(_widen(g[r, lo + j])) * _widen(x[r, lo + j]) * rs
    for j in range(width):
        gw[lo + j] = _narrow(acc[j], gw)


@njit(**_FMA)
def _rms_norm_backward_serial(x, weight, rstd, g, gx, gw):
    if gx is not None:
        for r in range(x.shape[0]):
            _rms_norm_backward_row(x, weight, rstd, g, gx, r)
    if gw is not None:
        _rms_norm_weight_cols(x, rstd, g, gw, np.int64(0), x.shape[1])


@njit(**_FMA_PARALLEL)
def _rms_norm_backward_parallel(x, weight, rstd, g, gx, gw):
    rows, cols = x.shape
    if gx is not None:
        for r in prange(rows):
            _rms_norm_backward_row(x, weight, rstd, g, gx, np.int64(r))
    if gw is not None:
        for item in prange(_count(cols, _COL_TILE)):
            lo, hi = _bounds(item, cols, _COL_TILE)
            _rms_norm_weight_cols(x, rstd, g, gw, lo, hi)


def rms_norm_backward(
    x: np.ndarray,
    weight: np.ndarray | None,
    rstd: np.ndarray,
    grad_out: np.ndarray,
    grad_x: np.ndarray | None,
    grad_weight: np.ndarray | None,
) -> None:
    """grad_x per row from the saved rstd; grad_weight as column sums (``reference``)."""
    kernel = _rms_norm_backward_parallel if _jit._parallel(x.size) else _rms_norm_backward_serial
    opt = [None if a is None else _bits(a) for a in (weight, grad_x, grad_weight)]
    kernel(_bits(x), opt[0], rstd, _bits(grad_out), opt[1], opt[2])


# ----------------------------------------------------------------------------- embedding backward
# NOTE [ Embedding backward without races ]
# Repeated indices add into the same row of grad_weight, so threads must not own indices; they
# own rows. A stable counting sort of the indices by row (O(N + V), serial: a D-th of the sums'
# work) lists each row's n in increasing order; each work item then takes a range of whole rows
# and sums every row in float64 in the order of n, from 0.0, as the reference's np.add.at does.
# No two items write the same row and the sums do not depend on the cut, so the result is the
# same bits on every run and for any thread count (for float32 and float64, the reference's bits).
# The ranges are cut to equal work (elements summed plus rows looked at), so that a few frequent
# tokens do not leave one thread with most of it. Indices outside [0, V) add nothing: the array
# path has rejected them already, and a kernel must not write out of bounds. Scratch (the sort's
# int64 arrays, one float64 row per work item) comes from the pool.
# NOTE: the zero fill stays a pass of its own, one memset of the whole of grad_weight before the
# sums. Writing each row once instead (zeros or its sum, in the row pass) was measured slower:
# for a large grad_weight (50257 x 768 float32) glibc's memset of the whole takes non-temporal
# stores, ~2 ms here, while zeroing the same bytes in runs between the written rows (or in
# per-thread slabs below glibc's non-temporal threshold) took 9-12 ms. The rows with an index,
# written twice, are at most N of the V.

_EMBEDDING_ITEMS_PER_THREAD = 4  # work items per thread: slack for rows of unequal cost


@njit(**_FMA)
def _embedding_sort(indices, starts, order):
    # starts (V + 2,), order (N,): afterwards row v's indices are order[starts[v]:starts[v + 1]],
    # in increasing n. Counting into starts[v + 2] and scattering through starts[v + 1] leaves
    # starts[v + 1] at the end of row v, that is the start of row v + 1.
    vocab = starts.size - 2
    starts[:] = 0
    for n in range(indices.size):
        v = indices[n]
        if 0 <= v < vocab:
            starts[v + 2] += 1
    for v in range(2, vocab + 2):
        starts[v] += starts[v - 1]
    for n in range(indices.size):
        v = indices[n]
        if 0 <= v < vocab:
            order[starts[v + 1]] = n
            starts[v + 1] += 1


@njit(**_FMA)
def _embedding_cuts(starts, cols, cuts):
    # cuts (items + 1,): row ranges [cuts[i], cuts[i + 1]) of about equal work, counted as the
    # elements summed before row v plus one per row looked at: starts[v] * cols + v, increasing.
    vocab = starts.size - 2
    items = cuts.size - 1
    total = starts[vocab] * cols + vocab
    v = 0
    for i in range(items):
        target = (total * i) // items
        while v < vocab and starts[v] * cols + v < target:
            v += 1
        cuts[i] = v
    cuts[items] = vocab


@njit(**_FMA)
def _embedding_zero(gw):
    gw[:, :] = 0  # one memset: see the NOTE


@njit(**_FMA)
def _embedding_rows(order, starts, g, gw, padding_idx, acc, lo, hi):
    cols = gw.shape[1]
    for v in range(lo, hi):
        first, last = starts[v], starts[v + 1]
        if v == padding_idx or first == last:
            continue  # stays zero
        n = order[first]
        if last - first == 1:  # no sum: one pass; 0.0 + x makes -0.0 +0.0, as the reference's
            for c in range(cols):
                gw[v, c] = _narrow(0.0 + _widen(g[n, c]), gw)
            continue
        for c in range(cols):
            acc[c] = 0.0 + _widen(g[n, c])
        for k in range(first + 1, last):
            n = order[k]
            for c in range(cols):
                acc[c] += _widen(g[n, c])
        for c in range(cols):
            gw[v, c] = _narrow(acc[c], gw)


@njit(**_FMA)
def _embedding_backward_serial(indices, g, gw, padding_idx, starts, order, cuts, acc):
    _embedding_zero(gw)
    _embedding_sort(indices, starts, order)
    _embedding_rows(order, starts, g, gw, padding_idx, acc[0], np.int64(0), gw.shape[0])


@njit(**_FMA_PARALLEL)
def _embedding_backward_parallel(indices, g, gw, padding_idx, starts, order, cuts, acc):
    _embedding_zero(gw)
    _embedding_sort(indices, starts, order)
    _embedding_cuts(starts, gw.shape[1], cuts)
    for i in prange(cuts.size - 1):
        _embedding_rows(order, starts, g, gw, padding_idx, acc[i], cuts[i], cuts[i + 1])


def embedding_backward(
    indices: np.ndarray, grad_out: np.ndarray, grad_weight: np.ndarray, padding_idx: int
) -> None:
    """Scatter-add of grad_out's rows into grad_weight (NOTE [ Embedding backward without races ])."""
    vocab, dim = grad_weight.shape
    par = _jit._parallel(grad_out.size)  # the sums; the zero fill is one memset either way
    items = _EMBEDDING_ITEMS_PER_THREAD * numba.get_num_threads() if par else 1
    kernel = _embedding_backward_parallel if par else _embedding_backward_serial
    scratch = pool.host_pool()
    ints = scratch.acquire((vocab + 2 + indices.size + items + 1,), np.int64)
    order_at, cuts_at = vocab + 2, vocab + 2 + indices.size
    starts, order, cuts = ints[:order_at], ints[order_at:cuts_at], ints[cuts_at:]
    acc = scratch.acquire((items, dim), np.float64)
    kernel(indices, _bits(grad_out), _bits(grad_weight), int(padding_idx), starts, order, cuts, acc)


def dropout_backward(grad_out: np.ndarray, grad_in: np.ndarray, p: float, seed: int) -> None:
    """grad_in = grad_out * (keep / (1 - p)): the forward dropout kernel applied to grad_out."""
    dropout(grad_out, grad_in, p, seed)


# ----------------------------------------------------------------------------- losses

_NONE, _MEAN, _SUM = range(3)
_REDUCTION_CODES = {"none": _NONE, "mean": _MEAN, "sum": _SUM}


@njit(**_FMA_REDUCE)
def _mse_span(x, t, out, reduction, lo, hi):
    s = 0.0
    for i in range(lo, hi):
        d = _widen(x[i]) - _widen(t[i])
        if reduction == _NONE:
            out[i] = _narrow(d * d, out)
        else:
            s += np.float64(d) * d
    return s


@njit(**_FMA)
def _mse_serial(x, t, out, reduction):
    s = _mse_span(x, t, out, reduction, np.int64(0), x.size)
    if reduction != _NONE:
        out[0] = _narrow(s / x.size if reduction == _MEAN else s, out)


@njit(**_FMA_PARALLEL)
def _mse_parallel(x, t, out, reduction, partial):
    n = x.size
    blocks = _count(n, _BLOCK)
    for item in prange(blocks):
        lo, hi = _bounds(item, n, _BLOCK)
        partial[item] = _mse_span(x, t, out, reduction, lo, hi)
    if reduction != _NONE:
        s = partial.sum()
        out[0] = _narrow(s / n if reduction == _MEAN else s, out)


def mse_loss(input: np.ndarray, target: np.ndarray, out: np.ndarray, reduction: str) -> None:
    """(input - target)^2, unreduced into ``out`` or summed/averaged (float64 sum) into ``out (1,)``."""
    code = _REDUCTION_CODES[reduction]
    if _jit._parallel(input.size):
        partial = pool.host_pool().acquire((_count(input.size, _BLOCK),), np.float64)  # one per block
        _mse_parallel(_flat(input), _flat(target), _flat(out), code, partial)
    else:
        _mse_serial(_flat(input), _flat(target), _flat(out), code)


@njit(**_FMA)
def _mse_backward_span(x, t, g, out, reduction, scale, lo, hi):
    if reduction == _NONE:
        for i in range(lo, hi):
            gv = _widen(g[i])
            out[i] = _narrow(_like(2.0, gv) * (_widen(x[i]) - _widen(t[i])) * gv, out)
    else:
        for i in range(lo, hi):
            d = _widen(x[i]) - _widen(t[i])
            out[i] = _narrow(d * _like(scale, d), out)


@njit(**_FMA)
def _mse_backward_serial(x, t, g, out, reduction, scale):
    _mse_backward_span(x, t, g, out, reduction, scale, np.int64(0), x.size)


@njit(**_FMA_PARALLEL)
def _mse_backward_parallel(x, t, g, out, reduction, scale):
    n = x.size
    for item in prange(_count(n, _BLOCK)):
        lo, hi = _bounds(item, n, _BLOCK)
        _mse_backward_span(x, t, g, out, reduction, scale, lo, hi)


def mse_loss_backward(
    input: np.ndarray, target: np.ndarray, grad_out: np.ndarray, grad_in: np.ndarray, reduction: str
) -> None:
    """grad_in = 2 * (input - target) * g (g per element, or grad_out[0], / input.size for mean)."""
    code = _REDUCTION_CODES[reduction]
    scale = 0.0
    if code != _NONE:
        scale = 2.0 * float(grad_out.reshape(-1)[0]) / (input.size if code == _MEAN else 1)
    kernel = _mse_backward_parallel if _jit._parallel(input.size) else _mse_backward_serial
    kernel(_flat(input), _flat(target), _flat(grad_out), _flat(grad_in), code, scale)


@njit(**_FMA_REDUCE)
def _cross_entropy_row(x, target, lse, r):
    # Returns the row's loss in float64 and writes its log-sum-exp.
    cols = x.shape[1]
    m = _widen(x[r, 0])
    for c in range(1, cols):
        m = _maxnum(m, _widen(x[r, c]))
    s = 0.0
    for c in range(cols):
        s += _exp_neg(_widen(x[r, c]) - m)
    row_lse = np.float64(m) + math.log(s)
    lse[r] = row_lse
    return row_lse - _widen(x[r, target[r]])


@njit(**_FMA)
def _cross_entropy_serial(x, target, out, reduction, lse):
    s = 0.0
    for r in range(x.shape[0]):
        loss = _cross_entropy_row(x, target, lse, r)
        if reduction == _NONE:
            out[r] = _narrow(loss, out)
        else:
            s += loss
    if reduction != _NONE:
        out[0] = _narrow(s / x.shape[0] if reduction == _MEAN else s, out)


@njit(**_FMA_PARALLEL)
def _cross_entropy_parallel(x, target, out, reduction, lse, losses):
    rows = x.shape[0]
    for r in prange(rows):
        losses[r] = _cross_entropy_row(x, target, lse, np.int64(r))
    if reduction == _NONE:
        for r in range(rows):
            out[r] = _narrow(losses[r], out)
    else:
        s = losses.sum()
        out[0] = _narrow(s / rows if reduction == _MEAN else s, out)


def cross_entropy(
    logits: np.ndarray, target: np.ndarray, out: np.ndarray, reduction: str, lse: np.ndarray
) -> None:
    """loss[n] = lse[n] - logits[n, target[n]], reduced as asked; writes ``lse`` for the backward."""
    code = _REDUCTION_CODES[reduction]
    if _jit._parallel(logits.size) and logits.shape[0] > 1:
        losses = pool.host_pool().acquire((logits.shape[0],), np.float64)  # each row's, in float64
        _cross_entropy_parallel(_bits(logits), target, _bits(out), code, lse, losses)
    else:
        _cross_entropy_serial(_bits(logits), target, _bits(out), code, lse)


@njit(**_FMA)
def _cross_entropy_backward_row(x, target, lse, g, out, reduction, scale, r):
    cols = x.shape[1]
    v0 = _widen(x[r, 0])
    gr = _like(scale, v0) if reduction != _NONE else _widen(g[r])
    lr = _like(lse[r], v0)
    t = target[r]
    for c in range(cols):
        p = _exp_neg(_widen(x[r, c]) - lr)
        if c == t:
            p = p - _like(1.0, v0)
        out[r, c] = _narrow(gr * p, out)


@njit(**_FMA)
def _cross_entropy_backward_serial(x, target, lse, g, out, reduction, scale):
    for r in range(x.shape[0]):
        _cross_entropy_backward_row(x, target, lse, g, out, reduction, scale, r)


@njit(**_FMA_PARALLEL)
def _cross_entropy_backward_parallel(x, target, lse, g, out, reduction, scale):
    for r in prange(x.shape[0]):
        _cross_entropy_backward_row(x, target, lse, g, out, reduction, scale, np.int64(r))


def cross_entropy_backward(
    logits: np.ndarray,
    target: np.ndarray,
    lse: np.ndarray,
    grad_out: np.ndarray,
    grad_in: np.ndarray,
    reduction: str,
) -> None:
    """grad_in[n, c] = g[n] * (exp(logits[n, c] - lse[n]) - [c == target[n]]), one pass per row."""
    code = _REDUCTION_CODES[reduction]
    scale = 0.0
    if code != _NONE:
        scale = float(grad_out.reshape(-1)[0]) / (logits.shape[0] if code == _MEAN else 1)
    par = _jit._parallel(logits.size) and logits.shape[0] > 1
    kernel = _cross_entropy_backward_parallel if par else _cross_entropy_backward_serial
    kernel(_bits(logits), target, lse, _bits(grad_out), _bits(grad_in), code, scale)
