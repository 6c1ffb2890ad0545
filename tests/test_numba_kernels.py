"""Tests specific to the Numba backend's implementation: its float32 approximations over a dense
sweep, the float16 bit conversions, the dropout hash, and both the serial and the parallel kernel
of every op (the op tests in test_ops.py only see whichever one the size picks).

The float32 approximations are compared with the backend's own float64 kernels, which use libm and
are themselves checked against ``backends.reference`` here.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

numba = pytest.importorskip("numba")

from taifuse.backends import _host
from taifuse.backends import numba as nb
from taifuse.backends import reference as ref
from taifuse.backends.numba import _jit as nb_jit
from taifuse.backends.numba import backward as nb_backward
from taifuse.backends.numba import forward as nb_forward
from taifuse.backends.numba._jit import _COL_TILE

DTYPES = (np.float16, np.float32, np.float64)
# |got - want| <= atol + rtol * |want| against the float64 reference, per storage dtype.
TOL = {np.float64: (1e-12, 1e-12), np.float32: (1e-6, 2e-6), np.float16: (2.0**-24, 2.0**-10)}
TRANSCENDENTAL = ("tanh", "sigmoid", "silu", "gelu", "gelu_tanh")


def run_unary(name: str, x: np.ndarray, out: np.ndarray) -> None:
    if name == "gelu_tanh":
        nb.gelu(x, out, "tanh")
    elif name == "gelu":
        nb.gelu(x, out, "none")
    else:
        getattr(nb, name)(x, out)


def assert_close(got: np.ndarray, want: np.ndarray, dtype, scale: float = 1.0) -> None:
    atol, rtol = TOL[np.dtype(dtype).type]
    np.testing.assert_allclose(
        got.astype(np.float64), want.astype(np.float64), atol=atol * scale, rtol=rtol, equal_nan=True
    )


def sweep_float32(step: int, limit: float = 1e4) -> np.ndarray:
    """Every ``step``-th float32 bit pattern with |x| <= limit, both signs."""
    top = int(np.float32(limit).view(np.uint32))
    bits = np.arange(0, top + 1, step, dtype=np.uint32)
    pos = bits.view(np.float32)
    return np.concatenate([pos, -pos])


# ----------------------------------------------------------------------------- float32 accuracy

# Bounds asserted below; the measured maxima are in NOTE [ float32 error bounds ] in numba/_jit.py.
# "mixed" error = |err| / max(1, |true|) everywhere; relative error where |true| > 1e-30.
MIXED_BOUND = 1e-6
REL_BOUND = {"tanh": 1e-6, "sigmoid": 1e-6, "silu": 1e-6, "gelu": 5e-5, "gelu_tanh": 5e-5}


def _truth(name: str, x64: np.ndarray) -> np.ndarray:
    """float64 values with full relative accuracy in the tails (0.5 * (1 + erf) cancels in float64)."""
    if name == "gelu":
        erfc = np.vectorize(math.erfc, otypes=[np.float64])
        return x64 * 0.5 * erfc(-x64 / math.sqrt(2.0))
    if name == "gelu_tanh":
        u = 2.0 * math.sqrt(2.0 / math.pi) * (x64 + 0.044715 * x64**3)
        with np.errstate(over="ignore"):
            return x64 / (1.0 + np.exp(-u))
    out = np.empty_like(x64)
    run_unary(name, x64, out)  # float64 libm kernels, checked against the reference below
    return out


@pytest.mark.parametrize("name", TRANSCENDENTAL)
def test_float32_approximation_error_dense_sweep(name):
    x = np.concatenate([sweep_float32(4099), np.linspace(-12, 12, 200_001, dtype=np.float32)])
    got = np.empty_like(x)
    run_unary(name, x, got)
    with np.errstate(over="ignore", invalid="ignore"):
        want = _truth(name, x.astype(np.float64))
    err = np.abs(got.astype(np.float64) - want)
    mixed = err / np.maximum(1.0, np.abs(want))
    assert mixed.max() <= MIXED_BOUND, f"{name}: max mixed error {mixed.max():.3g} at x={x[mixed.argmax()]}"
    # sigmoid and silu return 0 once exp(x) leaves the normal float32 range (x < -87).
    tail_ok = (np.abs(want) > 1e-30) & (x > -87)
    rel = err[tail_ok] / np.abs(want[tail_ok])
    worst = x[tail_ok][rel.argmax()]
    assert rel.max() <= REL_BOUND[name], f"{name}: max rel error {rel.max():.3g} at x={worst}"


def test_gelu_derivative_float32_error_dense_sweep():
    # gelu' has a float32 approximation of its own (_gelu_grad_f32 in numba/backward.py; NOTE [ Exact
    # GELU in float32 ] in numba/_jit.py): held to the forward's mixed bound everywhere, and to its
    # relative bound in the negative tail, away from the derivative's zero at x = -0.75.
    x = np.concatenate([sweep_float32(4099), np.linspace(-12, 12, 200_001, dtype=np.float32)])
    got = np.empty_like(x)
    nb.gelu_backward(x, np.ones_like(x), got, "none")
    x64 = x.astype(np.float64)
    erfc = np.vectorize(math.erfc, otypes=[np.float64])
    with np.errstate(under="ignore"):
        pdf = np.exp(-0.5 * x64 * x64) / math.sqrt(2.0 * math.pi)
    want = 0.5 * erfc(-x64 / math.sqrt(2.0)) + x64 * pdf
    err = np.abs(got - want)
    mixed = err / np.maximum(1.0, np.abs(want))
    assert mixed.max() <= MIXED_BOUND, f"max mixed error {mixed.max():.3g} at x={x[mixed.argmax()]}"
    tail = (x < -1.0) & (np.abs(want) > 1e-30)
    rel = err[tail] / np.abs(want[tail])
    assert rel.max() <= REL_BOUND["gelu"], f"max rel error {rel.max():.3g} at x={x[tail][rel.argmax()]}"


def test_exp2_float32_accuracy_and_ends():
    # gelu and gelu_tanh build exp from _exp2_f32; its own bound (rel 1.7e-7 measured) and the
    # ends the callers rely on: 2**-127 -> 0, 2**128 -> inf, integers exact.
    @numba.njit(error_model="numpy", fastmath={"contract"})
    def exp2_all(w, out):
        for i in range(w.size):
            out[i] = nb_jit._exp2_f32(w[i])

    w = np.linspace(-126, 127, 1_000_001, dtype=np.float32)
    got = np.empty_like(w)
    exp2_all(w, got)
    want = np.exp2(w.astype(np.float64))
    rel = np.abs(got - want) / want
    assert rel.max() <= 2.5e-7, f"max rel error {rel.max():.3g} at w={w[rel.argmax()]}"
    ints = np.arange(-126, 128, dtype=np.float32)
    exp2_all(ints, got[: ints.size])
    # Against float64: NumPy's float32 exp2 is not exact at every integer.
    assert np.array_equal(got[: ints.size], np.exp2(ints.astype(np.float64)))
    ends = np.array([-127.0, 128.0], np.float32)
    exp2_all(ends, got[:2])
    assert got[0] == 0.0 and got[1] == np.inf


def test_spans_ask_llvm_for_512_bit_vectors():
    # NOTE [ 512-bit vectors ] in numba/_jit.py: the attribute must reach the function the span is
    # inlined into (a compile error here would mean LLVM rejected it).
    @numba.njit(error_model="numpy")
    def double(x, out):
        nb_forward._unary_span(x, out, nb_jit._LEAKY_RELU, 2.0)

    x = np.array([-1.0, 2.0], np.float32)
    out = np.empty_like(x)
    double(x, out)
    assert out.tolist() == [-2.0, 2.0]
    ir = next(iter(double.inspect_llvm().values()))
    assert nb_jit._PREFER_512 in ir


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning", "ignore:overflow:RuntimeWarning")
def test_special_values_match_reference(dtype):
    x = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 1e4, -1e4, 60000.0, -60000.0], dtype=dtype)
    for name in ("relu", *TRANSCENDENTAL):
        got, want = np.empty_like(x), np.empty_like(x)
        run_unary(name, x, got)
        if name.startswith("gelu"):
            ref.gelu(x, want, "tanh" if name == "gelu_tanh" else "none")
        else:
            getattr(ref, name)(x, want)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=name)
        assert_close(got, want, dtype)
    # The PyTorch conventions the reference encodes, spelled out.
    out = np.empty(2, dtype)
    nb.tanh(np.array([np.inf, -np.inf], dtype), out)
    assert out.tolist() == [1.0, -1.0]
    nb.sigmoid(np.array([np.inf, -np.inf], dtype), out)
    assert out.tolist() == [1.0, 0.0]
    nb.relu(np.array([np.nan, -1.0], dtype), out)
    assert np.isnan(out[0]) and out[1] == 0.0


@pytest.mark.parametrize("name", TRANSCENDENTAL)
def test_float64_kernels_match_reference(name):
    x = np.random.default_rng(0).standard_normal(10_000) * 8
    got, want = np.empty_like(x), np.empty_like(x)
    run_unary(name, x, got)
    if name.startswith("gelu"):
        ref.gelu(x, want, "tanh" if name == "gelu_tanh" else "none")
    else:
        getattr(ref, name)(x, want)
    np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-15)


# ----------------------------------------------------------------------------- float16 storage


def test_float16_widen_is_exact_for_every_bit_pattern():
    @numba.njit
    def widen_all(bits, out):
        for i in range(bits.size):
            out[i] = nb_jit._widen(bits[i])

    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    got = np.empty(bits.size, np.float32)
    widen_all(bits, got)
    want = bits.view(np.float16).astype(np.float32)
    nan = np.isnan(want)
    np.testing.assert_array_equal(got.view(np.uint32)[~nan], want.view(np.uint32)[~nan])
    assert np.isnan(got[nan]).all()


def test_float16_narrow_rounds_like_numpy():
    @numba.njit
    def narrow_all(x, out):
        for i in range(x.size):
            out[i] = nb_jit._narrow(x[i], out)

    rng = np.random.default_rng(1)
    halfway = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    x = np.concatenate(
        [rng.standard_normal(200_000).astype(np.float32) * s for s in (1e-7, 1e-4, 1.0, 1e3, 7e4)]
        + [halfway[np.isfinite(halfway)] * np.float32(1.0 + 2.0**-11)]  # ties and near-ties
        + [np.array([np.inf, -np.inf, 65504.0, 65519.0, 65520.0, 2.0**-25, 2.0**-24, -0.0], np.float32)]
    )
    got = np.empty(x.size, np.uint16)
    narrow_all(x, got)
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).view(np.uint16)
    np.testing.assert_array_equal(got, want)


# ----------------------------------------------------------------------------- dropout hash


def test_hash32_bit_identical_to_reference():
    @numba.njit
    def hash_all(v, out):
        for i in range(v.size):
            out[i] = nb_forward._hash32(v[i])

    rng = np.random.default_rng(2)
    v = np.concatenate(
        [
            np.array([0, 1, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFE, 0xFFFFFFFF], np.uint32),
            rng.integers(0, 2**32, 100_000, dtype=np.uint64).astype(np.uint32),
        ]
    )
    got = np.empty_like(v)
    hash_all(v, got)
    np.testing.assert_array_equal(got, ref.hash32(v))
    assert int(got[5]) == ref.hash32(0xFFFFFFFF)  # the Python-int path agrees too


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 0.999, 1.0])
def test_dropout_bit_identical_serial_and_parallel(dtype, p):
    x = (np.random.default_rng(3).standard_normal(50_003) * 3).astype(dtype)
    want = np.empty_like(x)
    ref.dropout(x, want, p, 0xDEADBEEF)
    key = np.uint32(ref.dropout_key(0xDEADBEEF))
    threshold = np.uint32(ref.dropout_threshold(p))
    for kernel in (nb_forward._dropout_serial, nb_forward._dropout_parallel):
        got = np.empty_like(x)
        kernel(nb_jit._bits(x), nb_jit._bits(got), key, threshold, float(ref.dropout_scale(p)))
        np.testing.assert_array_equal(got == 0, want == 0)
        if dtype == np.float16:  # float64 -> float32 -> float16 can differ from one rounding by an ulp
            assert_close(got, want, dtype)
        else:
            np.testing.assert_array_equal(got, want)


# ----------------------------------------------------------------------------- serial and parallel paths


@pytest.fixture
def force_path(monkeypatch):
    def force(parallel: bool) -> None:
        monkeypatch.setattr(nb_jit, "_parallel", lambda size, transcendental=False: parallel)
        # Linear's epilogues also wait for a size threshold (NOTE [ Serial epilogue between BLAS calls ]).
        monkeypatch.setattr(nb_jit, "_EPILOGUE_PARALLEL_MIN", 0)

    return force


def _inputs(shape, dtype, seed=0, scale=3.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("parallel", [False, True])
def test_every_kernel_on_both_paths(dtype, parallel, force_path):
    force_path(parallel)
    x = _inputs((3, 5, 4099), dtype)  # odd sizes: partial blocks and vector tails
    y = _inputs((3, 5, 4099), dtype, seed=1)
    for name, args in [
        ("relu", ()),
        ("leaky_relu", (0.1,)),
        ("silu", ()),
        ("sigmoid", ()),
        ("tanh", ()),
        ("gelu", ("none",)),
        ("gelu", ("tanh",)),
    ]:
        got, want = np.empty_like(x), np.empty_like(x)
        getattr(nb, name)(x, got, *args)
        getattr(ref, name)(x, want, *args)
        assert_close(got, want, dtype)
    # out is x: the in-place kernels (NOTE [ Spans, blocks and in-place kernels ])
    for name, args in [("relu", ()), ("gelu", ("tanh",)), ("silu", ())]:
        got, want = x.copy(), np.empty_like(x)
        getattr(nb, name)(got, got, *args)
        getattr(ref, name)(x, want, *args)
        assert_close(got, want, dtype)
    for name in ("add_relu", "mul_relu"):
        got, want = np.empty_like(x), np.empty_like(x)
        getattr(nb, name)(x, y, got)
        getattr(ref, name)(x, y, want)
        assert_close(got, want, dtype, scale=10.0)

    # affine's parallel items: blocks of rows by column tiles, the last block and tile partial
    for rows, cols in [(15, 4099), (37, 1000), (2 * nb_jit._BLOCK // 7 + 3, 7)]:
        xa = x.reshape(-1)[: rows * cols].reshape(rows, cols)
        scale, bias = _inputs(cols, dtype, 2), _inputs(cols, dtype, 3)
        got, want = np.empty_like(xa), np.empty_like(xa)
        nb.affine(xa, scale, bias, got)
        ref.affine(xa, scale, bias, want)
        assert_close(got, want, dtype, scale=10.0)
    x2 = x.reshape(15, 4099)

    for shape in [(15, 4099, 1), (3, 5, 4099), (2, 7, nb_jit._STRIDED_TILE + 3)]:
        xs = x.reshape(-1)[: math.prod(shape)].reshape(shape)
        for name in ("softmax", "log_softmax"):
            got, want = np.empty_like(xs), np.empty_like(xs)
            getattr(nb, name)(xs, got)
            getattr(ref, name)(xs, want)
            assert_close(got, want, dtype, scale=10.0)

    stats = np.float64 if dtype == np.float64 else np.float32
    w, b = _inputs(4099, dtype, 4), _inputs(4099, dtype, 5)
    for weight, bias_ in [(None, None), (w, None), (None, b), (w, b)]:
        got, want = np.empty_like(x2), np.empty_like(x2)
        gm, gr, wm, wr = (np.empty(15, stats) for _ in range(4))
        nb.layer_norm(x2, weight, bias_, 1e-5, got, gm, gr)
        ref.layer_norm(x2, weight, bias_, 1e-5, want, wm, wr)
        assert_close(got, want, dtype, scale=20.0)
        np.testing.assert_allclose(gm, wm, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(gr, wr, rtol=1e-6)


@pytest.mark.parametrize("dtype", (np.float32, np.float64))
@pytest.mark.parametrize("parallel", [False, True])
def test_tensor_add_sub_mul_give_numpys_bits(dtype, parallel, force_path, monkeypatch):
    """NOTE [ Host tensor math on a backend's kernels ]: the numba backend's tensor ``+ - *`` and
    ``+=`` of two same-shape C-contiguous float32/float64 arrays run its own kernels when a
    parallel one would (odd sizes: block tails and vector tails; NaN, inf and signed zeros), and
    NumPy's ufuncs otherwise (broadcasting, a scalar, a strided view, mixed dtypes, the serial
    size); every result is NumPy's to the bit."""
    from taifuse._tensor_math import KernelHostMath, math_for

    force_path(parallel)
    m = math_for(nb)
    assert isinstance(m, KernelHostMath)
    called = []
    for name in ("add", "sub", "mul"):
        kernel = getattr(nb.HOST_MATH_KERNELS, name)
        spy = lambda a, b, out, k=kernel, n=name: (called.append(n), k(a, b, out))
        monkeypatch.setattr(nb.HOST_MATH_KERNELS, name, spy)
    x = _inputs((3, 2 * nb_jit._BLOCK + 37), dtype)
    y = _inputs(x.shape, dtype, seed=1)
    x[0, :4] = [np.nan, np.inf, -0.0, 0.0]
    y[0, :4] = [1.0, np.inf, 0.0, -0.0]
    cases = {"add": np.add, "sub": np.subtract, "mul": np.multiply}
    for name, ufunc in cases.items():
        for a, b in [
            (x, y),
            (x, y[0]),  # broadcast
            (x, 2.5),  # scalar
            (x[:, ::2], y[:, ::2]),  # strided views
            (x, y.astype(np.float16)),  # mixed dtypes
        ]:
            with np.errstate(invalid="ignore"):  # inf - inf, 0 * inf
                got = getattr(m, name)(a, b)
                want = ufunc(a, b)
            assert got.dtype == want.dtype and got.shape == want.shape
            bits = np.dtype(f"u{want.itemsize}")
            np.testing.assert_array_equal(np.asarray(got).view(bits), np.asarray(want).view(bits))
        if name == "add":  # in place: acc += a, the engine's gradient sums
            for a, b in [(x, y), (x, y[0]), (x[:, ::2], y[:, ::2]), (x, y.astype(np.float16))]:
                got, want = a.copy(), a.copy()
                m.add_(got, b)
                np.add(want, b, out=want, casting="unsafe")
                bits = np.dtype(f"u{want.itemsize}")
                np.testing.assert_array_equal(got.view(bits), want.view(bits))
    assert called == (["add", "add", "sub", "mul"] if parallel else [])


