"""The Numba fused Conv-BN-ReLU block's kernels that call ``?gemm`` from Numba's threads (NOTE [ BLAS
from Numba threads ] in ``backends/numba/conv.py``): ``conv2d_stats``'s items (``_stats_items``:
implicit GEMM, in place for items of one image, through scratch for items of several; im2col's
padded columns) and ``conv2d_batch_norm_backward``'s parts (``_bn_backward_items``: with and
without grad_x, a network's first layer). Each gives the bits of the Python items that run where
the library's ``?gemm`` address is not found (the same products on the same operands, summed in
the same order), on one and two threads, and the reference's values.

Tolerances as tests/test_conv_numba.py's and tests/test_conv_numba_backward.py's: the output
against the float64 reference relative to the sums on magnitudes (float32 1e-5, float16 2e-3,
float64 1e-12); the statistics against NumPy's float64 ones of the output as stored (rtol 1e-5,
float64 1e-12); the gradients against the reference with the backward suite's bound (float32
2e-5, float64 1e-12 of the sums on magnitudes).
"""

from __future__ import annotations

import numpy as np
import pytest

numba = pytest.importorskip("numba")

from taifuse.backends import reference as ref
from taifuse.backends.numba import _blas
from taifuse.backends.numba import conv as nb_conv

# (N, C, H, W, OC, (kh, kw), stride, padding, dilation, groups)
STATS = {
    # 99 output pixels: items of several images through scratch (implicit) or im2col's columns
    "small-images": (7, 3, 9, 11, 5, (3, 3), (1, 1), (1, 1), (1, 1), 1),
    # 1,056 output pixels: one image an item, in place (implicit); groups
    "one-image-groups2": (3, 4, 33, 32, 6, (3, 3), (1, 1), (1, 1), (1, 1), 2),
    "N1-dilation2-H!=W": (1, 3, 11, 40, 5, (3, 3), (1, 1), (2, 2), (2, 2), 1),
    # a 1 x 1 kernel: im2col's columns as wide as the output, one image an item lands in place
    "1x1-N1": (1, 2, 5, 4, 6, (1, 1), (1, 1), (0, 0), (1, 1), 1),
}
BACKWARD = {
    "steps-of-several": (9, 4, 16, 16, 6, (3, 3), (1, 1), (1, 1), (1, 1), 1),
    "1x1-stride2-groups2": (5, 4, 9, 9, 6, (1, 1), (2, 2), (0, 0), (1, 1), 2),
    # one image a step, 3 channels: the columns (not the per-tap grad_w, which stays in Python)
    "N2-few-channels": (2, 3, 32, 33, 8, (3, 3), (1, 1), (1, 1), (1, 1), 1),
}
TOLERANCE = {np.float32: 1e-5, np.float16: 2e-3, np.float64: 1e-12}
BACKWARD_TOLERANCE = {np.float32: 2e-5, np.float64: 1e-12}


def _out_size(size, k, s, p, d):
    return (size + 2 * p - d * (k - 1) - 1) // s + 1


def _f64(a):
    return None if a is None else a.astype(np.float64)


def _threads(count):
    if count > numba.config.NUMBA_NUM_THREADS:
        pytest.skip(f"needs {count} Numba threads")
    return count


def _shape(geometry):
    n, _c, h, w, oc, (kh, kw), stride, padding, dilation, _groups = geometry
    return (n, oc, _out_size(h, kh, stride[0], padding[0], dilation[0]),
            _out_size(w, kw, stride[1], padding[1], dilation[1]))  # fmt: skip


