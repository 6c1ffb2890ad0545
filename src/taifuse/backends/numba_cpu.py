"""The Numba CPU backend: JIT-compiled, multithreaded kernels on NumPy arrays.

This module imports Numba, so it is imported only when the backend is chosen
(``taifuse.backends`` does that lazily; ``import taifuse`` never imports Numba). Kernels compile
on first use per dtype and are cached on disk (``cache=True``).

Precision: float64 uses libm (``math.exp``, ``math.erf``, ``math.tanh``). float32 uses clamped
rational and polynomial approximations that LLVM can vectorize (the PyPI llvmlite has no SVML,
so ``math.tanh`` on float32 is a scalar libm call per element); their measured error bounds sit
next to each one. float16 is storage only: loaded into float32, computed, stored back.
See the NOTE blocks below for float16 storage and for serial versus parallel kernels.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload

from taifuse.backends import reference as _reference
from taifuse.backends._host import check_dtype, empty, from_numpy, is_array, to_numpy  # noqa: F401

NAME = "numba"

# NOTE [ float16 storage ]
# Numba cannot type float16 arrays on the CPU. float16 arrays reach the kernels as their uint16
# bit view (``_bits``); ``_widen`` turns the bits into float32 with LLVM's ``fpext half`` and
# ``_narrow`` stores with ``fptrunc`` (round to nearest even, bit-identical to NumPy's
# ``astype(np.float16)``, checked by the tests). Both compile to the hardware conversions
# (F16C / AVX512-FP16 on x86-64, FCVT on arm64), so no float32 copy of an array is made, except
# in ``linear_act``, whose matrix product runs through BLAS in float32 in row chunks.

# NOTE [ Serial and parallel kernels ]
# Every kernel has a serial and a ``parallel=True`` variant over the same block function. A
# parallel launch has a fixed cost that depends on Numba's threading layer (``omp`` here;
# ``workqueue``, the layer on macOS without TBB or OpenMP, costs far more), so small inputs run
# serially; see ``_PARALLEL_MIN_ELEMENTS`` for the thresholds and how they were found.

# FMA contraction only. No "nnan"/"ninf" (NaN and inf must propagate as in the reference) and no
# "reassoc" (it would undo the Cody-Waite range reduction in _exp_neg_f32).
_FASTMATH = {"contract"}
# Row reductions (sums) additionally reassociate so that LLVM vectorizes them; the math helpers
# they call are compiled separately with _FASTMATH and keep their own flags.
_REDUCE_FASTMATH = {"contract", "reassoc"}

# error_model="numpy": the default "python" model adds a divide-by-zero check that blocks
# vectorization of every loop with a division.
_HELPER = dict(cache=True, nogil=True, error_model="numpy", fastmath=_FASTMATH)
_REDUCE_HELPER = dict(_HELPER, fastmath=_REDUCE_FASTMATH)
_SERIAL = _HELPER
_PARALLEL = dict(_HELPER, parallel=True)

_BLOCK = 16384  # elements per parallel work item of elementwise kernels
_TILE = 4096  # columns per parallel work item of row-wise kernels (affine, linear epilogue)
_STRIDED_TILE = 256  # inner (B) positions per work item of softmax over a non-last axis

# Minimum element count for a parallel launch, per threading layer, for memory-bound kernels;
# kernels that evaluate exp/tanh/erf per element go parallel at half of it (NOTE [ Serial and
# parallel kernels ]). "omp": measured crossover on a 2-core x86-64 Linux machine (relu ~64K,
# gelu_tanh ~32K elements, float32). "workqueue": derived, not measured: its ~100 us launch
# (FACTS.md) against the measured serial cost per element. "tbb": not measured, as "omp".
_PARALLEL_MIN_ELEMENTS = {"omp": 65536, "tbb": 65536, "workqueue": 1 << 20}
_TRANSCENDENTAL_DISCOUNT = 2

# NOTE [ Serial epilogue between BLAS calls ]
# Linear's epilogues (the forward's bias + activation, which with autograd also stores the
# pre-activation, and the backward's activation derivative and bias gradient) run between matrix
# products that OpenBLAS runs on threads of its own. After a Numba parallel region the OpenMP
# worker keeps spinning for milliseconds (libgomp's default spin count), so on a machine with as
# many cores as threads the next product runs with a core taken from it; OpenBLAS's workers spin
# likewise after a product. The thresholds above were measured with nothing else running and
# miss this. Measured on 2 cores, the 784-1024-1024-10 GELU training step at batch 256 (60 steps,
# median): 21.6-23.9 ms with these kernels parallel, 11.3-11.4 ms with all of them serial, and
# 21.6-23.3 ms with either the forward epilogue or the forward activation alone left parallel:
# every parallel launch between two products cost ~2 ms. With OMP_WAIT_POLICY=PASSIVE the
# parallel step took 11.6 ms too, but that environment variable would also govern PyTorch's
# OpenMP runtime in the same process (it made PyTorch's own step ~25% slower), so taifuse leaves
# the environment alone. An epilogue therefore goes parallel only when halving its own time could
# outweigh that cost: from 4M elements (a serial exact-GELU epilogue took ~0.6 ns per element
# alone, ~2 ns right after a product, with the erfc form gelu had then).
# NOTE: measured since on a shared 2-core AMD EPYC (Zen 4) with the current gelu, the serial
# epilogue costs 0.43-0.53 ns per element alone and right after a product, and there the parallel
# one lost at this threshold: x (5462, 1024) @ w (768, 1024).T + b with gelu, 4.2M elements,
# 1.24x the bare product's time parallel against 1.04x serial (median of 12 ABAB rounds), and
# linear_act_backward at (4096, 768) -> 1024, 4M elements, 1.28x the two products' time against
# 1.03x: the parallel epilogue itself ran 3-4x slower than the serial one there, beside
# OpenBLAS's spinning worker. The previous session's Intel Xeon showed the same at that size (the
# parallel backward epilogue took ~19 ms after its products against 6.8 ms serial alone), so on
# both machines seen the serial epilogue wins at 4M: the threshold moved to 32M, a size no
# benchmark has measured either way yet (the bench's linear backward case sits at 4M).
_EPILOGUE_PARALLEL_MIN = 1 << 25


def init() -> None:
    """Nothing heavy: Numba is imported with this module and kernels compile on first use."""


def describe() -> dict:
    """Numba version, threading layer and thread count."""
    return {
        "backend": NAME,
        "numba": numba.__version__,
        "numpy": np.__version__,
        "threading_layer": _threading_layer(),
        "threads": numba.get_num_threads(),
        "parallel_min_elements": _parallel_min_elements(),
    }


# ----------------------------------------------------------------------------- LLVM intrinsics


@intrinsic
def _half_to_f32(typingctx, bits):
    """float16 bits (uint16) -> float32, exact."""
    if bits != types.uint16:
        return None

    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(bits), codegen


@intrinsic
def _f32_to_half(typingctx, value):
    """float32 -> float16 bits (uint16), rounded to nearest even."""
    if value != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(value), codegen


@intrinsic
def _f32_from_bits(typingctx, bits):
    """Reinterpret the low 32 bits of an integer as a float32."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        value = args[0]
        if bits.bitwidth > 32:
            value = builder.trunc(value, ir.IntType(32))
        elif bits.bitwidth < 32:
            value = builder.zext(value, ir.IntType(32))
        return builder.bitcast(value, ir.FloatType())

    return types.float32(bits), codegen


