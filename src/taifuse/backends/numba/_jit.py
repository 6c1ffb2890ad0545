"""The bottom of the Numba backend: what its forward, backward and optimizer kernels share.

Jit options, work-item sizes, the LLVM intrinsics (float16 conversions, maxnum, the 512-bit
vector hint), loads and stores in compute precision, the scalar math (exp, tanh, gelu, sigmoid,
silu in float32 and float64), the op codes, and the host-side choice between a serial and a
parallel kernel. It imports nothing else of ``taifuse.backends.numba``; ``forward``, ``backward``
and ``optim`` import from here, and the package's ``__init__`` is the kernel table.

Precision: float64 uses libm (``math.exp``, ``math.erf``, ``math.tanh``). float32 uses clamped
rational and polynomial approximations that LLVM can vectorize (the PyPI llvmlite has no SVML,
so ``math.tanh`` on float32 is a scalar libm call per element); their measured error bounds sit
next to each one. float16 is storage only: loaded into float32, computed, stored back.
See the NOTE blocks below for float16 storage and for serial versus parallel kernels.
"""

from __future__ import annotations

import math
import os

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload

from taifuse.backends import _host
from taifuse.backends._spec import Activation

# NOTE [ float16 storage ]
# Numba cannot type float16 arrays on the CPU. float16 arrays reach the kernels as their uint16
# bit view (``_bits``); ``_widen`` turns the bits into float32 with LLVM's ``fpext half`` and
# ``_narrow`` stores with ``fptrunc`` (round to nearest even, bit-identical to NumPy's
# ``astype(np.float16)``, checked by the tests). Both compile to the hardware conversions
# (F16C / AVX512-FP16 on x86-64, FCVT on arm64), so no float32 copy of an array is made; the
# matrix products convert blocks instead (NOTE [ float16 products in blocks ]). The memory-bound
# kernels then run at up to twice their float32 speed from DRAM; the transcendental ones (gelu,
# silu, ...) are compute-bound in float32 already on a 2-core x86 machine and gain nothing, the
# conversions adding ~0.05 ns per element to their vector work (measured figures in docs/amp.md).

# float16 products (linear_act and its backward, attention) convert blocks whose size the host
# backends share: NOTE [ float16 products in blocks ] and ``f16_rows`` in backends/_host.py.


# NOTE [ Serial and parallel kernels ]
# Every kernel has a serial and a ``parallel=True`` variant over the same block function. A
# parallel launch has a fixed cost that depends on Numba's threading layer (``omp`` here;
# ``workqueue``, the layer on macOS without TBB or OpenMP, costs far more), so small inputs run
# serially; see ``_PARALLEL_MIN_ELEMENTS`` for the thresholds and how they were found.


# ----------------------------------------------------------------------------- jit options
# Every jitted function is cached on disk and releases the GIL. error_model="numpy": the default
# "python" model adds a divide-by-zero check that blocks vectorization of every loop with a
# division.
_CACHED = {"cache": True, "nogil": True, "error_model": "numpy"}

# The forward and backward math: FMA contraction only. No "nnan"/"ninf" (NaN and inf must
# propagate as in the reference) and no "reassoc" (it would undo the Cody-Waite range reduction
# in _exp_neg_f32).
_FMA = dict(_CACHED, fastmath={"contract"})
# Row reductions (sums) additionally reassociate so that LLVM vectorizes them; the math helpers
# they call are compiled separately with _FMA and keep their own flags.
_FMA_REDUCE = dict(_CACHED, fastmath={"contract", "reassoc"})
_FMA_PARALLEL = dict(_FMA, parallel=True)
# Spans (NOTE [ Spans, blocks and in-place kernels ]) and small helpers, inlined by Numba.
_FMA_INLINE = dict(_FMA, inline="always")