def _integer_blind(signature: tuple) -> tuple:
    return tuple("integer" if isinstance(t, numba.types.Integer) else t for t in signature)


def test_helpers_compile_once_for_the_serial_and_the_parallel_kernel(force_path):
    """NOTE [ One integer type per helper argument ]: a helper that a serial kernel calls with the
    constant 0 and a parallel one with its prange index (or a host loop with a Python int) compiles
    once per dtype, not once per integer type (Literal[int](0), uint64, int64)."""
    from taifuse.backends.numba import batch_norm as nb_batch_norm

    x = _inputs((600, 4, 1), np.float32)
    for parallel in (False, True):
        force_path(parallel)
        nb.relu(x[:3], np.empty_like(x[:3]))  # a tiny op: _unary_small
        big = _inputs(nb_forward._SMALL_UNARY + 5, np.float32)
        nb.relu(big, np.empty_like(big))
        nb.softmax(x[:3, :, :], np.empty_like(x[:3]))
        nb.batch_norm_stats(x, np.empty(4, np.float32), np.empty(4, np.float32))
        rows = x.reshape(600, 4)
        w, b = np.ones(4, np.float32), np.zeros(4, np.float32)
        out, mean, rstd = np.empty_like(rows), np.empty(600, np.float32), np.empty(600, np.float32)
        nb.layer_norm(rows, w, b, 1e-5, out, mean, rstd)
        grads = (np.empty_like(rows), np.empty_like(w), np.empty_like(b))
        nb.layer_norm_backward(rows, w, mean, rstd, np.ones_like(rows), *grads)
    helpers = (
        nb_forward._unary_block,
        nb_forward._softmax_rows,
        nb_batch_norm._stats_rows,
        nb_forward._layer_norm_rows,
        nb_backward._layer_norm_backward_chunk,
    )
    for helper in helpers:
        blind = [_integer_blind(sig) for sig in helper.signatures]
        assert len(blind) == len(set(blind)), f"{helper.py_func.__name__}: {helper.signatures}"