@intrinsic
def _f32_to_bits(typingctx, value):
    """The bit pattern of a float32 as an int32."""
    if value != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.int32(value), codegen


@intrinsic
def _maxnum(typingctx, a, b):
    """IEEE maxNum: the larger of a and b, ignoring a NaN operand.

    LLVM vectorizes a ``maxnum`` reduction without fast-math flags; a compare-and-select max did
    not vectorize even with "reassoc" (measured 8x slower over an 8K row), and "nnan" would make a
    NaN input undefined. Softmax still propagates NaN: a NaN element makes its exp, and so the
    row sum, NaN.
    """
    if not (isinstance(a, types.Float) and a == b):
        return None

    def codegen(context, builder, sig, args):
        fltype = args[0].type
        fn = builder.module.declare_intrinsic(
            "llvm.maxnum", [fltype], ir.FunctionType(fltype, [fltype, fltype])
        )
        return builder.call(fn, args)

    return a(a, b), codegen


# NOTE [ 512-bit vectors ]
# LLVM's x86 tuning for AVX-512 CPUs prefers 256-bit vectors (512-bit instructions lowered the
# clock of early AVX-512 parts), and Numba offers no per-function way to ask otherwise. The
# elementwise kernels are compute-bound on their exp/erfc polynomials, not memory-bound, so the
# spans mark the function they are inlined into with "prefer-vector-width"="512", the attribute
# clang's -mprefer-vector-width=512 sets. Measured on a 2-core Sapphire Rapids VM, one thread,
# float32, 16K elements in cache, per 4M elements: gelu_tanh (the _exp_f32 form it had then)
# 4.4 ms -> 3.3 ms. With the base-2 exp (_exp2_f32) as well, same setup, old module against new
# in one process: gelu_tanh 4.7 -> 2.4-2.9 ms, gelu 8.9 -> 4.8 ms, and the linear epilogue
# (bias + gelu over rows of 1024) 10.2-10.7 -> 5.0-5.4 ms. CPUs without 512-bit registers ignore
# the attribute.
_PREFER_512 = '"prefer-vector-width"="512"'


@intrinsic
def _prefer_wide_vectors(typingctx):
    """Mark the jitted function that calls this as preferring 512-bit vectors (NOTE [ 512-bit vectors ])."""

    def codegen(context, builder, sig, args):
        # llvmlite's FunctionAttributes (a set) accepts only its known keyword attributes; a
        # string attribute added past that check is written as is into the function's
        # definition, which LLVM parses. Should a later llvmlite store attributes otherwise, the
        # kernels keep LLVM's default width (tests/test_numba_kernels.py notices).
        attributes = builder.function.attributes
        if isinstance(attributes, set):
            set.add(attributes, _PREFER_512)
        return context.get_dummy_value()

    return types.none(), codegen


# ----------------------------------------------------------------------------- loads, stores, constants


def _widen(v):
    """A stored element in its compute precision: float16 bits -> float32, others unchanged."""
    raise NotImplementedError("jitted code only")


@overload(_widen, jit_options=_HELPER)
def _widen_impl(v):
    if v == types.uint16:
        return lambda v: _half_to_f32(v)
    if isinstance(v, types.Float):
        return lambda v: v
    return None


def _narrow(v, out):
    """``v`` converted for storing into ``out`` (float16 bits for a uint16 view)."""
    raise NotImplementedError("jitted code only")


@overload(_narrow, jit_options=_HELPER)
def _narrow_impl(v, out):
    if out.dtype == types.uint16:
        return lambda v, out: _f32_to_half(np.float32(v))
    return lambda v, out: v  # setitem casts float64 -> float32 with one rounding


def _like(c, v):
    """The constant ``c`` in the precision of ``v`` (a float literal alone would promote to float64)."""
    raise NotImplementedError("jitted code only")


@overload(_like, jit_options=_HELPER)
def _like_impl(c, v):
    if v == types.float32:
        return lambda c, v: np.float32(c)
    return lambda c, v: np.float64(c)


def _by_precision(f32_impl, f64_impl):
    """A jitted scalar function running ``f32_impl`` on float32 and ``f64_impl`` on float64."""

    def scalar(v):
        raise NotImplementedError("jitted code only")

    @overload(scalar, jit_options=_HELPER)
    def _choose(v):
        if v == types.float32:
            return lambda v: f32_impl(v)
        if v == types.float64:
            return lambda v: f64_impl(v)
        return None

    return scalar


