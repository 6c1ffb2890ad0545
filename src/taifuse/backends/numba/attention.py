"""Fused ``scaled_dot_product_attention`` on the CPU: BLAS products with the softmax fused around them.

Signatures and semantics are the reference's (``backends/reference/attention.py``, NOTE
[ Attention kernel arguments ]).

NOTE [ Numba attention blocks ]
The work is cut into blocks of ``_BLOCK_Q`` query rows of a group of heads. For a block,
``q_blk @ k.T`` goes to BLAS (``np.matmul`` over the group's stack, one BLAS call per head
inside NumPy) into the block's scores, the only scratch that grows with the key length; one
jitted pass over the block's rows then scales, masks, takes each row's max, exponentiates
(applying dropout), divides by the row's sum and writes one log-sum-exp per row; a second
product multiplies the probabilities by ``v`` into the output's rows (a float32 or float64
output, strided or not; a float16 one through scratch). Dividing the block's (64 x 128) scores
rather than its (64 x 64) output rows spends a few more multiplies, on a row still in L1, and
saves the output's pass of its own and, for a strided output, a copy through scratch. A
block holds its rows' whole key range, so its softmax needs no online rescaling (the taichi
kernel, which walks keys in tiles, does). Under ``is_causal`` a block reads only the keys its
last row sees. A group holds as many heads as keep its block scores under ``_GROUP_SCORES``
(one or two heads at L = S = 512, 16 at the example GPT's L = 64): small heads then share one
Python-level call per product and one row-kernel launch, which took the example's attention
(B=32, H=4, L=64, E=32, forward+backward, one thread) from 7.5 to 4.6 ms of CPU time, and cost
nothing measurable at B=8, H=8, L=512, E=64 (143 and 138 ms). The scratch is
``_GROUP_SCORES`` scores per worker (or one head's ``_BLOCK_Q * S``), never ``L * S`` past
``_WHOLE_SCORES`` (the backward's whole-scores buffers below are L / ``_BLOCK_Q`` times that).

The backward (FlashAttention-2's) recomputes each block's scores the same way, with a second
buffer for ``grad_out @ v.T``: P = exp(s - lse), dS = P * (dP * Z - D) with
D = rowsum(P * dP * Z) / rowsum(P) summed over the block's row, which holds every key (NOTE
[ Attention backward's D ] in ``backends/reference/attention.py``; ``out`` is not read).
grad_q of the block is one product. Where a head's L * S scores stay under ``_WHOLE_SCORES``
(L = S <= 256), the two buffers hold the group's whole (L, S) scores and dP, each query block
writing its rows' columns 0 .. its last key; then grad_k and grad_v of each block of 64 keys
are one product each over the rows that see them (under ``is_causal`` rows k0 .. L: every such
row's block computed those columns), written into the gradients directly, and keys that no row
sees get 0. Larger heads keep block-sized buffers and sum grad_k, grad_v over the query blocks
through an ``(S, E)``-per-head buffer, added into the zeroed gradients. At B=16, H=4, L=S=128,
E=64 causal, the whole-scores backward took 0.89x the CPU time of the summed one (median of 15
interleaved pairs, two threads, a loaded 2-core machine): no zero fill, no strided adds.

NOTE [ Numba attention threads ]
A block's products are small (64 x 64 by 64 x 512 at E = 64): one BLAS call runs them at about
90 GFLOP/s on one core here, and its own second thread adds little. So the blocks are shared
out between ``numba.get_num_threads()`` Python threads instead (NumPy's products and the ``nogil`` row
kernels release the GIL), each with scratch of its own, and BLAS is held to one thread per call
for the duration (``_blas_single_threaded``, threadpoolctl): with OpenBLAS's own threads left on,
two callers' thread teams spun against each other and a B=8, H=8, L=512 forward+backward that
takes about 0.1 s took 6 to 19 s. Workers take the next item as they finish one: the forward's
items are (group, block) pairs, the costliest first (under ``is_causal`` the last blocks read
the most keys), which write disjoint rows; the backward's are whole groups of heads, whose grad_k
and grad_v sums no other thread touches. No sum is ever split between threads, so the result does
not depend on the thread count (tested bit for bit). float16 inputs are widened to float32 a
block (forward) or a group (backward) at a time in the worker's scratch, never whole tensors;
float64 runs in float64. A single worker runs its items on the calling thread, also with BLAS held
to one thread where a product is large enough for OpenBLAS to thread it (``_BLAS_THREADED_MNK``):
left threaded, a 64 x 128 x 64 product went to OpenBLAS's team, whose wake-up and spin cost
several times the product (B=16, H=4, L=S=128, E=64 causal forward on one Numba thread: 66-100
ms of CPU time against 6.4 held to one, on a loaded 2-core machine).

NOTE [ BLAS from Numba threads in attention ]
Where the library's ``?gemm`` address is known (``_blas.address``; float32 and float64 inputs, no
empty dimension, every array (BH, n, d) contiguous or a (B, H, n, d) view whose rows BLAS can step
through), the forward and the whole-scores backward (all three gradients asked for) run as jitted
items, one head each, that call ``?gemm`` themselves (``_blas.call_gemm``, as conv2d's: NOTE [ BLAS
from Numba threads ] in conv.py), with no Python, ctypes or GIL between the products of a call: one
jitted call per worker (``_run``'s threads, each taking the next head from an atomic counter,
``_blas.take``) runs every product and column kernel of its heads. Not a parallel Numba kernel: its
OpenMP threads spin at the closing barrier while a descheduled one finishes (two threads took 1.6x
the CPU time of one on the loaded 2-core machine; Python threads sleep in ``f.result()``). The
items work on the transposed scores (NOTE [ Attention scores by columns ]); the products and sums
are the Python items' on other layouts and in other orders, so results agree to float32's rounding
(tested against each other and the reference). The Python items run where the address is not found
(another BLAS), and for float16, the block-summed backward and a backward asked for fewer gradients.

NOTE [ Attention scores by columns ]
The jitted items hold a block's scores transposed, (keys, queries): ``k[:sn] @ q_blk.T`` (and
``v[:sn] @ grad_out_blk.T``) with the head's ``q.T`` (and ``grad_out.T``) laid out once in scratch,
so that no product takes a transposed right operand (OpenBLAS's kernels here took 1.7-2x as long on
one: 64 x 128 x 64 sgemm 19 us against 11 us, one thread, a loaded machine); the products that read
a block back take it as a transposed left operand, which ran at the untransposed rate (32 x 64 x
32: 1.21 us either way). The softmax's and the gradient's reductions then run down the columns, one
vector of queries per key row, with no horizontal reduction, call or log per row: the forward's
softmax of a 64 x 64 causal block took 3.57 us by rows and 2.69 us by columns (fastest of 20 x 200
calls, one thread); the gradient kernel by columns is no faster than by rows (2.5 us a head at T =
64 either way; 8.6 against 7.4 us at T = 128, where a key row of a block is only two vectors). The
blocks are ``_BLOCK_COLS`` = 32 queries, each reading the keys to its last query, so that causal
heads skip more of the masked half in every product than 64-row blocks do (at T = 64 a quarter of
the scores; at T = 128 10240 scores against 12288): sgemm ran at the same 105-110 GFLOP/s from 16 to
64 rows here (one thread, in cache), and the 64 x 64 block's softmax took 0.73 + 1.32 us as two
32-query blocks. Blocks of 16 and of 64 queries took as long or longer over whole calls. NOTE: index
the blocks through row slices (``pt[j, q0 : q0 + nq]``) in the column loops: with ``pt[j, q0 + i]``
LLVM vectorized nothing (Numba wraps a possibly negative index) and the gradient kernel ran 5-8x
slower. The scratch rows are ``_PAD`` elements longer than L: laying out q.T in rows of L = 128
(512 bytes apart, so that the stores of a row of q fell into a few L1 sets) took 5.1 us a head, in
rows 16 longer 2.6 us, and whole calls at (16, 4, 128, 64) 1.06x less CPU time forward, 1.03x
backward ((32, 4, 64, 32) no different). Whole calls, one thread, causal, float32, q, k, v as c_attn's
views, against the row items they replaced (medians of 15 interleaved rounds of 5 calls in one
process, CPU time; a loaded 2-core machine): (32, 4, 64, 32) forward 1367 -> 1044 us (1.31x),
backward 2606 -> 2114 us (1.23x); (16, 4, 128, 64) 3540 -> 3065 us (1.16x), 7274 -> 6111 us
(1.19x); without is_causal no different at either shape; (8, 8, 512, 64) causal forward 1.16x.

NOTE [ Numba attention views ]
Besides (BH, n, d) arrays, the kernels take q, k, v and grad_out as (B, H, n, d) arrays of any
strides whose last is one element: ``CausalSelfAttention``'s heads, split from c_attn's (B, T,
3C) output and transposed, reach them as such views, without the contiguous copy every other
kernel's strided input gets (``_Attention`` in _autograd_ops.py; ``ATTENTION_VIEWS`` in this
backend's package). BLAS reads a matrix of any row stride, so a group of heads is one strided
stack for ``np.matmul``: ``_group`` then keeps a group to whole batch rows (a (b, H, n, d)
stack) or a part of one row that divides H (an (h, n, d) stack), ``_stack`` slices it, and the
scratch blocks are reshaped to the stack's leading dims. out and the gradients may be such views
too: ``_Attention`` makes them in (B, L, H, d) layout and passes them transposed, so that the
heads' merge ``y.transpose(1, 2).reshape(B, L, C)`` is a view and the gradients reach c_attn's
split as views; the products write them through their row strides. lse stays (BH, L),
indexed by the flat head. A float16 view is widened into the worker's scratch as a contiguous
array would be.
"""