# The row-at-a-time layer norm forward that the blocked one replaced (NOTE [ Numba layer norm ]),
# kept to check that the blocks changed no bit.
@numba.njit(**dict(nb_jit._FMA_REDUCE, cache=False))
def _layer_norm_row_at_a_time(x, weight, bias, eps, out, mean, rstd):
    _widen, _narrow, _like = nb_jit._widen, nb_jit._narrow, nb_jit._like
    nb_jit._prefer_wide_vectors()
    n = x.shape[1]
    for r in range(x.shape[0]):
        v0 = _widen(x[r, 0])
        s = _like(0.0, v0)
        for c in range(n):
            s += _widen(x[r, c])
        mu_c = s / _like(n, v0)
        ss = _like(0.0, v0)
        for c in range(n):
            d = _widen(x[r, c]) - mu_c
            ss += d * d
        rs = 1.0 / math.sqrt(np.float64(ss) / n + eps)
        mean[r] = mu_c
        rstd[r] = rs
        rs_c = _like(rs, v0)
        for c in range(n):
            y = (_widen(x[r, c]) - mu_c) * rs_c
            if weight is None:
                if bias is not None:
                    y = y + _widen(bias[c])
            elif bias is None:
                y = y * _widen(weight[c])
            else:
                y = y * _widen(weight[c]) + _widen(bias[c])
            out[r, c] = _narrow(y, out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "cols"), [(1, 7), (5, 3), (33, 37), (300, 256), (17, 4099)])
