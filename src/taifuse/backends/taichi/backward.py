"""Backward and loss kernels of the taichi backend (``taifuse.backends.BACKWARD_KERNEL_NAMES``).

Signatures and math are the reference's (``backends/reference/backward.py``), which is also the
NumPy version. Written by hand: Taichi's autodiff writes gradients into the primal array on the
SPIR-V backends (Vulkan, Metal). Activation derivatives switch on ``_spec.Activation`` codes
(``_math.activation_grad``).

Fused where the forward is fused:

* ``linear_act_backward``: one pass over ``(N, M)`` forms grad_pre = grad_out * act'(pre) and
  per-chunk partial sums of grad_pre for the bias, then the two matrix products read grad_pre
  (and its transpose, through strides) without copying.
* ``softmax`` / ``log_softmax`` / ``layer_norm`` backward: one kernel per row (one thread on
  ``ti.cpu``, a block of ``ROW_THREADS`` with a threadgroup tree reduction on the GPU archs, as
  the forward kernels); layer_norm's weight/bias gradients are column sums.
* ``cross_entropy``: one row kernel writes the log-sum-exp and the loss; its backward is one
  elementwise pass ``g * (exp(x - lse) - onehot)`` (log_softmax + nll fused).

Column sums (bias, layer_norm weight/bias, losses' mean/sum) go through
``tensor_math.reduce_into``: no thread adds more than a bounded number of terms
(NOTE [ Loop limits in reductions ] there). Scratch buffers come from the pool
(``tensor_math._new``).

# NOTE [ Embedding backward without float atomics ]
# grad_weight[v] sums grad_out over every n with indices[n] == v; Metal has no float atomics, so
# no thread may add into a row that another thread adds into. ``embedding_backward`` is one kernel
# (each top-level loop a launch, in order): a counting sort of the indices with int32 atomics
# (count per row; an exclusive scan over the rows in blocks of SCAN_BLOCK; a scatter of each n to
# its row's bucket), a heapsort of each bucket (the atomics fill it in any order; sorted, every
# row sums in the order of n and gives the same bits on every run), then one thread per (row,
# column) of grad_weight sums its bucket's grad_out rows in float32 blocks. O(N log N + (N + V) *
# D) work, no row's sum shared between threads; the padding row is written as zeros.

# NOTE [ Class indices on the device ]
# Integer arrays on the taichi backend are int32 DeviceArrays (``from_numpy`` converts
# integer data, refusing values outside int32): Metal has 64-bit integers only as an optional
# capability, and class indices never need them. ``cross_entropy`` therefore takes an int32
# target here. A target already on the device is not range-checked on the host (that would be a
# device-to-host copy every step); a row whose index is outside [0, C) gets a NaN loss and NaN
# gradients instead, so the error shows in the loss.
"""

# NOTE: no `from __future__ import annotations`: Taichi reads kernel annotations as objects.

import functools
from types import SimpleNamespace
from typing import Any

import numpy as np

from taifuse.backends._spec import Activation, activation_code, gelu_code
from taifuse.backends.taichi import forward
from taifuse.backends.taichi import tensor_math as tm
from taifuse.backends.taichi._runtime import FLOAT_DTYPES, _import_taichi, _nd, _on_gpu, _optional, _ti_dtype
from taifuse.backends.taichi.tensor_math import _broadcast_strides, _merge, _new

# Rows per thread in the column-sum passes (bias and layer_norm parameter gradients).
COL_CHUNK = 64
# Counts per thread in the block-level scan of embedding_backward's counting sort.
SCAN_BLOCK = 256
_REDUCTION_CODES = {"none": 0, "mean": 1, "sum": 2}


# ----------------------------------------------------------------------------- kernels
#
# One cached factory per op family, each building its kernels for one storage dtype when first
# needed: activations, column partial sums, losses, embedding, and the row reductions (per storage
# dtype and per arch kind).