from __future__ import annotations

import contextlib
import math
import threading
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np
from numba import njit
from threadpoolctl import ThreadpoolController

from taifuse import pool
from taifuse.backends._host import compute_dtype
from taifuse.backends.numba import _blas
from taifuse.backends.numba._jit import (
    _FMA,
    _FMA_REDUCE,
    _convert,
    _exp_neg,
    _like,
    _maxnum,
    _prefer_wide_vectors,
)
from taifuse.backends.reference.forward import dropout_key, dropout_scale, dropout_threshold

_BLOCK_Q = 64  # query rows per block
_BLOCK_COLS = 32  # query rows per block of the jitted items (NOTE [ Attention scores by columns ])
_PAD = 16  # elements past L in a row of the jitted items' transposed scratch (the same NOTE)
_GROUP_SCORES = 1 << 16  # heads share a product call while their block scores stay under this
# The backward keeps a group's whole (L, S) scores and dP where a head's stay under this.
_WHOLE_SCORES = 1 << 16
# OpenBLAS runs a product of at most this many multiply-adds on one thread (interface/gemm.c:
# SMP_THRESHOLD_MIN * GEMM_MULTITHREAD_THRESHOLD); past it a lone worker holds BLAS to one.
_BLAS_THREADED_MNK = 1 << 18


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


# NOTE [ Attention rows at full width ]
# The row kernels run every loop over the block's whole key width and select, per key, what the
# causal limit (the row's last visible key) leaves: a score past it counts as -inf in the max and
# as 0 in the exp and the sums. A loop that stopped at the limit ended in a scalar remainder of up
# to a vector's width of exps on every row, and the rows are short at small T (64 to 128 keys):
# the forward's row kernel on an (8, 64, 128) causal block took 110 us that way and 74 us at full
# width (fastest of 20 interleaved calls, one thread, on a loaded 2-core Xeon). Whole calls, causal,
# forward and backward on Tensors: B=16, H=4, L=S=128, E=64 6.75 -> 6.16 ms and B=16, H=8,
# L=S=64, E=32 5.07 -> 3.08 ms (fastest of 3 x 10 calls, each side in its own processes taken in
# turn, a quiet 16-core Xeon VM held to 2 cores). A masked key's exp is computed and dropped
# (its argument may be positive there; the select discards whatever it gives). Without a
# mask, ``mask`` is None and Numba compiles the maskless loops apart; the functions ask for
# 512-bit vectors (NOTE [ 512-bit vectors ] in _jit.py).