def test_layer_norm_blocks_keep_the_row_at_a_time_bits(dtype, rows, cols, force_path):
    """The blocked forward (statistics of _LN_BLOCK rows, then their outputs) writes the bits of
    the row-at-a-time form it replaced, on the serial and the parallel path; partial last blocks."""
    x = _inputs((rows, cols), dtype) + 2
    w, b = _inputs(cols, dtype, 1, scale=1.0), _inputs(cols, dtype, 2)
    stats = np.float64 if dtype == np.float64 else np.float32
    for weight, bias_ in [(None, None), (w, None), (None, b), (w, b)]:
        want = np.empty_like(x), np.empty(rows, stats), np.empty(rows, stats)
        wb = [None if a is None else nb_jit._bits(a) for a in (weight, bias_)]
        _layer_norm_row_at_a_time(nb_jit._bits(x), *wb, 1e-5, nb_jit._bits(want[0]), want[1], want[2])
        for parallel in (False, True):
            force_path(parallel)
            got = np.empty_like(x), np.empty(rows, stats), np.empty(rows, stats)
            nb.layer_norm(x, weight, bias_, 1e-5, *got)
            for g_, w_ in zip(got, want):
                bits = np.dtype(f"u{g_.itemsize}")
                np.testing.assert_array_equal(g_.view(bits), w_.view(bits))


# (rows, cols): one row; fewer rows than chunks; rows that leave the last chunks short or empty
# (33 rows in chunks of 2); the GPT example's width past the parallel threshold (with the budget
# cut to two chunks, 150 rows each: runs of _LN_RUN = 64, 64 and 22 rows, NOTE [ Numba layer norm
# backward ]).
_LN_BACKWARD_SHAPES = [(1, 7), (5, 3), (33, 37), (300, 256)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "cols"), _LN_BACKWARD_SHAPES)
def test_layer_norm_backward_one_pass(dtype, rows, cols, force_path, monkeypatch):
    """The one-pass backward (NOTE [ Numba layer norm backward ]) against the reference for every
    subset of gradients, with and without a weight, and the same bits on the serial and parallel
    paths; with the partial sums' budget cut to two chunks' worth as well."""
    from taifuse.backends.numba import backward as nb_backward

    x, g = _inputs((rows, cols), dtype, 0), _inputs((rows, cols), dtype, 1)
    w = _inputs(cols, dtype, 2, scale=1.0)
    stats = np.float64 if dtype == np.float64 else np.float32
    mean, rstd = np.empty(rows, stats), np.empty(rows, stats)
    ref.layer_norm(x, None, None, 1e-5, np.empty_like(x), mean, rstd)
    for budget in (nb_backward._LN_PARTIAL_BYTES, 2 * 16 * cols):
        monkeypatch.setattr(nb_backward, "_LN_PARTIAL_BYTES", budget)
        for weight in (None, w):
            for asked in (
                (True, True, True),
                (True, False, False),
                (False, True, False),
                (False, True, True),
            ):
                want = [np.empty_like(x), np.empty(cols, dtype), np.empty(cols, dtype)]
                ref.layer_norm_backward(x, weight, mean, rstd, g, *want)
                runs = []
                for parallel in (False, True):
                    force_path(parallel)
                    got = [np.full_like(a, np.nan) if on else None for a, on in zip(want, asked)]
                    nb.layer_norm_backward(x, weight, mean, rstd, g, *got)
                    runs.append(got)
                for serial, par, expect, on in zip(*runs, want, asked):
                    if not on:
                        continue
                    np.testing.assert_array_equal(serial, par)
                    # The column sums add `rows` terms of |g * xhat| up to ~10.
                    assert_close(serial, expect, dtype, scale=20.0 * max(1.0, math.sqrt(rows)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "cols"), [(37, 257), (64, 256), (5, 1001)])
