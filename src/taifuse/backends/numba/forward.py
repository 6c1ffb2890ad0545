"""The Numba backend's forward kernels (``taifuse.backends.KERNEL_NAMES``).

Same signatures and semantics as ``backends/reference/forward.py``, which specifies them. The
conventions (float16 as uint16 bits, float32 math for float32/float16, libm float64 math for
float64, serial and parallel variants of every kernel) and the scalar math are in ``_jit``.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from taifuse import pool
from taifuse.backends import _host
from taifuse.backends._spec import activation_code, gelu_code
from taifuse.backends.numba import _jit
from taifuse.backends.numba._jit import (
    _BLOCK,
    _FLOAT16,
    _FMA,
    _FMA_INLINE,
    _FMA_PARALLEL,
    _FMA_REDUCE,
    _GELU,
    _GELU_TANH,
    _IDENTITY,
    _LEAKY_RELU,
    _RELU,
    _SIGMOID,
    _SILU,
    _STRIDED_TILE,
    _TANH,
    _TILE,
    _bits,
    _bounds,
    _count,
    _exp_neg,
    _flat,
    _gelu,
    _gelu_tanh,
    _like,
    _maxnum,
    _narrow,
    _prefer_wide_vectors,
    _readable,
    _relu,
    _row_tile,
    _same_data,
    _sigmoid,
    _silu,
    _tanh,
    _widen,
)
from taifuse.backends.reference.forward import dropout_key, dropout_scale, dropout_threshold

# NOTE: host code asks _jit._parallel and _jit._epilogue_parallel through the module at each call,
# so that one place decides serial or parallel for the forward, backward and optimizer kernels
# (the tests force either path by replacing them there).

# Ops whose span evaluates exp, tanh or erf per element: they go parallel at a smaller size.
_TRANSCENDENTAL_OPS = frozenset((_GELU, _GELU_TANH, _SILU, _SIGMOID, _TANH))

# ----------------------------------------------------------------------------- elementwise kernels


@njit(**_FMA_INLINE)
def _unary_span(x, out, op, param):
    # One loop per op, so that each loop body is branch-free and vectorizes.
    _prefer_wide_vectors()
    if op == _RELU:
        for i in range(x.size):
            out[i] = _narrow(_relu(_widen(x[i])), out)
    elif op == _GELU:
        for i in range(x.size):
            out[i] = _narrow(_gelu(_widen(x[i])), out)
    elif op == _GELU_TANH:
        for i in range(x.size):
            out[i] = _narrow(_gelu_tanh(_widen(x[i])), out)
    elif op == _SILU:
        for i in range(x.size):
            out[i] = _narrow(_silu(_widen(x[i])), out)
    elif op == _SIGMOID:
        for i in range(x.size):
            out[i] = _narrow(_sigmoid(_widen(x[i])), out)
    elif op == _TANH:
        for i in range(x.size):
            out[i] = _narrow(_tanh(_widen(x[i])), out)
    elif op == _LEAKY_RELU:
        for i in range(x.size):
            v = _widen(x[i])
            # param is float64: the product rounds once into out, exactly as the reference.
            out[i] = _narrow(v if v > 0 else v * param, out)
    else:
        for i in range(x.size):
            out[i] = x[i]


@njit(**_FMA)
def _unary_block(x, out, op, param, lo, hi):
    _unary_span(x[lo:hi], out[lo:hi], op, param)


@njit(**_FMA)
def _unary_inplace_block(x, op, param, lo, hi):
    part = x[lo:hi]
    _unary_span(part, part, op, param)


@njit(**_FMA)
def _unary_serial(x, out, op, param):
    _unary_block(x, out, op, param, np.int64(0), x.size)


# Below this many elements a unary op is serial under every threading layer, transcendental or
# not (NOTE [ Serial and parallel kernels ]): _unary then asks no thread count and leaves its
# overlap test to the kernel.
_SMALL_UNARY = _jit._SERIAL_BELOW // _jit._TRANSCENDENTAL_DISCOUNT

# NOTE [ A tiny op's kernel call ]
# Under _SMALL_UNARY elements the kernel is nothing and the call is everything (the ``step`` bench
# suite's per-op rows: F.relu on an (8, 16) tensor). Numba's dispatch itself took ~260 ns there
# and _unary's host code around it ~400 ns more, mostly two ``ravel`` calls and four dtype reads
# and compares. So _unary_small takes the arrays of any ndim and flattens them itself (one
# specialization per ndim, dtype and layout, each compiled once and cached on disk), and the host
# asks for the float16 bit views only when a dtype is float16. F.relu((8, 16) float32, requires
# grad), one process alternating the two forms, 15 rounds of 20k calls, thread time: 3260 -> 3153 ns
# median; instructions per call (callgrind): 31850 -> 30840-31755 (2026-11-28, loaded 2-core EPYC).


@njit(**_FMA)
def _unary_small(x, out, op, param):
    # _unary's serial kernels with its overlap test done here, on the flat arrays' addresses, not
    # by np.may_share_memory, and the arrays flattened here too (np.ravel: a view of C-contiguous
    # data, else a copy, as NumPy's): a tiny op's fixed cost (NOTE [ A tiny op's kernel call ]).
    xf, of = np.ravel(x), np.ravel(out)
    xs, os = xf.ctypes.data, of.ctypes.data
    if xs == os:  # out is x: NOTE [ Spans, blocks and in-place kernels ]
        _unary_inplace_block(of, op, param, np.int64(0), of.size)
    elif xs < os + of.nbytes and os < xs + xf.nbytes:  # a shifted view: x read from a copy
        _unary_block(xf.copy(), of, op, param, np.int64(0), xf.size)
    else:
        _unary_block(xf, of, op, param, np.int64(0), xf.size)


@njit(**_FMA_PARALLEL)
def _unary_parallel(x, out, op, param):
    n = x.size
    for item in prange(_count(n, _BLOCK)):
        lo, hi = _bounds(item, n, _BLOCK)
        _unary_block(x, out, op, param, lo, hi)


@njit(**_FMA)
def _unary_inplace_serial(x, op, param):
    _unary_inplace_block(x, op, param, np.int64(0), x.size)


@njit(**_FMA_PARALLEL)
def _unary_inplace_parallel(x, op, param):
    n = x.size
    for item in prange(_count(n, _BLOCK)):
        lo, hi = _bounds(item, n, _BLOCK)
        _unary_inplace_block(x, op, param, lo, hi)


_ADD_RELU, _MUL_RELU, _ADD, _SUB, _MUL = range(5)


@njit(**_FMA_INLINE)
def _binary_span(a, b, out, op):
    # One rounding per element (a lone product or sum has nothing to contract), as NumPy's ufuncs.
    _prefer_wide_vectors()
    if op == _ADD_RELU:
        for i in range(a.size):
            out[i] = _narrow(_relu(_widen(a[i]) + _widen(b[i])), out)
    elif op == _MUL_RELU:
        for i in range(a.size):
            out[i] = _narrow(_relu(_widen(a[i]) * _widen(b[i])), out)
    elif op == _ADD:
        for i in range(a.size):
            out[i] = _narrow(_widen(a[i]) + _widen(b[i]), out)
    elif op == _SUB:
        for i in range(a.size):
            out[i] = _narrow(_widen(a[i]) - _widen(b[i]), out)
    else:
        for i in range(a.size):
            out[i] = _narrow(_widen(a[i]) * _widen(b[i]), out)


@njit(**_FMA)
def _binary_block(a, b, out, op, lo, hi):
    _binary_span(a[lo:hi], b[lo:hi], out[lo:hi], op)


@njit(**_FMA)
def _binary_serial(a, b, out, op):
    _binary_block(a, b, out, op, np.int64(0), a.size)


@njit(**_FMA_PARALLEL)
def _binary_parallel(a, b, out, op):
    n = a.size
    for item in prange(_count(n, _BLOCK)):
        lo, hi = _bounds(item, n, _BLOCK)
        _binary_block(a, b, out, op, lo, hi)


@njit(**_FMA)
def _hash32(v):
    # reference.hash32 ("lowbias32") in uint32 wraparound arithmetic. Numba widens uint32
    # products to uint64, so every step truncates back to uint32.
    v = np.uint32(v)
    v = np.uint32(v ^ (v >> np.uint32(16)))
    v = np.uint32(v * np.uint32(0x7FEB352D))
    v = np.uint32(v ^ (v >> np.uint32(15)))
    v = np.uint32(v * np.uint32(0x846CA68B))
    return np.uint32(v ^ (v >> np.uint32(16)))


@njit(**_FMA)
def _dropout_block(x, out, key, threshold, scale, lo, hi):
    # Element lo + i hashes its global index (mod 2**32, as the reference's uint32 arange).
    # x * scale is formed in float64 and rounded once, exactly as the reference does.
    xs, outs = x[lo:hi], out[lo:hi]
    for i in range(xs.size):
        h = _hash32(np.uint32((lo + i) & 0xFFFFFFFF) ^ key)
        keep = np.uint32(h >> np.uint32(8)) >= threshold
        outs[i] = _narrow(np.float64(_widen(xs[i])) * (scale if keep else 0.0), outs)


@njit(**_FMA)
def _dropout_serial(x, out, key, threshold, scale):
    _dropout_block(x, out, key, threshold, scale, np.int64(0), x.size)


@njit(**_FMA_PARALLEL)
def _dropout_parallel(x, out, key, threshold, scale):
    n = x.size
    for item in prange(_count(n, _BLOCK)):
        lo, hi = _bounds(item, n, _BLOCK)
        _dropout_block(x, out, key, threshold, scale, lo, hi)


# ----------------------------------------------------------------------------- row-wise elementwise
# Work items are (row, column tile) pairs, so that a few long rows still split across threads;
# affine's items are (block of rows, column tile) pairs instead, see _affine_parallel.


@njit(**_FMA_INLINE)
def _affine_span(x, s, b, out):
    for c in range(x.size):
        out[c] = _narrow(_widen(x[c]) * _widen(s[c]) + _widen(b[c]), out)


@njit(**_FMA)
def _affine_rows(x, scale, bias, out, r0, r1, lo, hi):
    s, b = scale[lo:hi], bias[lo:hi]
    for r in range(r0, r1):
        _affine_span(x[r, lo:hi], s, b, out[r, lo:hi])


@njit(**_FMA)
def _affine_serial(x, scale, bias, out):
    _affine_rows(x, scale, bias, out, np.int64(0), x.shape[0], np.int64(0), x.shape[1])


@njit(**_FMA_INLINE)
def _rows_per_item(cols):
    """Rows per work item of a row-wise kernel whose rows are cut into tiles of ``_TILE`` columns:
    about ``_BLOCK`` elements an item, as the flat kernels' items."""
    return max(1, _BLOCK // max(1, min(cols, _TILE)))


@njit(**_FMA_PARALLEL)
def _affine_parallel(x, scale, bias, out):
    # NOTE: items of one row each (the kernel before) paid a call, the slices and the vector
    # loop's alias checks and remainder per row of 1024 columns; blocks of about _BLOCK elements
    # pay them once per 16 rows. One thread, the same loop called per row against per 16 rows,
    # fastest of 40 ABAB rounds on a loaded 2-core Xeon (indications, not a quiet measurement):
    # (4096, 1024) 2.35-2.62 ms against 1.93-2.01 ms; (1024, 1024) 336 us against 323 us.
    rows, cols = x.shape
    tiles = _count(cols, _TILE)
    per = _rows_per_item(cols)
    for item in prange(_count(rows, per) * tiles):
        block, lo, hi = _row_tile(item, tiles, cols, _TILE)
        r0 = block * per
        _affine_rows(x, scale, bias, out, r0, min(r0 + per, rows), lo, hi)


@njit(**_FMA_INLINE)
def _bias_act_span(y, b, op, out):
    # out[c] = act(y[c] + b[c]) along one row segment; b may be None (Numba prunes per signature).
    _prefer_wide_vectors()
    if b is None:
        if op == _RELU:
            for c in range(y.size):
                out[c] = _narrow(_relu(_widen(y[c])), out)
        elif op == _GELU:
            for c in range(y.size):
                out[c] = _narrow(_gelu(_widen(y[c])), out)
        elif op == _GELU_TANH:
            for c in range(y.size):
                out[c] = _narrow(_gelu_tanh(_widen(y[c])), out)
        elif op == _SILU:
            for c in range(y.size):
                out[c] = _narrow(_silu(_widen(y[c])), out)
        else:
            for c in range(y.size):
                out[c] = _narrow(_widen(y[c]), out)
    else:
        if op == _RELU:
            for c in range(y.size):
                out[c] = _narrow(_relu(_widen(y[c]) + _widen(b[c])), out)
        elif op == _GELU:
            for c in range(y.size):
                out[c] = _narrow(_gelu(_widen(y[c]) + _widen(b[c])), out)
        elif op == _GELU_TANH:
            for c in range(y.size):
                out[c] = _narrow(_gelu_tanh(_widen(y[c]) + _widen(b[c])), out)
        elif op == _SILU:
            for c in range(y.size):
                out[c] = _narrow(_silu(_widen(y[c]) + _widen(b[c])), out)
        else:
            for c in range(y.size):
                out[c] = _narrow(_widen(y[c]) + _widen(b[c]), out)


@njit(**_FMA_INLINE)
def _bias_act_keep_span(row, b, op, out):
    # row[c] += b[c] (b may be None) and out[c] = act(row[c] as stored), in one loop: row is read
    # and written through one pointer (NOTE [ Spans, blocks and in-place kernels ]). One loop
    # instead of a bias span and an activation span: ~0.65 against ~0.95 ns per element (exact
    # GELU, 256 x 1024 float32, one thread). Without a bias, row is already pre: out = act(row).
    _prefer_wide_vectors()
    if b is None:
        _bias_act_span(row, None, op, out)
    elif op == _RELU:
        for c in range(row.size):
            v = _narrow(_widen(row[c]) + _widen(b[c]), row)
            row[c] = v
            out[c] = _narrow(_relu(_widen(v)), out)
    elif op == _GELU:
        for c in range(row.size):
            v = _narrow(_widen(row[c]) + _widen(b[c]), row)
            row[c] = v
            out[c] = _narrow(_gelu(_widen(v)), out)
    elif op == _GELU_TANH:
        for c in range(row.size):
            v = _narrow(_widen(row[c]) + _widen(b[c]), row)
            row[c] = v
            out[c] = _narrow(_gelu_tanh(_widen(v)), out)
    elif op == _SILU:
        for c in range(row.size):
            v = _narrow(_widen(row[c]) + _widen(b[c]), row)
            row[c] = v
            out[c] = _narrow(_silu(_widen(v)), out)
    else:
        for c in range(row.size):
            v = _narrow(_widen(row[c]) + _widen(b[c]), row)
            row[c] = v
            out[c] = v


@njit(**_FMA)
def _bias_act_keep_rows(pre, b, op, out, r0, r1, lo, hi):
    bs = None if b is None else b[lo:hi]
    for r in range(r0, r1):
        _bias_act_keep_span(pre[r, lo:hi], bs, op, out[r, lo:hi])


@njit(**_FMA)
def _bias_act_keep_serial(pre, b, op, out):
    _bias_act_keep_rows(pre, b, op, out, np.int64(0), pre.shape[0], np.int64(0), pre.shape[1])


@njit(**_FMA_PARALLEL)
def _bias_act_keep_parallel(pre, b, op, out):
    rows, cols = pre.shape
    tiles = _count(cols, _TILE)
    for item in prange(rows * tiles):
        r, lo, hi = _row_tile(item, tiles, cols, _TILE)
        _bias_act_keep_rows(pre, b, op, out, r, r + 1, lo, hi)


@njit(**_FMA)
def _bias_act_rows(y, b, op, pre, out, r0, r1, lo, hi):
    # pre may be None (pruned per signature); else pre = y + b and out = act(pre as stored), two
    # loops over one row segment while it is in L1: one pass over memory.
    bs = None if b is None else b[lo:hi]
    for r in range(r0, r1):
        if pre is None:
            _bias_act_span(y[r, lo:hi], bs, op, out[r, lo:hi])
        else:
            _bias_act_span(y[r, lo:hi], bs, _IDENTITY, pre[r, lo:hi])
            _bias_act_span(pre[r, lo:hi], None, op, out[r, lo:hi])


@njit(**_FMA)
def _bias_act_inplace_rows(y, b, op, r0, r1, lo, hi):
    bs = None if b is None else b[lo:hi]
    for r in range(r0, r1):
        row = y[r, lo:hi]
        _bias_act_span(row, bs, op, row)


@njit(**_FMA)
def _bias_act_serial(y, b, op, pre, out):
    _bias_act_rows(y, b, op, pre, out, np.int64(0), y.shape[0], np.int64(0), y.shape[1])


@njit(**_FMA_PARALLEL)
def _bias_act_parallel(y, b, op, pre, out):
    rows, cols = y.shape
    tiles = _count(cols, _TILE)
    for item in prange(rows * tiles):
        r, lo, hi = _row_tile(item, tiles, cols, _TILE)
        _bias_act_rows(y, b, op, pre, out, r, r + 1, lo, hi)


@njit(**_FMA)
def _bias_act_inplace_serial(y, b, op):
    _bias_act_inplace_rows(y, b, op, np.int64(0), y.shape[0], np.int64(0), y.shape[1])


@njit(**_FMA_PARALLEL)
def _bias_act_inplace_parallel(y, b, op):
    rows, cols = y.shape
    tiles = _count(cols, _TILE)
    for item in prange(rows * tiles):
        r, lo, hi = _row_tile(item, tiles, cols, _TILE)
        _bias_act_inplace_rows(y, b, op, r, r + 1, lo, hi)


# ----------------------------------------------------------------------------- softmax


@njit(**_FMA_REDUCE)
def _softmax_row(x, out, log):
    # Three passes over one contiguous row (it stays in cache): max, sum of exp, write.
    m = _widen(x[0])
    for c in range(1, x.size):
        m = _maxnum(m, _widen(x[c]))
    # NOTE: the sum accumulates in float64 for every dtype (the row can be long).
    s = 0.0
    for c in range(x.size):
        s += _exp_neg(_widen(x[c]) - m)
    if log:
        log_s = _like(math.log(s), m)
        for c in range(x.size):
            out[c] = _narrow((_widen(x[c]) - m) - log_s, out)
    else:
        inv = _like(1.0 / s, m)
        # exp is recomputed rather than stored in the first pass: a float16 `out` would round
        # the intermediate, and the row is in cache, so the second exp is cheap.
        for c in range(x.size):
            out[c] = _narrow(_exp_neg(_widen(x[c]) - m) * inv, out)


@njit(**_FMA)
def _softmax_rows(x, out, r0, r1, log):
    for r in range(r0, r1):
        _softmax_row(x[r], out[r], log)


@njit(**_FMA)
def _softmax_rows_serial(x, out, log):
    _softmax_rows(x, out, np.int64(0), x.shape[0], log)


@njit(**_FMA_PARALLEL)
def _softmax_rows_parallel(x, out, log):
    for r in prange(x.shape[0]):
        _softmax_rows(x, out, np.int64(r), r + 1, log)


@njit(**_FMA)
def _softmax_strided_tile(x, out, a, lo, hi, log):
    # Reduce over axis 1 of x (A, C, B) for positions lo <= b < hi: the inner loops run along
    # the contiguous B axis and vectorize; m and s hold one running value per b (float64), the
    # work item's own scratch (the column sums' comment in backward.py says why not the pool's).
    channels = x.shape[1]
    width = hi - lo
    m = np.empty(width, np.float64)
    s = np.zeros(width, np.float64)
    first = x[a, 0, lo:hi]
    for j in range(width):
        m[j] = _widen(first[j])
    for c in range(1, channels):
        xs = x[a, c, lo:hi]
        for j in range(width):
            m[j] = _maxnum(m[j], np.float64(_widen(xs[j])))
    for c in range(channels):
        xs = x[a, c, lo:hi]
        for j in range(width):
            v = _widen(xs[j])
            s[j] += _exp_neg(v - _like(m[j], v))
    if log:
        for j in range(width):
            s[j] = math.log(s[j])
        for c in range(channels):
            xs, outs = x[a, c, lo:hi], out[a, c, lo:hi]
            for j in range(width):
                v = _widen(xs[j])
                outs[j] = _narrow((v - _like(m[j], v)) - _like(s[j], v), outs)
    else:
        for j in range(width):
            s[j] = 1.0 / s[j]
        for c in range(channels):
            xs, outs = x[a, c, lo:hi], out[a, c, lo:hi]
            for j in range(width):
                v = _widen(xs[j])
                outs[j] = _narrow(_exp_neg(v - _like(m[j], v)) * _like(s[j], v), outs)


@njit(**_FMA)
def _softmax_strided_serial(x, out, log):
    for a in range(x.shape[0]):
        _softmax_strided_tile(x, out, a, np.int64(0), x.shape[2], log)


@njit(**_FMA_PARALLEL)
def _softmax_strided_parallel(x, out, log):
    inner = x.shape[2]
    tiles = _count(inner, _STRIDED_TILE)
    for item in prange(x.shape[0] * tiles):
        a, lo, hi = _row_tile(item, tiles, inner, _STRIDED_TILE)
        _softmax_strided_tile(x, out, a, lo, hi, log)


# ----------------------------------------------------------------------------- layer norm


# NOTE [ Numba layer norm ]
# A row is read from memory once: its first pass brings it into L1, where the second (the
# centred sum of squares) and the write pass find it. The sums accumulate in compute precision
# (float32 for float32 and float16 rows, float64 for float64), in the vector lanes LLVM splits
# them into (fastmath reassoc: at the GPT example's width 256, a 16-lane float32 vector and four
# of them interleaved leave about four terms per partial sum), and the variance is the centred
# sum of squares of the second pass, so there is no cancellation as in E[x^2] - E[x]^2; the
# per-row scalars (1 / sqrt(var + eps)) are float64. The float64 sums of the form before cost a
# float32 -> float64 conversion per element and pass, which made the kernel compute-bound: at
# (2048, 256) float32 on one thread it took 1.43x the CPU time of a copy of x, now 1.23x (fastest
# of 15 rounds interleaved in one process, on a loaded 2-core machine). PyTorch accumulates
# float32 rows in float32 too. The rows function indexes the 2-D arrays itself (no per-row views)
# and asks for 512-bit vectors (NOTE [ 512-bit vectors ]).
#
# Rows go in blocks of _LN_BLOCK: the statistics of every row of a block first, then the block's
# outputs, which read the row's mean and rstd back from ``mean`` and ``rstd`` (stored in compute
# precision: the array path's stats dtype, so the values are the ones the row computed). Row by
# row, each write pass waited on its own row's chain of two reductions, a float32 division and
# the float64 division, square root and division; a block's statistics are independent of each
# other, so the CPU overlaps their chains, and the kernel is one call per block, not one per row.
# The same arithmetic per row (the tests compare the bits with the row-at-a-time form): at
# (2048, 128) float32 on one thread, 118 -> 60 us against a 25 us copy of x (fastest of 40 rounds
# interleaved in one process, loaded 2-core AMD EPYC). The parallel kernel's work items are the
# blocks, so the serial and parallel kernels give the same bits. The GPT example's layer norms
# ((2048, 128) and (2048, 256) rows) run the serial kernel: NOTE [ A launch wakes the worker ].
_LN_BLOCK = 16  # rows per block: their statistics, then their outputs


@njit(**_FMA_REDUCE)
def _layer_norm_rows(x, weight, bias, eps, out, mean, rstd, r0, r1):
    _prefer_wide_vectors()
    n = x.shape[1]
    v0 = _widen(x[r0, 0])
    for b0 in range(r0, r1, _LN_BLOCK):
        b1 = min(b0 + _LN_BLOCK, r1)
        for r in range(b0, b1):
            s = _like(0.0, v0)
            for c in range(n):
                s += _widen(x[r, c])
            mu_c = s / _like(n, v0)
            ss = _like(0.0, v0)
            for c in range(n):
                d = _widen(x[r, c]) - mu_c
                ss += d * d
            mean[r] = mu_c
            rstd[r] = 1.0 / math.sqrt(np.float64(ss) / n + eps)
        for r in range(b0, b1):
            mu_c = _like(mean[r], v0)
            rs_c = _like(rstd[r], v0)
            # NOTE: plain `is None` tests (not `and`-ed) so that Numba prunes the branches per signature.
            if weight is None:
                if bias is None:
                    for c in range(n):
                        out[r, c] = _narrow((_widen(x[r, c]) - mu_c) * rs_c, out)
                else:
                    for c in range(n):
                        out[r, c] = _narrow((_widen(x[r, c]) - mu_c) * rs_c + _widen(bias[c]), out)
            else:
                if bias is None:
                    for c in range(n):
                        out[r, c] = _narrow((_widen(x[r, c]) - mu_c) * rs_c * _widen(weight[c]), out)
                else:
                    for c in range(n):
                        out[r, c] = _narrow(
                            (_widen(x[r, c]) - mu_c) * rs_c * _widen(weight[c]) + _widen(bias[c]), out
                        )


@njit(**_FMA)
def _layer_norm_serial(x, weight, bias, eps, out, mean, rstd):
    _layer_norm_rows(x, weight, bias, eps, out, mean, rstd, np.int64(0), x.shape[0])


@njit(**_FMA_PARALLEL)
def _layer_norm_parallel(x, weight, bias, eps, out, mean, rstd):
    rows = x.shape[0]
    for item in prange(_count(rows, _LN_BLOCK)):
        lo, hi = _bounds(item, rows, _LN_BLOCK)
        _layer_norm_rows(x, weight, bias, eps, out, mean, rstd, lo, hi)


# ----------------------------------------------------------------------------- rms norm


@njit(**_FMA_REDUCE)
def _rms_norm_row(x, weight, eps, out):
    # One pass for the sum of squares in float64, one write pass in compute precision; returns rstd.
    n = x.size
    ss = 0.0
    for c in range(n):
        v = np.float64(_widen(x[c]))
        ss += v * v
    rs = 1.0 / math.sqrt(ss / n + eps)
    rs_c = _like(rs, _widen(x[0]))
    if weight is None:
        for c in range(n):
            out[c] = _narrow(_widen(x[c]) * rs_c, out)
    else:
        for c in range(n):
            out[c] = _narrow(_widen(x[c]) * rs_c * _widen(weight[c]), out)
    return rs


@njit(**_FMA)
def _rms_norm_serial(x, weight, eps, out, rstd):
    for r in range(x.shape[0]):
        rstd[r] = _rms_norm_row(x[r], weight, eps, out[r])


@njit(**_FMA_PARALLEL)
def _rms_norm_parallel(x, weight, eps, out, rstd):
    for r in prange(x.shape[0]):
        rstd[r] = _rms_norm_row(x[r], weight, eps, out[r])


# ----------------------------------------------------------------------------- embedding


@njit(**_FMA)
def _embedding_serial(indices, weight, out):
    for n in range(indices.size):
        out[n, :] = weight[indices[n], :]


@njit(**_FMA_PARALLEL)
def _embedding_parallel(indices, weight, out):
    for n in prange(indices.size):
        out[n, :] = weight[indices[n], :]


# ----------------------------------------------------------------------------- kernel table


def _unary(x: np.ndarray, out: np.ndarray, op: int, param: float = 0.0) -> None:
    if x.size < _SMALL_UNARY:
        if x.dtype == _FLOAT16 or out.dtype == _FLOAT16:  # _bits, only when needed
            x, out = _bits(x), _bits(out)
        _unary_small(x, out, op, param)  # a float already (leaky_relu converts its slope)
        return
    # As _readable, with the one overlap test serving both questions.
    shared = np.may_share_memory(x, out)
    if shared and not _same_data(x, out):
        x, shared = x.copy(), False
    xf, of = _flat(x), _flat(out)
    par = _jit._parallel(xf.size, transcendental=op in _TRANSCENDENTAL_OPS)
    if shared:  # then out is x: NOTE [ Spans, blocks and ... ]
        (_unary_inplace_parallel if par else _unary_inplace_serial)(of, op, float(param))
        return
    kernel = _unary_parallel if par else _unary_serial
    kernel(xf, of, op, float(param))


def gelu(x: np.ndarray, out: np.ndarray, approximate: str) -> None:
    """out = gelu(x) (``'none'``: erf form; ``'tanh'``: tanh form), as ``reference.gelu``."""
    _unary(x, out, int(gelu_code(approximate)))


def relu(x: np.ndarray, out: np.ndarray) -> None:
    """out = max(x, 0); NaN propagates."""
    _unary(x, out, _RELU)


def leaky_relu(x: np.ndarray, out: np.ndarray, negative_slope: float) -> None:
    """out = x if x > 0 else negative_slope * x."""
    _unary(x, out, _LEAKY_RELU, float(negative_slope))


def silu(x: np.ndarray, out: np.ndarray) -> None:
    """out = x * sigmoid(x)."""
    _unary(x, out, _SILU)


def sigmoid(x: np.ndarray, out: np.ndarray) -> None:
    """out = 1 / (1 + exp(-x)), evaluated without overflow."""
    _unary(x, out, _SIGMOID)


def tanh(x: np.ndarray, out: np.ndarray) -> None:
    """out = tanh(x)."""
    _unary(x, out, _TANH)


def _binary(a: np.ndarray, b: np.ndarray, out: np.ndarray, op: int) -> None:
    af, bf, of = _flat(_readable(a, out)), _flat(_readable(b, out)), _flat(out)
    kernel = _binary_parallel if _jit._parallel(af.size) else _binary_serial
    kernel(af, bf, of, op)


def runs_parallel(size: int) -> bool:
    """Whether an elementwise kernel over ``size`` elements runs on the threads (the host tensor
    math asks: NOTE [ Host tensor math on a backend's kernels ] in taifuse/_tensor_math.py)."""
    return _jit._parallel(size)


def add(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """out = a + b, all of one shape (the numba backend's tensor ``+``)."""
    _binary(a, b, out, _ADD)


def sub(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """out = a - b, all of one shape."""
    _binary(a, b, out, _SUB)


def mul(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """out = a * b, all of one shape."""
    _binary(a, b, out, _MUL)


def add_relu(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """out = max(a + b, 0)."""
    _binary(a, b, out, _ADD_RELU)


def mul_relu(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """out = max(a * b, 0)."""
    _binary(a, b, out, _MUL_RELU)


def affine(x: np.ndarray, scale: np.ndarray, bias: np.ndarray, out: np.ndarray) -> None:
    """out[r, c] = x[r, c] * scale[c] + bias[c] for ``x (R, C)``."""
    kernel = _affine_parallel if _jit._parallel(x.size) else _affine_serial
    x, scale, bias = (_readable(a, out) for a in (x, scale, bias))
    kernel(_bits(x), _bits(scale), _bits(bias), _bits(out))


def linear_act(
    x: np.ndarray,
    w: np.ndarray,
    b: np.ndarray | None,
    activation: str | None,
    out: np.ndarray,
    pre: np.ndarray | None = None,
) -> None:
    """out = activation(x @ w.T + b) for ``x (N, K)``, ``w (M, K)``, ``b (M,)`` or ``None``.

    The product runs in BLAS through NumPy (``w.T`` is a transposed view, not a copy); bias and
    activation are then applied in one pass over ``out``, in place (serial unless it is large:
    NOTE [ Serial epilogue between BLAS calls ]). With ``pre`` the product goes into ``pre``, and
    the same pass adds the bias there and writes the activation of it into ``out``. float16
    inputs are multiplied in float32 on blocks converted in scratch from the host pool (NOTE
    [ float16 products in blocks ]), and each chunk's epilogue stores straight into the float16
    outputs.
    """
    op = int(activation_code(activation))
    if x.dtype != _FLOAT16:  # the dtype, not np.float16: == then converts nothing
        # The epilogue reads b for every row after the product wrote out (np.dot alone is
        # overlap-safe: x and w need no copy, and a small linear's fixed cost is spared that test).
        # np.dot, not np.matmul: the same BLAS product of 2-D operands without the ufunc's
        # dispatch (the step suite's per-op row: about 1 us of 3 at (8, 16) x (16, 16)).
        bb = None if b is None else _readable(b, out)
        if pre is None:
            np.dot(x, w.T, out=out)
            if b is not None or op != _IDENTITY:
                par = _jit._epilogue_parallel(out.size, op in _TRANSCENDENTAL_OPS)
                (_bias_act_inplace_parallel if par else _bias_act_inplace_serial)(out, bb, op)
        else:
            np.dot(x, w.T, out=pre)
            par = _jit._epilogue_parallel(out.size, op in _TRANSCENDENTAL_OPS)
            (_bias_act_keep_parallel if par else _bias_act_keep_serial)(pre, bb, op, out)
        return
    # The float16 path reads x and w in blocks between writes, and b in every chunk's epilogue.
    bb = None if b is None else _bits(_readable(b, out))
    transcendental = op in _TRANSCENDENTAL_OPS
    x, w = _readable(x, out), _readable(w, out)
    rows, k = x.shape
    m = w.shape[0]
    # The float32 scratch comes from the host pool and goes back to it when this call drops it
    # (NOTE [ Buffer ownership ] in pool.py).
    scratch = pool.host_pool()
    chunk = _host.f16_rows(rows, max(k, m))
    wrows = _host.f16_weight_rows(m, k)
    w32 = scratch.acquire((wrows, k), np.float32)
    if wrows == m:
        _jit._convert(w32, w)
    x32 = scratch.acquire((chunk, k), np.float32)
    y32 = scratch.acquire((chunk, m), np.float32)
    # np.matmul into a column slice of y32 skips BLAS (measured 6x slower): blocks of the weight
    # multiply into a tile of their own.
    tile = None if wrows == m else scratch.acquire((chunk * wrows,), np.float32)
    out_bits = _bits(out)
    pre_bits = None if pre is None else _bits(pre)
    for lo in range(0, rows, chunk):
        hi = min(lo + chunk, rows)
        n = hi - lo
        _jit._convert(x32[:n], x[lo:hi])
        if tile is None:
            np.matmul(x32[:n], w32.T, out=y32[:n])
        else:
            for m0 in range(0, m, wrows):
                m1 = min(m0 + wrows, m)
                _jit._convert(w32[: m1 - m0], w[m0:m1])
                t = tile[: n * (m1 - m0)].reshape(n, m1 - m0)
                np.matmul(x32[:n], w32[: m1 - m0].T, out=t)
                y32[:n, m0:m1] = t
        par = _jit._epilogue_parallel(n * m, transcendental)
        chunk_pre = None if pre_bits is None else pre_bits[lo:hi]
        (_bias_act_parallel if par else _bias_act_serial)(y32[:n], bb, op, chunk_pre, out_bits[lo:hi])


def softmax(x: np.ndarray, out: np.ndarray) -> None:
    """out = exp(x - max) / sum(exp(x - max)) over axis 1 of ``x (A, C, B)``."""
    _softmax_like(x, out, False)


def log_softmax(x: np.ndarray, out: np.ndarray) -> None:
    """out = x - max - log(sum(exp(x - max))) over axis 1 of ``x (A, C, B)``."""
    _softmax_like(x, out, True)


def _softmax_like(x: np.ndarray, out: np.ndarray, log: bool) -> None:
    x = _readable(x, out)
    outer, channels, inner = x.shape
    par = _jit._parallel(x.size, transcendental=True)
    if inner == 1:
        x2, o2 = _bits(x.reshape(outer, channels)), _bits(out.reshape(outer, channels))
        (_softmax_rows_parallel if par and outer > 1 else _softmax_rows_serial)(x2, o2, log)
    else:
        (_softmax_strided_parallel if par else _softmax_strided_serial)(_bits(x), _bits(out), log)


def layer_norm(
    x: np.ndarray,
    weight: np.ndarray | None,
    bias: np.ndarray | None,
    eps: float,
    out: np.ndarray,
    mean: np.ndarray,
    rstd: np.ndarray,
) -> None:
    """Normalize each row of ``x (R, D)``; writes ``out`` and the row ``mean`` and ``rstd``."""
    x = _readable(x, out)
    kernel = _layer_norm_parallel if _jit._parallel(x.size) and x.shape[0] > 1 else _layer_norm_serial
    # Every row reads weight and bias, so one that out overlaps is read from a copy.
    wb = None if weight is None else _bits(_readable(weight, out))
    bb = None if bias is None else _bits(_readable(bias, out))
    kernel(_bits(x), wb, bb, float(eps), _bits(out), mean, rstd)


def rms_norm(x: np.ndarray, weight: np.ndarray | None, eps: float, out: np.ndarray, rstd: np.ndarray) -> None:
    """Root-mean-square normalize each row of ``x (R, D)``; writes ``out`` and the row ``rstd``."""
    x = _readable(x, out)
    kernel = _rms_norm_parallel if _jit._parallel(x.size) and x.shape[0] > 1 else _rms_norm_serial
    wb = None if weight is None else _bits(_readable(weight, out))  # read by every row: see layer_norm
    kernel(_bits(x), wb, float(eps), _bits(out), rstd)


def embedding(indices: np.ndarray, weight: np.ndarray, out: np.ndarray) -> None:
    """out[n] = weight[indices[n]], a row gather (float16 rows copied as bits)."""
    kernel = _embedding_parallel if _jit._parallel(out.size) and indices.size > 1 else _embedding_serial
    kernel(indices, _bits(weight), _bits(out))


def dropout(x: np.ndarray, out: np.ndarray, p: float, seed: int) -> None:
    """out = x * (keep / (1 - p)) with the counter-hash mask of ``reference.dropout`` (bit-identical)."""
    key = np.uint32(dropout_key(seed))
    threshold = np.uint32(dropout_threshold(p))
    scale = float(dropout_scale(p))
    xf, of = _flat(_readable(x, out)), _flat(out)
    kernel = _dropout_parallel if _jit._parallel(xf.size) else _dropout_serial
    kernel(xf, of, key, threshold, scale)