# The optimizer updates: no fast-math flags. Without FMA contraction the float32 arithmetic
# rounds exactly as the NumPy reference's, so the two agree to the last bit on the same operation
# order, and those loops vectorize without it.
_EXACT = _CACHED
_EXACT_PARALLEL = dict(_EXACT, parallel=True)
_EXACT_INLINE = dict(_EXACT, inline="always")
# A sum of (x - x) is NaN exactly when some x is NaN or infinite, in any order of summation, so
# reassociating it (which lets LLVM vectorize the reduction) cannot change the answer.
_REASSOC = dict(_CACHED, fastmath={"reassoc"})
_REASSOC_PARALLEL = dict(_REASSOC, parallel=True)

# ----------------------------------------------------------------------------- work items
_BLOCK = 16384  # elements per parallel work item of elementwise kernels
_TILE = 4096  # columns per parallel work item of row-wise kernels (affine, linear epilogue)
_STRIDED_TILE = 256  # inner (B) positions per work item of softmax over a non-last axis
_COL_TILE = 256  # columns per work item of column sums (bias / weight gradients)

# Minimum element count for a parallel launch, per threading layer, for memory-bound kernels;
# kernels that evaluate exp/tanh/erf per element go parallel at half of it (NOTE [ Serial and
# parallel kernels ]). "omp": see NOTE [ A launch wakes the worker ]. "workqueue": derived, not
# measured: its ~100 us launch (docs/backends.md, "Numba") against the measured serial cost per
# element. "tbb": not measured, as "omp".
#
# NOTE [ A launch wakes the worker ]
# The "omp" threshold was 64K elements, the crossover measured with Numba's worker thread awake.
# Since the worker spins only briefly after a region (NOTE [ OpenMP spin between BLAS calls ]), it
# is asleep at every launch that does not follow another within microseconds, which is every
# launch of a training step, and waking it is the launch's cost: on the 2-vCPU AMD EPYC VM
# (firecracker), a 2-element parallel kernel took 37 us median [32, 95 p10-p90] back to back, 63-84
# us after 20 us to 1 ms of work on the calling thread, against 2 us with the worker spinning
# (GOMP_SPINCOUNT=300000) and 0.7 us serial (200 rounds, one process, quiet). Right after an
# OpenBLAS product the worker also queued ~90 us behind that product's threads. Serial against
# parallel, medians of 25 rounds with the worker asleep (after 200 us of work, or after a
# (2048, 128) @ (128, 512) product), float32: add 0.26M elements 82 vs 112 us and 130 vs 230 us
# after the product, 2M 766 vs 760 and 819 vs 944 us; layer norm (the row blocks of NOTE [ Numba
# layer norm ]) 0.26M 71 vs 129 and 117 vs 203 us, 1M 291 vs 333 and 335 vs 435 us; its backward
# 0.26M 137 vs 156 and 176 vs 259 us, 1M 508 vs 489 and 490 vs 601 us (lightly loaded machine);
# relu 0.26M 36 vs 90 us, 1M 215 vs 209 us (30 rounds, loaded). So parallel pays from about 1M
# elements (4 MiB of float32) for memory-bound kernels, and from 512K for the transcendental ones
# through the discount: the GPT example's layer norms and residual adds ((32, 64, 128) and
# (16, 128, 256) float32) now run on the calling thread. The example GPT's step (2 layers, width
# 128, batch 32; 15 timed steps, median) against the 64K threshold: 0.94x the wall time
# and 0.97x the CPU time (medians of the per-round ratios, 7 alternating process pairs, loaded
# machine); its profile's layer_norm row 325 -> 184 us a call, add 315 -> 205, AdamW.step
# 446 -> 302, cross_entropy 635 -> 457 (4 pairs); the CNN bench step 0.99x.
_PARALLEL_MIN_ELEMENTS = {"omp": 1 << 20, "tbb": 1 << 20, "workqueue": 1 << 20}
_SERIAL_BELOW = min(_PARALLEL_MIN_ELEMENTS.values())
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


@overload(_widen, jit_options=_FMA)
def _widen_impl(v):
    if v == types.uint16:
        return lambda v: _half_to_f32(v)
    if isinstance(v, types.Float):
        return lambda v: v
    return None