@njit(**_FMA)
def _row_max(row, mrow, sn, lim, scale):
    # max(row[j] * scale (+ mrow[j]) for j < lim), -inf for none: a function of its own, without
    # the 512-bit preference of the row kernels that call it (NOTE [ 512-bit vectors ] in _jit.py).
    # Over rows of 64 to 128 keys the maxnum reduction's closing steps across a 512-bit register
    # cost more than its loop: the forward's row kernel on (8, 64, 64), (8, 64, 128) and (16, 64,
    # 64) blocks took 55, 74 and 105 us with the max inlined, 44, 66 and 83 us so (fastest of 40
    # interleaved calls, one thread, a loaded 2-core machine). The max is exact: the same bits.
    ninf = row.dtype.type(-np.inf)
    m = ninf
    if mrow is None:
        for j in range(sn):
            m = _maxnum(m, row[j] * scale if j < lim else ninf)
    else:
        for j in range(sn):
            m = _maxnum(m, row[j] * scale + mrow[j] if j < lim else ninf)
    return m


@njit(**_FMA_REDUCE)
def _softmax_rows(sc, mask, h0, q0, L, S, causal, scale, drop, key, threshold, dscale, lse):
    # sc (g, nq, sn) holds q_blk @ k.T for heads h0 .. h0 + g; it becomes the probabilities
    # exp(s - m) / sum (times the dropout factor), with lse[h, q0 + i] = m + log(sum).
    # NOTE: the max is a pass of its own that stores nothing, and the scaled, masked score is
    # recomputed in the exp pass: LLVM vectorizes a maxnum reduction only alone (a pass that
    # also stored the scores ran 9x slower on a 64 x 512 block), and the sum only under
    # "reassoc". A NaN score still makes its row NaN through the sum.
    _prefer_wide_vectors()
    gn, nq, sn = sc.shape
    zero = sc.dtype.type(0.0)
    one = sc.dtype.type(1.0)
    ninf = sc.dtype.type(-np.inf)
    for r in range(gn * nq):
        g = r // nq
        i = r - g * nq
        h = h0 + g
        qi = q0 + i
        lim = min(qi + 1, sn) if causal else sn
        m = ninf
        total = zero
        if mask is None:
            m = _row_max(sc[g, i], None, sn, lim, scale)
            if m != ninf:
                for j in range(sn):
                    e = _exp_neg(sc[g, i, j] * scale - m)
                    e = e if j < lim else zero
                    sc[g, i, j] = e
                    total += e
        else:
            mrow = mask[h if mask.shape[0] > 1 else 0, qi]
            m = _row_max(sc[g, i], mrow, sn, lim, scale)
            if m != ninf:
                for j in range(sn):
                    e = _exp_neg(sc[g, i, j] * scale + mrow[j] - m)
                    e = e if j < lim else zero
                    sc[g, i, j] = e
                    total += e
        if m == ninf:  # a fully masked row: 0, as PyTorch (NOTE [ Attention kernel arguments ])
            for j in range(sn):
                sc[g, i, j] = zero
            lse[h, qi] = -np.inf
            continue
        inv = (dscale if drop else one) / total  # the kept ones' dropout_scale rides on 1/sum
        for j in range(sn):
            sc[g, i, j] *= inv
        if drop:
            for j in range(lim):
                if not _keep(h, qi, j, L, S, key, threshold):
                    sc[g, i, j] = zero
        lse[h, qi] = m + math.log(total)


@njit(**_FMA_REDUCE)
def _gradient_rows(sc, dp, r0, nq, sn, mask, h0, q0, L, S, causal, scale, drop, key, threshold, dscale, lse):
    # In: sc[:, r0 : r0 + nq, :sn] = q_blk @ k.T, dp (likewise) = grad_out_blk @ v.T over heads
    # h0 .. h0 + g, the block's rows r0 .. r0 + nq of buffers of any width >= sn (the block's own,
    # or a group's whole (L, S) scores: NOTE [ Numba attention blocks ]). Out, there: sc = P * Z
    # (for grad_v), dp = dS * scale, with dS = P * (dP * Z - D) and D = rowsum(P * dP * Z) /
    # rowsum(P), summed from the row itself (NOTE [ Attention backward's D ] in
    # backends/reference/attention.py).
    _prefer_wide_vectors()
    gn = sc.shape[0]
    zero = sc.dtype.type(0.0)
    for r in range(gn * nq):
        g = r // nq
        i = r0 + r - g * nq
        h = h0 + g
        qi = q0 + r - g * nq
        lim = min(qi + 1, sn) if causal else sn
        row_lse = lse[h, qi]
        if row_lse == -np.inf:
            lim = 0
        total = zero
        if mask is None:
            for j in range(sn):
                p = _exp_neg(sc[g, i, j] * scale - row_lse)
                p = p if j < lim else zero
                sc[g, i, j] = p
                total += p
        else:
            mrow = mask[h if mask.shape[0] > 1 else 0, qi]
            for j in range(sn):
                p = _exp_neg(sc[g, i, j] * scale + mrow[j] - row_lse)
                p = p if j < lim else zero
                sc[g, i, j] = p
                total += p
        if drop:
            for j in range(lim):
                if not _keep(h, qi, j, L, S, key, threshold):
                    dp[g, i, j] = zero
                else:
                    dp[g, i, j] *= dscale
        di = zero
        for j in range(sn):
            di += sc[g, i, j] * (dp[g, i, j] if j < lim else zero)
        if lim > 0:
            di /= total
        for j in range(sn):
            d = sc[g, i, j] * (dp[g, i, j] - di) * scale
            dp[g, i, j] = d if j < lim else zero
        if drop:
            for j in range(lim):
                if not _keep(h, qi, j, L, S, key, threshold):
                    sc[g, i, j] = zero
                else:
                    sc[g, i, j] *= dscale