# ----------------------------------------------------------------------------- float32 math
# NOTE [ float32 error bounds ]
# Measured on x86-64 with FMA contraction, over every 64th float32 bit pattern with |x| <= 1e4
# (both signs; +-0, +-inf, NaN checked separately), against float64 truths (libm; for gelu
# x * erfc(-x / sqrt 2) / 2 and x / (1 + exp(-2u)), which keep relative accuracy in the tails).
# "mixed" = |err| / max(1, |y|); relative error where |y| > 1e-30 (and x > -87 for sigmoid/silu).
#   tanh       abs 2.7e-7  mixed 2.7e-7  rel 2.9e-7
#   sigmoid    abs 8.9e-8  mixed 8.9e-8  rel 1.4e-7
#   silu       abs 1.3e-6 (at x = 13.8, 1.3 ulp of y)  mixed 1.2e-7  rel 1.7e-7
#   gelu       abs 3.8e-7  mixed 1.5e-7  rel 7.6e-6 (deep tail, |y| ~ 1e-30)
#   gelu_tanh  abs 5.2e-7  mixed 1.3e-7  rel 9.0e-6 (deep tail, as gelu)
#   gelu'      abs 3.5e-7  (_numba_backward's _gelu_grad_f32; relative error as gelu's, except
#              near its zero at x = -0.75)
# gelu and gelu_tanh as they are now, through _exp2_f32: measured over every 64th bit pattern
# plus 2M (gelu: 4M, on [-14, 14]) points on [-12, 12]. Their relative error grows with x*x in
# the negative tail (the rounding of the exponent, ~x*x/2 in magnitude): gelu 6.5e-7 for x >= 0,
# 7.8e-7 on [-3, 0), 2.1e-6 on [-6, -3), 3.8e-6 on [-9, -6), 7.6e-6 on [-12, -9); gelu' 6.9e-7,
# -, 2.0e-6, 3.8e-6, 7.5e-6 on the same ranges.
# tests/test_numba_kernels.py asserts mixed <= 1e-6 and relative bounds over a sparser sweep.

_TANH_CLAMP = np.float32(7.99881172180175781)  # smallest x where the rational reaches 1.0 (with FMA)
_TANH_TINY = np.float32(0.0004)  # below this tanh(x) == x in float32
_TANH_A1 = np.float32(4.89352455891786e-03)
_TANH_A3 = np.float32(6.37261928875436e-04)
_TANH_A5 = np.float32(1.48572235717979e-05)
_TANH_A7 = np.float32(5.12229709037114e-08)
_TANH_A9 = np.float32(-8.60467152213735e-11)
_TANH_A11 = np.float32(2.00018790482477e-13)
_TANH_A13 = np.float32(-2.76076847742355e-16)
_TANH_B0 = np.float32(4.89352518554385e-03)
_TANH_B2 = np.float32(2.26843463243900e-03)
_TANH_B4 = np.float32(1.18534705686654e-04)
_TANH_B6 = np.float32(1.19825839466702e-06)

_F32_ONE = np.float32(1.0)
_F32_HALF = np.float32(0.5)


@njit(**_HELPER)
def _clamp(v, lo, hi):
    """lo <= v <= hi, with NaN passed through (both compares are false for NaN)."""
    # NOTE: not min/max: these ternaries pass NaN through, and linters' "simplify to min/max"
    # fixes change that. Keep the comparisons as written (noqa below).
    v = hi if v > hi else v  # noqa: FURB136
    return lo if v < lo else v  # noqa: FURB136


@njit(**_HELPER)
def _tanh_rational_f32(v):
    # Eigen's generic_fast_tanh_float: a 13/6-degree rational on [-c, c] (c from Eigen's FMA build).
    x = _clamp(v, -_TANH_CLAMP, _TANH_CLAMP)
    x2 = x * x
    p = x2 * _TANH_A13 + _TANH_A11
    p = x2 * p + _TANH_A9
    p = x2 * p + _TANH_A7
    p = x2 * p + _TANH_A5
    p = x2 * p + _TANH_A3
    p = x2 * p + _TANH_A1
    p = x * p
    q = x2 * _TANH_B6 + _TANH_B4
    q = x2 * q + _TANH_B2
    q = x2 * q + _TANH_B0
    return p / q


@njit(**_HELPER)
def _tanh_f32(v):
    # The rational, held to [-1, 1], and tanh(x) = x near 0 for full relative accuracy there.
    # tanh(+-inf) = +-1, NaN -> NaN. Errors: NOTE [ float32 error bounds ].
    t = _clamp(_tanh_rational_f32(v), -_F32_ONE, _F32_ONE)
    return v if abs(v) < _TANH_TINY else t


_EXP_LO = np.float32(-87.0)  # exp(-87) = 1.6e-38 is still a normal float32; below, 0 is returned
_LOG2E = np.float32(1.44269504088896341)
_LN2_HI = np.float32(0.693359375)  # Cody-Waite split of ln 2: the high part is exact in 9 bits
_LN2_LO = np.float32(-2.12194440e-4)
_EXP_P0 = np.float32(1.9875691500e-4)
_EXP_P1 = np.float32(1.3981999507e-3)
_EXP_P2 = np.float32(8.3334519073e-3)
_EXP_P3 = np.float32(4.1665795894e-2)
_EXP_P4 = np.float32(1.6666665459e-1)
_EXP_P5 = np.float32(5.0000001201e-1)


@njit(**_HELPER)
def _exp_neg_f32(v):
    # exp(v) for v <= 0 (the softmax and sigmoid arguments): Cephes' expf polynomial after
    # Cody-Waite range reduction, 2**n built from its bit pattern. Values below -87 (true result
    # < 1.6e-38) return 0; NaN -> NaN; exp(-inf) = 0.
    # Measured over every 7th float32 bit pattern in [-87, 0]: max rel error 8.5e-8.
    vc = v if v > _EXP_LO else _EXP_LO  # noqa: FURB136  NaN -> _EXP_LO: the integer part must not be NaN
    n = np.floor(vc * _LOG2E + _F32_HALF)
    r = v - n * _LN2_HI
    r = r - n * _LN2_LO
    p = _EXP_P0 * r + _EXP_P1
    p = p * r + _EXP_P2
    p = p * r + _EXP_P3
    p = p * r + _EXP_P4
    p = p * r + _EXP_P5
    y = p * r * r + r + _F32_ONE
    scale = _f32_from_bits((np.int32(n) + 127) << 23)
    return np.float32(0.0) if v < _EXP_LO else y * scale


_EXP_HI = np.float32(89.0)  # 2**128: the bit pattern of +inf, so exp overflows to inf from here