def _narrow(v, out):
    """``v`` converted for storing into ``out`` (float16 bits for a uint16 view)."""
    raise NotImplementedError("jitted code only")


@overload(_narrow, jit_options=_FMA)
def _narrow_impl(v, out):
    if out.dtype == types.uint16:
        return lambda v, out: _f32_to_half(np.float32(v))
    return lambda v, out: v  # setitem casts float64 -> float32 with one rounding


def _like(c, v):
    """The constant ``c`` in the precision of ``v`` (a float literal alone would promote to float64)."""
    raise NotImplementedError("jitted code only")


@overload(_like, jit_options=_FMA)
def _like_impl(c, v):
    if v == types.float32:
        return lambda c, v: np.float32(c)
    return lambda c, v: np.float64(c)


def _by_precision(f32_impl, f64_impl):
    """A jitted scalar function running ``f32_impl`` on float32 and ``f64_impl`` on float64."""

    def scalar(v):
        raise NotImplementedError("jitted code only")

    @overload(scalar, jit_options=_FMA)
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
#   gelu'      abs 3.5e-7  (backward.py's _gelu_grad_f32; relative error as gelu's, except
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


@njit(**_FMA)
def _clamp(v, lo, hi):
    """lo <= v <= hi, with NaN passed through (both compares are false for NaN)."""
    # NOTE: not min/max: these ternaries pass NaN through, and linters' "simplify to min/max"
    # fixes change that. Keep the comparisons as written (noqa below).
    v = hi if v > hi else v  # noqa: FURB136
    return lo if v < lo else v  # noqa: FURB136


@njit(**_FMA)
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


@njit(**_FMA)
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


@njit(**_FMA)
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


@njit(**_FMA)
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


@njit(**_FMA)
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


@njit(**_FMA)
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
# shift of those tried for degree 7. gelu' (backward.py) shares exp(-a*a/2) with phi(v).
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


@njit(**_FMA)
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


@njit(**_FMA)
def _gauss_f32(v):
    # exp(-v*v/2); 0 from |v| = 13.2 (2**-127 and below), and for NaN (the callers' NaN comes
    # through _tail_ratio_f32 or v itself).
    w = (v * v) * _F32_MINUS_HALF_LOG2E
    w = w if w > _EXP2_LO else _EXP2_LO  # noqa: FURB136  NaN -> _EXP2_LO
    return _exp2_f32(w)


@njit(**_FMA)
def _gelu_f32(v):
    # v * Phi(v), Phi taken from the small side. gelu(+inf) = inf * 1; gelu(-inf) = -inf * 0 = NaN,
    # as torch and the reference.
    q = _tail_ratio_f32(v) * _gauss_f32(v)
    return v * (q if v < 0 else _F32_ONE - q)


@njit(**_FMA)
def _gelu_f64(v):
    return 0.5 * v * (1.0 + math.erf(v * _INV_SQRT2))


# gelu_tanh's exponent in base 2: -2u * log2(e) = v * (_GT_A + _GT_B * v * v).
_GT_A = np.float32(-2.0 * _SQRT_2_OVER_PI * math.log2(math.e))
_GT_B = np.float32(-2.0 * _SQRT_2_OVER_PI * math.log2(math.e) * _GELU_CUBIC)


@njit(**_FMA)
def _gelu_tanh_f32(v):
    # 0.5 * v * (1 + tanh(u)) == v / (1 + exp(-2u)): no cancellation in the negative tail, where
    # 1 + tanh(u) loses all float32 digits below v = -4.9. exp(-2u) is 2**w with the constants
    # folded into w: 16 vector instructions and a division per 16 elements, against 25 and a
    # division per 8 through _exp_f32 (256-bit vectors). v -> +inf: w = -inf -> 2**-127 = 0 and
    # gelu = v; large negative v: w -> 2**128 = inf and gelu = v / inf = -0; gelu(-inf) =
    # -inf / inf = NaN, as torch. Errors: NOTE [ float32 error bounds ].
    w = _clamp(v * (_GT_A + _GT_B * (v * v)), _EXP2_LO, _EXP2_HI)
    return v / (_F32_ONE + _exp2_f32(w))


