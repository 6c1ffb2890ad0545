"""Taichi kernels of the ``taichi`` backend, one set per storage dtype (float32, float16).

Every kernel takes flat 1-D ndarrays plus plain ints for the logical dimensions, so each kernel
object compiles exactly once per arch (ndarray arguments specialise on dtype and ndim only).
float16 is storage only: values are converted to float32 on load and back on store.

Rules these kernels follow (see /work/shared/FACTS.md):

* Loops are ``for i in range(n)``, never ``for i in x`` over an ndarray (that adds a modulo per
  element on ``ti.cpu``).
* No Taichi autodiff: on the SPIR-V backends (Vulkan, Metal) it writes gradients into the primal
  array. Backward kernels are written by hand elsewhere.
* No float64 anywhere and no more than a handful of ndarray arguments per kernel: Metal has no
  f64 and 31 buffer bindings. ``taifuse.backends.metal_check`` proves both for every kernel here.
* Transcendentals are built from ``ti.exp`` / ``ti.log`` / ``ti.sqrt`` only. ``tanh`` and ``erf``
  are implemented here: Taichi has no ``erf``, and a driver's ``tanh`` under fast math may
  overflow to NaN for large arguments.

Row reductions (softmax, log_softmax, layer_norm) use one thread per row: simple and exact enough,
but a GPU is underused when there are few long rows.
"""

# NOTE: no `from __future__ import annotations` here: Taichi reads kernel annotations as objects.

import functools
from types import SimpleNamespace

import numpy as np
import taichi as ti

# Activation codes of the fused linear epilogue; index = position in reference.ACTIVATIONS.
ACT_CODES = {None: 0, "relu": 1, "gelu": 2, "gelu_tanh": 3, "silu": 4}