@njit(**_HELPER)
def _exp_f32(v):
    # exp(v) over the whole line, for 1 / (1 + exp(-v)) forms: the same polynomial as
    # _exp_neg_f32, with v held to [-87, 89]. exp(v) for v < -87 returns exp(-87) = 1.6e-38
    # (harmless next to 1), and for v >= 88.8 returns +inf, as the true value overflows.
    x = _clamp(v, _EXP_LO, _EXP_HI)
    xn = x if x > _EXP_LO else _EXP_LO  # noqa: FURB136  NaN -> _EXP_LO: the integer part must not be NaN
    n = np.floor(xn * _LOG2E + _F32_HALF)
    r = x - n * _LN2_HI
    r = r - n * _LN2_LO
    p = _EXP_P0 * r + _EXP_P1
    p = p * r + _EXP_P2
    p = p * r + _EXP_P3
    p = p * r + _EXP_P4
    p = p * r + _EXP_P5
    y = p * r * r + r + _F32_ONE
    return y * _f32_from_bits((np.int32(n) + 127) << 23)


@njit(**_HELPER)
def _exp_neg_f64(v):
    return math.exp(v)


_exp_neg = _by_precision(_exp_neg_f32, _exp_neg_f64)


# ----------------------------------------------------------------------------- activations
# Each has a float32 and a float64 form; _by_precision picks one while compiling.

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT2 = 1.0 / math.sqrt(2.0)
_GELU_CUBIC = 0.044715


# 2**f on [-1/2, 1/2]: a degree-5 polynomial fitted for relative error (iteratively reweighted
# least squares). Evaluated in float32 with FMA, max rel error 1.7e-7 on that interval.
_EXP2_C = (
    np.float32(1.0),
    np.float32(0.6931470036506653),
    np.float32(0.24022242426872253),
    np.float32(0.05550733581185341),
    np.float32(0.009671494364738464),
    np.float32(0.001326467376202345),
)
# w + _EXP2_ROUND rounds w to an integer n (|w| < 2**22) and holds n + 127 in its low mantissa
# bits, so (bits << 23) is 2**n: no float-to-int conversion, which a NaN w would make undefined.
_EXP2_ROUND = np.float32(1.5 * 2**23 + 127)
_EXP2_LO = np.float32(-127.0)  # 2**-127 is built as +0.0 (exponent field 0)
_EXP2_HI = np.float32(128.0)  # 2**128 is built as +inf (exponent field 255)


@njit(**_HELPER)
def _exp2_f32(w):
    # 2**w for -127 <= w <= 128 (callers clamp); 2**-127 comes out as 0 and 2**128 as inf.
    m = w + _EXP2_ROUND
    f = w - (m - _EXP2_ROUND)  # both subtractions are exact: f = w - round(w) in [-1/2, 1/2]
    p = _EXP2_C[5] * f + _EXP2_C[4]
    p = p * f + _EXP2_C[3]
    p = p * f + _EXP2_C[2]
    p = p * f + _EXP2_C[1]
    p = p * f + _EXP2_C[0]
    return p * _f32_from_bits(_f32_to_bits(m) << 23)


# NOTE [ Exact GELU in float32 ]
# gelu(v) = v * Phi(v), with the standard normal CDF taken from its small side: Phi(v) = q for
# v < 0 and 1 - q otherwise, q = Phi(-a), a = |v|. Going through q (not 1 + erf) keeps gelu's
# negative tail accurate in relative terms: 1 + erf(x) cancels in float32 below x = -3. q is
#     q = t * S(t) * exp(-a*a/2),  t = 1 / (4.2 + a),
# exp(-a*a/2) carrying the tail's decay and t * S(t) = q * exp(a*a/2) the slowly varying rest
# (~ 1 / (a sqrt(2 pi)) for large a): one division, a degree-7 polynomial and one _exp2_f32.
# S was fitted for the relative error of q on a in [0, 13.5] (beyond, q is 0 in float32: see
# _gauss_f32) by least squares iterated to minimax, with float32 coefficients rounded one at a
# time and the rest refitted: max relative error 1.9e-7 in float64 arithmetic; 4.2 the best
# shift of those tried for degree 7. gelu' (_numba_backward) shares exp(-a*a/2) with phi(v).
# Speed (16K float32 in cache, one thread of a shared 2-core AMD EPYC (Zen 4), fastest tenth of
# 40 interleaved rounds, ns per element): Numerical Recipes' erfcc as used before (t = 1 / (1 +
# z/2), erfc = t * exp(P(t) - z*z) with P of degree 9) 0.56; the same form with t = 1 / (3 + a)
# and degree 7, 0.46; this one 0.40. It has one multiply more than the second, but its two
# chains (t, S and exp) are independent: the others put the polynomial in the exponent, so
# each element's exp waited for its division and polynomial, and the loop ran at the latency of
# that chain rather than at the core's multiply-add throughput.
_GELU_T_SHIFT = np.float32(4.199999809265137)
_GELU_S = (
    np.float32(0.3989841043949127),
    np.float32(1.6694304943084717),
    np.float32(6.934093475341797),
    np.float32(17.46992301940918),
    np.float32(178.42556762695312),
    np.float32(-503.0119934082031),
    np.float32(3984.1884765625),
    np.float32(-5526.48095703125),
)
_F32_MINUS_HALF_LOG2E = np.float32(-math.log2(math.e) / 2)


@njit(**_HELPER)
def _tail_ratio_f32(v):
    # Phi(-|v|) * exp(v*v/2) = t * S(t) (NOTE [ Exact GELU in float32 ]); NaN -> NaN, +-inf -> 0.
    t = _F32_ONE / (_GELU_T_SHIFT + abs(v))
    s = _GELU_S[7]
    s = s * t + _GELU_S[6]
    s = s * t + _GELU_S[5]
    s = s * t + _GELU_S[4]
    s = s * t + _GELU_S[3]
    s = s * t + _GELU_S[2]
    s = s * t + _GELU_S[1]
    s = s * t + _GELU_S[0]
    return t * s