@functools.cache
def activation_kernels_for(dtype: Any) -> SimpleNamespace:
    """Activation backward kernels (elementwise, and linear_act's fused bias pass) for storage
    dtype ``dtype``, built once per process."""
    ti = _import_taichi()
    from taifuse.backends.taichi import _math as M

    T = _ti_dtype(dtype)
    X = ti.types.ndarray(dtype=T, ndim=1)
    F32 = ti.types.ndarray(dtype=ti.f32, ndim=1)
    IDENTITY, RELU, LEAKY_RELU = M.IDENTITY, M.RELU, M.LEAKY_RELU

    @ti.kernel
    def act_backward(x: X, g: X, gi: X, n: ti.i32, code: ti.i32, slope: ti.f32):
        # x is the op's input, or its output y for SIGMOID and TANH (M.activation_grad).
        for i in range(n):
            gv = ti.cast(g[i], ti.f32)
            r = gv * M.activation_grad(ti.cast(x[i], ti.f32), code, slope)
            # Selects, not products: 0 * inf would be nan where PyTorch gives 0. relu masks only
            # where x <= 0 (a NaN x passes the gradient, as PyTorch's threshold backward); leaky_relu
            # scales where not x > 0 (NaN included), as PyTorch's leaky_relu_backward.
            if code == RELU:
                r = ti.select(ti.cast(x[i], ti.f32) <= 0.0, 0.0, gv)
            elif code == LEAKY_RELU:
                r = ti.select(ti.cast(x[i], ti.f32) > 0.0, gv, gv * slope)
            gi[i] = ti.cast(r, T)

    @ti.kernel
    def mul_relu_backward(a: X, b: X, g: X, ga: X, gb: X, n: ti.i32, want_a: ti.i32, want_b: ti.i32):
        for i in range(n):
            av = ti.cast(a[i], ti.f32)
            bv = ti.cast(b[i], ti.f32)
            gv = ti.select(av * bv <= 0.0, 0.0, ti.cast(g[i], ti.f32))  # NaN passes, as relu's
            if want_a != 0:
                ga[i] = ti.cast(gv * bv, T)
            if want_b != 0:
                gb[i] = ti.cast(gv * av, T)

    @ti.kernel
    def bias_act_backward(
        pre: X,
        g: X,
        gpre: X,
        partial: F32,
        rows: ti.i32,
        cols: ti.i32,
        chunks: ti.i32,
        act: ti.i32,
        want_bias: ti.i32,
    ):
        # The fused pass of linear_act_backward: thread (chunk, col) forms grad_pre for COL_CHUNK
        # rows of one column and their sum (adjacent threads read adjacent columns: coalesced).
        for t in range(chunks * cols):
            ch = t // cols
            c = t % cols
            s = 0.0
            for r in range(ch * COL_CHUNK, ti.min(ch * COL_CHUNK + COL_CHUNK, rows)):
                i = r * cols + c
                d = ti.cast(g[i], ti.f32)
                if act != IDENTITY:
                    pv = ti.cast(pre[i], ti.f32)
                    if act == RELU:
                        d = ti.select(pv <= 0.0, 0.0, d)
                    else:
                        d *= M.activation_grad(pv, act, 0.0)
                gpre[i] = ti.cast(d, T)
                s += d
            if want_bias != 0:
                partial[t] = s

    return SimpleNamespace(
        act_backward=act_backward, mul_relu_backward=mul_relu_backward, bias_act_backward=bias_act_backward
    )


@functools.cache
def column_kernels_for(dtype: Any) -> SimpleNamespace:
    """Column partial-sum kernels (affine, layer_norm and rms_norm parameter gradients) for storage
    dtype ``dtype``, built once per process."""
    ti = _import_taichi()

    T = _ti_dtype(dtype)
    X = ti.types.ndarray(dtype=T, ndim=1)
    F32 = ti.types.ndarray(dtype=ti.f32, ndim=1)

    @ti.kernel
    def col_partials(
        g: X,
        x: X,
        mean: F32,
        rstd: F32,
        p_g: F32,
        p_gx: F32,
        rows: ti.i32,
        cols: ti.i32,
        chunks: ti.i32,
        normalize: ti.i32,
        want_g: ti.i32,
        want_gx: ti.i32,
    ):
        # Per (chunk, col): partial sums of g and of g * xhat, xhat = x (affine) or (x - mean) * rstd
        # (layer_norm), for the scale/weight and bias gradients.
        for t in range(chunks * cols):
            ch = t // cols
            c = t % cols
            sg = 0.0
            sgx = 0.0
            for r in range(ch * COL_CHUNK, ti.min(ch * COL_CHUNK + COL_CHUNK, rows)):
                i = r * cols + c
                gv = ti.cast(g[i], ti.f32)
                xv = ti.cast(x[i], ti.f32)
                if normalize != 0:
                    xv = (xv - mean[r]) * rstd[r]
                sg += gv
                sgx += gv * xv
            if want_g != 0:
                p_g[t] = sg
            if want_gx != 0:
                p_gx[t] = sgx

    @ti.kernel
    def rms_weight_partials(g: X, x: X, rstd: F32, p_gx: F32, rows: ti.i32, cols: ti.i32, chunks: ti.i32):
        # Per (chunk, col): the partial sum of g * x * rstd, for rms_norm's weight gradient.
        for t in range(chunks * cols):
            ch = t // cols
            c = t % cols
            s = 0.0
            for r in range(ch * COL_CHUNK, ti.min(ch * COL_CHUNK + COL_CHUNK, rows)):
                i = r * cols + c
                s += ti.cast(g[i], ti.f32) * ti.cast(x[i], ti.f32) * rstd[r]
            p_gx[t] = s

    return SimpleNamespace(col_partials=col_partials, rms_weight_partials=rms_weight_partials)


