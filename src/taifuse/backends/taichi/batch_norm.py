"""Batch norm kernels of the taichi backend (signatures and math: ``backends/reference/batch_norm.py``).

Every input is a flat ndarray viewed as ``(N, C, S)``. No float atomics and no float64 (Metal has
neither): each per-channel reduction is two-level. The first level is ``parts`` threads per
channel, thread ``p`` summing the channel's values ``p, p + parts, p + 2 * parts, ...`` (so that
neighbouring threads read neighbouring addresses) in float32 blocks of at most ``SUM_BLOCK``
terms; the second level is one thread per channel adding its ``parts`` partials in the same
blocked way. The order is fixed, so the result has the same bits on every run. The statistics
are shifted sums (NOTE [ Batch norm statistics in one pass ] in ``backends/numba/batch_norm.py``):
one read of ``x``. Each kernel's top-level loops run as launches in order, so the statistics are
one call, the backward one call (reduction, per-channel sums, the gradient pass).

Kernels are built per (storage dtype, parameter dtype): float32 with float32 parameters, float16
with float16 or with float32 parameters (PyTorch's mixed batch norm under autocast).
"""

# NOTE: no `from __future__ import annotations` here: Taichi reads kernel annotations as objects.

import functools
from types import SimpleNamespace
from typing import Any

import numpy as np

from taifuse.backends.taichi._runtime import DeviceArray, _import_taichi, _nd, _optional, _ti_dtype
from taifuse.backends.taichi.tensor_math import _new

# The dtype pairs (x, parameters) kernels are built for.
DTYPE_PAIRS = (
    (np.dtype(np.float32), np.dtype(np.float32)),
    (np.dtype(np.float16), np.dtype(np.float16)),
    (np.dtype(np.float16), np.dtype(np.float32)),
)
# First-level threads per channel: enough for each to sum about TARGET values, at most MAX_PARTS.
TARGET = 1024
MAX_PARTS = 1024