@njit(**_FMA)
def _transpose_into(a, kt):
    # kt[:, :n] = a.T for an (n, d) matrix of any strides: the products then take their right
    # operand untransposed (NOTE [ BLAS from Numba threads in attention ]).
    n, d = a.shape
    for j in range(n):
        for c in range(d):
            kt[c, j] = a[j, c]


@njit(**_FMA_REDUCE)
def _softmax_cols(st, mask, h, q0, L, S, causal, scale, drop, key, threshold, dscale, lse, mx, total):
    # _softmax_rows on the transposed block (NOTE [ Attention scores by columns ]): st (sn, nq)
    # holds k[:sn] @ q_blk.T of head h, column i query q0 + i; it becomes the probabilities, with
    # lse[h, q0 + i]. mx and total (at least nq each) are scratch: every reduction runs down the
    # columns, one vector of queries per key row.
    _prefer_wide_vectors()
    sn, nq = st.shape
    zero = st.dtype.type(0.0)
    ninf = st.dtype.type(-np.inf)
    hm = 0 if mask is None else (h if mask.shape[0] > 1 else 0)
    for i in range(nq):
        mx[i] = ninf
        total[i] = zero
    for j in range(sn):
        lo = j - q0 if causal else 0  # query q0 + i sees key j from i = j - q0 on
        if mask is None:
            for i in range(nq):
                mx[i] = _maxnum(mx[i], st[j, i] * scale if i >= lo else ninf)
        else:
            mcol = mask[hm, q0:, j]
            for i in range(nq):
                mx[i] = _maxnum(mx[i], st[j, i] * scale + mcol[i] if i >= lo else ninf)
    for j in range(sn):
        lo = j - q0 if causal else 0
        if mask is None:
            for i in range(nq):
                e = _exp_neg(st[j, i] * scale - mx[i])
                e = e if i >= lo and mx[i] != ninf else zero
                st[j, i] = e
                total[i] += e
        else:
            mcol = mask[hm, q0:, j]
            for i in range(nq):
                e = _exp_neg(st[j, i] * scale + mcol[i] - mx[i])
                e = e if i >= lo and mx[i] != ninf else zero
                st[j, i] = e
                total[i] += e
    for i in range(nq):
        # A fully masked row (mx -inf): 0 and lse -inf, as PyTorch (NOTE [ Attention kernel arguments ]).
        lse[h, q0 + i] = mx[i] + math.log(total[i]) if mx[i] != ninf else ninf
        total[i] = (dscale if drop else st.dtype.type(1.0)) / total[i] if mx[i] != ninf else zero
    for j in range(sn):
        for i in range(nq):
            st[j, i] *= total[i]
    if drop:
        for j in range(sn):
            for i in range(max(j - q0, 0) if causal else 0, nq):
                if not _keep(h, q0 + i, j, L, S, key, threshold):
                    st[j, i] = zero


@njit(**_FMA)
def _forward_items(
    q, k, v, mask, causal, scale, drop, key, threshold, dscale, out, lse, rows, buf, qt, cols, fn, ilp64,
    next_item, t,
):  # fmt: skip
    # The forward's items on one thread (NOTE [ BLAS from Numba threads in attention ]): item h is
    # flat head h, all its query blocks of ``rows`` rows, each as k @ q_blk.T (NOTE [ Attention
    # scores by columns ]); q, k, v, out (B, H, n, d) of any strides whose last is one element;
    # buf[t] (S * rows), qt[t] (E, L + _PAD) and cols[t] (2, rows) this worker's scratch.
    nb, nh, L, e = q.shape
    S, ev = k.shape[2], v.shape[3]
    size = q.itemsize
    one, zero = _like(1.0, buf[0, 0]), _like(0.0, buf[0, 0])
    nt, tr = _blas.NO_TRANS, _blas.TRANS
    ldk, ldv, ldo = k.strides[2] // size, v.strides[2] // size, out.strides[2] // size
    qth = qt[t]
    ldt = qth.shape[1]
    mx, total = cols[t, 0], cols[t, 1]
    h = _blas.take(next_item)
    while h < nb * nh:
        b, hh = h // nh, h % nh
        _transpose_into(q[b, hh], qth)
        ka, va = k[b, hh].ctypes.data, v[b, hh].ctypes.data
        for q0 in range(0, L, rows):
            q1 = min(q0 + rows, L)
            sn = min(S, q1) if causal else S  # under is_causal the block's last row's keys
            nq = q1 - q0
            st = buf[t, : sn * nq].reshape((sn, nq))
            sa, qa, oa = st.ctypes.data, qth[:, q0:].ctypes.data, out[b, hh, q0:].ctypes.data
            _blas.call_gemm(fn, ilp64, nt, nt, sn, nq, e, one, ka, ldk, qa, ldt, zero, sa, nq)
            _softmax_cols(st, mask, h, q0, L, S, causal, scale, drop, key, threshold, dscale, lse, mx, total)
            _blas.call_gemm(fn, ilp64, tr, nt, nq, ev, sn, one, sa, nq, va, ldv, zero, oa, ldo)
        h = _blas.take(next_item)