# Register tile of the linear kernel: each thread owns TILE_N x TILE_M outputs.
TILE_N = 4
TILE_M = 4
# Shared-memory linear (GPU archs): a block of BLOCK_THREADS threads owns a BLOCK_N x BLOCK_M output
# tile and walks K in chunks of BLOCK_K staged through threadgroup memory; each thread keeps a
# TILE_N x TILE_M register tile. 2 * BLOCK_K * 64 floats = 8 KiB of shared memory per block.
BLOCK_N = 64
BLOCK_M = 64
BLOCK_K = 16
BLOCK_THREADS = (BLOCK_N // TILE_N) * (BLOCK_M // TILE_M)

_SQRT_HALF = 0.7071067811865476
_SQRT_2_OVER_PI = 0.7978845608028654

# ----------------------------------------------------------------------------- scalar math (f32)


@ti.func
def _sigmoid(v: ti.f32) -> ti.f32:
    e = ti.exp(-ti.abs(v))  # never overflows
    r = 1.0 / (1.0 + e)
    return ti.select(v >= 0.0, r, e * r)


@ti.func
def _tanh(v: ti.f32) -> ti.f32:
    a = ti.abs(v)
    r = 0.0
    if a < 0.55:
        # Taylor series to x**15: the next term is below 2.5e-8 relative for |x| < 0.55, and
        # no cancellation of 1 - exp(-2|x|) as in the branch below.
        z = a * a
        p = -929569.0 / 638512875.0
        p = p * z + 21844.0 / 6081075.0
        p = p * z - 1382.0 / 155925.0
        p = p * z + 62.0 / 2835.0
        p = p * z - 17.0 / 315.0
        p = p * z + 2.0 / 15.0
        p = p * z - 1.0 / 3.0
        r = a + a * z * p
    else:
        e = ti.exp(-2.0 * a)  # in (0, 0.33]: no overflow, no cancellation
        r = (1.0 - e) / (1.0 + e)
    # NaN fails `a < 0.55` and flows through exp, so it propagates.
    return ti.select(v < 0.0, -r, r)


@ti.func
def _erfc_pos(z: ti.f32) -> ti.f32:
    """erfc(z) for z >= 0 with relative error below 1.2e-7 in exact arithmetic (Numerical Recipes' erfcc)."""
    t = 1.0 / (1.0 + 0.5 * z)
    p = 0.17087277
    p = p * t - 0.82215223
    p = p * t + 1.48851587
    p = p * t - 1.13520398
    p = p * t + 0.27886807
    p = p * t - 0.18628806
    p = p * t + 0.09678418
    p = p * t + 0.37409196
    p = p * t + 1.00002368
    p = p * t - 1.26551223
    return t * ti.exp(p - z * z)


@ti.func
def _erf(z: ti.f32) -> ti.f32:
    a = ti.abs(z)
    r = 0.0
    if a < 0.5:
        # Maclaurin series to z**13: 1 - erfc would lose the relative accuracy near 0.
        s = a * a
        p = 1.0 / 75600.0
        p = -p * s + 1.0 / 9360.0
        p = p * s - 1.0 / 1320.0
        p = p * s + 1.0 / 216.0
        p = p * s - 1.0 / 42.0
        p = p * s + 1.0 / 10.0
        p = p * s - 1.0 / 3.0
        r = 1.1283791670955126 * (a + a * s * p)
    else:
        r = 1.0 - _erfc_pos(a)
    return ti.select(z < 0.0, -r, r)


@ti.func
def _normal_cdf(v: ti.f32) -> ti.f32:
    # Phi(v) through erfc of |v|: 1 + erf(v / sqrt 2) would cancel for negative v and lose the
    # relative accuracy of gelu's left tail.
    c = 0.5 * _erfc_pos(ti.abs(v) * _SQRT_HALF)
    return ti.select(v < 0.0, c, 1.0 - c)


@ti.func
def _gelu_erf(v: ti.f32) -> ti.f32:
    return v * _normal_cdf(v)


@ti.func
def _gelu_tanh(v: ti.f32) -> ti.f32:
    # 0.5 * (1 + tanh(u)) == sigmoid(2u): no cancellation for negative v.
    u = _SQRT_2_OVER_PI * (v + 0.044715 * v * v * v)
    return v * _sigmoid(2.0 * u)


@ti.func
def _relu(v: ti.f32) -> ti.f32:
    return ti.select(v < 0.0, 0.0, v)  # NaN < 0 is false: NaN propagates


@ti.func
def _activate(v: ti.f32, act: ti.i32) -> ti.f32:
    r = v
    if act == 1:
        r = _relu(v)
    elif act == 2:
        r = _gelu_erf(v)
    elif act == 3:
        r = _gelu_tanh(v)
    elif act == 4:
        r = v * _sigmoid(v)
    return r


@ti.func
def _hash32(v: ti.u32) -> ti.u32:
    # reference.hash32 ("lowbias32"); u32 multiplication wraps mod 2**32 as in the reference.
    v ^= ti.bit_shr(v, 16)
    v *= ti.u32(0x7FEB352D)
    v ^= ti.bit_shr(v, 15)
    v *= ti.u32(0x846CA68B)
    v ^= ti.bit_shr(v, 16)
    return v


# Row sums run in three levels of at most SUM_BLOCK terms each (a fixed-shape pairwise sum): a plain
# float32 running sum of n similar terms drifts by up to ~n/2 ulp, and Kahan's compensation would be
# optimised away under fast math.
SUM_BLOCK = 256
SUM_TERM_VALUE, SUM_TERM_EXP, SUM_TERM_SQUARE = 0, 1, 2


@ti.func
def _row_sum(
    x: ti.template(), base: ti.i32, stride: ti.i32, n: ti.i32, shift: ti.f32, term: ti.template()
) -> ti.f32:
    """sum over c < n of f(x[base + c * stride] - shift), f = identity, exp or square (by ``term``)."""
    blocks = (n + SUM_BLOCK - 1) // SUM_BLOCK
    total = 0.0
    for hi in range((blocks + SUM_BLOCK - 1) // SUM_BLOCK):
        mid = 0.0
        for lo in range(hi * SUM_BLOCK, ti.min(hi * SUM_BLOCK + SUM_BLOCK, blocks)):
            inner = 0.0
            for c in range(lo * SUM_BLOCK, ti.min(lo * SUM_BLOCK + SUM_BLOCK, n)):
                v = ti.cast(x[base + c * stride], ti.f32) - shift
                if ti.static(term == SUM_TERM_EXP):
                    v = ti.exp(v)
                if ti.static(term == SUM_TERM_SQUARE):
                    v = v * v
                inner += v
            mid += inner
        total += mid
    return total


# Row reductions on GPU archs: one block of ROW_THREADS threads per row, each thread striding over the
# row, then a tree reduction in threadgroup memory. ti.cpu keeps one thread per row.
ROW_THREADS = 128


@ti.func
def _block_reduce(red: ti.template(), tid: ti.i32, v: ti.f32, is_max: ti.template()) -> ti.f32:
    """Max or sum of ``v`` over the ROW_THREADS threads of a block; every thread must call it."""
    red[tid] = v
    ti.simt.block.sync()
    for step in ti.static([64, 32, 16, 8, 4, 2, 1]):
        if tid < step:
            if ti.static(is_max):
                red[tid] = ti.max(red[tid], red[tid + step])
            else:
                red[tid] = red[tid] + red[tid + step]
        ti.simt.block.sync()
    r = red[0]
    ti.simt.block.sync()  # red is reused by the next reduction
    return r


# ----------------------------------------------------------------------------- kernel factory

_TI_DTYPES = {np.dtype(np.float32): ti.f32, np.dtype(np.float16): ti.f16}


@functools.cache
def kernels_for(dtype: np.dtype) -> SimpleNamespace:
    """The kernel set for storage dtype ``dtype`` (float32 or float16), built once per process."""
    T = _TI_DTYPES[np.dtype(dtype)]
    X = ti.types.ndarray(dtype=T, ndim=1)
    F32 = ti.types.ndarray(dtype=ti.f32, ndim=1)

    @ti.kernel
    def gelu_erf(x: X, out: X, n: ti.i32):
        for i in range(n):
            out[i] = ti.cast(_gelu_erf(ti.cast(x[i], ti.f32)), T)

    @ti.kernel
    def gelu_tanh(x: X, out: X, n: ti.i32):
        for i in range(n):
            out[i] = ti.cast(_gelu_tanh(ti.cast(x[i], ti.f32)), T)

    @ti.kernel
    def relu(x: X, out: X, n: ti.i32):
        for i in range(n):
            out[i] = ti.cast(_relu(ti.cast(x[i], ti.f32)), T)

    @ti.kernel
    def leaky_relu(x: X, out: X, n: ti.i32, slope: ti.f32):
        for i in range(n):
            v = ti.cast(x[i], ti.f32)
            out[i] = ti.cast(ti.select(v > 0.0, v, slope * v), T)

    @ti.kernel
    def silu(x: X, out: X, n: ti.i32):
        for i in range(n):
            v = ti.cast(x[i], ti.f32)
            out[i] = ti.cast(v * _sigmoid(v), T)

    @ti.kernel
    def sigmoid(x: X, out: X, n: ti.i32):
        for i in range(n):
            out[i] = ti.cast(_sigmoid(ti.cast(x[i], ti.f32)), T)

    @ti.kernel
    def tanh(x: X, out: X, n: ti.i32):
        for i in range(n):
            out[i] = ti.cast(_tanh(ti.cast(x[i], ti.f32)), T)

    @ti.kernel
    def add_relu(a: X, b: X, out: X, n: ti.i32):
        for i in range(n):
            out[i] = ti.cast(_relu(ti.cast(a[i], ti.f32) + ti.cast(b[i], ti.f32)), T)

    @ti.kernel
    def mul_relu(a: X, b: X, out: X, n: ti.i32):
        for i in range(n):
            out[i] = ti.cast(_relu(ti.cast(a[i], ti.f32) * ti.cast(b[i], ti.f32)), T)

    @ti.kernel
    def affine(x: X, scale: X, bias: X, out: X, rows: ti.i32, cols: ti.i32):
        for r, c in ti.ndrange(rows, cols):
            i = r * cols + c
            v = ti.cast(x[i], ti.f32) * ti.cast(scale[c], ti.f32) + ti.cast(bias[c], ti.f32)
            out[i] = ti.cast(v, T)

    @ti.kernel
    def dropout(x: X, out: X, n: ti.i32, key: ti.u32, threshold: ti.u32, scale: ti.f32):
        for i in range(n):
            keep = ti.bit_shr(_hash32(ti.cast(i, ti.u32) ^ key), 8) >= threshold
            out[i] = ti.cast(ti.cast(x[i], ti.f32) * ti.select(keep, scale, 0.0), T)

    @ti.kernel
    def linear_act(
        x: X, w: X, b: X, out: X, n_rows: ti.i32, m_cols: ti.i32, k_dim: ti.i32, has_bias: ti.i32, act: ti.i32
    ):
        # out (n_rows, m_cols) = act(x (n_rows, k_dim) @ w (m_cols, k_dim).T + b), one TILE_N x TILE_M
        # register tile per thread. Edge tiles clamp their load indices (no branch in the K loop)
        # and mask their stores.
        tiles_m = (m_cols + TILE_M - 1) // TILE_M
        tiles = ((n_rows + TILE_N - 1) // TILE_N) * tiles_m
        for t in range(tiles):
            n0 = (t // tiles_m) * TILE_N
            m0 = (t % tiles_m) * TILE_M
            xrow = ti.Vector([0] * TILE_N, dt=ti.i32)
            wrow = ti.Vector([0] * TILE_M, dt=ti.i32)
            for i in ti.static(range(TILE_N)):
                xrow[i] = ti.min(n0 + i, n_rows - 1) * k_dim
            for j in ti.static(range(TILE_M)):
                wrow[j] = ti.min(m0 + j, m_cols - 1) * k_dim
            acc = ti.Matrix.zero(ti.f32, TILE_N, TILE_M)
            for k in range(k_dim):
                xv = ti.Vector.zero(ti.f32, TILE_N)
                wv = ti.Vector.zero(ti.f32, TILE_M)
                for i in ti.static(range(TILE_N)):
                    xv[i] = ti.cast(x[xrow[i] + k], ti.f32)
                for j in ti.static(range(TILE_M)):
                    wv[j] = ti.cast(w[wrow[j] + k], ti.f32)
                for i, j in ti.static(ti.ndrange(TILE_N, TILE_M)):
                    acc[i, j] += xv[i] * wv[j]
            for i, j in ti.static(ti.ndrange(TILE_N, TILE_M)):
                if n0 + i < n_rows and m0 + j < m_cols:
                    v = acc[i, j]
                    if has_bias != 0:
                        v += ti.cast(b[m0 + j], ti.f32)
                    out[(n0 + i) * m_cols + m0 + j] = ti.cast(_activate(v, act), T)

    @ti.kernel
    def linear_act_shared(
        x: X, w: X, b: X, out: X, n_rows: ti.i32, m_cols: ti.i32, k_dim: ti.i32, has_bias: ti.i32, act: ti.i32
    ):
        # Same contract as linear_act, for archs with threadgroup memory (Metal, Vulkan, CUDA).
        # Loop index g = block * BLOCK_THREADS + thread: the launch has exactly BLOCK_THREADS threads
        # per block, so every thread of a block reaches each barrier the same number of times.
        blocks_m = (m_cols + BLOCK_M - 1) // BLOCK_M
        blocks = ((n_rows + BLOCK_N - 1) // BLOCK_N) * blocks_m
        ti.loop_config(block_dim=BLOCK_THREADS)
        for g in range(blocks * BLOCK_THREADS):
            tid = g % BLOCK_THREADS
            blk = g // BLOCK_THREADS
            n_base = (blk // blocks_m) * BLOCK_N
            m_base = (blk % blocks_m) * BLOCK_M
            ty = tid // (BLOCK_M // TILE_M)
            tx = tid % (BLOCK_M // TILE_M)
            # K-major staging: a thread's TILE_N (TILE_M) operands for one k are contiguous.
            xs = ti.simt.block.SharedArray((BLOCK_K * BLOCK_N,), ti.f32)
            ws = ti.simt.block.SharedArray((BLOCK_K * BLOCK_M,), ti.f32)
            acc = ti.Matrix.zero(ti.f32, TILE_N, TILE_M)
            for chunk in range((k_dim + BLOCK_K - 1) // BLOCK_K):
                k0 = chunk * BLOCK_K
                # Cooperative, coalesced loads: consecutive threads read consecutive k of a row.
                for r in ti.static(range(BLOCK_K * BLOCK_N // BLOCK_THREADS)):
                    e = tid + r * BLOCK_THREADS
                    row = e // BLOCK_K
                    kk = e % BLOCK_K
                    v = 0.0
                    if n_base + row < n_rows and k0 + kk < k_dim:
                        v = ti.cast(x[(n_base + row) * k_dim + k0 + kk], ti.f32)
                    xs[kk * BLOCK_N + row] = v
                for r in ti.static(range(BLOCK_K * BLOCK_M // BLOCK_THREADS)):
                    e = tid + r * BLOCK_THREADS
                    col = e // BLOCK_K
                    kk = e % BLOCK_K
                    v = 0.0
                    if m_base + col < m_cols and k0 + kk < k_dim:
                        v = ti.cast(w[(m_base + col) * k_dim + k0 + kk], ti.f32)
                    ws[kk * BLOCK_M + col] = v
                ti.simt.block.sync()
                for kk in range(BLOCK_K):
                    xv = ti.Vector.zero(ti.f32, TILE_N)
                    wv = ti.Vector.zero(ti.f32, TILE_M)
                    for i in ti.static(range(TILE_N)):
                        xv[i] = xs[kk * BLOCK_N + ty * TILE_N + i]
                    for j in ti.static(range(TILE_M)):
                        wv[j] = ws[kk * BLOCK_M + tx * TILE_M + j]
                    for i, j in ti.static(ti.ndrange(TILE_N, TILE_M)):
                        acc[i, j] += xv[i] * wv[j]
                ti.simt.block.sync()  # the next chunk overwrites xs/ws
            for i, j in ti.static(ti.ndrange(TILE_N, TILE_M)):
                n = n_base + ty * TILE_N + i
                m = m_base + tx * TILE_M + j
                if n < n_rows and m < m_cols:
                    v = acc[i, j]
                    if has_bias != 0:
                        v += ti.cast(b[m], ti.f32)
                    out[n * m_cols + m] = ti.cast(_activate(v, act), T)

    @ti.kernel
    def softmax(x: X, out: X, a_dim: ti.i32, c_dim: ti.i32, b_dim: ti.i32, log: ti.i32):
        # One thread per (a, b) row; the reduced axis has stride b_dim.
        for r in range(a_dim * b_dim):
            base = (r // b_dim) * c_dim * b_dim + r % b_dim
            m = -ti.math.inf
            for c in range(c_dim):
                m = ti.max(m, ti.cast(x[base + c * b_dim], ti.f32))
            s = _row_sum(x, base, b_dim, c_dim, m, SUM_TERM_EXP)
            if log != 0:
                # (x - m) - log(s), not x - (m + log(s)): m + log(s) would round at |m|'s scale.
                log_s = ti.log(s)
                for c in range(c_dim):
                    i = base + c * b_dim
                    out[i] = ti.cast((ti.cast(x[i], ti.f32) - m) - log_s, T)
            else:
                inv = 1.0 / s
                for c in range(c_dim):
                    i = base + c * b_dim
                    out[i] = ti.cast(ti.exp(ti.cast(x[i], ti.f32) - m) * inv, T)

    @ti.kernel
    def layer_norm(
        x: X,
        weight: X,
        bias: X,
        out: X,
        mean: F32,
        rstd: F32,
        rows: ti.i32,
        cols: ti.i32,
        eps: ti.f32,
        has_weight: ti.i32,
        has_bias: ti.i32,
    ):
        # One thread per row, two passes (mean, then centred variance: no E[x^2] - E[x]^2 cancellation).
        for r in range(rows):
            base = r * cols
            mu = _row_sum(x, base, 1, cols, 0.0, SUM_TERM_VALUE) / cols
            q = _row_sum(x, base, 1, cols, mu, SUM_TERM_SQUARE)
            inv = 1.0 / ti.sqrt(q / cols + eps)
            mean[r] = mu
            rstd[r] = inv
            for c in range(cols):
                v = (ti.cast(x[base + c], ti.f32) - mu) * inv
                if has_weight != 0:
                    v *= ti.cast(weight[c], ti.f32)
                if has_bias != 0:
                    v += ti.cast(bias[c], ti.f32)
                out[base + c] = ti.cast(v, T)

    @ti.kernel
    def softmax_rows(x: X, out: X, a_dim: ti.i32, c_dim: ti.i32, b_dim: ti.i32, log: ti.i32):
        # softmax for GPU archs: one block per (a, b) row; see ROW_THREADS.
        ti.loop_config(block_dim=ROW_THREADS)
        for g in range(a_dim * b_dim * ROW_THREADS):
            tid = g % ROW_THREADS
            r = g // ROW_THREADS
            base = (r // b_dim) * c_dim * b_dim + r % b_dim
            red = ti.simt.block.SharedArray((ROW_THREADS,), ti.f32)
            mine = (c_dim - tid + ROW_THREADS - 1) // ROW_THREADS  # elements tid, tid + ROW_THREADS, ...
            start = base + tid * b_dim
            stride = ROW_THREADS * b_dim
            m = -ti.math.inf
            for j in range(mine):
                m = ti.max(m, ti.cast(x[start + j * stride], ti.f32))
            m = _block_reduce(red, tid, m, True)
            s = _block_reduce(red, tid, _row_sum(x, start, stride, mine, m, SUM_TERM_EXP), False)
            if log != 0:
                log_s = ti.log(s)  # see softmax: subtract m first
                for j in range(mine):
                    i = start + j * stride
                    out[i] = ti.cast((ti.cast(x[i], ti.f32) - m) - log_s, T)
            else:
                inv = 1.0 / s
                for j in range(mine):
                    i = start + j * stride
                    out[i] = ti.cast(ti.exp(ti.cast(x[i], ti.f32) - m) * inv, T)

    @ti.kernel
    def layer_norm_rows(
        x: X,
        weight: X,
        bias: X,
        out: X,
        mean: F32,
        rstd: F32,
        rows: ti.i32,
        cols: ti.i32,
        eps: ti.f32,
        has_weight: ti.i32,
        has_bias: ti.i32,
    ):
        # layer_norm for GPU archs: one block per row; see ROW_THREADS.
        ti.loop_config(block_dim=ROW_THREADS)
        for g in range(rows * ROW_THREADS):
            tid = g % ROW_THREADS
            r = g // ROW_THREADS
            red = ti.simt.block.SharedArray((ROW_THREADS,), ti.f32)
            mine = (cols - tid + ROW_THREADS - 1) // ROW_THREADS
            start = r * cols + tid
            mu = (
                _block_reduce(red, tid, _row_sum(x, start, ROW_THREADS, mine, 0.0, SUM_TERM_VALUE), False)
                / cols
            )
            q = _block_reduce(red, tid, _row_sum(x, start, ROW_THREADS, mine, mu, SUM_TERM_SQUARE), False)
            inv = 1.0 / ti.sqrt(q / cols + eps)
            if tid == 0:
                mean[r] = mu
                rstd[r] = inv
            for j in range(mine):
                c = tid + j * ROW_THREADS
                v = (ti.cast(x[r * cols + c], ti.f32) - mu) * inv
                if has_weight != 0:
                    v *= ti.cast(weight[c], ti.f32)
                if has_bias != 0:
                    v += ti.cast(bias[c], ti.f32)
                out[r * cols + c] = ti.cast(v, T)

    return SimpleNamespace(
        gelu_erf=gelu_erf,
        gelu_tanh=gelu_tanh,
        relu=relu,
        leaky_relu=leaky_relu,
        silu=silu,
        sigmoid=sigmoid,
        tanh=tanh,
        add_relu=add_relu,
        mul_relu=mul_relu,
        affine=affine,
        dropout=dropout,
        linear_act=linear_act,
        linear_act_shared=linear_act_shared,
        softmax=softmax,
        layer_norm=layer_norm,
        softmax_rows=softmax_rows,
        layer_norm_rows=layer_norm_rows,
    )


def all_kernels() -> list[tuple[str, object]]:
    """Every (name, kernel) pair the backend may launch, in every dtype specialisation it uses."""
    pairs = []
    for dtype in _TI_DTYPES:
        for name, kernel in vars(kernels_for(dtype)).items():
            pairs.append((f"{name}_{dtype.name}", kernel))
    return pairs


# ----------------------------------------------------------------------------- test probes


@ti.kernel
def erf_probe(
    z: ti.types.ndarray(dtype=ti.f32, ndim=1), out: ti.types.ndarray(dtype=ti.f32, ndim=1), n: ti.i32
):
    """out = erf(z) through the f32 implementation the kernels use, to measure its error."""
    for i in range(n):
        out[i] = _erf(z[i])
