"""Scalar ``@ti.func`` math shared by the forward, backward and tensor-math kernels (float32).

Imported by the kernel factories once Taichi runs (never at the package's import time).
Transcendentals are built from ``ti.exp`` / ``ti.log`` / ``ti.sqrt`` only: Taichi has no
``erf``, and a driver's ``tanh`` under fast math may overflow to NaN for large arguments.
Functions that switch on an op code compare with the module constants below (one numbering for
every backend: ``taifuse.backends._spec.Activation``), plain ints that Taichi folds.
"""

# NOTE: no `from __future__ import annotations` here: Taichi reads kernel annotations as objects.

import math

from taifuse.backends._spec import Activation
from taifuse.backends.taichi._runtime import _import_taichi

ti = _import_taichi()

IDENTITY = int(Activation.IDENTITY)
RELU = int(Activation.RELU)
GELU = int(Activation.GELU)
GELU_TANH = int(Activation.GELU_TANH)
SILU = int(Activation.SILU)
SIGMOID = int(Activation.SIGMOID)
TANH = int(Activation.TANH)
LEAKY_RELU = int(Activation.LEAKY_RELU)

SQRT_HALF = 0.7071067811865476
SQRT_2_OVER_PI = 0.7978845608028654
INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)

# Row sums run in three levels of at most SUM_BLOCK terms each (a fixed-shape pairwise sum): a plain
# float32 running sum of n similar terms drifts by up to ~n/2 ulp, and Kahan's compensation would be
# optimised away under fast math.
SUM_BLOCK = 256
SUM_TERM_VALUE, SUM_TERM_EXP, SUM_TERM_SQUARE = 0, 1, 2
# Row reductions on GPU archs: one block of ROW_THREADS threads per row, each thread striding over the
# row, then a tree reduction in threadgroup memory. ti.cpu keeps one thread per row.
ROW_THREADS = 128


# ----------------------------------------------------------------------------- elementwise


@ti.func
def is_nan(v: ti.f32) -> ti.i32:
    # A bit test (exponent all ones, mantissa non-zero): fast math may fold v != v to False.
    return ti.cast((ti.bit_cast(v, ti.i32) & 0x7FFFFFFF) > 0x7F800000, ti.i32)


@ti.func
def nan_max(u: ti.f32, v: ti.f32) -> ti.f32:
    """max(u, v) that is NaN when either is, as NumPy's maximum (a GPU's max returns the number)."""
    return ti.select(is_nan(u) or is_nan(v), ti.math.nan, ti.max(u, v))


@ti.func
def nan_min(u: ti.f32, v: ti.f32) -> ti.f32:
    """min(u, v) that is NaN when either is, as NumPy's minimum."""
    return ti.select(is_nan(u) or is_nan(v), ti.math.nan, ti.min(u, v))


@ti.func
def sigmoid(v: ti.f32) -> ti.f32:
    e = ti.exp(-ti.abs(v))  # never overflows
    r = 1.0 / (1.0 + e)
    return ti.select(v >= 0.0, r, e * r)


@ti.func
def tanh(v: ti.f32) -> ti.f32:
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
def erfc_pos(z: ti.f32) -> ti.f32:
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
def erf(z: ti.f32) -> ti.f32:
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
        r = 1.0 - erfc_pos(a)
    return ti.select(z < 0.0, -r, r)


@ti.func
def normal_cdf(v: ti.f32) -> ti.f32:
    # Phi(v) through erfc of |v|: 1 + erf(v / sqrt 2) would cancel for negative v and lose the
    # relative accuracy of gelu's left tail.
    c = 0.5 * erfc_pos(ti.abs(v) * SQRT_HALF)
    return ti.select(v < 0.0, c, 1.0 - c)


@ti.func
def gelu_erf(v: ti.f32) -> ti.f32:
    return v * normal_cdf(v)


@ti.func
def gelu_tanh(v: ti.f32) -> ti.f32:
    # 0.5 * (1 + tanh(u)) == sigmoid(2u): no cancellation for negative v.
    u = SQRT_2_OVER_PI * (v + 0.044715 * v * v * v)
    return v * sigmoid(2.0 * u)


@ti.func
def relu(v: ti.f32) -> ti.f32:
    return ti.select(v < 0.0, 0.0, v)  # NaN < 0 is false: NaN propagates


@ti.func
def activate(v: ti.f32, act: ti.i32) -> ti.f32:
    """The fused linear's epilogue: IDENTITY, RELU, GELU, GELU_TANH or SILU of ``v``."""
    r = v
    if act == RELU:
        r = relu(v)
    elif act == GELU:
        r = gelu_erf(v)
    elif act == GELU_TANH:
        r = gelu_tanh(v)
    elif act == SILU:
        r = v * sigmoid(v)
    return r


@ti.func
def activation_grad(v: ti.f32, code: ti.i32, slope: ti.f32) -> ti.f32:
    """d act(x) / dx for op ``code``; ``v`` is the input x, except for SIGMOID and TANH, whose
    derivative is a function of their output y, which ``v`` is then."""
    d = 1.0
    if code == RELU:
        d = ti.select(v <= 0.0, 0.0, 1.0)  # NaN passes, as PyTorch's threshold backward
    elif code == GELU:
        d = normal_cdf(v) + v * INV_SQRT_2PI * ti.exp(-0.5 * v * v)
    elif code == GELU_TANH:
        # gelu_tanh = v * sigmoid(2u): d = s + 2 v s (1 - s) u', no cancellation for negative v.
        u = SQRT_2_OVER_PI * (v + 0.044715 * v * v * v)
        du = SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044715 * v * v)
        s = sigmoid(2.0 * u)
        d = s + 2.0 * v * s * (1.0 - s) * du
    elif code == SILU:
        s = sigmoid(v)
        d = s * (1.0 + v * (1.0 - s))
    elif code == LEAKY_RELU:
        d = ti.select(v > 0.0, 1.0, slope)
    elif code == SIGMOID:  # v is y = sigmoid(x)
        d = v * (1.0 - v)
    elif code == TANH:  # v is y = tanh(x)
        d = 1.0 - v * v
    return d


@ti.func
def hash32(v: ti.u32) -> ti.u32:
    # reference.hash32 ("lowbias32"); u32 multiplication wraps mod 2**32 as in the reference.
    v ^= ti.bit_shr(v, 16)
    v *= ti.u32(0x7FEB352D)
    v ^= ti.bit_shr(v, 15)
    v *= ti.u32(0x846CA68B)
    v ^= ti.bit_shr(v, 16)
    return v


# ----------------------------------------------------------------------------- row reductions


@ti.func
def row_sum(
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


@ti.func
def block_reduce(red: ti.template(), tid: ti.i32, v: ti.f32, is_max: ti.template()) -> ti.f32:
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


# ----------------------------------------------------------------------------- test probes


@ti.kernel
def erf_probe(
    z: ti.types.ndarray(dtype=ti.f32, ndim=1), out: ti.types.ndarray(dtype=ti.f32, ndim=1), n: ti.i32
):
    """out = erf(z) through the f32 implementation the kernels use, to measure its error."""
    for i in range(n):
        out[i] = erf(z[i])
