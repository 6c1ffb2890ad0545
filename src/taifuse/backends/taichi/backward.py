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
_REDUCTION_CODES = {"none": 0, "mean": 1, "sum": 2}


# ----------------------------------------------------------------------------- kernels


@functools.cache
def kernels_for(dtype: Any) -> SimpleNamespace:
    """Elementwise and column-pass backward kernels for storage dtype ``dtype``, built once per process."""
    ti = _import_taichi()
    from taifuse.backends.taichi import _math as M

    T = _ti_dtype(dtype)
    X = ti.types.ndarray(dtype=T, ndim=1)
    F32 = ti.types.ndarray(dtype=ti.f32, ndim=1)
    I32 = ti.types.ndarray(dtype=ti.i32, ndim=1)
    IDENTITY, RELU, LEAKY_RELU = M.IDENTITY, M.RELU, M.LEAKY_RELU

    @ti.kernel
    def act_backward(x: X, g: X, gi: X, n: ti.i32, code: ti.i32, slope: ti.f32):
        # x is the op's input, or its output y for SIGMOID and TANH (M.activation_grad).
        for i in range(n):
            gv = ti.cast(g[i], ti.f32)
            r = gv * M.activation_grad(ti.cast(x[i], ti.f32), code, slope)
            if code == RELU or code == LEAKY_RELU:
                # A select, not a product: 0 * inf would be nan where the reference gives 0.
                r = ti.select(ti.cast(x[i], ti.f32) > 0.0, gv, gv * slope)
            gi[i] = ti.cast(r, T)

    @ti.kernel
    def mul_relu_backward(a: X, b: X, g: X, ga: X, gb: X, n: ti.i32, want_a: ti.i32, want_b: ti.i32):
        for i in range(n):
            av = ti.cast(a[i], ti.f32)
            bv = ti.cast(b[i], ti.f32)
            gv = ti.select(av * bv > 0.0, ti.cast(g[i], ti.f32), 0.0)
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
                        d = ti.select(pv > 0.0, d, 0.0)
                    else:
                        d *= M.activation_grad(pv, act, 0.0)
                gpre[i] = ti.cast(d, T)
                s += d
            if want_bias != 0:
                partial[t] = s

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
        act_backward=act_backward,
        mul_relu_backward=mul_relu_backward,
        bias_act_backward=bias_act_backward,
        col_partials=col_partials,
        squared_error=squared_error,
        squared_error_f32=squared_error_f32,
        mse_backward=mse_backward,
        cross_entropy_backward=cross_entropy_backward,
    )


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
        cross_entropy=make_cross_entropy(X, T),
        cross_entropy_f32=make_cross_entropy(F32, ti.f32),
    )


def all_kernels() -> list:
    """Every (name, kernel) pair of this module, in every specialisation, for ``metal_check``."""
    pairs = []
    for dtype in FLOAT_DTYPES:
        for name, kernel in vars(kernels_for(dtype)).items():
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
    kernels_for(x.dtype).act_backward(_nd(x), _nd(grad_out), _nd(grad_in), x.size, int(code), float(slope))


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
    kernels_for(a.dtype).mul_relu_backward(
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
    kernels_for(x.dtype).col_partials(
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
        tm.kernels_for(x.dtype).binary(_nd(grad_out), _nd(scale), _nd(grad_x), tm.OP_MUL, x.size, *geo)
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
    partial = _new((chunks, cols), np.float32) if grad_b is not None else None
    kernels_for(x.dtype).bias_act_backward(
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


def dropout_backward(grad_out: Any, grad_in: Any, p: float, seed: int) -> None:
    # The forward kernel on grad_out: the mask is regenerated from (index, seed).
    forward.dropout(grad_out, grad_in, p, seed)


# ----------------------------------------------------------------------------- losses


def mse_loss(input: Any, target: Any, out: Any, reduction: str) -> None:
    k = kernels_for(input.dtype)
    n = input.size
    if reduction == "none":
        k.squared_error(_nd(input), _nd(target), _nd(out), n)
        return
    squares = _new((n,), np.float32)
    k.squared_error_f32(_nd(input), _nd(target), _nd(squares), n)
    tm.reduce_into(squares, out, (), (), (n,), (1,), 1.0 / n if reduction == "mean" else 1.0)


def mse_loss_backward(input: Any, target: Any, grad_out: Any, grad_in: Any, reduction: str) -> None:
    per_element, factor = _reduction_scale(grad_out, reduction, input.size)
    kernels_for(input.dtype).mse_backward(
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
    kernels_for(logits.dtype).cross_entropy_backward(
        _nd(logits), _nd(target), _nd(lse), _nd(grad_out), _nd(grad_in), rows, cols, per_row, factor
    )