def test_layer_norm_compute_precision_sums_on_offset_rows(dtype, rows, cols, force_path):
    """The layer norm kernels sum in compute precision (NOTE [ Numba layer norm ], float32 for
    float16 and float32 rows): rows far from zero mean (an offset 100 x their spread, the hard
    case for a one-pass variance) against the float64 reference, forward and backward, serial and
    parallel bit-identical. The bound is the conditioning of the problem: an error of a few units
    in the last place of the compute precision at the rows' magnitude, times rstd (so in xhat's
    units), carried through each output's formula, plus the rounding of the stored result."""
    rng = np.random.default_rng(7)
    spread = rng.uniform(0.5, 2.0, (rows, 1))
    x = 100.0 * spread * rng.choice([-1.0, 1.0], (rows, 1)) + spread * rng.standard_normal((rows, cols))
    x = x.astype(dtype)
    w = rng.uniform(0.5, 1.5, cols).astype(dtype)
    b = rng.standard_normal(cols).astype(dtype)
    g = rng.standard_normal((rows, cols)).astype(dtype)
    x64, w64, b64, g64 = (a.astype(np.float64) for a in (x, w, b, g))
    want = np.empty_like(x64), np.empty(rows), np.empty(rows)
    ref.layer_norm(x64, w64, b64, 1e-5, *want)
    want_g = np.empty_like(x64), np.empty(cols), np.empty(cols)
    ref.layer_norm_backward(x64, w64, want[1], want[2], g64, *want_g)

    stats = np.float64 if dtype == np.float64 else np.float32
    runs = []
    for parallel in (False, True):
        force_path(parallel)
        out, mean, rstd = np.empty_like(x), np.empty(rows, stats), np.empty(rows, stats)
        nb.layer_norm(x, w, b, 1e-5, out, mean, rstd)
        grads = np.empty_like(x), np.empty(cols, dtype), np.empty(cols, dtype)
        nb.layer_norm_backward(x, w, mean, rstd, g, *grads)
        runs.append((out, mean, rstd, *grads))
    for serial, par in zip(*runs):
        np.testing.assert_array_equal(serial, par)

    out, mean, rstd, gx, gw, gb = runs[0]
    eps_c = np.finfo(stats).eps
    eps_s = np.finfo(dtype).eps
    rs = want[2][:, None]
    # xhat's error: 8 units in the last place of the compute precision at the row's largest |x|.
    e_xh = 8 * eps_c * np.abs(x64).max(axis=1, keepdims=True) * rs
    gy = g64 * w64
    xh = (x64 - want[1][:, None]) * rs
    a_row = np.abs(gy.mean(axis=1, keepdims=True))  # grad_x = rstd * (gy - a - xhat * b)
    b_row = np.abs((gy * xh).mean(axis=1, keepdims=True))
    gy_row = np.abs(gy).mean(axis=1, keepdims=True)  # bounds b's error: mean(gy * xhat's error)
    bounds = {
        "mean": (mean, want[1], 8 * eps_c * np.abs(x64).max(axis=1)),
        "rstd": (rstd, want[2], 8 * eps_c * want[2]),
        "out": (out, want[0], e_xh * np.abs(w64) + 2 * eps_s * np.abs(want[0])),
        "grad_x": (
            gx,
            want_g[0],
            rs
            * (e_xh * (b_row + np.abs(xh) * gy_row) + 8 * eps_c * (np.abs(gy) + a_row + np.abs(xh) * b_row))
            + 2 * eps_s * np.abs(want_g[0]),
        ),
        "grad_weight": (gw, want_g[1], (np.abs(g64) * e_xh).sum(axis=0) * 2 + 2 * eps_s * np.abs(want_g[1])),
        "grad_bias": (
            gb,
            want_g[2],
            4 * rows * eps_c * np.abs(g64).sum(axis=0) + 2 * eps_s * np.abs(want_g[2]),
        ),
    }
    for what, (got, expect, bound) in bounds.items():
        err = np.abs(got.astype(np.float64) - expect)
        assert (err <= bound).all(), f"{what}: worst err/bound {(err / bound).max():.3g}"


def test_layer_norm_backward_float64_finite_differences():
    """The float64 kernels' gradients against central differences of sum(g * layer_norm(x))."""
    rng = np.random.default_rng(3)
    rows, cols = 4, 6
    x, w, b, g = (
        rng.standard_normal((rows, cols)),
        rng.standard_normal(cols),
        rng.standard_normal(cols),
        rng.standard_normal((rows, cols)),
    )

    def loss(x, w, b):
        out, mean, rstd = np.empty_like(x), np.empty(rows), np.empty(rows)
        nb.layer_norm(x, w, b, 1e-5, out, mean, rstd)
        return float((out * g).sum()), mean, rstd

    _, mean, rstd = loss(x, w, b)
    gx, gw, gb = np.empty_like(x), np.empty(cols), np.empty(cols)
    nb.layer_norm_backward(x, w, mean, rstd, g, gx, gw, gb)
    h = 1e-6
    for got, arg in ((gx, 0), (gw, 1), (gb, 2)):
        args = [x, w, b]
        fd = np.empty_like(args[arg])
        for i in np.ndindex(fd.shape):
            plus, minus = [a.copy() for a in args], [a.copy() for a in args]
            plus[arg][i] += h
            minus[arg][i] -= h
            fd[i] = (loss(*plus)[0] - loss(*minus)[0]) / (2 * h)
        np.testing.assert_allclose(got, fd, rtol=1e-6, atol=1e-7)


# float16's budget in rows of the (29, 37) weight: all of it in one block, or blocks of 10 rows.
_DTYPE_WEIGHT_ROWS = [(dtype, 29) for dtype in DTYPES] + [(np.float16, 10)]