@functools.cache
def loss_kernels_for(dtype: Any) -> SimpleNamespace:
    """Loss kernels (mse's squares and backward, cross_entropy's backward) for storage dtype
    ``dtype``, built once per process."""
    ti = _import_taichi()

    T = _ti_dtype(dtype)
    X = ti.types.ndarray(dtype=T, ndim=1)
    F32 = ti.types.ndarray(dtype=ti.f32, ndim=1)
    I32 = ti.types.ndarray(dtype=ti.i32, ndim=1)

    @ti.kernel
    def squared_error(x: X, t: X, out: X, n: ti.i32):
        for i in range(n):
            d = ti.cast(x[i], ti.f32) - ti.cast(t[i], ti.f32)
            out[i] = ti.cast(d * d, T)

    @ti.kernel
    def squared_error_f32(x: X, t: X, out: F32, n: ti.i32):
        for i in range(n):
            d = ti.cast(x[i], ti.f32) - ti.cast(t[i], ti.f32)
            out[i] = d * d

    @ti.kernel
    def mse_backward(x: X, t: X, g: X, gi: X, n: ti.i32, per_element: ti.i32, factor: ti.f32):
        for i in range(n):
            gv = 0.0
            if per_element != 0:
                gv = ti.cast(g[i], ti.f32)
            else:
                gv = ti.cast(g[0], ti.f32) * factor
            gi[i] = ti.cast(2.0 * (ti.cast(x[i], ti.f32) - ti.cast(t[i], ti.f32)) * gv, T)

    @ti.kernel
    def cross_entropy_backward(
        x: X, target: I32, lse: F32, g: X, gi: X, rows: ti.i32, cols: ti.i32, per_row: ti.i32, factor: ti.f32
    ):
        # g[n] * (softmax(x)[n, c] - [c == target[n]]), softmax from the forward's lse.
        for i in range(rows * cols):
            r = i // cols
            c = i % cols
            tr = target[r]
            p = ti.exp(ti.cast(x[i], ti.f32) - lse[r])
            if c == tr:
                p -= 1.0
            if tr < 0 or tr >= cols:  # NOTE [ Class indices on the device ]
                p = ti.math.nan
            gv = 0.0
            if per_row != 0:
                gv = ti.cast(g[r], ti.f32)
            else:
                gv = ti.cast(g[0], ti.f32) * factor
            gi[i] = ti.cast(p * gv, T)

    return SimpleNamespace(
        squared_error=squared_error,
        squared_error_f32=squared_error_f32,
        mse_backward=mse_backward,
        cross_entropy_backward=cross_entropy_backward,
    )


