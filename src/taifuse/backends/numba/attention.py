"""Fused ``scaled_dot_product_attention`` on the CPU: BLAS products with the softmax fused around them.

Signatures and semantics are the reference's (``backends/reference/attention.py``, NOTE
[ Attention kernel arguments ]).

NOTE [ Numba attention blocks ]
The work is cut into query blocks of ``_BLOCK_Q`` rows over a group of batch rows (heads). For
one block, ``q_blk @ k.T`` goes to BLAS (``np.dot``, one call per head of the group) into the block's
scores, the only scratch that grows with the key length; a jitted pass over the block's rows (a
``prange``) then scales, masks, takes the row max, exponentiates, normalises, applies dropout
and writes one log-sum-exp per row; a second BLAS product multiplies the probabilities by ``v``.
A block holds its rows' whole key range, so its softmax needs no online rescaling (the taichi
kernel, which walks keys in tiles, does). Under ``is_causal`` a block reads only the keys its
last row sees. The scratch is ``(heads in group, _BLOCK_Q, S)``, with the group sized to keep
it near ``_SCRATCH_BYTES``: ``_BLOCK_Q * S`` per head, never ``L * S``.

The backward (FlashAttention-2's) recomputes each block's scores the same way, with a second
block-sized buffer for ``grad_out @ v.T``: P = exp(s - lse), dS = P * (dP * Z - D) with
D = rowsum(grad_out * out); grad_q of the block is one product, and grad_k, grad_v are summed
over the query blocks through a ``(heads, S, E)``-sized buffer. float16 inputs are computed in
float32 copies (input-sized), float64 in float64.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from taifuse import pool
from taifuse.backends._host import compute_dtype
from taifuse.backends.numba._jit import _FMA, _FMA_PARALLEL, _exp_neg
from taifuse.backends.reference.forward import dropout_key, dropout_scale, dropout_threshold

_BLOCK_Q = 64  # query rows per block
_SCRATCH_BYTES = 4 << 20  # about this many bytes of scores per block group


@njit(**_FMA)
def _hash32(v):
    # reference.hash32 in uint32 wraparound arithmetic (as numba/forward.py's).
    v = np.uint32(v)
    v = np.uint32(v ^ (v >> np.uint32(16)))
    v = np.uint32(v * np.uint32(0x7FEB352D))
    v = np.uint32(v ^ (v >> np.uint32(15)))
    v = np.uint32(v * np.uint32(0x846CA68B))
    return np.uint32(v ^ (v >> np.uint32(16)))


@njit(**_FMA)
def _keep(bh, qi, j, L, S, key, threshold):
    idx = np.uint32(((bh * L + qi) * S + j) & 0xFFFFFFFF)
    return np.uint32(_hash32(idx ^ key) >> np.uint32(8)) >= threshold


@njit(**_FMA)
def _visible(qi, sn, causal):
    """How many keys of a block's row are visible (keys past it are masked by is_causal)."""
    return min(qi + 1, sn) if causal else sn


@njit(**_FMA_PARALLEL)
def _forward_rows(sc, mask, has_mask, g0, q0, L, S, causal, scale, drop, key, threshold, dscale, lse):
    # sc (gn, nq, sn) holds q_blk @ k.T; it becomes the (dropped-out) probabilities.
    gn, nq, sn = sc.shape
    zero = sc.dtype.type(0.0)
    for r in prange(gn * nq):
        g = r // nq
        i = r - g * nq
        bh = g0 + g
        qi = q0 + i
        row = sc[g, i]
        lim = _visible(qi, sn, causal)
        mrow = mask[bh if mask.shape[0] > 1 else 0, qi] if has_mask else mask[0, 0]
        m = -np.inf
        for j in range(lim):
            x = row[j] * scale
            if has_mask:
                x += mrow[j]
            row[j] = x
            m = max(m, x)
        if m == -np.inf:  # a fully masked row: 0, as PyTorch (NOTE [ Attention kernel arguments ])
            row[:] = zero
            lse[bh, qi] = -np.inf
            continue
        total = zero
        for j in range(lim):
            e = _exp_neg(row[j] - m)
            row[j] = e
            total += e
        inv = 1.0 / total
        for j in range(lim):
            p = row[j] * inv
            if drop:
                p = p * dscale if _keep(bh, qi, j, L, S, key, threshold) else zero
            row[j] = p
        row[lim:] = zero
        lse[bh, qi] = m + math.log(total)