@pytest.mark.parametrize(("dtype", "weight_rows"), _DTYPE_WEIGHT_ROWS)
@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("activation", [None, "relu", "gelu", "gelu_tanh", "silu"])
def test_linear_act_both_paths(dtype, weight_rows, parallel, activation, force_path, monkeypatch):
    force_path(parallel)
    # A small float16 budget forces several row chunks (40 rows) through the float32 scratch, and
    # the weight through blocks of weight_rows rows (NOTE [ float16 products in blocks ]).
    monkeypatch.setattr(_host, "F16_BLOCK_BYTES", 4 * weight_rows * 37)
    monkeypatch.setattr(_host, "F16_MIN_ROWS", 40)
    x = _inputs((131, 37), dtype, scale=1.0)
    w = (_inputs((29, 37), dtype, seed=1, scale=1.0) / 6).astype(dtype)
    for b in (_inputs(29, dtype, seed=2, scale=1.0), None):
        got, want = np.empty((131, 29), dtype), np.empty((131, 29), dtype)
        nb.linear_act(x, w, b, activation, got)
        ref.linear_act(x, w, b, activation, want)
        assert_close(got, want, dtype, scale=10.0)
        # With `pre` (autograd's path): pre = x @ w.T + b, and out = the activation of pre as
        # stored (so in float16 against the reference's activation of our pre, not of its own).
        got_pre, want_pre = np.empty_like(got), np.empty_like(want)
        nb.linear_act(x, w, b, activation, got, pre=got_pre)
        ref.linear_act(x, w, b, None, want_pre)
        assert_close(got_pre, want_pre, dtype, scale=10.0)
        _activation(ref, activation, got_pre, want)
        assert_close(got, want, dtype, scale=10.0)
        # Bitwise what the unfused pair computes: linear without activation, then the activation.
        split_pre, split = np.empty_like(got), np.empty_like(got)
        nb.linear_act(x, w, b, None, split_pre)
        _activation(nb, activation, split_pre, split)
        np.testing.assert_array_equal(got_pre, split_pre)
        np.testing.assert_array_equal(got, split)


def _activation(kernels, activation, x, out):
    """``out = activation(x)`` through a backend's elementwise kernel (None: a copy)."""
    if activation is None:
        out[...] = x
        return
    name, args = {
        "relu": ("relu", ()),
        "gelu": ("gelu", ("none",)),
        "gelu_tanh": ("gelu", ("tanh",)),
        "silu": ("silu", ()),
    }[activation]
    getattr(kernels, name)(x, out, *args)