@functools.cache
def embedding_kernels_for(dtype: Any) -> SimpleNamespace:
    """embedding's backward (NOTE [ Embedding backward without float atomics ]) for storage
    dtype ``dtype``, built once per process."""
    ti = _import_taichi()
    from taifuse.backends.taichi import _math as M

    T = _ti_dtype(dtype)
    X = ti.types.ndarray(dtype=T, ndim=1)
    I32 = ti.types.ndarray(dtype=ti.i32, ndim=1)
    SB = M.SUM_BLOCK

    @ti.func
    def _sift_down(a: ti.template(), lo: ti.i32, root: ti.i32, n: ti.i32):
        r = root
        done = 0
        while done == 0:
            child = 2 * r + 1
            if child >= n:
                done = 1
            else:
                if child + 1 < n and a[lo + child] < a[lo + child + 1]:
                    child += 1
                if a[lo + r] < a[lo + child]:
                    t = a[lo + r]
                    a[lo + r] = a[lo + child]
                    a[lo + child] = t
                    r = child
                else:
                    done = 1

    @ti.func
    def _heapsort(a: ti.template(), lo: ti.i32, n: ti.i32):
        start = n // 2 - 1
        while start >= 0:
            _sift_down(a, lo, start, n)
            start -= 1
        end = n - 1
        while end > 0:
            t = a[lo]
            a[lo] = a[lo + end]
            a[lo + end] = t
            _sift_down(a, lo, 0, end)
            end -= 1

    @ti.kernel
    def embedding_backward(
        indices: I32,
        g: X,
        gw: X,
        counts: I32,
        starts: I32,
        block_sums: I32,
        order: I32,
        n: ti.i32,
        vocab: ti.i32,
        cols: ti.i32,
        padding_idx: ti.i32,
    ):
        # NOTE [ Embedding backward without float atomics ] (above). Each top-level loop is one
        # launch, run in order.
        n_blocks = (vocab + SCAN_BLOCK - 1) // SCAN_BLOCK
        for v in range(vocab):
            counts[v] = 0
        for i in range(n):
            v = indices[i]
            if v >= 0 and v < vocab:  # NOTE [ Class indices on the device ]: others add nothing
                ti.atomic_add(counts[v], 1)
        for b in range(n_blocks):  # exclusive scan of counts: block totals,
            s = 0
            for v in range(b * SCAN_BLOCK, ti.min(b * SCAN_BLOCK + SCAN_BLOCK, vocab)):
                s += counts[v]
            block_sums[b] = s
        for _ in range(1):  # their scan on one thread (vocab / SCAN_BLOCK terms),
            acc = 0
            for b in range(n_blocks):
                t = block_sums[b]
                block_sums[b] = acc
                acc += t
            starts[vocab] = acc
        for b in range(n_blocks):  # then each block's own; counts become the fill cursors
            acc = block_sums[b]
            for v in range(b * SCAN_BLOCK, ti.min(b * SCAN_BLOCK + SCAN_BLOCK, vocab)):
                starts[v] = acc
                acc += counts[v]
                counts[v] = 0
        for i in range(n):
            v = indices[i]
            if v >= 0 and v < vocab:
                order[starts[v] + ti.atomic_add(counts[v], 1)] = i
        for v in range(vocab):  # the atomics fill a bucket in any order: sort it, for determinism
            _heapsort(order, starts[v], starts[v + 1] - starts[v])
        for t in range(vocab * cols):
            v = t // cols
            c = t % cols
            lo = starts[v]
            hi = starts[v + 1]
            total = 0.0
            if v != padding_idx:
                for blk in range((hi - lo + SB - 1) // SB):  # blocked: see row_kernels_for's _sum
                    inner = 0.0
                    for k in range(lo + blk * SB, ti.min(lo + blk * SB + SB, hi)):
                        inner += ti.cast(g[order[k] * cols + c], ti.f32)
                    total += inner
            gw[t] = ti.cast(total, T)

    return SimpleNamespace(embedding_backward=embedding_backward)


@functools.cache
def row_kernels_for(dtype: Any, gpu: bool) -> SimpleNamespace:
    """Row-reduction backward kernels: one thread per row (``gpu=False``) or one block per row."""
    ti = _import_taichi()
    from taifuse.backends.taichi import _math as M

    T = _ti_dtype(dtype)
    X = ti.types.ndarray(dtype=T, ndim=1)
    F32 = ti.types.ndarray(dtype=ti.f32, ndim=1)
    I32 = ti.types.ndarray(dtype=ti.i32, ndim=1)
    TH = M.ROW_THREADS if gpu else 1
    SB = M.SUM_BLOCK

    @ti.func
    def _combine(tid: ti.i32, v: ti.f32, is_max: ti.template()) -> ti.f32:
        r = v
        if ti.static(gpu):
            red = ti.simt.block.SharedArray((TH,), ti.f32)
            r = M.block_reduce(red, tid, v, is_max)
        return r

    @ti.func
    def _sum(
        a: ti.template(), b: ti.template(), start: ti.i32, stride: ti.i32, n: ti.i32, dot: ti.template()
    ) -> ti.f32:
        # sum_j a[start + j * stride] (* b[...] when dot), in three levels of SUM_BLOCK terms: a
        # plain float32 running sum over a long row drifts (see _math.row_sum).
        blocks = (n + SB - 1) // SB
        total = 0.0
        for hi in range((blocks + SB - 1) // SB):
            mid = 0.0
            for lo in range(hi * SB, ti.min(hi * SB + SB, blocks)):
                inner = 0.0
                for j in range(lo * SB, ti.min(lo * SB + SB, n)):
                    v = ti.cast(a[start + j * stride], ti.f32)
                    if ti.static(dot):
                        v *= ti.cast(b[start + j * stride], ti.f32)
                    inner += v
                mid += inner
            total += mid
        return total

    @ti.kernel
    def softmax_backward(y: X, g: X, gi: X, a_dim: ti.i32, c_dim: ti.i32, b_dim: ti.i32, log: ti.i32):
        # softmax: gi = y * (g - sum_c g y); log_softmax: gi = g - exp(y) * sum_c g; over axis 1 of (A, C, B).
        if ti.static(gpu):
            ti.loop_config(block_dim=TH)
        for t in range(a_dim * b_dim * TH):
            tid = t % TH
            r = t // TH
            base = (r // b_dim) * c_dim * b_dim + r % b_dim
            mine = (c_dim - tid + TH - 1) // TH
            start = base + tid * b_dim
            stride = TH * b_dim
            s = 0.0
            if log != 0:
                s = _combine(tid, _sum(g, g, start, stride, mine, False), False)
            else:
                s = _combine(tid, _sum(g, y, start, stride, mine, True), False)
            for j in range(mine):
                i = start + j * stride
                yv = ti.cast(y[i], ti.f32)
                gv = ti.cast(g[i], ti.f32)
                if log != 0:
                    gi[i] = ti.cast(gv - ti.exp(yv) * s, T)
                else:
                    gi[i] = ti.cast(yv * (gv - s), T)

    @ti.kernel
    def layer_norm_backward(
        x: X, weight: X, mean: F32, rstd: F32, g: X, gx: X, rows: ti.i32, cols: ti.i32, has_weight: ti.i32
    ):
        # gx = rstd * (gy - mean_d(gy) - xhat * mean_d(gy * xhat)), gy = g * weight.
        if ti.static(gpu):
            ti.loop_config(block_dim=TH)
        for t in range(rows * TH):
            tid = t % TH
            r = t // TH
            mu = mean[r]
            inv = rstd[r]
            mine = (cols - tid + TH - 1) // TH
            s1 = 0.0
            s2 = 0.0
            for blk in range((mine + SB - 1) // SB):  # blocked: see _sum
                b1 = 0.0
                b2 = 0.0
                for j in range(blk * SB, ti.min(blk * SB + SB, mine)):
                    c = tid + j * TH
                    gy = ti.cast(g[r * cols + c], ti.f32)
                    if has_weight != 0:
                        gy *= ti.cast(weight[c], ti.f32)
                    b1 += gy
                    b2 += gy * (ti.cast(x[r * cols + c], ti.f32) - mu) * inv
                s1 += b1
                s2 += b2
            m1 = _combine(tid, s1, False) / cols
            m2 = _combine(tid, s2, False) / cols
            for j in range(mine):
                c = tid + j * TH
                gy = ti.cast(g[r * cols + c], ti.f32)
                if has_weight != 0:
                    gy *= ti.cast(weight[c], ti.f32)
                xhat = (ti.cast(x[r * cols + c], ti.f32) - mu) * inv
                gx[r * cols + c] = ti.cast(inv * (gy - m1 - xhat * m2), T)

    @ti.kernel
    def rms_norm_backward(
        x: X, weight: X, rstd: F32, g: X, gx: X, rows: ti.i32, cols: ti.i32, has_weight: ti.i32
    ):
        # gx = rstd * (gy - xhat * mean_d(gy * xhat)), xhat = x * rstd, gy = g * weight.
        if ti.static(gpu):
            ti.loop_config(block_dim=TH)
        for t in range(rows * TH):
            tid = t % TH
            r = t // TH
            inv = rstd[r]
            mine = (cols - tid + TH - 1) // TH
            s2 = 0.0
            for blk in range((mine + SB - 1) // SB):  # blocked: see _sum
                b2 = 0.0
                for j in range(blk * SB, ti.min(blk * SB + SB, mine)):
                    c = tid + j * TH
                    gy = ti.cast(g[r * cols + c], ti.f32)
                    if has_weight != 0:
                        gy *= ti.cast(weight[c], ti.f32)
                    b2 += gy * ti.cast(x[r * cols + c], ti.f32) * inv
                s2 += b2
            m2 = _combine(tid, s2, False) / cols
            for j in range(mine):
                c = tid + j * TH
                gy = ti.cast(g[r * cols + c], ti.f32)
                if has_weight != 0:
                    gy *= ti.cast(weight[c], ti.f32)
                xhat = ti.cast(x[r * cols + c], ti.f32) * inv
                gx[r * cols + c] = ti.cast(inv * (gy - xhat * m2), T)

    def make_cross_entropy(OUT, OUT_T):
        @ti.kernel
        def cross_entropy(x: X, target: I32, loss: OUT, lse: F32, rows: ti.i32, cols: ti.i32):
            # loss[n] = lse[n] - x[n, target[n]] as (m - x[n, t]) + log(s): no rounding at |m|'s scale.
            if ti.static(gpu):
                ti.loop_config(block_dim=TH)
            for t in range(rows * TH):
                tid = t % TH
                r = t // TH
                mine = (cols - tid + TH - 1) // TH
                start = r * cols + tid
                m = -ti.math.inf
                for j in range(mine):
                    m = ti.max(m, ti.cast(x[start + j * TH], ti.f32))
                m = _combine(tid, m, True)
                s = _combine(tid, M.row_sum(x, start, TH, mine, m, M.SUM_TERM_EXP), False)
                if tid == 0:
                    log_s = ti.log(s)
                    lse[r] = m + log_s
                    tr = target[r]
                    v = ti.math.nan  # NOTE [ Class indices on the device ]
                    if tr >= 0 and tr < cols:
                        v = (m - ti.cast(x[r * cols + tr], ti.f32)) + log_s
                    loss[r] = ti.cast(v, OUT_T)

        return cross_entropy

    return SimpleNamespace(
        softmax_backward=softmax_backward,
        layer_norm_backward=layer_norm_backward,
        rms_norm_backward=rms_norm_backward,
        cross_entropy=make_cross_entropy(X, T),
        cross_entropy_f32=make_cross_entropy(F32, ti.f32),
    )


# The per-dtype families, in the order all_kernels lists them.
_FAMILIES = (activation_kernels_for, column_kernels_for, loss_kernels_for, embedding_kernels_for)


def all_kernels() -> list:
    """Every (name, kernel) pair of this module, in every specialisation, for ``metal_check``."""
    pairs = []
    for dtype in FLOAT_DTYPES:
        for family in _FAMILIES:
            for name, kernel in vars(family(dtype)).items():
                pairs.append((f"bw_{name}_{dtype.name}", kernel))
        for gpu in (False, True):
            for name, kernel in vars(row_kernels_for(dtype, gpu)).items():
                pairs.append((f"bw_{name}{'_rows' if gpu else ''}_{dtype.name}", kernel))
    return pairs


# ----------------------------------------------------------------------------- helpers


def _dummy_f32() -> Any:
    return _optional(None, np.float32)


def _chunks(rows: int) -> int:
    return -(-rows // COL_CHUNK)


def _act(x: Any, grad_out: Any, grad_in: Any, code: Activation, slope: float = 0.0) -> None:
    activation_kernels_for(x.dtype).act_backward(
        _nd(x), _nd(grad_out), _nd(grad_in), x.size, int(code), float(slope)
    )


def _reduction_scale(grad_out: Any, reduction: str, count: int) -> tuple:
    """(per_element, factor) of a loss backward: g itself, or g[0] (/ count for 'mean')."""
    if reduction == "none":
        return 1, 1.0
    return 0, (1.0 / count if reduction == "mean" else 1.0)


# ----------------------------------------------------------------------------- elementwise backward


def gelu_backward(x: Any, grad_out: Any, grad_in: Any, approximate: str) -> None:
    _act(x, grad_out, grad_in, gelu_code(approximate))


def relu_backward(x: Any, grad_out: Any, grad_in: Any) -> None:
    _act(x, grad_out, grad_in, Activation.RELU)


def leaky_relu_backward(x: Any, grad_out: Any, grad_in: Any, negative_slope: float) -> None:
    _act(x, grad_out, grad_in, Activation.LEAKY_RELU, negative_slope)


def silu_backward(x: Any, grad_out: Any, grad_in: Any) -> None:
    _act(x, grad_out, grad_in, Activation.SILU)


def sigmoid_backward(y: Any, grad_out: Any, grad_in: Any) -> None:
    _act(y, grad_out, grad_in, Activation.SIGMOID)  # takes the output y: sigmoid' = y (1 - y)


def tanh_backward(y: Any, grad_out: Any, grad_in: Any) -> None:
    _act(y, grad_out, grad_in, Activation.TANH)  # takes the output y: tanh' = 1 - y^2


def add_relu_backward(y: Any, grad_out: Any, grad_in: Any) -> None:
    _act(y, grad_out, grad_in, Activation.RELU)  # relu(a + b) > 0 exactly where a + b > 0


def mul_relu_backward(a: Any, b: Any, grad_out: Any, grad_a: Any | None, grad_b: Any | None) -> None:
    activation_kernels_for(a.dtype).mul_relu_backward(
        _nd(a),
        _nd(b),
        _nd(grad_out),
        _optional(grad_a, a.dtype),
        _optional(grad_b, a.dtype),
        a.size,
        int(grad_a is not None),
        int(grad_b is not None),
    )


def _column_grads(
    g: Any,
    x: Any,
    mean: Any,
    rstd: Any,
    grad_gx: Any | None,
    grad_g: Any | None,
) -> None:
    """grad_gx[c] = sum_r g * xhat, grad_g[c] = sum_r g (xhat = x, or normalised when mean is given)."""
    if grad_gx is None and grad_g is None:
        return
    rows, cols = x.shape
    chunks = _chunks(rows)
    p_g = _new((chunks, cols), np.float32) if grad_g is not None else None
    p_gx = _new((chunks, cols), np.float32) if grad_gx is not None else None
    column_kernels_for(x.dtype).col_partials(
        _nd(g),
        _nd(x),
        _nd(mean) if mean is not None else _dummy_f32(),
        _nd(rstd) if rstd is not None else _dummy_f32(),
        _nd(p_g) if p_g is not None else _dummy_f32(),
        _nd(p_gx) if p_gx is not None else _dummy_f32(),
        rows,
        cols,
        chunks,
        int(mean is not None),
        int(p_g is not None),
        int(p_gx is not None),
    )
    if p_g is not None:
        tm.sum_rows_into(p_g, grad_g, chunks, cols)
    if p_gx is not None:
        tm.sum_rows_into(p_gx, grad_gx, chunks, cols)


def affine_backward(
    x: Any,
    scale: Any,
    grad_out: Any,
    grad_x: Any | None,
    grad_scale: Any | None,
    grad_bias: Any | None,
) -> None:
    if grad_x is not None:
        shape = tuple(x.shape)
        geo = _merge(shape, _broadcast_strides(shape, shape), _broadcast_strides(tuple(scale.shape), shape))
        tm.elementwise_kernels_for(x.dtype).binary(
            _nd(grad_out), _nd(scale), _nd(grad_x), tm.OP_MUL, x.size, *geo
        )
    _column_grads(grad_out, x, None, None, grad_scale, grad_bias)


# ----------------------------------------------------------------------------- fused linear backward


def linear_act_backward(
    x: Any,
    w: Any,
    pre: Any | None,
    grad_out: Any,
    activation: str | None,
    grad_pre: Any,
    grad_x: Any | None,
    grad_w: Any | None,
    grad_b: Any | None,
) -> None:
    rows, cols = grad_out.shape
    chunks = _chunks(rows)
    if grad_pre is None:
        grad_pre = _new((rows, cols), x.dtype)
    partial = _new((chunks, cols), np.float32) if grad_b is not None else None
    activation_kernels_for(x.dtype).bias_act_backward(
        _optional(pre, x.dtype),
        _nd(grad_out),
        _nd(grad_pre),
        _nd(partial) if partial is not None else _dummy_f32(),
        rows,
        cols,
        chunks,
        int(activation_code(activation)),
        int(partial is not None),
    )
    if partial is not None:
        tm.sum_rows_into(partial, grad_b, chunks, cols)
    if grad_x is not None:  # (N, M) @ (M, K)
        tm.matmul_into(grad_pre, w, grad_x, transpose_a=False, transpose_b=False)
    if grad_w is not None:  # (N, M).T @ (N, K), the transpose read through strides
        tm.matmul_into(grad_pre, x, grad_w, transpose_a=True, transpose_b=False)


# ----------------------------------------------------------------------------- row reductions backward


def softmax_backward(y: Any, grad_out: Any, grad_in: Any) -> None:
    row_kernels_for(y.dtype, _on_gpu()).softmax_backward(_nd(y), _nd(grad_out), _nd(grad_in), *y.shape, 0)


def log_softmax_backward(y: Any, grad_out: Any, grad_in: Any) -> None:
    row_kernels_for(y.dtype, _on_gpu()).softmax_backward(_nd(y), _nd(grad_out), _nd(grad_in), *y.shape, 1)


def layer_norm_backward(
    x: Any,
    weight: Any | None,
    mean: Any,
    rstd: Any,
    grad_out: Any,
    grad_x: Any | None,
    grad_weight: Any | None,
    grad_bias: Any | None,
) -> None:
    rows, cols = x.shape
    if grad_x is not None:
        row_kernels_for(x.dtype, _on_gpu()).layer_norm_backward(
            _nd(x),
            _optional(weight, x.dtype),
            _nd(mean),
            _nd(rstd),
            _nd(grad_out),
            _nd(grad_x),
            rows,
            cols,
            int(weight is not None),
        )
    _column_grads(grad_out, x, mean, rstd, grad_weight, grad_bias)


def rms_norm_backward(
    x: Any, weight: Any | None, rstd: Any, grad_out: Any, grad_x: Any | None, grad_weight: Any | None
) -> None:
    rows, cols = x.shape
    if grad_x is not None:
        row_kernels_for(x.dtype, _on_gpu()).rms_norm_backward(
            _nd(x),
            _optional(weight, x.dtype),
            _nd(rstd),
            _nd(grad_out),
            _nd(grad_x),
            rows,
            cols,
            int(weight is not None),
        )
    if grad_weight is not None:
        chunks = _chunks(rows)
        partial = _new((chunks, cols), np.float32)
        column_kernels_for(x.dtype).rms_weight_partials(
            _nd(grad_out), _nd(x), _nd(rstd), _nd(partial), rows, cols, chunks
        )
        tm.sum_rows_into(partial, grad_weight, chunks, cols)


def embedding_backward(indices: Any, grad_out: Any, grad_weight: Any, padding_idx: int) -> None:
    """See the reference's; ``indices`` is an int32 DeviceArray.

    NOTE [ Embedding backward without float atomics ] says how; the scratch (counts, bucket
    starts, block totals, the sorted order) is int32 from the pool.
    """
    vocab, cols = grad_weight.shape
    n = indices.size
    counts = _new((vocab,), np.int32)
    starts = _new((vocab + 1,), np.int32)
    block_sums = _new((-(-vocab // SCAN_BLOCK),), np.int32)
    order = _new((max(n, 1),), np.int32)
    embedding_kernels_for(grad_weight.dtype).embedding_backward(
        _nd(indices) if n else _optional(None, np.int32),
        _nd(grad_out) if n else _optional(None, grad_weight.dtype),
        _nd(grad_weight),
        _nd(counts),
        _nd(starts),
        _nd(block_sums),
        _nd(order),
        n,
        vocab,
        cols,
        int(padding_idx),
    )


def dropout_backward(grad_out: Any, grad_in: Any, p: float, seed: int) -> None:
    # The forward kernel on grad_out: the mask is regenerated from (index, seed).
    forward.dropout(grad_out, grad_in, p, seed)


# ----------------------------------------------------------------------------- losses


def mse_loss(input: Any, target: Any, out: Any, reduction: str) -> None:
    k = loss_kernels_for(input.dtype)
    n = input.size
    if reduction == "none":
        k.squared_error(_nd(input), _nd(target), _nd(out), n)
        return
    squares = _new((n,), np.float32)
    k.squared_error_f32(_nd(input), _nd(target), _nd(squares), n)
    tm.reduce_into(squares, out, (), (), (n,), (1,), 1.0 / n if reduction == "mean" else 1.0)


def mse_loss_backward(input: Any, target: Any, grad_out: Any, grad_in: Any, reduction: str) -> None:
    per_element, factor = _reduction_scale(grad_out, reduction, input.size)
    loss_kernels_for(input.dtype).mse_backward(
        _nd(input), _nd(target), _nd(grad_out), _nd(grad_in), input.size, per_element, factor
    )


def cross_entropy(logits: Any, target: Any, out: Any, reduction: str, lse: Any) -> None:
    """See the reference's cross_entropy; ``target`` is an int32 DeviceArray (NOTE [ Class indices on the device ])."""
    rows, cols = logits.shape
    k = row_kernels_for(logits.dtype, _on_gpu())
    if reduction == "none":
        k.cross_entropy(_nd(logits), _nd(target), _nd(out), _nd(lse), rows, cols)
        return
    losses = _new((rows,), np.float32)
    k.cross_entropy_f32(_nd(logits), _nd(target), _nd(losses), _nd(lse), rows, cols)
    tm.reduce_into(losses, out, (), (), (rows,), (1,), 1.0 / rows if reduction == "mean" else 1.0)


def cross_entropy_backward(
    logits: Any, target: Any, lse: Any, grad_out: Any, grad_in: Any, reduction: str
) -> None:
    rows, cols = logits.shape
    per_row, factor = _reduction_scale(grad_out, reduction, rows)
    loss_kernels_for(logits.dtype).cross_entropy_backward(
        _nd(logits), _nd(target), _nd(lse), _nd(grad_out), _nd(grad_in), rows, cols, per_row, factor
    )