@njit(**_FMA)
def _gelu_tanh_f64(v):
    return 0.5 * v * (1.0 + math.tanh(_SQRT_2_OVER_PI * (v + _GELU_CUBIC * v * v * v)))


@njit(**_FMA)
def _sigmoid_f32(v):
    # exp(-v) overflows to inf for v < -88.7, and 1 / inf = 0: sigmoid(-inf) = 0, (+inf) = 1.
    return _F32_ONE / (_F32_ONE + _exp_f32(-v))


@njit(**_FMA)
def _sigmoid_f64(v):
    e = math.exp(-abs(v))
    r = 1.0 / (1.0 + e)
    return r if v >= 0 else e * r


@njit(**_FMA)
def _silu_f32(v):
    # v / (1 + exp(-v)): silu(-inf) = -inf / inf = NaN, as torch and the reference.
    return v / (_F32_ONE + _exp_f32(-v))


@njit(**_FMA)
def _silu_f64(v):
    return v * _sigmoid_f64(v)


@njit(**_FMA)
def _tanh_f64(v):
    return math.tanh(v)


_tanh = _by_precision(_tanh_f32, _tanh_f64)
_gelu = _by_precision(_gelu_f32, _gelu_f64)
_gelu_tanh = _by_precision(_gelu_tanh_f32, _gelu_tanh_f64)
_sigmoid = _by_precision(_sigmoid_f32, _sigmoid_f64)
_silu = _by_precision(_silu_f32, _silu_f64)


@njit(**_FMA)
def _relu(v):
    # NaN propagates; relu(-0.0) is +0.0, as np.maximum(-0.0, 0.0) in the reference.
    return _like(0.0, v) if v <= 0 else v


# ----------------------------------------------------------------------------- op codes

# The elementwise spans and the linear epilogues, forward and backward, switch on _spec's
# Activation; as plain ints, which Numba compiles in as constants and takes as int64 arguments.
_IDENTITY = int(Activation.IDENTITY)
_RELU = int(Activation.RELU)
_GELU = int(Activation.GELU)
_GELU_TANH = int(Activation.GELU_TANH)
_SILU = int(Activation.SILU)
_SIGMOID = int(Activation.SIGMOID)
_TANH = int(Activation.TANH)
_LEAKY_RELU = int(Activation.LEAKY_RELU)

# NOTE [ Spans, blocks and in-place kernels ]
# A "span" is the loop over one contiguous 1-D piece (a slice of the flat array, or a row segment),
# indexed from 0: with an unknown start index Numba's negative-index wraparound hides the address
# from LLVM, and an in-place loop (out is x) then does not vectorize. Spans are inlined by Numba
# (inline="always") into small "block" functions; the *_inplace blocks pass one slice as both x
# and out, so LLVM sees a single pointer. Passing the same array as two arguments instead
# vectorizes but fails LLVM's runtime overlap check and runs the scalar loop (about 10x slower,
# measured on the linear epilogue). Serial kernels call a block once; parallel kernels call it per
# work item from a prange loop.
#
# Parallel kernels cut their work into items with _count and _bounds (or _row_tile), inlined into
# the prange loop. The loop itself is written out in each parallel kernel: a driver that took the
# block function as an argument would serve them all, but Numba keys its on-disk cache on the
# argument types, and a jitted function's type does not match across processes (checked with
# Numba 0.68: such a driver missed the cache and compiled again in every new process).

