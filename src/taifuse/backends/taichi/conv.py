"""The Taichi backend's convolution and pooling kernels (reference: ``backends/reference/conv.py``).

NOTE [ Convolution on the device: implicit GEMM ]
The forward and both gradients are matrix products whose operands are read through the
convolution's index arithmetic instead of materialised columns (an "implicit GEMM"): per batch
item ``bz`` the kernel computes ``C[m, p] = sum_k A[m, k] * B[k, p]`` with

=========  ============  ===================  =====================  ==============================
mode       bz            m                    p                      k
=========  ============  ===================  =====================  ==============================
FWD        (n, group)    output channel       output pixel           (input channel, tap)
DGRAD      (n, group)    input channel        input pixel            (output channel, tap)
WGRAD      group         output channel       (input channel, tap)   (n, output pixel)
=========  ============  ===================  =====================  ==============================

so each output element is written by exactly one thread and no backward needs an atomic
(Metal has no float atomics): grad_x gathers, for each input pixel, the output pixels whose
taps read it (a tap contributes where ``ih + pad - i * dilation`` is a multiple of the stride),
and grad_w reduces over the batch inside its own dot products. On GPU archs a block of
``BLOCK_THREADS`` threads stages ``BLOCK_K``-deep slices of both operands in threadgroup memory
and each thread keeps a ``TILE_N x TILE_M`` register tile, as ``linear_act_shared``; ``ti.cpu``
runs the same loaders without threadgroup memory. The forward's epilogue adds the bias;
an activation runs as the elementwise kernel after it (in place, or from ``pre``), as
``linear_act`` with ``pre`` does; the backward's first pass forms
grad_pre = grad_out * act'(pre) in float32 and per-(image, channel) partial sums that a second
small kernel adds into grad_b (two levels, no atomics).

Pooling: one thread per output element forward; the backward gathers per input element over
the windows that hold it (max pooling: those whose recorded index is this element).
"""

# NOTE: no `from __future__ import annotations` here: Taichi reads kernel annotations as objects.

import functools
from types import SimpleNamespace

import numpy as np

from taifuse.backends._spec import activation_code
from taifuse.backends.taichi import forward as F
from taifuse.backends.taichi._runtime import (
    FLOAT_DTYPES,
    INDEX_DTYPE,
    _import_taichi,
    _nd,
    _on_gpu,
    _optional,
    _ti_dtype,
)
from taifuse.backends.taichi.batch_norm import batch_norm_backward, batch_norm_stats
from taifuse.backends.taichi.forward import BLOCK_K, BLOCK_M, BLOCK_N, BLOCK_THREADS, TILE_M, TILE_N
from taifuse.backends.taichi.tensor_math import TaichiMath, _new

FWD, DGRAD, WGRAD = 0, 1, 2
# The geometry vector every convolution kernel takes (one argument instead of sixteen).
_GEO = ("n", "c", "h", "w", "oc", "kh", "kw", "oh", "ow", "sh", "sw", "ph", "pw", "dh", "dw", "groups")


def _geo(x_shape, w_shape, out_hw, stride, padding, dilation, groups) -> list:
    n, c, h, w = x_shape
    oc, _, kh, kw = w_shape
    return [n, c, h, w, oc, kh, kw, *out_hw, *stride, *padding, *dilation, groups]


def _dims(mode: int, geo: list) -> tuple[int, int, int, int]:
    """(batch items, M, P, K) of ``mode``'s product (NOTE [ Convolution on the device: implicit GEMM ])."""
    n, c, h, w, oc, kh, kw, oh, ow, *_, groups = geo
    cg, ocg, taps = c // groups, oc // groups, kh * kw
    if mode == FWD:
        return n * groups, ocg, oh * ow, cg * taps
    if mode == DGRAD:
        return n * groups, cg, h * w, ocg * taps
    return groups, ocg, cg * taps, n * oh * ow