def parts_for(count: int) -> int:
    """First-level threads per channel for ``count`` values per channel."""
    return max(1, min(MAX_PARTS, -(-count // TARGET)))


@functools.cache
def kernels_for(dtype: np.dtype, param_dtype: np.dtype) -> SimpleNamespace:
    """The batch norm kernels for storage ``dtype`` and parameters of ``param_dtype``, built once."""
    ti = _import_taichi()
    from taifuse.backends.taichi import _math as M

    T = _ti_dtype(dtype)
    X = ti.types.ndarray(dtype=T, ndim=1)
    PT = _ti_dtype(param_dtype)
    P = ti.types.ndarray(dtype=PT, ndim=1)
    F32 = ti.types.ndarray(dtype=ti.f32, ndim=1)
    SUM_BLOCK = M.SUM_BLOCK

    @ti.func
    def index(ch: ti.i32, m: ti.i32, channels: ti.i32, spatial: ti.i32) -> ti.i32:
        # The m-th value of channel ch: sample m // S, position m % S.
        return ((m // spatial) * channels + ch) * spatial + m % spatial

    @ti.func
    def channel_of(t: ti.i32, channels: ti.i32, parts: ti.i32, rowwise: ti.i32) -> ti.i32:
        # Thread t's channel: with S == 1 neighbouring threads take neighbouring channels (their
        # values are neighbours in memory), else neighbouring parts of one channel.
        return ti.select(rowwise != 0, t % channels, t // parts)

    @ti.func
    def part_of(t: ti.i32, channels: ti.i32, parts: ti.i32, rowwise: ti.i32) -> ti.i32:
        return ti.select(rowwise != 0, t // channels, t % parts)

    @ti.func
    def scale_of(inv: ti.f32, w: ti.template(), ch: ti.i32, has_w: ti.i32) -> ti.f32:
        a = inv
        if has_w != 0:
            a *= ti.cast(w[ch], ti.f32)
        return a

    @ti.func
    def shift_of(b: ti.template(), ch: ti.i32, has_b: ti.i32) -> ti.f32:
        v = 0.0
        if has_b != 0:
            v = ti.cast(b[ch], ti.f32)
        return v

    @ti.func
    def relu_grad(gv: ti.f32, pre: ti.f32, relu: ti.i32) -> ti.f32:
        # NOTE [ The ReLU mask in the backward ] in backends/numba/batch_norm.py.
        r = gv
        if relu != 0 and ti.cast(ti.cast(pre, T), ti.f32) <= 0.0:
            r = 0.0
        return r

    @ti.kernel
    def stats(
        x: X,
        s1: F32,
        s2: F32,
        mean: F32,
        var: F32,
        channels: ti.i32,
        spatial: ti.i32,
        count: ti.i32,
        parts: ti.i32,
        rowwise: ti.i32,
    ):
        for t in range(channels * parts):
            ch = channel_of(t, channels, parts, rowwise)
            p = part_of(t, channels, parts, rowwise)
            k = ti.cast(x[ch * spatial], ti.f32)  # the shift: the channel's first value
            mine = (count - p + parts - 1) // parts
            a = 0.0
            b = 0.0
            for blk in range((mine + SUM_BLOCK - 1) // SUM_BLOCK):
                ia = 0.0
                ib = 0.0
                for j in range(blk * SUM_BLOCK, ti.min(blk * SUM_BLOCK + SUM_BLOCK, mine)):
                    d = ti.cast(x[index(ch, p + j * parts, channels, spatial)], ti.f32) - k
                    ia += d
                    ib += d * d
                a += ia
                b += ib
            s1[ch * parts + p] = a
            s2[ch * parts + p] = b
        for ch in range(channels):
            a = 0.0
            b = 0.0
            for blk in range((parts + SUM_BLOCK - 1) // SUM_BLOCK):
                ia = 0.0
                ib = 0.0
                for p in range(blk * SUM_BLOCK, ti.min(blk * SUM_BLOCK + SUM_BLOCK, parts)):
                    ia += s1[ch * parts + p]
                    ib += s2[ch * parts + p]
                a += ia
                b += ib
            m = a / count
            mean[ch] = ti.cast(x[ch * spatial], ti.f32) + m
            var[ch] = ti.max(b / count - m * m, 0.0)

    @ti.kernel
    def update(
        mean: F32,
        var: F32,
        invstd: F32,
        running_mean: P,
        running_var: P,
        channels: ti.i32,
        unbias: ti.f32,
        eps: ti.f32,
        momentum: ti.f32,
        has_running: ti.i32,
    ):
        for ch in range(channels):
            v = var[ch]
            invstd[ch] = 1.0 / ti.sqrt(v + eps)
            if has_running != 0:
                rm = ti.cast(running_mean[ch], ti.f32)
                rv = ti.cast(running_var[ch], ti.f32)
                running_mean[ch] = ti.cast((1.0 - momentum) * rm + momentum * mean[ch], PT)
                running_var[ch] = ti.cast((1.0 - momentum) * rv + momentum * v * unbias, PT)

    @ti.kernel
    def elemt(
        x: X,
        mean: F32,
        invstd: F32,
        w: P,
        b: P,
        out: X,
        n: ti.i32,
        channels: ti.i32,
        spatial: ti.i32,
        has_w: ti.i32,
        has_b: ti.i32,
        relu: ti.i32,
    ):
        for i in range(n):
            ch = (i // spatial) % channels
            a = scale_of(invstd[ch], w, ch, has_w)
            v = (ti.cast(x[i], ti.f32) - mean[ch]) * a + shift_of(b, ch, has_b)
            if relu != 0:
                v = M.relu(v)
            out[i] = ti.cast(v, T)

    def make_backward(GX, GT):
        @ti.kernel
        def backward(
            x: X,
            g: X,
            mean: F32,
            invstd: F32,
            w: P,
            b: P,
            t1: F32,
            t2: F32,
            sums: F32,
            gx: GX,
            gw: P,
            gb: P,
            n: ti.i32,
            channels: ti.i32,
            spatial: ti.i32,
            count: ti.i32,
            parts: ti.i32,
            rowwise: ti.i32,
            has_w: ti.i32,
            has_b: ti.i32,
            relu: ti.i32,
            training: ti.i32,
            need_sums: ti.i32,
            need_gx: ti.i32,
            need_gw: ti.i32,
            need_gb: ti.i32,
        ):
            # Level 1: per (channel, part) sum(g') and sum(g' * (x - mean)).
            for t in range(channels * parts):
                if need_sums != 0:
                    ch = channel_of(t, channels, parts, rowwise)
                    p = part_of(t, channels, parts, rowwise)
                    m = mean[ch]
                    a = scale_of(invstd[ch], w, ch, has_w)
                    c0 = shift_of(b, ch, has_b)
                    mine = (count - p + parts - 1) // parts
                    u = 0.0
                    v = 0.0
                    for blk in range((mine + SUM_BLOCK - 1) // SUM_BLOCK):
                        iu = 0.0
                        iv = 0.0
                        for j in range(blk * SUM_BLOCK, ti.min(blk * SUM_BLOCK + SUM_BLOCK, mine)):
                            i = index(ch, p + j * parts, channels, spatial)
                            d = ti.cast(x[i], ti.f32) - m
                            gv = relu_grad(ti.cast(g[i], ti.f32), d * a + c0, relu)
                            iu += gv
                            iv += gv * d
                        u += iu
                        v += iv
                    t1[ch * parts + p] = u
                    t2[ch * parts + p] = v
            # Level 2: sums[ch] = sum(g'), sums[channels + ch] = sum(g' * xhat).
            for ch in range(channels):
                if need_sums != 0:
                    u = 0.0
                    v = 0.0
                    for blk in range((parts + SUM_BLOCK - 1) // SUM_BLOCK):
                        iu = 0.0
                        iv = 0.0
                        for p in range(blk * SUM_BLOCK, ti.min(blk * SUM_BLOCK + SUM_BLOCK, parts)):
                            iu += t1[ch * parts + p]
                            iv += t2[ch * parts + p]
                        u += iu
                        v += iv
                    v *= invstd[ch]
                    sums[ch] = u
                    sums[channels + ch] = v
                    if need_gb != 0:
                        gb[ch] = ti.cast(u, PT)
                    if need_gw != 0:
                        gw[ch] = ti.cast(v, PT)
            # The gradient pass: gx = w * invstd * (g' - sum(g') / M - xhat * sum(g' * xhat) / M).
            for i in range(n):
                if need_gx != 0:
                    ch = (i // spatial) % channels
                    m = mean[ch]
                    inv = invstd[ch]
                    a = scale_of(inv, w, ch, has_w)
                    d = ti.cast(x[i], ti.f32) - m
                    gv = relu_grad(ti.cast(g[i], ti.f32), d * a + shift_of(b, ch, has_b), relu)
                    if training != 0:
                        gv = gv - sums[ch] / count - d * inv * (sums[channels + ch] / count)
                    gx[i] = ti.cast(a * gv, GT)

        return backward

    backward = make_backward(X, T)
    # The same kernel writing the input gradient in float32: the fused Conv-BN-ReLU backward's
    # grad_pre, which the convolution's products read (NOTE [ The fused Conv-BN-ReLU block in
    # training ] in backends/reference/conv.py).
    backward_f32 = backward if T == ti.f32 else make_backward(F32, ti.f32)

    return SimpleNamespace(
        stats=stats, update=update, elemt=elemt, backward=backward, backward_f32=backward_f32
    )


def all_kernels() -> list:
    """Every (name, kernel) pair of this module, per dtype pair, for ``metal_check``."""
    return [
        (f"bn_{name}_{dtype.name}_{param.name}", kernel)
        for dtype, param in DTYPE_PAIRS
        for name, kernel in vars(kernels_for(dtype, param)).items()
    ]


def _param_dtype(x: DeviceArray, *params: Any) -> np.dtype:
    for p in params:
        if p is not None:
            return p.dtype
    return x.dtype


def _dims(x: DeviceArray) -> tuple[int, int, int]:
    n, c, s = x.shape
    return n, c, s


# ----------------------------------------------------------------------------- the table's kernels


def batch_norm_stats(x: DeviceArray, mean: DeviceArray, var: DeviceArray) -> None:
    n, c, s = _dims(x)
    count = n * s
    parts = parts_for(count)
    s1, s2 = _new((c * parts,), np.float32), _new((c * parts,), np.float32)
    kernels_for(x.dtype, x.dtype if x.dtype != np.float16 else np.dtype(np.float32)).stats(
        _nd(x), _nd(s1), _nd(s2), _nd(mean), _nd(var), c, s, count, parts, int(s == 1)
    )


def batch_norm_update(
    mean: DeviceArray,
    var: DeviceArray,
    count: int,
    eps: float,
    momentum: float,
    running_mean: DeviceArray | None,
    running_var: DeviceArray | None,
    invstd: DeviceArray,
) -> None:
    has = running_mean is not None
    pdt = running_mean.dtype if has else np.dtype(np.float32)
    kernels_for(np.dtype(np.float16) if pdt == np.float16 else np.dtype(np.float32), pdt).update(
        _nd(mean),
        _nd(var),
        _nd(invstd),
        _optional(running_mean, pdt),
        _optional(running_var, pdt),
        invstd.size,
        float(count / (count - 1)) if has else 1.0,
        float(eps),
        float(momentum),
        int(has),
    )


def batch_norm_elemt(
    x: DeviceArray,
    mean: DeviceArray,
    invstd: DeviceArray,
    weight: DeviceArray | None,
    bias: DeviceArray | None,
    activation: str | None,
    out: DeviceArray,
) -> None:
    _, c, s = _dims(x)
    pdt = _param_dtype(x, weight, bias)
    kernels_for(x.dtype, pdt).elemt(
        _nd(x),
        _nd(mean),
        _nd(invstd),
        _optional(weight, pdt),
        _optional(bias, pdt),
        _nd(out),
        x.size,
        c,
        s,
        int(weight is not None),
        int(bias is not None),
        int(activation == "relu"),
    )


def batch_norm_backward(
    x: DeviceArray,
    grad_out: DeviceArray,
    mean: DeviceArray,
    invstd: DeviceArray,
    weight: DeviceArray | None,
    bias: DeviceArray | None,
    activation: str | None,
    training: bool,
    grad_x: DeviceArray | None,
    grad_weight: DeviceArray | None,
    grad_bias: DeviceArray | None,
) -> None:
    n, c, s = _dims(x)
    count = n * s
    pdt = _param_dtype(x, weight, bias, grad_weight, grad_bias)
    need_sums = grad_weight is not None or grad_bias is not None or (training and grad_x is not None)
    parts = parts_for(count) if need_sums else 1
    t1, t2 = _new((c * parts,), np.float32), _new((c * parts,), np.float32)
    sums = _new((2 * c,), np.float32)
    k = kernels_for(x.dtype, pdt)
    # A float32 grad_x for float16 x: the fused block's grad_pre (the reference allows any dtype).
    gx_dtype = x.dtype if grad_x is None else grad_x.dtype
    (k.backward_f32 if gx_dtype == np.float32 else k.backward)(
        _nd(x),
        _nd(grad_out),
        _nd(mean),
        _nd(invstd),
        _optional(weight, pdt),
        _optional(bias, pdt),
        _nd(t1),
        _nd(t2),
        _nd(sums),
        _optional(grad_x, gx_dtype),
        _optional(grad_weight, pdt),
        _optional(grad_bias, pdt),
        x.size,
        c,
        s,
        count,
        parts,
        int(s == 1),
        int(weight is not None),
        int(bias is not None),
        int(activation == "relu"),
        int(bool(training)),
        int(need_sums),
        int(grad_x is not None),
        int(grad_weight is not None),
        int(grad_bias is not None),
    )