# NOTE [ One integer type per helper argument ]
# Numba compiles a jitted function once per tuple of argument types, called from Python or from
# another jitted function alike, and each compile of a block or row function costs ~0.3-1 s of CPU
# the first time (the on-disk cache then keeps it; CI starts with an empty cache). Inside jitted
# code an integer constant is typed as its literal (``0`` is ``Literal[int](0)``) and a prange
# index as ``uint64``, while the host's Python ints, the shapes and _bounds' results are int64: a
# serial kernel passing ``0`` and a parallel one passing its prange index would each compile the
# shared helper once more for the same dtypes. Jitted callers therefore pass such an argument as
# ``np.int64(...)`` (compiled to the same constant or register; helpers inlined with
# inline="always" are typed in their caller and need none).


@njit(**_FMA_INLINE)
def _count(n, size):
    """How many work items of ``size`` cover ``n`` (the last one may be shorter)."""
    return (n + size - 1) // size


@njit(**_FMA_INLINE)
def _bounds(item, n, size):
    """The range [lo, hi) of work item ``item`` of ``n`` positions cut into items of ``size``."""
    lo = item * size
    return lo, min(lo + size, n)


@njit(**_FMA_INLINE)
def _row_tile(item, tiles, cols, size):
    """(row, lo, hi) of work item ``item`` over rows of ``cols`` cut into ``tiles`` tiles of ``size``."""
    lo = (item % tiles) * size
    return item // tiles, lo, min(lo + size, cols)


# ----------------------------------------------------------------------------- serial or parallel


@njit(**_FMA_PARALLEL)
def _touch_threads(out):
    for i in prange(out.size):
        out[i] = i


_layer_cache: str | None = None

# NOTE [ OpenMP spin between BLAS calls ]
# After a parallel region, GNU OpenMP's workers spin before they sleep (GOMP_SPINCOUNT, by
# default 300,000 polls, milliseconds), and OpenBLAS's workers do the same after a product. In a
# training step, where small parallel kernels (layer norm, losses, the optimizer) sit between
# products, the two teams take the cores from each other: the example GPT's step (2 layers,
# width 128, 2048 tokens) measured 160 ms median with the defaults, 78 ms with GOMP_SPINCOUNT=1000,
# 64 ms with Numba held to one thread, 68 ms with OMP_WAIT_POLICY=PASSIVE, and PyTorch 46 ms
# (2 cores, quiet). The short spin cost nothing measurable on back-to-back kernels (gelu over
# 64K to 16M elements, the same medians), where PASSIVE added ~50 us a launch. libgomp reads the
# variable once, when it is loaded, which Numba does at its first parallel launch: so that
# launch (``_touch_threads``) runs with GOMP_SPINCOUNT=1000 set, and the variable is removed
# again at once, so that nothing else (PyTorch's own libgomp copy, processes started later)
# inherits it. A GOMP_SPINCOUNT or OMP_WAIT_POLICY the user set is left alone, and so is a
# libgomp some other library loaded first. Other OpenMP runtimes (LLVM's libomp on macOS, whose
# knob is KMP_BLOCKTIME) were not measured and are not touched.
_SHORT_SPIN = "1000"


def _threading_layer() -> str:
    """The threading layer Numba runs parallel kernels on (starts it with a tiny launch if needed,
    NOTE [ OpenMP spin between BLAS calls ])."""
    global _layer_cache
    if _layer_cache is None:
        try:
            _layer_cache = numba.threading_layer()
        except ValueError:  # no parallel kernel has run yet in this process
            ours = "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ
            if ours:
                os.environ["GOMP_SPINCOUNT"] = _SHORT_SPIN
            try:
                _touch_threads(np.empty(numba.get_num_threads(), np.float64))
            finally:
                if ours:
                    del os.environ["GOMP_SPINCOUNT"]
            _layer_cache = numba.threading_layer()
    return _layer_cache


def _parallel_min_elements() -> int:
    """Inputs with fewer elements run the serial kernels; with one thread everything does."""
    if numba.get_num_threads() < 2:
        return np.iinfo(np.int64).max
    return _PARALLEL_MIN_ELEMENTS.get(_threading_layer(), max(_PARALLEL_MIN_ELEMENTS.values()))