def test_parallel_threshold_and_describe():
    info = nb.describe()
    assert info["backend"] == "numba" and info["numba"] == numba.__version__
    assert info["threading_layer"] in ("omp", "tbb", "workqueue")
    assert info["threads"] == numba.get_num_threads()
    threshold = info["parallel_min_elements"]
    assert nb_jit._parallel(threshold) and not nb_jit._parallel(threshold - 1)
    if threshold < 2**62:
        assert nb_jit._parallel(threshold // nb_jit._TRANSCENDENTAL_DISCOUNT, transcendental=True)


def test_unary_kernels_go_parallel_where_the_threshold_says(monkeypatch):
    # A transcendental op goes parallel at half the elements of the others (NOTE [ Serial and
    # parallel kernels ]): the unary wrapper asks _jit._parallel at every size where that may say
    # parallel, and forcing the parallel path (as force_path does) reaches it.
    monkeypatch.setattr(nb_jit, "_parallel_min_elements", lambda: 65536)
    monkeypatch.setattr(nb_jit, "_SERIAL_BELOW", 65536)
    monkeypatch.setattr(nb_forward, "_SMALL_UNARY", 65536 // nb_jit._TRANSCENDENTAL_DISCOUNT)
    calls = []
    parallel = nb_forward._unary_parallel
    monkeypatch.setattr(nb_forward, "_unary_parallel", lambda *a: (calls.append(a[0].size), parallel(*a)))
    x = _inputs((40_000,), np.float32)
    got, want = np.empty_like(x), np.empty_like(x)
    nb.gelu(x, got, "tanh")  # 2 x 40,000 elements of work: parallel
    ref.gelu(x, want, "tanh")
    assert calls == [40_000]
    assert_close(got, want, np.float32)
    nb.relu(x, got)  # 40,000 < 65,536: serial
    assert calls == [40_000]
    monkeypatch.setattr(nb_jit, "_parallel", lambda size, transcendental=False: True)
    nb.relu(x, got)
    assert calls == [40_000, 40_000]
    np.testing.assert_array_equal(got, np.maximum(x, 0))


# The small unary path (its overlap test in the kernel) and the other.
@pytest.mark.parametrize("size", [101, nb_jit._SERIAL_BELOW + 1])
@pytest.mark.parametrize("name", ["relu", "gelu", "dropout", "add_relu"])
def test_out_overlapping_the_input(name, size):
    # out may be x itself (the in-place kernels) or a shifted view of it (x is read from a copy).
    base = np.random.default_rng(6).standard_normal(size).astype(np.float32)
    shifts = [(slice(None), slice(None)), (slice(0, -1), slice(1, None)), (slice(1, None), slice(0, -1))]
    for x_slice, out_slice in shifts:
        buf = base.copy()
        x, out = buf[x_slice], buf[out_slice]
        want = np.empty_like(x)
        args = {"relu": (), "gelu": ("none",), "dropout": (0.5, 99), "add_relu": ()}[name]
        if name == "add_relu":
            ref.add_relu(x.copy(), x.copy(), want)
            nb.add_relu(x, x, out)
        else:
            getattr(ref, name)(x.copy(), want, *args)
            getattr(nb, name)(x, out, *args)
        assert_close(out, want, np.float32, scale=10.0)


# The small unary path flattens inside the kernel (NOTE [ A tiny op's kernel call ] in
# numba/forward.py): each ndim is its own specialization, so every ndim is checked against the
# same elements as a flat 1-D call (the flattening done by NumPy, as before), bit for bit, with
# NaN, signed zeros and infinities among them; out may be x itself.
@pytest.mark.parametrize("shape", [(), (0,), (7,), (3, 5), (2, 3, 4), (2, 1, 3, 2)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["relu", "gelu", "gelu_tanh", "silu", "sigmoid", "tanh", "leaky_relu"])
def test_small_unary_any_ndim_equals_the_flat_call(name, dtype, shape):
    special = np.array([np.nan, -0.0, 0.0, np.inf, -np.inf, 1e-30, -2.5], dtype)
    x = np.asarray(_inputs(shape, dtype))  # shape (): a 0-d array, not a scalar
    x.reshape(-1)[: special.size] = special[: x.size]
    args = (0.1,) if name == "leaky_relu" else ()

    def run(a, out):
        if name == "leaky_relu":
            nb.leaky_relu(a, out, *args)
        else:
            run_unary(name, a, out)

    flat = np.empty(x.size, dtype)
    run(x.ravel().copy(), flat)
    got = np.full(shape, 7, dtype)
    run(x, got)
    assert got.shape == x.shape
    np.testing.assert_array_equal(got.reshape(-1).view(np.uint8), flat.view(np.uint8))
    inplace = x.copy()
    run(inplace, inplace)
    np.testing.assert_array_equal(inplace.reshape(-1).view(np.uint8), flat.view(np.uint8))
    want = np.empty(shape)
    if name == "leaky_relu":
        ref.leaky_relu(x.astype(np.float64), want, *args)
    elif name.startswith("gelu"):
        ref.gelu(x.astype(np.float64), want, "tanh" if name == "gelu_tanh" else "none")
    else:
        getattr(ref, name)(x.astype(np.float64), want)
    assert_close(got, want.astype(dtype), dtype, scale=10.0)


# float16's budget in rows of the (549, 23) weight: the default (one chunk, the whole weight),
# the whole weight in chunks of 23 rows, and blocks of 100 weight rows with chunks of 20 rows.
_BACKWARD_BLOCKS = [(dtype, None) for dtype in DTYPES] + [(np.float16, 549), (np.float16, 100)]


@pytest.mark.parametrize(("dtype", "weight_rows"), _BACKWARD_BLOCKS)
@pytest.mark.parametrize("activation", [None, "relu", "gelu", "gelu_tanh", "silu"])
def test_linear_act_backward_both_paths(dtype, weight_rows, activation, force_path, monkeypatch):
    # The parallel epilogue works in column tiles (NOTE [ Column tiles as spans from 0 ]): two
    # whole tiles and a partial one. Each gradient matches the reference, and the parallel
    # result is bitwise the serial one (the same operations, the column sums in the same order).
    # float16 goes through row chunks and weight blocks (NOTE [ float16 products in blocks ]).
    if weight_rows is not None:
        monkeypatch.setattr(_host, "F16_BLOCK_BYTES", 4 * weight_rows * 23)
        monkeypatch.setattr(_host, "F16_MIN_ROWS", 20)
    rows, in_features, out_features = 67, 23, 2 * _COL_TILE + 37
    x = _inputs((rows, in_features), dtype, scale=1.0)
    w = _inputs((out_features, in_features), dtype, seed=1, scale=0.2)
    pre = _inputs((rows, out_features), dtype, seed=2, scale=2.0)
    g = _inputs((rows, out_features), dtype, seed=3, scale=1.0)
    results = {}
    for parallel in (False, True):
        force_path(parallel)
        grads = (np.empty((rows, in_features), dtype), np.empty_like(w), np.empty(out_features, dtype))
        nb.linear_act_backward(x, w, pre, g, activation, np.empty(g.shape, dtype), *grads)
        results[parallel] = grads
    wide = [a.astype(np.float64) for a in (x, w, pre, g)]
    want = (np.empty((rows, in_features)), np.empty(w.shape), np.empty(out_features))
    ref.linear_act_backward(*wide[:3], wide[3], activation, np.empty(g.shape), *want)
    for serial, par, expected in zip(results[False], results[True], want):
        np.testing.assert_array_equal(par, serial)
        assert_close(serial, expected, dtype, scale=100.0)


@pytest.mark.parametrize("activation", [None, "gelu"])
def test_float16_linear_converts_blocks_not_whole_tensors(activation, monkeypatch):
    # NOTE [ float16 products in blocks ]: with a 64 KiB budget, what the forward and the backward
    # allocate (the pool bypassed, so that every scratch buffer is a new allocation tracemalloc
    # sees) stays far below the float32 form of any operand: 2 MiB for w, 4 MiB for x, 8 MiB for
    # grad_out. Converting any one of them whole, as the kernels once did, exceeds the bound.
    import tracemalloc

    from taifuse import pool

    budget = 64 * 1024
    monkeypatch.setattr(_host, "F16_BLOCK_BYTES", budget)
    monkeypatch.setattr(_host, "F16_MIN_ROWS", 8)
    rows, k, m = 2048, 512, 1024
    x = _inputs((rows, k), np.float16, scale=1.0)
    w = (_inputs((m, k), np.float16, seed=1, scale=1.0) / 20).astype(np.float16)
    b = _inputs(m, np.float16, seed=2, scale=1.0)
    g = _inputs((rows, m), np.float16, seed=3, scale=1.0)
    out, pre = np.empty((rows, m), np.float16), np.empty((rows, m), np.float16)
    grads = (np.empty_like(x), np.empty_like(w), np.empty_like(b))
    bound = 1024 * 1024  # half of w's float32 form, the smallest of the operands'

    def peak_of(call):
        with pool.host_pool().disabled():
            tracemalloc.start()
            try:
                call()
                return tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()

    grad_pre = np.empty_like(g)
    calls = (
        lambda: nb.linear_act(x, w, b, activation, out, pre=pre),
        lambda: nb.linear_act_backward(x, w, pre, g, activation, grad_pre, *grads),
    )
    for call in calls:
        call()  # compile outside the measurement
    forward, backward = (peak_of(call) for call in calls)
    assert forward < bound and backward < bound, (forward, backward)
    # Still the right answer through 128 chunks and 32 weight blocks: within float16's rounding
    # of each result (2**-11 relative) plus float32 summation, against float64. The sums run over
    # up to 2048 terms and cancel, so the absolute part scales with the largest result.
    wide = [a.astype(np.float64) for a in (x, w, b, g)]
    want = np.empty((rows, m))
    ref.linear_act(wide[0], wide[1], wide[2], None, want)
    want_grads = (np.empty((rows, k)), np.empty((m, k)), np.empty(m))
    wide_pre = pre.astype(np.float64)
    ref.linear_act_backward(wide[0], wide[1], wide_pre, wide[3], activation, np.empty((rows, m)), *want_grads)
    for got, expected in zip((pre, *grads), (want, *want_grads)):
        atol = 2.0**-12 * np.abs(expected).max()
        np.testing.assert_allclose(got.astype(np.float64), expected, rtol=2.0**-11, atol=atol)


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "silu", "relu"])
def test_linear_backward_flushes_subnormal_grad_pre(activation):
    # NOTE [ Subnormal gradients ]: g * act'(pre) below float32's smallest normal becomes a zero
    # of the same sign; normal results, NaN and infinities are untouched. The truth is computed
    # in float64, where these values are normal: float32 subnormals depend on the thread's
    # flush mode, which Taichi's ti.init turns on for the whole process.
    tiny = float(np.finfo(np.float32).tiny)
    # act'(1) is near 1 for every activation, so g = +-tiny/4 gives a product below tiny.
    pre = np.array([[1.0, 1.0, 0.5, 1.0, 2.0, -3.0]])
    g = np.array([[tiny / 4, -tiny / 4, 0.25, np.nan, np.inf, 0.5]])
    x, w = np.ones((1, 3)), np.ones((6, 3))
    got = np.empty(g.shape, np.float32)
    nb.linear_act_backward(
        x.astype(np.float32),
        w.astype(np.float32),
        pre.astype(np.float32),
        g.astype(np.float32),
        activation,
        got,
        None,
        None,
        None,
    )
    want = np.empty(g.shape)
    ref.linear_act_backward(x, w, pre, g, activation, want, None, None, None)
    assert 0 < abs(want[0, 0]) < tiny and 0 < abs(want[0, 1]) < tiny, "the setup should make subnormals"
    assert got[0, 0] == 0 and got[0, 1] == 0
    assert np.signbit(got[0, :2]).tolist() == np.signbit(want[0, :2]).tolist()
    assert np.isnan(got[0, 3]) and np.isnan(want[0, 3])
    np.testing.assert_allclose(got[0, [2, 4, 5]], want[0, [2, 4, 5]], rtol=1e-6, atol=0)


# The elementwise backwards that flush: each with an input where its derivative is near 1 (gelu,
# gelu_tanh, silu at x = 1) or 0.25 (sigmoid from its output y = 0.5).
_UNARY_BACKWARD = {
    "gelu": (lambda m, x, g, o: m.gelu_backward(x, g, o, "none"), 1.0),
    "gelu_tanh": (lambda m, x, g, o: m.gelu_backward(x, g, o, "tanh"), 1.0),
    "silu": (lambda m, x, g, o: m.silu_backward(x, g, o), 1.0),
    "sigmoid": (lambda m, y, g, o: m.sigmoid_backward(y, g, o), 0.5),
}


@pytest.mark.parametrize("name", sorted(_UNARY_BACKWARD))
def test_elementwise_backward_flushes_subnormal_gradients(name):
    # NOTE [ Subnormal gradients ]: the same flush as the linear epilogue, checked the same way
    # (float64 truth, where these values are normal). g = +-tiny/8 times a derivative <= ~1.1.
    run, at = _UNARY_BACKWARD[name]
    tiny = float(np.finfo(np.float32).tiny)
    x = np.full(6, at)
    g = np.array([tiny / 8, -tiny / 8, 0.25, np.nan, np.inf, 0.5])
    got = np.empty(6, np.float32)
    run(nb, x.astype(np.float32), g.astype(np.float32), got)
    want = np.empty(6)
    run(ref, x, g, want)
    assert 0 < abs(want[0]) < tiny and 0 < abs(want[1]) < tiny, "the setup should make subnormals"
    assert got[0] == 0 and got[1] == 0
    assert np.signbit(got[:2]).tolist() == np.signbit(want[:2]).tolist()
    assert np.isnan(got[3]) and np.isnan(want[3])
    np.testing.assert_allclose(got[[2, 4, 5]], want[[2, 4, 5]], rtol=1e-6, atol=0)


@pytest.mark.parametrize("user_value", [None, "5"])
def test_short_openmp_spin_is_set_for_numba_only_and_never_left_behind(user_value):
    """NOTE [ OpenMP spin between BLAS calls ]: starting the backend loads libgomp with
    GOMP_SPINCOUNT set only while it loads, so the variable never reaches the rest of the process
    (or PyTorch, or a child process); a value the user set stays as it was."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    env["OMP_DISPLAY_ENV"] = "VERBOSE"  # libgomp prints the settings it read when it loaded
    if user_value is not None:
        env["GOMP_SPINCOUNT"] = user_value
    code = (
        "import os, taifuse\n"
        "taifuse.set_backend('numba')\n"
        "from taifuse.backends import numba as nb\n"
        "nb.init()\n"
        "print(nb.describe()['threading_layer'], os.environ.get('GOMP_SPINCOUNT'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    layer, seen = out.stdout.split()
    assert seen == str(user_value)
    if layer == "omp" and "GOMP_SPINCOUNT = " in out.stderr:  # GNU OpenMP (not LLVM's libomp)
        assert f"GOMP_SPINCOUNT = '{user_value or nb_jit._SHORT_SPIN}'" in out.stderr


@pytest.mark.parametrize("user_value", [None, "28"])
def test_openblas_spin_is_shortened_at_start_and_a_users_timeout_is_left_alone(user_value):
    """NOTE [ OpenBLAS spin after a product ]: starting the backend restarts NumPy's OpenBLAS workers
    with a timeout of 2**SPIN_LOG2 cycles, with OPENBLAS_THREAD_TIMEOUT set only while OpenBLAS reads
    it; the workers then sleep after a product instead of spinning for ~0.1 s. A value the user set
    stays, and so does the spin it asks for."""
    import os
    import subprocess
    import sys

    from taifuse.backends.numba import _blas

    if _blas.spin_log2() is None:
        pytest.skip("NumPy's BLAS is not an OpenBLAS that exports openblas_thread_timeout")
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_THREAD_TIMEOUT", "GOTO_THREAD_TIMEOUT")}
    env["OPENBLAS_NUM_THREADS"] = "2"  # a worker thread to spin, whatever this machine's cores
    if user_value is not None:
        env["OPENBLAS_THREAD_TIMEOUT"] = user_value
    code = (
        "import os, time, numpy as np, taifuse\n"
        "taifuse.set_backend('numba')\n"
        "from taifuse.backends import numba as nb\n"
        "nb.init()\n"
        "a = np.ones((512, 512), np.float32)\n"
        "for _ in range(3): a @ a\n"
        "c = time.process_time(); a @ a; time.sleep(0.3)\n"
        "print(nb.describe()['openblas_spin_log2'], os.environ.get('OPENBLAS_THREAD_TIMEOUT'), "
        "time.process_time() - c)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    log2, seen, cpu = out.stdout.split()
    assert seen == str(user_value)  # never left behind for later processes
    assert int(log2) == int(user_value or _blas.SPIN_LOG2)
    if user_value is None:
        # 2**18 cycles is ~0.1 ms: one product and its short spin, then asleep (the default: ~0.1 s)
        assert float(cpu) < 0.05, f"the OpenBLAS worker still spun after the product: {cpu} s of CPU"