@njit(**_FMA_REDUCE)
def _gradient_cols(
    pt, dst, q0, nq, sn, mask, h, L, S, causal, scale, drop, key, threshold, dscale, lse, total, di
):
    # _gradient_rows on the transposed blocks (NOTE [ Attention scores by columns ]): in, pt[:sn,
    # q0 : q0 + nq] = k[:sn] @ q_blk.T and dst (likewise) = v[:sn] @ grad_out_blk.T of head h, in
    # buffers of width >= q0 + nq; out, there: pt = P * Z (for grad_v), dst = dS * scale. total
    # and di (at least nq each) are scratch for the column sums.
    _prefer_wide_vectors()
    zero = pt.dtype.type(0.0)
    ninf = pt.dtype.type(-np.inf)
    hm = 0 if mask is None else (h if mask.shape[0] > 1 else 0)
    cols_lse = lse[h, q0 : q0 + nq]
    for i in range(nq):
        total[i] = zero
        di[i] = zero
    for j in range(sn):
        lo = j - q0 if causal else 0  # query q0 + i sees key j from i = j - q0 on
        prow = pt[j, q0 : q0 + nq]
        if mask is None:
            for i in range(nq):
                p = _exp_neg(prow[i] * scale - cols_lse[i])
                p = p if (i >= lo) & (cols_lse[i] != ninf) else zero
                prow[i] = p
                total[i] += p
        else:
            mcol = mask[hm, q0:, j]
            for i in range(nq):
                p = _exp_neg(prow[i] * scale + mcol[i] - cols_lse[i])
                p = p if (i >= lo) & (cols_lse[i] != ninf) else zero
                prow[i] = p
                total[i] += p
        drow = dst[j, q0 : q0 + nq]
        if drop:
            for i in range(max(lo, 0), nq):
                if not _keep(h, q0 + i, j, L, S, key, threshold):
                    drow[i] = zero
                else:
                    drow[i] *= dscale
        for i in range(nq):
            di[i] += prow[i] * (drow[i] if i >= lo else zero)
    for i in range(nq):
        if total[i] > zero:
            di[i] /= total[i]
    for j in range(sn):
        lo = j - q0 if causal else 0
        prow, drow = pt[j, q0 : q0 + nq], dst[j, q0 : q0 + nq]
        for i in range(nq):
            d = prow[i] * (drow[i] - di[i]) * scale
            drow[i] = d if (i >= lo) & (cols_lse[i] != ninf) else zero
        if drop:
            for i in range(max(lo, 0), nq):
                if not _keep(h, q0 + i, j, L, S, key, threshold):
                    prow[i] = zero
                else:
                    prow[i] *= dscale


@njit(**_FMA)
def _backward_items(
    q, k, v, mask, causal, scale, drop, key, threshold, dscale, lse, grad_out, grad_q, grad_k, grad_v, rows,
    scores, dps, qt, gt, cols, fn, ilp64, next_item, t,
):  # fmt: skip
    # The whole-scores backward's items on one thread (NOTE [ BLAS from Numba threads in
    # attention ]): item h is flat head h, by columns (NOTE [ Attention scores by columns ]); the
    # arrays (B, H, n, d) of any strides whose last is one element; scores[t], dps[t] (S, L +
    # _PAD), qt[t] (E, L + _PAD), gt[t] (Ev, L + _PAD) and cols[t] (2, rows) this worker's scratch.
    nb, nh, L, e = q.shape
    S, ev = k.shape[2], v.shape[3]
    size = q.itemsize
    one, zero = _like(1.0, scores[0, 0, 0]), _like(0.0, scores[0, 0, 0])
    nt, tr = _blas.NO_TRANS, _blas.TRANS
    ldq, ldk, ldv = q.strides[2] // size, k.strides[2] // size, v.strides[2] // size
    ldg = grad_out.strides[2] // size
    ldgq, ldgk, ldgv = grad_q.strides[2] // size, grad_k.strides[2] // size, grad_v.strides[2] // size
    seen = min(S, L) if causal else S
    qth, gth = qt[t], gt[t]
    pt_all, dst_all = scores[t], dps[t]
    ldt, lds = qth.shape[1], pt_all.shape[1]
    total, di = cols[t, 0], cols[t, 1]
    h = _blas.take(next_item)
    while h < nb * nh:
        b, hh = h // nh, h % nh
        _transpose_into(q[b, hh], qth)
        _transpose_into(grad_out[b, hh], gth)
        ka, va = k[b, hh].ctypes.data, v[b, hh].ctypes.data
        for q0 in range(0, L, rows):
            q1 = min(q0 + rows, L)
            sn = min(S, q1) if causal else S
            nq = q1 - q0
            pa, da = pt_all[:, q0:].ctypes.data, dst_all[:, q0:].ctypes.data
            qa, ga = qth[:, q0:].ctypes.data, gth[:, q0:].ctypes.data
            _blas.call_gemm(fn, ilp64, nt, nt, sn, nq, e, one, ka, ldk, qa, ldt, zero, pa, lds)
            _blas.call_gemm(fn, ilp64, nt, nt, sn, nq, ev, one, va, ldv, ga, ldt, zero, da, lds)
            _gradient_cols(
                pt_all, dst_all, q0, nq, sn, mask, h, L, S, causal, scale, drop, key, threshold, dscale, lse,
                total, di,
            )  # fmt: skip
            dqa = grad_q[b, hh, q0:].ctypes.data
            _blas.call_gemm(fn, ilp64, tr, nt, nq, e, sn, one, da, lds, ka, ldk, zero, dqa, ldgq)
        # Keys k0 .. k1 are seen by rows from k0 on under is_causal (NOTE [ Numba attention blocks ]).
        step = rows if causal else max(seen, 1)
        for k0 in range(0, seen, step):
            k1 = min(k0 + step, seen)
            r0 = k0 if causal else 0
            pa, da = pt_all[k0, r0:].ctypes.data, dst_all[k0, r0:].ctypes.data
            qa, ga = q[b, hh, r0:].ctypes.data, grad_out[b, hh, r0:].ctypes.data
            dva, dka = grad_v[b, hh, k0:].ctypes.data, grad_k[b, hh, k0:].ctypes.data
            _blas.call_gemm(fn, ilp64, nt, nt, k1 - k0, ev, L - r0, one, pa, lds, ga, ldg, zero, dva, ldgv)
            _blas.call_gemm(fn, ilp64, nt, nt, k1 - k0, e, L - r0, one, da, lds, qa, ldq, zero, dka, ldgk)
        grad_k[b, hh, seen:] = zero
        grad_v[b, hh, seen:] = zero
        h = _blas.take(next_item)


# ----------------------------------------------------------------------------- threads

_executor: ThreadPoolExecutor | None = None
_blas_controller = None
_lock = threading.Lock()


def _workers(items: int) -> int:
    return max(1, min(items, numba.get_num_threads()))