@njit(**_HELPER)
def _gauss_f32(v):
    # exp(-v*v/2); 0 from |v| = 13.2 (2**-127 and below), and for NaN (the callers' NaN comes
    # through _tail_ratio_f32 or v itself).
    w = (v * v) * _F32_MINUS_HALF_LOG2E
    w = w if w > _EXP2_LO else _EXP2_LO  # noqa: FURB136  NaN -> _EXP2_LO
    return _exp2_f32(w)


@njit(**_HELPER)
def _gelu_f32(v):
    # v * Phi(v), Phi taken from the small side. gelu(+inf) = inf * 1; gelu(-inf) = -inf * 0 = NaN,
    # as torch and the reference.
    q = _tail_ratio_f32(v) * _gauss_f32(v)
    return v * (q if v < 0 else _F32_ONE - q)


@njit(**_HELPER)
def _gelu_f64(v):
    return 0.5 * v * (1.0 + math.erf(v * _INV_SQRT2))


# gelu_tanh's exponent in base 2: -2u * log2(e) = v * (_GT_A + _GT_B * v * v).
_GT_A = np.float32(-2.0 * _SQRT_2_OVER_PI * math.log2(math.e))
_GT_B = np.float32(-2.0 * _SQRT_2_OVER_PI * math.log2(math.e) * _GELU_CUBIC)


@njit(**_HELPER)
def _gelu_tanh_f32(v):
    # 0.5 * v * (1 + tanh(u)) == v / (1 + exp(-2u)): no cancellation in the negative tail, where
    # 1 + tanh(u) loses all float32 digits below v = -4.9. exp(-2u) is 2**w with the constants
    # folded into w: 16 vector instructions and a division per 16 elements, against 25 and a
    # division per 8 through _exp_f32 (256-bit vectors). v -> +inf: w = -inf -> 2**-127 = 0 and
    # gelu = v; large negative v: w -> 2**128 = inf and gelu = v / inf = -0; gelu(-inf) =
    # -inf / inf = NaN, as torch. Errors: NOTE [ float32 error bounds ].
    w = _clamp(v * (_GT_A + _GT_B * (v * v)), _EXP2_LO, _EXP2_HI)
    return v / (_F32_ONE + _exp2_f32(w))


@njit(**_HELPER)
def _gelu_tanh_f64(v):
    return 0.5 * v * (1.0 + math.tanh(_SQRT_2_OVER_PI * (v + _GELU_CUBIC * v * v * v)))


@njit(**_HELPER)
def _sigmoid_f32(v):
    # exp(-v) overflows to inf for v < -88.7, and 1 / inf = 0: sigmoid(-inf) = 0, (+inf) = 1.
    return _F32_ONE / (_F32_ONE + _exp_f32(-v))


@njit(**_HELPER)
def _sigmoid_f64(v):
    e = math.exp(-abs(v))
    r = 1.0 / (1.0 + e)
    return r if v >= 0 else e * r


@njit(**_HELPER)
def _silu_f32(v):
    # v / (1 + exp(-v)): silu(-inf) = -inf / inf = NaN, as torch and the reference.
    return v / (_F32_ONE + _exp_f32(-v))


@njit(**_HELPER)
def _silu_f64(v):
    return v * _sigmoid_f64(v)


@njit(**_HELPER)
def _tanh_f64(v):
    return math.tanh(v)


_tanh = _by_precision(_tanh_f32, _tanh_f64)
_gelu = _by_precision(_gelu_f32, _gelu_f64)
_gelu_tanh = _by_precision(_gelu_tanh_f32, _gelu_tanh_f64)
_sigmoid = _by_precision(_sigmoid_f32, _sigmoid_f64)
_silu = _by_precision(_silu_f32, _silu_f64)


@njit(**_HELPER)
def _relu(v):
    # NaN propagates; relu(-0.0) is +0.0, as np.maximum(-0.0, 0.0) in the reference.
    return _like(0.0, v) if v <= 0 else v


# ----------------------------------------------------------------------------- elementwise kernels

# NOTE [ Spans, blocks and in-place kernels ]
# A "span" is the loop over one contiguous 1-D piece (a slice of the flat array, or a row segment),
# indexed from 0: with an unknown start index Numba's negative-index wraparound hides the address
# from LLVM, and an in-place loop (out is x) then does not vectorize. Spans are inlined by Numba
# (inline="always") into small "block" functions; the *_inplace blocks pass one slice as both x
# and out, so LLVM sees a single pointer. Passing the same array as two arguments instead
# vectorizes but fails LLVM's runtime overlap check and runs the scalar loop (about 10x slower,
# measured on the linear epilogue). Serial kernels call a block once; parallel kernels call it per
# work item from a prange loop.
_SPAN = dict(_HELPER, inline="always")

# Op codes shared by the elementwise span and the linear epilogue.
_IDENTITY, _RELU, _GELU, _GELU_TANH, _SILU, _SIGMOID, _TANH, _LEAKY_RELU = range(8)
_ACTIVATION_CODES = {None: _IDENTITY, "relu": _RELU, "gelu": _GELU, "gelu_tanh": _GELU_TANH, "silu": _SILU}
_TRANSCENDENTAL_OPS = frozenset((_GELU, _GELU_TANH, _SILU, _SIGMOID, _TANH))


@njit(**_SPAN)
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


@njit(**_HELPER)
def _unary_block(x, out, op, param, lo, hi):
    _unary_span(x[lo:hi], out[lo:hi], op, param)


@njit(**_HELPER)
def _unary_inplace_block(x, op, param, lo, hi):
    part = x[lo:hi]
    _unary_span(part, part, op, param)


@njit(**_SERIAL)
def _unary_serial(x, out, op, param):
    _unary_block(x, out, op, param, 0, x.size)