def _inputs(geometry, dtype, seed):
    n, c, h, w, oc, (kh, kw), _s, _p, _d, groups = geometry
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((n, c, h, w)) + 3.0).astype(dtype)  # an offset mean: the shifted sums
    wt = (rng.standard_normal((oc, c // groups, kh, kw)) / np.sqrt(c // groups * kh * kw)).astype(dtype)
    b = (rng.standard_normal(oc) + 10.0).astype(dtype)
    return x, wt, b


def _spy(monkeypatch, name):
    """Records each call of the kernel ``name`` of conv.py (the path taken)."""
    calls, kernel = [], getattr(nb_conv, name)
    monkeypatch.setattr(nb_conv, name, lambda *args: calls.append(name) or kernel(*args))
    return calls


def _on_threads(threads, run):
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(_threads(threads))
        return run()
    finally:
        numba.set_num_threads(before)


@pytest.fixture(params=["implicit", "im2col"])
def path(request, monkeypatch):
    if _blas.address(np.float32) is None:
        pytest.skip("no OpenBLAS with CBLAS loaded: the block takes the Python items")
    if request.param == "implicit":
        monkeypatch.setattr(nb_conv, "IMPLICIT_MIN_K", 0)
    else:  # the columns: no implicit GEMM (the ?gemm the kernel calls stays reachable by address)
        monkeypatch.setattr(_blas, "gemm", lambda dtype: None)
    return request.param


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("geometry", STATS.values(), ids=STATS.keys())
def test_numba_conv2d_stats_from_numba_matches_the_python_items(geometry, dtype, threads, path, monkeypatch):
    x, wt, b = _inputs(geometry, dtype, seed=1)
    *_, stride, padding, dilation, groups = geometry
    shape = _shape(geometry)
    oc = shape[1]
    stats = np.float64 if dtype == np.float64 else np.float32
    calls = _spy(monkeypatch, "_stats_items")

    def run():
        out, mean, var = np.empty(shape, dtype), np.empty(oc, stats), np.empty(oc, stats)
        nb_conv.conv2d_stats(x, wt, b, stride, padding, dilation, groups, out, mean, var)
        return out, mean, var

    new = _on_threads(threads, run)
    monkeypatch.setattr(_blas, "address", lambda dtype: None)  # not found: the Python items
    old = _on_threads(threads, run)
    assert calls == ["_stats_items"]
    for what, a, b_ in zip(("out", "mean", "var"), new, old):
        np.testing.assert_array_equal(a, b_, err_msg=what)
    out, mean, var = new
    expected, scale = np.empty(shape), np.empty(shape)
    ref.conv2d(_f64(x), _f64(wt), _f64(b), stride, padding, dilation, groups, None, expected)
    ref.conv2d(
        np.abs(_f64(x)), np.abs(_f64(wt)), np.abs(_f64(b)), stride, padding, dilation, groups, None, scale
    )
    tol = TOLERANCE[dtype]
    np.testing.assert_array_less(np.abs(out.astype(np.float64) - expected), tol * np.maximum(1.0, scale))
    stored = out.astype(np.float64).transpose(1, 0, 2, 3).reshape(oc, -1)
    rtol = 1e-12 if dtype == np.float64 else 1e-5
    np.testing.assert_allclose(mean, stored.mean(axis=1), rtol=rtol, atol=rtol * 10)
    np.testing.assert_allclose(var, stored.var(axis=1), rtol=rtol, atol=rtol)


@pytest.mark.parametrize("input_grad", [True, False], ids=["grad_x", "no-grad_x"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("geometry", BACKWARD.values(), ids=BACKWARD.keys())
def test_numba_conv2d_batch_norm_backward_from_numba_matches_the_python_items(
    geometry, dtype, threads, input_grad, monkeypatch
):
    if _blas.address(np.float32) is None:
        pytest.skip("no OpenBLAS with CBLAS loaded: the block takes the Python items")
    x, wt, _b = _inputs(geometry, dtype, seed=3)
    *_, stride, padding, dilation, groups = geometry
    shape = _shape(geometry)
    oc = shape[1]
    rng = np.random.default_rng(4)
    y, g = rng.standard_normal(shape).astype(dtype), rng.standard_normal(shape).astype(dtype)
    stats = np.float64 if dtype == np.float64 else np.float32
    mean, invstd = rng.standard_normal(oc).astype(stats), rng.uniform(0.5, 2.0, oc).astype(stats)
    gamma, beta = rng.uniform(0.5, 1.5, oc).astype(stats), rng.standard_normal(oc).astype(stats)
    args = (mean, invstd, gamma, beta, "relu", stride, padding, dilation, groups)
    calls = _spy(monkeypatch, "_bn_backward_items")

    def run():
        gx = np.empty(x.shape, dtype) if input_grad else None
        gw, gbw, gbb = np.empty(wt.shape, dtype), np.empty(oc, stats), np.empty(oc, stats)
        nb_conv.conv2d_batch_norm_backward(x, wt, y, g, *args, gx, gw, None, gbw, gbb)
        return gx, gw, gbw, gbb

    new = _on_threads(threads, run)
    monkeypatch.setattr(_blas, "address", lambda dtype: None)  # not found: the Python items
    old = _on_threads(threads, run)
    assert calls == ["_bn_backward_items"]
    for what, a, b_ in zip(("grad_x", "grad_w", "grad_bn_weight", "grad_bn_bias"), new, old):
        np.testing.assert_array_equal(a, b_, err_msg=what)
    ex, ew, ebw, ebb = np.empty(x.shape), np.empty(wt.shape), np.empty(oc), np.empty(oc)
    ref.conv2d_batch_norm_backward(_f64(x), _f64(wt), _f64(y), _f64(g), *args, ex, ew, None, ebw, ebb)
    # grad_pre's magnitude bound: |gamma * invstd| (|g| + mean |g| + |xhat| mean |g xhat|)
    c4 = (1, oc, 1, 1)
    xhat = np.abs((_f64(y) - mean.reshape(c4)) * invstd.reshape(c4))
    ga = np.abs(_f64(g))
    gp = ga + ga.mean(axis=(0, 2, 3), keepdims=True) + xhat * (ga * xhat).mean(axis=(0, 2, 3), keepdims=True)
    gp *= np.abs(gamma * invstd).reshape(c4)
    sx, sw, sb = np.empty(x.shape), np.empty(wt.shape), np.empty(oc)
    ref.conv2d_backward(np.abs(_f64(x)), np.abs(_f64(wt)), None, gp, stride, padding, dilation, groups, None,
                        sx, sw, sb)  # fmt: skip
    tol = BACKWARD_TOLERANCE[dtype]
    gx, gw, gbw, gbb = new
    if input_grad:
        np.testing.assert_array_less(np.abs(gx - ex), tol * np.maximum(1.0, sx))
    np.testing.assert_array_less(np.abs(gw - ew), tol * np.maximum(1.0, sw))
    np.testing.assert_allclose(gbb, ebb, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(gbw, ebw, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("hidden", [False, True], ids=["kernel", "python-items"])
@pytest.mark.parametrize("where", ["input", "weight"])
def test_numba_conv2d_batch_norm_backward_keeps_infinities_where_the_reference_has_them(
    where, hidden, monkeypatch
):
    """The padded columns' junk is zeroed only where x (grad_w's product) or w (the columns'
    gradient) holds an inf or NaN; then inf and NaN land where the float64 reference puts them,
    and nowhere else (0 * inf is NaN in a junk column otherwise)."""
    if hidden:
        monkeypatch.setattr(_blas, "address", lambda dtype: None)
    geometry = BACKWARD["steps-of-several"]
    x, wt, _b = _inputs(geometry, np.float32, seed=5)
    if where == "input":
        x[1, 2, 5, 15] = np.inf  # the last column: the junk columns of the padded row before read it
    else:
        wt[3, 1, 0, 2] = -np.inf
    *_, stride, padding, dilation, groups = geometry
    shape = _shape(geometry)
    oc = shape[1]
    rng = np.random.default_rng(6)
    y, g = rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32)
    ones = np.ones(oc, np.float32)
    args = (
        np.zeros(oc, np.float32),
        ones,
        ones,
        np.zeros(oc, np.float32),
        "relu",
        stride,
        padding,
        dilation,
        groups,
    )
    gx, gw = np.empty(x.shape, np.float32), np.empty(wt.shape, np.float32)
    nb_conv.conv2d_batch_norm_backward(x, wt, y, g, *args, gx, gw, None, np.empty(oc, np.float32),
                                       np.empty(oc, np.float32))  # fmt: skip
    ex, ew = np.empty(x.shape), np.empty(wt.shape)
    ref.conv2d_batch_norm_backward(_f64(x), _f64(wt), _f64(y), _f64(g), *args, ex, ew, None, np.empty(oc),
                                   np.empty(oc))  # fmt: skip
    for what, a, e in (("grad_x", gx, ex), ("grad_w", gw, ew)):
        np.testing.assert_array_equal(np.isnan(a), np.isnan(e), err_msg=what)
        np.testing.assert_array_equal(np.isinf(a) * np.sign(a), np.isinf(e) * np.sign(e), err_msg=what)
        fin = np.isfinite(e)
        np.testing.assert_allclose(a[fin], e[fin], rtol=1e-4, atol=1e-4, err_msg=what)
    assert not np.isfinite(ew if where == "input" else ex).all()  # the case reaches the non-finite values