def _run(task, items: list, workers: int, blas_may_thread: bool) -> None:
    """``task(w, item)`` for every item, on ``workers`` threads that each take the next item
    as they finish one (NOTE [ Numba attention threads ]); ``w`` names the worker's scratch.
    BLAS runs single-threaded throughout, also on one worker, where ``blas_may_thread`` says
    that a product is large enough for OpenBLAS to thread it (NOTE [ Numba attention threads ])."""
    global _executor
    if workers == 1:
        with _blas_single_threaded() if blas_may_thread else contextlib.nullcontext():
            for item in items:
                task(0, item)
        return
    with _lock:
        if _executor is None or _executor._max_workers < workers:
            _executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="taifuse-attention")
        executor = _executor
    queue = iter(items)  # next() on a list iterator is atomic under the GIL

    def worker(w: int) -> None:
        for item in queue:
            task(w, item)

    # The calling thread is worker 0 (NOTE [ The caller is a worker ]).
    with _blas_single_threaded():
        futures = [executor.submit(worker, w) for w in range(1, workers)]
        try:
            worker(0)
        finally:  # never return (or raise) while a pool thread still writes the outputs
            for f in futures:
                f.exception()
        for f in futures:
            f.result()


# NOTE [ The caller is a worker ]
# ``_run`` runs worker 0 on the calling thread and hands only the others to the pool. Before, every
# worker was a pool thread and the caller slept in ``f.result()``: a call paid one more wake-up
# (35-90 us on the 2-core EPYC VM, NOTE [ A launch wakes the worker ] in _jit.py) and, at its end,
# the caller's own wake-up, while the items of a small shape take ~1 ms in all (128 heads of
# (64, 32) at ~7.5 us each). Which thread runs which item never changed the result: each item
# writes its own outputs and no sum is split between items (tested bit for bit across thread counts).
# Measured (quiet, 2 threads, causal float32 on c_attn views, each tree in its own process, 5
# alternating pairs, medians of 15 rounds of 10 calls, us per call): (32, 4, 64, 32) forward 693 ->
# 621, backward 1261 -> 1161, with 8% less CPU; (16, 4, 128, 64) forward 1469 -> 1419, backward 3332
# -> 3410 (within the spread); the example GPT step, 4 pairs, within its spread.


def _run_jitted(kernel, args: tuple, workers: int) -> None:
    """``kernel(*args, counter, w)`` on ``workers`` threads, each taking the next head from
    ``counter`` as it finishes one (NOTE [ BLAS from Numba threads in attention ])."""
    counter = np.zeros(1, np.int64)
    _run(lambda w, _: kernel(*args, counter, w), list(range(workers)), workers, True)


def _blas_single_threaded():
    """A context in which BLAS calls run on the calling thread alone (NOTE [ Numba attention
    threads ])."""
    global _blas_controller
    with _lock:
        if _blas_controller is None:
            _blas_controller = (
                ThreadpoolController()
            )  # inspects the loaded libraries once: ~8 us a limit after
    return _blas_controller.limit(limits=1, user_api="blas")


# ----------------------------------------------------------------------------- host side


def _widened(a: np.ndarray, dtype: np.dtype, buf: np.ndarray | None) -> np.ndarray:
    """``a`` in ``dtype``: itself, or widened from float16 into the front of ``buf``."""
    if a.dtype == dtype:
        return a
    c = _block(buf, *a.shape)
    _convert(c, a)  # the hardware conversions, not NumPy's (the note above _convert)
    return c


def _block(buf: np.ndarray, *shape: int) -> np.ndarray:
    """A C-contiguous ``shape`` view of the front of a flat scratch buffer."""
    return buf[: math.prod(shape)].reshape(shape)


def _mask_args(mask: np.ndarray | None, dtype: np.dtype) -> np.ndarray | None:
    if mask is None:
        return None
    # A float16 mask is widened whole, once: it is (1 or BH, L, S), read row by row.
    return mask if mask.dtype == dtype else mask.astype(dtype)


def _dropout_args(dropout_p: float, seed: int, dtype: np.dtype) -> tuple:
    drop = dropout_p > 0.0
    key = np.uint32(dropout_key(seed) if drop else 0)
    return drop, key, np.uint32(dropout_threshold(dropout_p)), dtype.type(dropout_scale(dropout_p))


def _scratch(workers: int, dtype: np.dtype, *sizes: int) -> list[list[np.ndarray]]:
    """Per worker, one flat pooled buffer of each size (an empty array, not pooled, for a size
    of 0: head dim 0 still takes views of its buffers)."""
    host = pool.host_pool()
    return [[host.acquire((n,), dtype) for n in sizes] for _ in range(workers)]