@njit(**_FMA_PARALLEL)
def _backward_rows(sc, dp, mask, has_mask, g0, q0, L, S, causal, scale, drop, key, threshold, dscale, lse, d):
    # In: sc = q_blk @ k.T, dp = grad_out_blk @ v.T. Out: sc = P * Z (for grad_v), dp = dS * scale.
    gn, nq, sn = sc.shape
    zero = sc.dtype.type(0.0)
    for r in prange(gn * nq):
        g = r // nq
        i = r - g * nq
        bh = g0 + g
        qi = q0 + i
        row, drow = sc[g, i], dp[g, i]
        lim = _visible(qi, sn, causal)
        mrow = mask[bh if mask.shape[0] > 1 else 0, qi] if has_mask else mask[0, 0]
        row_lse = lse[bh, qi]
        if row_lse == -np.inf:
            lim = 0
        di = d[bh, qi]
        for j in range(lim):
            x = row[j] * scale
            if has_mask:
                x += mrow[j]
            p = _exp_neg(x - row_lse)
            z = dscale if (not drop or _keep(bh, qi, j, L, S, key, threshold)) else zero
            row[j] = p * z
            drow[j] = p * (drow[j] * z - di) * scale
        row[lim:] = zero
        drow[lim:] = zero


@njit(**_FMA_PARALLEL)
def _row_dots(g, o, d):
    # d[b, i] = sum_e g[b, i, e] * o[b, i, e], in the compute dtype.
    bh, L, ev = g.shape
    for r in prange(bh * L):
        b = r // L
        i = r - b * L
        acc = d.dtype.type(0.0)
        for e in range(ev):
            acc += d.dtype.type(g[b, i, e]) * d.dtype.type(o[b, i, e])
        d[b, i] = acc


def _as(a: np.ndarray, dtype: np.dtype, scratch) -> np.ndarray:
    """``a`` in ``dtype``: itself, or a float32 copy of a float16 array from the pool."""
    if a is None or a.dtype == dtype:
        return a
    c = scratch.acquire(a.shape, dtype)
    np.copyto(c, a)
    return c


def _mask_args(mask: np.ndarray | None, dtype: np.dtype, scratch) -> tuple[np.ndarray, bool]:
    if mask is None:
        return np.zeros((1, 1, 1), dtype=dtype), False
    return _as(mask, dtype, scratch), True


def _dropout_args(dropout_p: float, seed: int, dtype: np.dtype) -> tuple:
    drop = dropout_p > 0.0
    key = np.uint32(dropout_key(seed) if drop else 0)
    return drop, key, np.uint32(dropout_threshold(dropout_p)), dtype.type(dropout_scale(dropout_p))