@njit(**_PARALLEL)
def _unary_parallel(x, out, op, param):
    n = x.size
    for block in prange((n + _BLOCK - 1) // _BLOCK):
        lo = block * _BLOCK
        _unary_block(x, out, op, param, lo, min(lo + _BLOCK, n))


@njit(**_SERIAL)
def _unary_inplace_serial(x, op, param):
    _unary_inplace_block(x, op, param, 0, x.size)


@njit(**_PARALLEL)
def _unary_inplace_parallel(x, op, param):
    n = x.size
    for block in prange((n + _BLOCK - 1) // _BLOCK):
        lo = block * _BLOCK
        _unary_inplace_block(x, op, param, lo, min(lo + _BLOCK, n))


_ADD_RELU, _MUL_RELU = range(2)


@njit(**_SPAN)
def _binary_span(a, b, out, op):
    _prefer_wide_vectors()
    if op == _ADD_RELU:
        for i in range(a.size):
            out[i] = _narrow(_relu(_widen(a[i]) + _widen(b[i])), out)
    else:
        for i in range(a.size):
            out[i] = _narrow(_relu(_widen(a[i]) * _widen(b[i])), out)


@njit(**_HELPER)
def _binary_block(a, b, out, op, lo, hi):
    _binary_span(a[lo:hi], b[lo:hi], out[lo:hi], op)


@njit(**_SERIAL)
def _binary_serial(a, b, out, op):
    _binary_block(a, b, out, op, 0, a.size)


@njit(**_PARALLEL)
def _binary_parallel(a, b, out, op):
    n = a.size
    for block in prange((n + _BLOCK - 1) // _BLOCK):
        lo = block * _BLOCK
        _binary_block(a, b, out, op, lo, min(lo + _BLOCK, n))


@njit(**_HELPER)
def _hash32(v):
    # reference.hash32 ("lowbias32") in uint32 wraparound arithmetic. Numba widens uint32
    # products to uint64, so every step truncates back to uint32.
    v = np.uint32(v)
    v = np.uint32(v ^ (v >> np.uint32(16)))
    v = np.uint32(v * np.uint32(0x7FEB352D))
    v = np.uint32(v ^ (v >> np.uint32(15)))
    v = np.uint32(v * np.uint32(0x846CA68B))
    return np.uint32(v ^ (v >> np.uint32(16)))


@njit(**_HELPER)
def _dropout_block(x, out, key, threshold, scale, lo, hi):
    # Element lo + i hashes its global index (mod 2**32, as the reference's uint32 arange).
    # x * scale is formed in float64 and rounded once, exactly as the reference does.
    xs, outs = x[lo:hi], out[lo:hi]
    for i in range(xs.size):
        h = _hash32(np.uint32((lo + i) & 0xFFFFFFFF) ^ key)
        keep = np.uint32(h >> np.uint32(8)) >= threshold
        outs[i] = _narrow(np.float64(_widen(xs[i])) * (scale if keep else 0.0), outs)


@njit(**_SERIAL)
def _dropout_serial(x, out, key, threshold, scale):
    _dropout_block(x, out, key, threshold, scale, 0, x.size)


@njit(**_PARALLEL)
def _dropout_parallel(x, out, key, threshold, scale):
    n = x.size
    for block in prange((n + _BLOCK - 1) // _BLOCK):
        lo = block * _BLOCK
        _dropout_block(x, out, key, threshold, scale, lo, min(lo + _BLOCK, n))


# ----------------------------------------------------------------------------- row-wise elementwise
# Work items are (row, column tile) pairs, so that a few long rows still split across threads.


@njit(**_HELPER)
def _affine_rows(x, scale, bias, out, r0, r1, lo, hi):
    s, b = scale[lo:hi], bias[lo:hi]
    for r in range(r0, r1):
        xs, outs = x[r, lo:hi], out[r, lo:hi]
        for c in range(xs.size):
            outs[c] = _narrow(_widen(xs[c]) * _widen(s[c]) + _widen(b[c]), outs)


@njit(**_SERIAL)
def _affine_serial(x, scale, bias, out):
    _affine_rows(x, scale, bias, out, 0, x.shape[0], 0, x.shape[1])


@njit(**_PARALLEL)
def _affine_parallel(x, scale, bias, out):
    rows, cols = x.shape
    tiles = (cols + _TILE - 1) // _TILE
    for t in prange(rows * tiles):
        r = t // tiles
        lo = (t % tiles) * _TILE
        _affine_rows(x, scale, bias, out, r, r + 1, lo, min(lo + _TILE, cols))


@njit(**_SPAN)
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


@njit(**_SPAN)
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


@njit(**_HELPER)
def _bias_act_keep_rows(pre, b, op, out, r0, r1, lo, hi):
    bs = None if b is None else b[lo:hi]
    for r in range(r0, r1):
        _bias_act_keep_span(pre[r, lo:hi], bs, op, out[r, lo:hi])


@njit(**_SERIAL)
def _bias_act_keep_serial(pre, b, op, out):
    _bias_act_keep_rows(pre, b, op, out, 0, pre.shape[0], 0, pre.shape[1])


@njit(**_PARALLEL)
def _bias_act_keep_parallel(pre, b, op, out):
    rows, cols = pre.shape
    tiles = (cols + _TILE - 1) // _TILE
    for t in prange(rows * tiles):
        r = t // tiles
        lo = (t % tiles) * _TILE
        _bias_act_keep_rows(pre, b, op, out, r, r + 1, lo, min(lo + _TILE, cols))


@njit(**_HELPER)
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


@njit(**_HELPER)
def _bias_act_inplace_rows(y, b, op, r0, r1, lo, hi):
    bs = None if b is None else b[lo:hi]
    for r in range(r0, r1):
        row = y[r, lo:hi]
        _bias_act_span(row, bs, op, row)


@njit(**_SERIAL)
def _bias_act_serial(y, b, op, pre, out):
    _bias_act_rows(y, b, op, pre, out, 0, y.shape[0], 0, y.shape[1])


@njit(**_PARALLEL)
def _bias_act_parallel(y, b, op, pre, out):
    rows, cols = y.shape
    tiles = (cols + _TILE - 1) // _TILE
    for t in prange(rows * tiles):
        r = t // tiles
        lo = (t % tiles) * _TILE
        _bias_act_rows(y, b, op, pre, out, r, r + 1, lo, min(lo + _TILE, cols))


@njit(**_SERIAL)
def _bias_act_inplace_serial(y, b, op):
    _bias_act_inplace_rows(y, b, op, 0, y.shape[0], 0, y.shape[1])


@njit(**_PARALLEL)
def _bias_act_inplace_parallel(y, b, op):
    rows, cols = y.shape
    tiles = (cols + _TILE - 1) // _TILE
    for t in prange(rows * tiles):
        r = t // tiles
        lo = (t % tiles) * _TILE
        _bias_act_inplace_rows(y, b, op, r, r + 1, lo, min(lo + _TILE, cols))


# ----------------------------------------------------------------------------- softmax


@njit(**_REDUCE_HELPER)
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


@njit(**_HELPER)
def _softmax_rows(x, out, r0, r1, log):
    for r in range(r0, r1):
        _softmax_row(x[r], out[r], log)


@njit(**_SERIAL)
def _softmax_rows_serial(x, out, log):
    _softmax_rows(x, out, 0, x.shape[0], log)


@njit(**_PARALLEL)
def _softmax_rows_parallel(x, out, log):
    for r in prange(x.shape[0]):
        _softmax_rows(x, out, r, r + 1, log)


@njit(**_HELPER)
def _softmax_strided_tile(x, out, a, lo, hi, log):
    # Reduce over axis 1 of x (A, C, B) for positions lo <= b < hi: the inner loops run along
    # the contiguous B axis and vectorize; m and s hold one running value per b (float64).
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


@njit(**_SERIAL)
def _softmax_strided_serial(x, out, log):
    for a in range(x.shape[0]):
        _softmax_strided_tile(x, out, a, 0, x.shape[2], log)


@njit(**_PARALLEL)
def _softmax_strided_parallel(x, out, log):
    inner = x.shape[2]
    tiles = (inner + _STRIDED_TILE - 1) // _STRIDED_TILE
    for t in prange(x.shape[0] * tiles):
        a = t // tiles
        lo = (t % tiles) * _STRIDED_TILE
        _softmax_strided_tile(x, out, a, lo, min(lo + _STRIDED_TILE, inner), log)


# ----------------------------------------------------------------------------- layer norm


@njit(**_REDUCE_HELPER)
def _layer_norm_row(x, weight, bias, eps, out):
    # Two passes over the row in cache, accumulated in float64 (mean, then the centred sum of
    # squares: no cancellation as in E[x^2] - E[x]^2), then one write pass in compute precision.
    # Returns (mean, rstd).
    n = x.size
    s = 0.0
    for c in range(n):
        s += _widen(x[c])
    mu = s / n
    ss = 0.0
    for c in range(n):
        d = _widen(x[c]) - mu
        ss += d * d
    rs = 1.0 / math.sqrt(ss / n + eps)
    v0 = _widen(x[0])
    mu_c = _like(mu, v0)
    rs_c = _like(rs, v0)
    # NOTE: plain `is None` tests (not `and`-ed) so that Numba prunes the branches per signature.
    if weight is None:
        if bias is None:
            for c in range(n):
                out[c] = _narrow((_widen(x[c]) - mu_c) * rs_c, out)
        else:
            for c in range(n):
                out[c] = _narrow((_widen(x[c]) - mu_c) * rs_c + _widen(bias[c]), out)
    else:
        if bias is None:
            for c in range(n):
                out[c] = _narrow((_widen(x[c]) - mu_c) * rs_c * _widen(weight[c]), out)
        else:
            for c in range(n):
                out[c] = _narrow((_widen(x[c]) - mu_c) * rs_c * _widen(weight[c]) + _widen(bias[c]), out)
    return mu, rs


@njit(**_HELPER)
def _layer_norm_rows(x, weight, bias, eps, out, mean, rstd, r0, r1):
    for r in range(r0, r1):
        mean[r], rstd[r] = _layer_norm_row(x[r], weight, bias, eps, out[r])


@njit(**_SERIAL)
def _layer_norm_serial(x, weight, bias, eps, out, mean, rstd):
    _layer_norm_rows(x, weight, bias, eps, out, mean, rstd, 0, x.shape[0])


@njit(**_PARALLEL)
def _layer_norm_parallel(x, weight, bias, eps, out, mean, rstd):
    for r in prange(x.shape[0]):
        _layer_norm_rows(x, weight, bias, eps, out, mean, rstd, r, r + 1)


# ----------------------------------------------------------------------------- threading


@njit(**_PARALLEL)
def _touch_threads(out):
    for i in prange(out.size):
        out[i] = i


_layer_cache: str | None = None


def _threading_layer() -> str:
    """The threading layer Numba runs parallel kernels on (starts it with a tiny launch if needed)."""
    global _layer_cache
    if _layer_cache is None:
        try:
            _layer_cache = numba.threading_layer()
        except ValueError:  # no parallel kernel has run yet in this process
            _touch_threads(np.empty(numba.get_num_threads(), np.float64))
            _layer_cache = numba.threading_layer()
    return _layer_cache


def _parallel_min_elements() -> int:
    """Inputs with fewer elements run the serial kernels; with one thread everything does."""
    if numba.get_num_threads() < 2:
        return np.iinfo(np.int64).max
    return _PARALLEL_MIN_ELEMENTS.get(_threading_layer(), max(_PARALLEL_MIN_ELEMENTS.values()))


def _parallel(size: int, transcendental: bool = False) -> bool:
    work = size * _TRANSCENDENTAL_DISCOUNT if transcendental else size
    return work >= _parallel_min_elements()


# ----------------------------------------------------------------------------- host side


def _epilogue_parallel(size: int, transcendental: bool = False) -> bool:
    """Whether a linear epilogue of ``size`` elements runs parallel (NOTE [ Serial epilogue between BLAS calls ])."""
    return size >= _EPILOGUE_PARALLEL_MIN and _parallel(size, transcendental)


def _bits(a: np.ndarray) -> np.ndarray:
    """The array as the kernels take it: float16 as its uint16 bit view (NOTE [ float16 storage ])."""
    return a.view(np.uint16) if a.dtype == np.float16 else a


def _flat(a: np.ndarray) -> np.ndarray:
    return _bits(a.reshape(-1))


def _same_data(a: np.ndarray, out: np.ndarray) -> bool:
    return a.__array_interface__["data"][0] == out.__array_interface__["data"][0] and a.shape == out.shape


def _readable(a: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``a``, or a copy of it if writing ``out`` would overwrite elements not yet read.

    Kernels read and write element i (or row r) together, so ``out`` may be ``a`` itself; only a
    partial overlap (``out`` a shifted view of ``a``) needs the copy.
    """
    if np.may_share_memory(a, out) and not _same_data(a, out):
        return a.copy()
    return a


def _unary(x: np.ndarray, out: np.ndarray, op: int, param: float = 0.0) -> None:
    xf, of = _flat(_readable(x, out)), _flat(out)
    par = _parallel(xf.size, transcendental=op in _TRANSCENDENTAL_OPS)
    if np.may_share_memory(xf, of):  # then out is x (see _readable): NOTE [ Spans, blocks and ... ]
        (_unary_inplace_parallel if par else _unary_inplace_serial)(of, op, float(param))
        return
    kernel = _unary_parallel if par else _unary_serial
    kernel(xf, of, op, float(param))


def gelu(x: np.ndarray, out: np.ndarray, approximate: str) -> None:
    """out = gelu(x) (``'none'``: erf form; ``'tanh'``: tanh form), as ``reference.gelu``."""
    _unary(x, out, _GELU_TANH if approximate == "tanh" else _GELU)


def relu(x: np.ndarray, out: np.ndarray) -> None:
    """out = max(x, 0); NaN propagates."""
    _unary(x, out, _RELU)


def leaky_relu(x: np.ndarray, out: np.ndarray, negative_slope: float) -> None:
    """out = x if x > 0 else negative_slope * x."""
    _unary(x, out, _LEAKY_RELU, negative_slope)


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
    kernel = _binary_parallel if _parallel(af.size) else _binary_serial
    kernel(af, bf, of, op)


def add_relu(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """out = max(a + b, 0)."""
    _binary(a, b, out, _ADD_RELU)


def mul_relu(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """out = max(a * b, 0)."""
    _binary(a, b, out, _MUL_RELU)


def affine(x: np.ndarray, scale: np.ndarray, bias: np.ndarray, out: np.ndarray) -> None:
    """out[r, c] = x[r, c] * scale[c] + bias[c] for ``x (R, C)``."""
    kernel = _affine_parallel if _parallel(x.size) else _affine_serial
    x, scale, bias = (_readable(a, out) for a in (x, scale, bias))
    kernel(_bits(x), _bits(scale), _bits(bias), _bits(out))


# float16 linear: rows of x per float32 chunk (NOTE [ float16 storage ]). About this many bytes
# of float32 scratch for the x and result chunks together.
_F16_LINEAR_CHUNK_BYTES = 4 * 1024 * 1024


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
    inputs are multiplied in float32: ``w`` is converted once and ``x`` in row chunks through a
    fixed float32 scratch, and each chunk's epilogue stores straight into the float16 outputs.
    """
    op = _ACTIVATION_CODES[activation]
    # The epilogue reads b for every row after the product wrote out, and the float16 path reads
    # x in row chunks between writes (np.matmul alone is overlap-safe; a float16 w is converted
    # before any write).
    x = _readable(x, out)
    bb = None if b is None else _bits(_readable(b, out))
    transcendental = op in _TRANSCENDENTAL_OPS
    if x.dtype != np.float16:
        if pre is None:
            np.matmul(x, w.T, out=out)
            if b is not None or op != _IDENTITY:
                par = _epilogue_parallel(out.size, transcendental)
                (_bias_act_inplace_parallel if par else _bias_act_inplace_serial)(out, bb, op)
        else:
            np.matmul(x, w.T, out=pre)
            par = _epilogue_parallel(out.size, transcendental)
            (_bias_act_keep_parallel if par else _bias_act_keep_serial)(pre, bb, op, out)
        return
    rows, k = x.shape
    m = w.shape[0]
    w32 = w.astype(np.float32)
    chunk = max(1, min(rows, _F16_LINEAR_CHUNK_BYTES // (4 * (k + m))))
    x32 = np.empty((chunk, k), np.float32)
    y32 = np.empty((chunk, m), np.float32)
    out_bits = _bits(out)
    pre_bits = None if pre is None else _bits(pre)
    for lo in range(0, rows, chunk):
        hi = min(lo + chunk, rows)
        n = hi - lo
        np.copyto(x32[:n], x[lo:hi])
        np.matmul(x32[:n], w32.T, out=y32[:n])
        par = _epilogue_parallel(n * m, transcendental)
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
    par = _parallel(x.size, transcendental=True)
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
    kernel = _layer_norm_parallel if _parallel(x.size) and x.shape[0] > 1 else _layer_norm_serial
    # Every row reads weight and bias, so one that out overlaps is read from a copy.
    wb = None if weight is None else _bits(_readable(weight, out))
    bb = None if bias is None else _bits(_readable(bias, out))
    kernel(_bits(x), wb, bb, float(eps), _bits(out), mean, rstd)


def dropout(x: np.ndarray, out: np.ndarray, p: float, seed: int) -> None:
    """out = x * (keep / (1 - p)) with the counter-hash mask of ``reference.dropout`` (bit-identical)."""
    key = np.uint32(_reference.dropout_key(seed))
    threshold = np.uint32(_reference.dropout_threshold(p))
    scale = float(_reference.dropout_scale(p))
    xf, of = _flat(_readable(x, out)), _flat(out)
    kernel = _dropout_parallel if _parallel(xf.size) else _dropout_serial
    kernel(xf, of, key, threshold, scale)


# ----------------------------------------------------------------------------- backward and loss kernels
# They live in _numba_backward.py (which uses the helpers above) and are re-exported here so that
# the backend's kernel table is this one module. Imported last: see NOTE [ Import order ] there.

from taifuse.backends._numba_backward import (  # noqa: E402, F401 (re-exported kernel table)
    add_relu_backward,
    affine_backward,
    cross_entropy,
    cross_entropy_backward,
    dropout_backward,
    gelu_backward,
    layer_norm_backward,
    leaky_relu_backward,
    linear_act_backward,
    log_softmax_backward,
    mse_loss,
    mse_loss_backward,
    mul_relu_backward,
    relu_backward,
    sigmoid_backward,
    silu_backward,
    softmax_backward,
    tanh_backward,
)

# The fused optimizer kernels of taifuse.optim (OPTIM_KERNEL_NAMES), Numba implementations.
from taifuse.backends._numba_optim import adam_step, all_finite, lion_step, sgd_step  # noqa: F401