def _group(bh: int, rows: int, s: int, heads: int = 0) -> int:
    """Heads per product call: enough that small heads share one (NOTE [ Numba attention blocks ]).
    With ``heads`` per batch row ((B, H, n, d) views, NOTE [ Numba attention views ]) a group is
    whole batch rows or a part of one that divides it, so that it is one strided stack."""
    gs = max(1, min(bh, _GROUP_SCORES // max(1, rows * s)))
    if heads and gs < bh:
        if gs >= heads:
            return gs // heads * heads
        while heads % gs:
            gs -= 1
    return gs


def _stack(a: np.ndarray, h0: int, h1: int) -> np.ndarray:
    """Heads ``h0 .. h1`` (flat, batch-major) of a ``(BH, n, d)`` array, or of a ``(B, H, n, d)``
    one of any strides, where :func:`_group` keeps them whole batch rows or a part of one."""
    if a.ndim == 3:
        return a[h0:h1]
    heads = a.shape[1]
    b0, r0 = divmod(h0, heads)
    if r0 == 0 and h1 - h0 >= heads:
        return a[b0 : h1 // heads]
    return a[b0, r0 : r0 + h1 - h0]


def _like_stack(a: np.ndarray, lead: tuple[int, ...]) -> np.ndarray:
    """A ``(g, n, d)`` block with its heads split as a stack's leading dims ``lead`` (a view)."""
    return a.reshape(lead + a.shape[1:])


def _heads(a: np.ndarray | None, bh: int) -> np.ndarray | None:
    """An output array as (BH, n, d) (a view) when C-contiguous; a strided one stays the (B, H, n,
    d) view it is (NOTE [ Numba attention views ])."""
    if a is None or not a.flags.c_contiguous:
        return a
    return a.reshape((bh,) + a.shape[-2:])


def _jitted_views(bh: int, *arrays: np.ndarray) -> tuple[np.ndarray, ...] | None:
    """The arrays as (B, H, n, d) views of one (B, H) split for the jitted items (a (BH, n, d) one
    reshaped to the (B, H, n, d) views' split, or to (1, BH)), or None where the items cannot take
    them: a strided array that is not (B, H, n, d), two splits of the heads, rows that BLAS cannot
    step through (their stride under their length, or not whole elements), or an empty dimension
    (NOTE [ BLAS from Numba threads in attention ])."""
    lead = {a.shape[:2] for a in arrays if a.ndim == 4} or {(1, bh)}
    if len(lead) > 1:
        return None
    (split,) = lead
    out = []
    for a in arrays:
        if a.ndim != 4:
            if not a.flags.c_contiguous:
                return None
            a = a.reshape(split + a.shape[-2:])
        d, size = a.shape[-1], a.itemsize
        if 0 in a.shape or a.strides[3] != size or a.strides[2] % size or a.strides[2] < d * size:
            return None
        out.append(a)
    return tuple(out)


def _rows_of(a: np.ndarray, h0: int, h1: int, lead: tuple[int, ...]) -> np.ndarray:
    """Heads ``h0 .. h1`` of a (BH, n, d) or (B, H, n, d) array, shaped as the stack ``lead``."""
    return _stack(a, h0, h1) if a.ndim == 4 else _like_stack(a[h0:h1], lead)


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
    NOTE [ Numba attention blocks ], threaded as in NOTE [ Numba attention threads ]; q, k, v may
    be (B, H, n, d) views (NOTE [ Numba attention views ])."""
    L, e = q.shape[-2:]
    bh = math.prod(q.shape[:-2])
    S, ev = k.shape[-2], v.shape[-1]
    out = _heads(out, bh)
    ct = compute_dtype(q.dtype)
    half = q.dtype != ct
    m = _mask_args(mask, ct)
    drop, key, threshold, dscale = _dropout_args(dropout_p, seed, ct)
    sc_scale = ct.type(scale)
    lc = lse if lse.dtype == ct else pool.host_pool().acquire(lse.shape, ct)
    address = None if half else _blas.address(ct)
    views = None if address is None else _jitted_views(bh, q, k, v, out)
    if views is not None:
        q4, k4, v4, o4 = views
        rows = min(_BLOCK_COLS, L)
        workers = _workers(bh)
        host = pool.host_pool()
        buf, qt = host.acquire((workers, rows * S), ct), host.acquire((workers, e, L + _PAD), ct)
        cols = host.acquire((workers, 2, rows), ct)
        args = (q4, k4, v4, m, is_causal, sc_scale, drop, key, threshold, dscale, o4, lc, rows, buf, qt, cols)
        _run_jitted(_forward_items, args + address, workers)
        if lc is not lse:
            np.copyto(lse, lc)
        return
    rows = min(_BLOCK_Q, L)
    gs = _group(bh, rows, S, q.shape[1] if q.ndim == 4 else 0)
    # (first head, first row) of every block, the costliest first: under is_causal the last
    # blocks read the most keys, and taking them first evens out the workers' shares.
    items = [(h0, q0) for q0 in range(0, L, rows)[::-1] for h0 in range(0, bh, gs)]
    workers = _workers(len(items))
    # The output's block goes through scratch where it is widened; else the product writes it.
    wide = (gs * rows * e, gs * S * e, gs * S * ev, gs * rows * ev) if half else (0, 0, 0, 0)
    scratch = _scratch(workers, ct, gs * rows * S, *wide)

    def task(w: int, item: tuple[int, int]) -> None:
        buf, bq, bk, bv, bo = scratch[w]
        h0, q0 = item
        h1 = min(h0 + gs, bh)
        q1 = min(q0 + rows, L)
        sn = min(S, q1) if is_causal else S
        qs = _stack(q, h0, h1)
        lead = qs.shape[:-2]
        qb = _widened(qs[..., q0:q1, :], ct, bq)
        kb = _widened(_stack(k, h0, h1)[..., :sn, :], ct, bk)
        vb = _widened(_stack(v, h0, h1)[..., :sn, :], ct, bv)
        sc = _block(buf, h1 - h0, q1 - q0, sn)
        np.matmul(qb, kb.swapaxes(-1, -2), out=_like_stack(sc, lead))
        _softmax_rows(sc, m, h0, q0, L, S, is_causal, sc_scale, drop, key, threshold, dscale, lc)
        o = _rows_of(out, h0, h1, lead)[..., q0:q1, :]
        if half:
            ob = _like_stack(_block(bo, h1 - h0, q1 - q0, ev), lead)
            np.matmul(_like_stack(sc, lead), vb, out=ob)
            _convert(o, ob)
        else:
            np.matmul(_like_stack(sc, lead), vb, out=o)

    _run(task, items, workers, rows * S * max(e, ev) > _BLAS_THREADED_MNK)
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
    by block (NOTE [ Numba attention blocks ]), one group of heads per worker at a time (NOTE
    [ Numba attention threads ]); q, k, v and grad_out may be (B, H, n, d) views (NOTE [ Numba
    attention views ])."""
    L, e = q.shape[-2:]
    bh = math.prod(q.shape[:-2])
    S, ev = k.shape[-2], v.shape[-1]
    grad_q, grad_k, grad_v = (_heads(a, bh) for a in (grad_q, grad_k, grad_v))
    ct = compute_dtype(q.dtype)
    half = q.dtype != ct
    m = _mask_args(mask, ct)
    drop, key, threshold, dscale = _dropout_args(dropout_p, seed, ct)
    sc_scale = ct.type(scale)
    lc = lse if lse.dtype == ct else lse.astype(ct)
    rows = min(_BLOCK_Q, L)
    whole = L <= rows or L * S <= _WHOLE_SCORES
    grads = (grad_q, grad_k, grad_v)
    address = None if half or not whole or any(g is None for g in grads) else _blas.address(ct)
    views = None if address is None else _jitted_views(bh, q, k, v, grad_out, *grads)
    if views is not None:
        workers = _workers(bh)
        host = pool.host_pool()
        scores, dps = host.acquire((workers, S, L + _PAD), ct), host.acquire((workers, S, L + _PAD), ct)
        qt, gt = host.acquire((workers, e, L + _PAD), ct), host.acquire((workers, ev, L + _PAD), ct)
        cols = host.acquire((workers, 2, _BLOCK_COLS), ct)
        q4, k4, v4, g4, dq4, dk4, dv4 = views
        rows = min(_BLOCK_COLS, L)
        args = (q4, k4, v4, m, is_causal, sc_scale, drop, key, threshold, dscale, lc, g4, dq4, dk4, dv4, rows)
        _run_jitted(_backward_items, args + (scores, dps, qt, gt, cols) + address, workers)
        return
    gs = _group(bh, rows, S, q.shape[1] if q.ndim == 4 else 0)
    # Small heads keep a group's whole (L, S) scores and dP, and grad_k, grad_v are one product per
    # block of keys written in place; larger ones sum them over query blocks through a scratch
    # product (NOTE [ Numba attention blocks ]).
    groups = list(range(0, bh, gs))
    workers = _workers(len(groups))
    # Per worker: the scores and dP (the group's whole, or a block's), one product's (S, max(E,
    # Ev)) where the key sums go through scratch, the group's grad_q, grad_k, grad_v in compute
    # precision where they cannot be written in place, and the group's widened float16 inputs.
    own = [g is None or half for g in (grad_q, grad_k, grad_v)]
    sizes = [gs * (L if whole else rows) * S] * 2 + [0 if whole else gs * S * max(e, ev)]
    sizes += [gs * n if o else 0 for n, o in zip((L * e, S * e, S * ev), own)]
    sizes += [gs * n for n in (L * e, S * e, S * ev, L * ev)] if half else [0] * 4
    scratch = _scratch(workers, ct, *sizes)
    # Under is_causal, key j is seen by rows j .. L only, and keys past min(S, L) by none.
    seen = min(S, L) if is_causal else S

    def task(w: int, h0: int) -> None:
        buf_s, buf_p, buf_t, bdq, bdk, bdv, bq, bk, bv, bg = scratch[w]
        h1 = min(h0 + gs, bh)
        gn = h1 - h0
        qh, kh, vh, gh = (
            _widened(_stack(a, h0, h1), ct, b) for a, b in ((q, bq), (k, bk), (v, bv), (grad_out, bg))
        )
        lead = qh.shape[:-2]
        dq4, dk4, dv4 = (
            _like_stack(_block(buf, gn, n, d), lead) if o else _rows_of(grad, h0, h1, lead)
            for grad, buf, n, d, o in zip(
                (grad_q, grad_k, grad_v), (bdq, bdk, bdv), (L, S, S), (e, e, ev), own
            )
        )
        if whole:
            sc_all, dp_all = _block(buf_s, gn, L, S), _block(buf_p, gn, L, S)
        else:
            dk4[...] = 0
            dv4[...] = 0
        for q0 in range(0, L, rows):
            q1 = min(q0 + rows, L)
            sn = min(S, q1) if is_causal else S
            if whole:  # the block's rows of the group's scores, read by the key products below
                sc, dp, r0 = sc_all[:, q0:q1, :sn], dp_all[:, q0:q1, :sn], q0
            else:
                sc, dp, r0 = _block(buf_s, gn, q1 - q0, sn), _block(buf_p, gn, q1 - q0, sn), 0
            sc4, dp4 = _like_stack(sc, lead), _like_stack(dp, lead)
            qb, gb = qh[..., q0:q1, :], gh[..., q0:q1, :]
            kb, vb = kh[..., :sn, :], vh[..., :sn, :]
            np.matmul(qb, kb.swapaxes(-1, -2), out=sc4)
            np.matmul(gb, vb.swapaxes(-1, -2), out=dp4)
            _gradient_rows(
                sc_all if whole else sc, dp_all if whole else dp, r0, q1 - q0, sn, m, h0, q0, L, S,
                is_causal, sc_scale, drop, key, threshold, dscale, lc,
            )  # fmt: skip
            np.matmul(dp4, kb, out=dq4[..., q0:q1, :])
            if whole:
                continue
            t = _like_stack(_block(buf_t, gn, sn, ev), lead)
            np.matmul(sc4.swapaxes(-1, -2), gb, out=t)
            dv4[..., :sn, :] += t
            t = _like_stack(_block(buf_t, gn, sn, e), lead)
            np.matmul(dp4.swapaxes(-1, -2), qb, out=t)
            dk4[..., :sn, :] += t
        if whole:
            # Keys k0 .. k1 are seen by rows from k0 on (under is_causal; by every row without):
            # their sums are one product each over those rows, all of whose scores the blocks
            # above computed (a block's rows read the keys up to its last row).
            for k0 in range(0, seen, rows if is_causal else max(seen, 1)):
                k1 = min(k0 + rows, seen) if is_causal else seen
                r0 = k0 if is_causal else 0
                p4 = _like_stack(sc_all[:, r0:, k0:k1], lead).swapaxes(-1, -2)
                ds4 = _like_stack(dp_all[:, r0:, k0:k1], lead).swapaxes(-1, -2)
                np.matmul(p4, gh[..., r0:, :], out=dv4[..., k0:k1, :])
                np.matmul(ds4, qh[..., r0:, :], out=dk4[..., k0:k1, :])
            dk4[..., seen:, :] = 0
            dv4[..., seen:, :] = 0
        for grad, acc, o in zip((grad_q, grad_k, grad_v), (dq4, dk4, dv4), own):
            if grad is not None and o:
                _convert(_rows_of(grad, h0, h1, lead), acc)

    _run(task, groups, workers, rows * S * max(e, ev) > _BLAS_THREADED_MNK)