def _groups(bh: int, rows: int, s: int, itemsize: int):
    """(g0, g1) batch-row groups whose block scores stay near ``_SCRATCH_BYTES``."""
    g = max(1, min(bh, _SCRATCH_BYTES // max(1, rows * s * itemsize)))
    return [(g0, min(g0 + g, bh)) for g0 in range(0, bh, g)], g


def _products(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """out[i] = a[i] @ b[i] for each head of the group, one BLAS call (``np.dot``) each.

    NOTE: not a stacked ``np.matmul``: measured here (numpy 2 with scipy-openblas, 64x64 @
    64x512 float32 blocks), np.matmul took 10-20x longer than np.dot on the same operands.
    """
    for i in range(out.shape[0]):
        np.dot(a[i], b[i], out=out[i])


def _block(buf: np.ndarray, *shape: int) -> np.ndarray:
    """A C-contiguous ``shape`` view of the front of a flat scratch buffer."""
    return buf[: math.prod(shape)].reshape(shape)


def attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    mask: np.ndarray | None,
    is_causal: bool,
    scale: float,
    dropout_p: float,
    seed: int,
    out: np.ndarray,
    lse: np.ndarray,
) -> None:
    """out = dropout(softmax(q @ k.T * scale + mask)) @ v, lse = its row log-sum-exp; blocked as in
    NOTE [ Numba attention blocks ]."""
    bh, L, _ = q.shape
    S = k.shape[1]
    ct = compute_dtype(q.dtype)
    scratch = pool.host_pool()
    qc, kc, vc = (_as(a, ct, scratch) for a in (q, k, v))
    m, has_mask = _mask_args(mask, ct, scratch)
    drop, key, threshold, dscale = _dropout_args(dropout_p, seed, ct)
    oc = out if out.dtype == ct else scratch.acquire(out.shape, ct)
    lc = lse if lse.dtype == ct else scratch.acquire(lse.shape, ct)
    rows = min(_BLOCK_Q, L)
    groups, g = _groups(bh, rows, S, ct.itemsize)
    buf = scratch.acquire((g * rows * S,), ct)
    for g0, g1 in groups:
        for q0 in range(0, L, rows):
            q1 = min(q0 + rows, L)
            sn = min(S, q1) if is_causal else S
            sc = _block(buf, g1 - g0, q1 - q0, sn)
            _products(qc[g0:g1, q0:q1], kc[g0:g1, :sn].transpose(0, 2, 1), sc)
            _forward_rows(
                sc, m, has_mask, g0, q0, L, S, is_causal, ct.type(scale), drop, key, threshold, dscale, lc
            )
            _products(sc, vc[g0:g1, :sn], oc[g0:g1, q0:q1])
    if oc is not out:
        np.copyto(out, oc)
    if lc is not lse:
        np.copyto(lse, lc)


def attention_backward(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    mask: np.ndarray | None,
    is_causal: bool,
    scale: float,
    dropout_p: float,
    seed: int,
    out: np.ndarray,
    lse: np.ndarray,
    grad_out: np.ndarray,
    grad_q: np.ndarray | None,
    grad_k: np.ndarray | None,
    grad_v: np.ndarray | None,
) -> None:
    """The gradients of :func:`attention` from ``out`` and ``lse``, recomputing the scores block
    by block (NOTE [ Numba attention blocks ])."""
    bh, L, e = q.shape
    S, ev = k.shape[1], v.shape[2]
    ct = compute_dtype(q.dtype)
    scratch = pool.host_pool()
    qc, kc, vc, gc = (_as(a, ct, scratch) for a in (q, k, v, grad_out))
    lc = _as(lse, ct, scratch)
    m, has_mask = _mask_args(mask, ct, scratch)
    drop, key, threshold, dscale = _dropout_args(dropout_p, seed, ct)
    d = scratch.acquire((bh, L), ct)
    _row_dots(gc, _as(out, ct, scratch), d)

    def accumulator(grad, shape):
        if grad is not None and grad.dtype == ct:
            grad[...] = 0
            return grad
        return scratch.acquire(shape, ct, zero=True)

    dq = grad_q if grad_q is not None and grad_q.dtype == ct else scratch.acquire((bh, L, e), ct)
    dk = accumulator(grad_k, (bh, S, e))
    dv = accumulator(grad_v, (bh, S, ev))
    rows = min(_BLOCK_Q, L)
    groups, g = _groups(bh, rows, S, ct.itemsize)
    buf_s = scratch.acquire((g * rows * S,), ct)
    buf_p = scratch.acquire((g * rows * S,), ct)
    buf_t = scratch.acquire((g * S * max(e, ev),), ct)
    for g0, g1 in groups:
        gn = g1 - g0
        for q0 in range(0, L, rows):
            q1 = min(q0 + rows, L)
            sn = min(S, q1) if is_causal else S
            sc = _block(buf_s, gn, q1 - q0, sn)
            dp = _block(buf_p, gn, q1 - q0, sn)
            _products(qc[g0:g1, q0:q1], kc[g0:g1, :sn].transpose(0, 2, 1), sc)
            _products(gc[g0:g1, q0:q1], vc[g0:g1, :sn].transpose(0, 2, 1), dp)
            _backward_rows(
                sc,
                dp,
                m,
                has_mask,
                g0,
                q0,
                L,
                S,
                is_causal,
                ct.type(scale),
                drop,
                key,
                threshold,
                dscale,
                lc,
                d,
            )
            t = _block(buf_t, gn, sn, ev)
            _products(sc.transpose(0, 2, 1), gc[g0:g1, q0:q1], t)
            dv[g0:g1, :sn] += t
            _products(dp, kc[g0:g1, :sn], dq[g0:g1, q0:q1])
            t = _block(buf_t, gn, sn, e)
            _products(dp.transpose(0, 2, 1), qc[g0:g1, q0:q1], t)
            dk[g0:g1, :sn] += t
    for grad, acc in ((grad_q, dq), (grad_k, dk), (grad_v, dv)):
        if grad is not None and grad is not acc:
            np.copyto(grad, acc)