@functools.cache
def kernels_for(dtype: np.dtype) -> SimpleNamespace:
    """The kernel set for storage dtype ``dtype`` (float32 or float16), built once per process."""
    ti = _import_taichi()
    from taifuse.backends.taichi import _math as M

    T = _ti_dtype(dtype)
    X = ti.types.ndarray(dtype=T, ndim=1)
    F32 = ti.types.ndarray(dtype=ti.f32, ndim=1)
    IDX = ti.types.ndarray(dtype=ti.i32, ndim=1)
    GEO = ti.types.vector(len(_GEO), ti.i32)

    @ti.func
    def a_val(mode: ti.template(), w: ti.template(), gp: ti.template(), geo, bz, m, k):
        c, oc, kh, kw, oh, ow, groups = geo[1], geo[4], geo[5], geo[6], geo[7], geo[8], geo[15]
        taps = kh * kw
        ocg = oc // groups
        r = 0.0
        if ti.static(mode == FWD):  # w_g (OCg, Cg * taps)
            g = bz % groups
            r = ti.cast(w[(g * ocg + m) * (c // groups) * taps + k], ti.f32)
        elif ti.static(mode == DGRAD):  # w_g.T: (Cg, OCg * taps)
            g = bz % groups
            o = k // taps
            r = ti.cast(w[((g * ocg + o) * (c // groups) + m) * taps + k % taps], ti.f32)
        else:  # WGRAD: grad_pre_g (OCg, N * P)
            p = oh * ow
            n = k // p
            r = ti.cast(gp[(n * oc + bz * ocg + m) * p + k % p], ti.f32)
        return r

    @ti.func
    def x_tap(x: ti.template(), geo, n, ch, t, op):
        # The input under tap t of output pixel op, 0 in the padding.
        h, w, kw, ow = geo[2], geo[3], geo[6], geo[8]
        ih = (op // ow) * geo[9] - geo[11] + (t // kw) * geo[13]
        iw = (op % ow) * geo[10] - geo[12] + (t % kw) * geo[14]
        r = 0.0
        if 0 <= ih < h and 0 <= iw < w:
            r = ti.cast(x[((n * geo[1] + ch) * h + ih) * w + iw], ti.f32)
        return r

    @ti.func
    def b_val(mode: ti.template(), x: ti.template(), gp: ti.template(), geo, bz, k, p):
        c, oc, kh, kw, oh, ow, groups = geo[1], geo[4], geo[5], geo[6], geo[7], geo[8], geo[15]
        taps = kh * kw
        cg = c // groups
        r = 0.0
        if ti.static(mode == FWD):  # columns (Cg * taps, P) of image n, group g
            g = bz % groups
            r = x_tap(x, geo, bz // groups, g * cg + k // taps, k % taps, p)
        elif ti.static(mode == DGRAD):  # grad_pre at the output pixel whose tap reads input pixel p
            g = bz % groups
            o = k // taps
            t = k % taps
            th = p // geo[3] + geo[11] - (t // kw) * geo[13]
            tw = p % geo[3] + geo[12] - (t % kw) * geo[14]
            if th >= 0 and tw >= 0 and th % geo[9] == 0 and tw % geo[10] == 0:
                yh = th // geo[9]
                yw = tw // geo[10]
                if yh < oh and yw < ow:
                    n = bz // groups
                    r = ti.cast(gp[((n * oc + g * (oc // groups) + o) * oh + yh) * ow + yw], ti.f32)
        else:  # WGRAD: columns transposed, (N * P, Cg * taps)
            pp = oh * ow
            r = x_tap(x, geo, k // pp, bz * cg + p // taps, p % taps, k % pp)
        return r

    @ti.func
    def store(mode: ti.template(), b: ti.template(), out: ti.template(), geo, bz, m, p, v, has_bias):
        c, oc, groups = geo[1], geo[4], geo[15]
        if ti.static(mode == FWD):
            o = (bz % groups) * (oc // groups) + m
            if has_bias != 0:
                v += ti.cast(b[o], ti.f32)
            out[((bz // groups) * oc + o) * geo[7] * geo[8] + p] = ti.cast(v, T)
        elif ti.static(mode == DGRAD):
            out[((bz // groups) * c + (bz % groups) * (c // groups) + m) * geo[2] * geo[3] + p] = ti.cast(
                v, T
            )
        else:
            taps = geo[5] * geo[6]
            out[(bz * (oc // groups) + m) * (c // groups) * taps + p] = ti.cast(v, T)

    def make(mode):
        @ti.kernel
        def gemm(
            x: X, w: X, gp: F32, b: X, out: X, geo: GEO, has_bias: ti.i32,
            items: ti.i32, m_dim: ti.i32, p_dim: ti.i32, k_dim: ti.i32,
        ):  # fmt: skip
            # One TILE_N x TILE_M register tile (m x p) per thread; edges masked.
            tiles_p = (p_dim + TILE_M - 1) // TILE_M
            tiles_m = (m_dim + TILE_N - 1) // TILE_N
            for t in range(items * tiles_m * tiles_p):
                bz = t // (tiles_m * tiles_p)
                m0 = (t // tiles_p) % tiles_m * TILE_N
                p0 = t % tiles_p * TILE_M
                acc = ti.Matrix.zero(ti.f32, TILE_N, TILE_M)
                for k in range(k_dim):
                    av = ti.Vector.zero(ti.f32, TILE_N)
                    bv = ti.Vector.zero(ti.f32, TILE_M)
                    for i in ti.static(range(TILE_N)):
                        if m0 + i < m_dim:
                            av[i] = a_val(mode, w, gp, geo, bz, m0 + i, k)
                    for j in ti.static(range(TILE_M)):
                        if p0 + j < p_dim:
                            bv[j] = b_val(mode, x, gp, geo, bz, k, p0 + j)
                    for i, j in ti.static(ti.ndrange(TILE_N, TILE_M)):
                        acc[i, j] += av[i] * bv[j]
                for i, j in ti.static(ti.ndrange(TILE_N, TILE_M)):
                    if m0 + i < m_dim and p0 + j < p_dim:
                        store(mode, b, out, geo, bz, m0 + i, p0 + j, acc[i, j], has_bias)

        @ti.kernel
        def gemm_shared(
            x: X, w: X, gp: F32, b: X, out: X, geo: GEO, has_bias: ti.i32,
            items: ti.i32, m_dim: ti.i32, p_dim: ti.i32, k_dim: ti.i32,
        ):  # fmt: skip
            # A block owns a BLOCK_N (m) x BLOCK_M (p) output tile of one batch item and walks k in
            # BLOCK_K slices staged in threadgroup memory; every thread of a block reaches each
            # barrier the same number of times (the launch has exactly BLOCK_THREADS per block).
            blocks_p = (p_dim + BLOCK_M - 1) // BLOCK_M
            blocks_m = (m_dim + BLOCK_N - 1) // BLOCK_N
            ti.loop_config(block_dim=BLOCK_THREADS)
            for gidx in range(items * blocks_m * blocks_p * BLOCK_THREADS):
                tid = gidx % BLOCK_THREADS
                blk = gidx // BLOCK_THREADS
                bz = blk // (blocks_m * blocks_p)
                m_base = (blk // blocks_p) % blocks_m * BLOCK_N
                p_base = blk % blocks_p * BLOCK_M
                ty = tid // (BLOCK_M // TILE_M)
                tx = tid % (BLOCK_M // TILE_M)
                As = ti.simt.block.SharedArray((BLOCK_K * BLOCK_N,), ti.f32)
                Bs = ti.simt.block.SharedArray((BLOCK_K * BLOCK_M,), ti.f32)
                acc = ti.Matrix.zero(ti.f32, TILE_N, TILE_M)
                for chunk in range((k_dim + BLOCK_K - 1) // BLOCK_K):
                    k0 = chunk * BLOCK_K
                    # Dynamic loops: unrolled, the inlined loaders make a larger shader.
                    for r in range(BLOCK_K * BLOCK_N // BLOCK_THREADS):
                        e = tid + r * BLOCK_THREADS
                        row = e // BLOCK_K
                        kk = e % BLOCK_K
                        v = 0.0
                        if m_base + row < m_dim and k0 + kk < k_dim:
                            v = a_val(mode, w, gp, geo, bz, m_base + row, k0 + kk)
                        As[kk * BLOCK_N + row] = v
                    for r in range(BLOCK_K * BLOCK_M // BLOCK_THREADS):
                        e = tid + r * BLOCK_THREADS
                        col = e % BLOCK_M  # consecutive threads: consecutive pixels
                        kk = e // BLOCK_M
                        v = 0.0
                        if p_base + col < p_dim and k0 + kk < k_dim:
                            v = b_val(mode, x, gp, geo, bz, k0 + kk, p_base + col)
                        Bs[kk * BLOCK_M + col] = v
                    ti.simt.block.sync()
                    for kk in range(BLOCK_K):
                        av = ti.Vector.zero(ti.f32, TILE_N)
                        bv = ti.Vector.zero(ti.f32, TILE_M)
                        for i in ti.static(range(TILE_N)):
                            av[i] = As[kk * BLOCK_N + ty * TILE_N + i]
                        for j in ti.static(range(TILE_M)):
                            bv[j] = Bs[kk * BLOCK_M + tx * TILE_M + j]
                        for i, j in ti.static(ti.ndrange(TILE_N, TILE_M)):
                            acc[i, j] += av[i] * bv[j]
                    ti.simt.block.sync()  # the next slice overwrites As / Bs
                for i, j in ti.static(ti.ndrange(TILE_N, TILE_M)):
                    m = m_base + ty * TILE_N + i
                    p = p_base + tx * TILE_M + j
                    if m < m_dim and p < p_dim:
                        store(mode, b, out, geo, bz, m, p, acc[i, j], has_bias)

        return gemm, gemm_shared

    fwd, fwd_shared = make(FWD)
    dgrad, dgrad_shared = make(DGRAD)
    wgrad, wgrad_shared = make(WGRAD)

    @ti.kernel
    def grad_pre(pre: X, g: X, gp: F32, partial: F32, rows: ti.i32, p_dim: ti.i32, act: ti.i32):
        # gp = g * act'(pre) over each (image, channel) row of P pixels, and that row's sum.
        for r in range(rows):
            s = 0.0
            for q in range(p_dim):
                i = r * p_dim + q
                gv = ti.cast(g[i], ti.f32)
                if act == M.RELU:  # a select: a masked inf or NaN gradient is 0, as PyTorch
                    gv = ti.select(ti.cast(pre[i], ti.f32) <= 0.0, 0.0, gv)
                elif act != 0:
                    gv = gv * M.activation_grad(ti.cast(pre[i], ti.f32), act, 0.0)
                gp[i] = gv
                s += gv
            partial[r] = s

    @ti.kernel
    def channel_sums(partial: F32, out: X, n: ti.i32, oc: ti.i32):
        for o in range(oc):
            s = 0.0
            for i in range(n):
                s += partial[i * oc + o]
            out[o] = ti.cast(s, T)

    @ti.func
    def window(o, size, k, s, p, include, adaptive, osz):
        start, end, div = 0, 0, 1
        if adaptive != 0:
            start = (o * size) // osz
            end = ((o + 1) * size + osz - 1) // osz
            div = end - start
        else:
            start = o * s - p
            end = ti.min(start + k, size + p)
            div = end - start
            start = ti.max(start, 0)
            end = ti.min(end, size)
            if include == 0:
                div = end - start
        return start, end, div

    @ti.func
    def reach(i, size, k, s, p, d, adaptive, osz):
        # The output positions whose window may hold input index i (each is checked by the caller).
        lo, hi = 0, 0
        if adaptive != 0:
            lo = (i * osz) // size
            hi = ti.min(osz - 1, ((i + 1) * osz + size - 1) // size - 1)
        else:
            num = i + p - (k - 1) * d
            if num > 0:
                lo = (num + s - 1) // s
            hi = ti.min(osz - 1, (i + p) // s)
        return lo, hi

    @ti.kernel
    def max_pool(x: X, out: X, idx: IDX, geo: GEO):
        # geo: n, c, h, w, -, kh, kw, oh, ow, sh, sw, ph, pw, dh, dw, -
        h, w, oh, ow = geo[2], geo[3], geo[7], geo[8]
        for e in range(geo[0] * geo[1] * oh * ow):
            plane = e // (oh * ow)
            r = e % (oh * ow) // ow
            q = e % ow
            best = 0.0
            where = -1
            for i in range(geo[5]):
                ih = r * geo[9] - geo[11] + i * geo[13]
                if 0 <= ih < h:
                    for j in range(geo[6]):
                        iw = q * geo[10] - geo[12] + j * geo[14]
                        if 0 <= iw < w:
                            v = ti.cast(x[(plane * h + ih) * w + iw], ti.f32)
                            if where < 0 or v > best or M.is_nan(v) != 0:
                                best = v
                                where = ih * w + iw
            out[e] = ti.cast(best, T)
            idx[e] = where

    @ti.kernel
    def max_pool_backward(idx: IDX, g: X, gx: X, geo: GEO):
        h, w, oh, ow = geo[2], geo[3], geo[7], geo[8]
        for e in range(geo[0] * geo[1] * h * w):
            plane = e // (h * w)
            ih = e % (h * w) // w
            iw = e % w
            # Output rows whose window reaches ih: oh * sh - ph <= ih <= oh * sh - ph + (kh - 1) * dh.
            lo_h, hi_h = reach(ih, h, geo[5], geo[9], geo[11], geo[13], 0, oh)
            lo_w, hi_w = reach(iw, w, geo[6], geo[10], geo[12], geo[14], 0, ow)
            s = 0.0
            me = ih * w + iw
            for r in range(lo_h, hi_h + 1):
                for q in range(lo_w, hi_w + 1):
                    o = (plane * oh + r) * ow + q
                    if idx[o] == me:
                        s += ti.cast(g[o], ti.f32)
            gx[e] = ti.cast(s, T)

    @ti.kernel
    def avg_pool(x: X, out: X, geo: GEO, include: ti.i32, divisor: ti.i32, adaptive: ti.i32):
        h, w, oh, ow = geo[2], geo[3], geo[7], geo[8]
        for e in range(geo[0] * geo[1] * oh * ow):
            plane = e // (oh * ow)
            r = e % (oh * ow) // ow
            q = e % ow
            h0, h1, hd = window(r, h, geo[5], geo[9], geo[11], include, adaptive, oh)
            w0, w1, wd = window(q, w, geo[6], geo[10], geo[12], include, adaptive, ow)
            s = 0.0
            for a in range(h0, h1):
                for c in range(w0, w1):
                    s += ti.cast(x[(plane * h + a) * w + c], ti.f32)
            div = divisor if divisor != 0 else hd * wd
            out[e] = ti.cast(s / ti.cast(div, ti.f32), T)

    @ti.kernel
    def avg_pool_backward(g: X, gx: X, geo: GEO, include: ti.i32, divisor: ti.i32, adaptive: ti.i32):
        h, w, oh, ow = geo[2], geo[3], geo[7], geo[8]
        for e in range(geo[0] * geo[1] * h * w):
            plane = e // (h * w)
            ih = e % (h * w) // w
            iw = e % w
            lo_h, hi_h = reach(ih, h, geo[5], geo[9], geo[11], 1, adaptive, oh)
            lo_w, hi_w = reach(iw, w, geo[6], geo[10], geo[12], 1, adaptive, ow)
            s = 0.0
            for r in range(lo_h, hi_h + 1):
                h0, h1, hd = window(r, h, geo[5], geo[9], geo[11], include, adaptive, oh)
                if h0 <= ih < h1:
                    for q in range(lo_w, hi_w + 1):
                        w0, w1, wd = window(q, w, geo[6], geo[10], geo[12], include, adaptive, ow)
                        if w0 <= iw < w1:
                            div = divisor if divisor != 0 else hd * wd
                            s += ti.cast(g[(plane * oh + r) * ow + q], ti.f32) / ti.cast(div, ti.f32)
            gx[e] = ti.cast(s, T)

    return SimpleNamespace(
        conv_fwd=fwd, conv_fwd_shared=fwd_shared, conv_dgrad=dgrad, conv_dgrad_shared=dgrad_shared,
        conv_wgrad=wgrad, conv_wgrad_shared=wgrad_shared, conv_grad_pre=grad_pre, conv_channel_sums=channel_sums,
        max_pool=max_pool, max_pool_backward=max_pool_backward, avg_pool=avg_pool, avg_pool_backward=avg_pool_backward,
    )  # fmt: skip


def all_kernels() -> list[tuple[str, object]]:
    """Every (name, kernel) pair of this module, per storage dtype, for ``metal_check``."""
    return [
        (f"{name}_{dtype.name}", k) for dtype in FLOAT_DTYPES for name, k in vars(kernels_for(dtype)).items()
    ]


# ----------------------------------------------------------------------------- wrappers


def _gemm(mode: int, x, w, gp, b, out, geo: list) -> None:
    k = kernels_for(out.dtype)
    name = ("conv_fwd", "conv_dgrad", "conv_wgrad")[mode]
    kernel = getattr(k, name + "_shared") if _on_gpu() else getattr(k, name)
    items, m_dim, p_dim, k_dim = _dims(mode, geo)
    dtype = out.dtype
    kernel(
        _optional(x, dtype), _optional(w, dtype), _optional(gp, np.float32), _optional(b, dtype), _nd(out),
        geo, int(b is not None and mode == FWD), items, m_dim, p_dim, k_dim,
    )  # fmt: skip


def conv2d(x, w, b, stride, padding, dilation, groups, activation, out, pre=None) -> None:
    """See the reference's conv2d; NOTE [ Convolution on the device: implicit GEMM ]."""
    geo = _geo(x.shape, w.shape, out.shape[2:], stride, padding, dilation, groups)
    if activation is None:
        _gemm(FWD, x, w, None, b, out, geo)
        return
    # The product with the bias, then the activation kernel (in place without pre), as linear_act
    # with pre: the activation's code in the tiled kernel's unrolled epilogue made a shader that
    # took lavapipe seconds to compile per dtype.
    target = out if pre is None else pre
    _gemm(FWD, x, w, None, b, target, geo)
    if activation in ("gelu", "gelu_tanh"):
        F.gelu(target, out, "tanh" if activation == "gelu_tanh" else "none")
    else:
        {"relu": F.relu, "silu": F.silu}[activation](target, out)


def conv2d_backward(
    x, w, pre, grad_out, stride, padding, dilation, groups, activation, grad_x, grad_w, grad_b
) -> None:
    """See the reference's conv2d_backward; NOTE [ Convolution on the device: implicit GEMM ]."""
    n, oc, oh, ow = grad_out.shape
    geo = _geo(x.shape, w.shape, (oh, ow), stride, padding, dilation, groups)
    act = int(activation_code(activation))
    k = kernels_for(x.dtype)
    # One pass: grad_pre in float32 (what the products read) and per-(image, channel) sums.
    gp = _new(grad_out.shape, np.float32)
    partial = _new((n * oc,), np.float32)
    k.conv_grad_pre(_optional(pre, x.dtype), _nd(grad_out), _nd(gp), _nd(partial), n * oc, oh * ow, act)
    if grad_b is not None:
        k.conv_channel_sums(_nd(partial), _nd(grad_b), n, oc)
    if grad_x is not None:
        _gemm(DGRAD, None, w, gp, None, grad_x, geo)
    if grad_w is not None:
        _gemm(WGRAD, x, None, gp, None, grad_w, geo)


def conv2d_stats(x, w, b, stride, padding, dilation, groups, out, mean, var) -> None:
    """See the reference's conv2d_stats: the product (its epilogue adds the bias), then batch norm's
    one statistics pass over the output (a tile of the product holds a few channels' pixels of one
    image; summing them in its epilogue would need float atomics, which Metal lacks)."""
    conv2d(x, w, b, stride, padding, dilation, groups, None, out)
    n, oc, oh, ow = out.shape
    batch_norm_stats(out.reshape((n, oc, oh * ow)), mean, var)


def conv2d_batch_norm_backward(
    x, w, y, grad_out, mean, invstd, bn_weight, bn_bias, activation, stride, padding, dilation, groups,
    grad_x, grad_w, grad_b, grad_bn_weight, grad_bn_bias,
) -> None:  # fmt: skip
    """See the reference's conv2d_batch_norm_backward: batch norm's one backward call writes its
    input gradient in float32 as the products' grad_pre (never stored in y's dtype and read back),
    then the two products."""
    n, oc, oh, ow = y.shape
    geo = _geo(x.shape, w.shape, (oh, ow), stride, padding, dilation, groups)
    needs_y = grad_x is not None or grad_w is not None
    gp = _new(y.shape, np.float32) if needs_y else None
    batch_norm_backward(
        y.reshape((n, oc, oh * ow)), grad_out.reshape((n, oc, oh * ow)), mean, invstd, bn_weight, bn_bias,
        activation, True, None if gp is None else gp.reshape((n, oc, oh * ow)), grad_bn_weight, grad_bn_bias,
    )  # fmt: skip
    if grad_b is not None:
        TaichiMath.fill_(grad_b, 0.0)
    if grad_x is not None:
        _gemm(DGRAD, None, w, gp, None, grad_x, geo)
    if grad_w is not None:
        _gemm(WGRAD, x, None, gp, None, grad_w, geo)


def _pool_geo(x_shape, out_shape, kernel_size, stride, padding, dilation) -> list:
    n, c, h, w = x_shape
    return [n, c, h, w, 0, *kernel_size, *out_shape[2:], *stride, *padding, *dilation, 1]


def max_pool2d(x, kernel_size, stride, padding, dilation, out, indices) -> None:
    geo = _pool_geo(x.shape, out.shape, kernel_size, stride, padding, dilation)
    kernels_for(x.dtype).max_pool(_nd(x), _nd(out), _nd(indices), geo)


def max_pool2d_backward(indices, grad_out, kernel_size, stride, padding, dilation, grad_x) -> None:
    geo = _pool_geo(grad_x.shape, grad_out.shape, kernel_size, stride, padding, dilation)
    kernels_for(grad_x.dtype).max_pool_backward(_nd(indices), _nd(grad_out), _nd(grad_x), geo)


def avg_pool2d(x, kernel_size, stride, padding, count_include_pad, divisor_override, out) -> None:
    geo = _pool_geo(x.shape, out.shape, kernel_size, stride, padding, (1, 1))
    kernels_for(x.dtype).avg_pool(_nd(x), _nd(out), geo, int(count_include_pad), int(divisor_override), 0)


def avg_pool2d_backward(
    grad_out, kernel_size, stride, padding, count_include_pad, divisor_override, grad_x
) -> None:
    geo = _pool_geo(grad_x.shape, grad_out.shape, kernel_size, stride, padding, (1, 1))
    kernels_for(grad_x.dtype).avg_pool_backward(
        _nd(grad_out), _nd(grad_x), geo, int(count_include_pad), int(divisor_override), 0
    )


def adaptive_avg_pool2d(x, out) -> None:
    geo = _pool_geo(x.shape, out.shape, (0, 0), (1, 1), (0, 0), (1, 1))
    kernels_for(x.dtype).avg_pool(_nd(x), _nd(out), geo, 1, 0, 1)


def adaptive_avg_pool2d_backward(grad_out, grad_x) -> None:
    geo = _pool_geo(grad_x.shape, grad_out.shape, (0, 0), (1, 1), (0, 0), (1, 1))
    kernels_for(grad_x.dtype).avg_pool_backward(_nd(grad_out), _nd(grad_x), geo, 1, 0, 1)


assert INDEX_DTYPE == np.int32  # max_pool's indices kernel argument is i32