def _parallel(size: int, transcendental: bool = False) -> bool:
    """Whether a kernel over ``size`` elements runs parallel (NOTE [ Serial and parallel kernels ])."""
    work = size * _TRANSCENDENTAL_DISCOUNT if transcendental else size
    # Under every layer's threshold it is serial whatever the threads: no thread query (a small
    # op's fixed cost, the ``step`` bench suite's per-op rows).
    return work >= _SERIAL_BELOW and work >= _parallel_min_elements()


def _epilogue_parallel(size: int, transcendental: bool = False) -> bool:
    """Whether a linear epilogue of ``size`` elements runs parallel (NOTE [ Serial epilogue between BLAS calls ])."""
    return size >= _EPILOGUE_PARALLEL_MIN and _parallel(size, transcendental)


# ----------------------------------------------------------------------------- host-side array views


_FLOAT16 = np.dtype(np.float16)  # a dtype, not the type: == then converts nothing


def _bits(a: np.ndarray) -> np.ndarray:
    """The array as the kernels take it: float16 as its uint16 bit view (NOTE [ float16 storage ])."""
    return a.view(np.uint16) if a.dtype == _FLOAT16 else a


def _flat(a: np.ndarray) -> np.ndarray:
    # ravel: as reshape(-1) (a view of C-contiguous data, else a copy), in half the time.
    flat = a.ravel()
    return flat.view(np.uint16) if flat.dtype == _FLOAT16 else flat


def _same_data(a: np.ndarray, out: np.ndarray) -> bool:
    return a.__array_interface__["data"][0] == out.__array_interface__["data"][0] and a.shape == out.shape


def _readable(a: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``a``, or a copy of it if writing ``out`` would overwrite elements not yet read.

    Kernels read and write element i (or row r) together, so ``out`` may be ``a`` itself; only a
    partial overlap (``out`` a shifted view of ``a``) needs the copy.
    """
    # Two arrays that each own their memory are apart, or one array: no overlap test (a small op's case).
    if a.base is None and out.base is None:
        return a
    if np.may_share_memory(a, out) and not _same_data(a, out):
        return a.copy()
    return a


# ----------------------------------------------------------------------------- float16 blocks
# NOTE: NumPy's own float16 casts (np.copyto, astype) convert in software, one element at a time:
# over 1M elements, float16 -> float32 took 1.6-3.5 ns per element and float32 -> float16
# 2.5-6.3 ns (fastest tenth and median of 31, shared 2-core AMD EPYC (Zen 4)), against 0.08-0.14 ns
# for these loops, which compile to vcvtph2ps / vcvtps2ph (NOTE [ float16 storage ]). The blocks
# of NOTE [ float16 products in blocks ] are converted here.


@njit(**_FMA_INLINE)
def _convert_span(src, dst):
    for i in range(src.size):
        dst[i] = _narrow(_widen(src[i]), dst)


@njit(**_FMA)
def _convert_rows(src, dst):
    for r in range(src.shape[0]):
        _convert_span(src[r], dst[r])


def _convert(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[...] = src`` of the same shape; float16 <-> float32 through the hardware conversions."""
    pair = {src.dtype, dst.dtype}
    if pair != {np.dtype(np.float16), np.dtype(np.float32)} or src.size == 0:
        np.copyto(dst, src)
        return
    if src.ndim > 2:  # a group of matrices (attention's heads): one at a time
        for i in range(src.shape[0]):
            _convert(dst[i], src[i])
        return
    if src.ndim < 2:
        src, dst = src.reshape(1, -1), dst.reshape(1, -1)
    if not src.flags.c_contiguous:
        # Loops over rows of a strided source did not vectorize (1.1 against 0.07 ns per element):
        # gather the block first, a same-dtype copy.
        src = np.ascontiguousarray(src)
    _convert_rows(_bits(src), _bits(dst))


# The host array code's float16 conversions go through this one from now on (NOTE [ Hardware float16
# conversions ] in backends/_host.py).
_host.set_f16_converter(_convert)
