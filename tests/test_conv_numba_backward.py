"""The Numba convolution backward's work items (NOTE [ Convolution on the host: im2col in blocks ]).

``conv2d_backward`` and ``conv2d_batch_norm_backward`` share the images out between threads in
parts of consecutive images, each part summing its own grad_w, taken a step of whole images at a
time: one image a step where it has at least ``ITEM_MIN_COLUMNS`` output pixels (at stride 1 with
one group of ``TAPS_MIN_CHANNELS`` to ``TAPS_MAX_CHANNELS`` input channels, grad_w as one product
per tap from the image's padded planes, no columns; the N = 1 case with fewer channels and the
32-channel case take the columns), several small ones a step otherwise (the columns). The
columns' grad_w product runs in either order, (OC, K) or (K, OC), by which is larger, per group
too (``test_..._take_the_paths_named``). The geometries below reach each with one and two
threads, at odd sizes: 1 x 1 and 7 x 7 kernels, stride 2, dilation 2, groups (depthwise too),
N = 1, H != W, a last part and a last step shorter than the others; every subset of the three
gradients (an input without grad: a network's first layer).

Tolerances: against the float64 reference on the same (stored) values, relative to the sums on
magnitudes (``_scale``: the reference's backward of |x|, |w| and 1.2 |grad_out|, 1.2 bounding
every activation's slope): float32 2e-5 (grad_w sums up to 3 * 1,056 products, in BLAS's blocks
and then over the parts: a few hundred roundings of 2**-24 at worst, far fewer in practice);
float16 storage 1e-3 (the float32 math as above, then half an ulp, 2**-11, for a stored
gradient); float64 1e-12.
"""

from __future__ import annotations

import numpy as np
import pytest

numba = pytest.importorskip("numba")

from taifuse.backends import reference as ref
from taifuse.backends.numba import _blas
from taifuse.backends.numba import conv as nb_conv

# (N, C, H, W, OC, (kh, kw), stride, padding, dilation, groups, activation)
GEOMETRIES = {
    # 99 output pixels: eleven images a step, one step
    "small-images": (7, 3, 9, 11, 5, (3, 3), (1, 1), (1, 1), (1, 1), 1, "relu"),
    # 256 output pixels: four images a step, three parts, the last step of one image
    "steps-of-several": (9, 4, 16, 16, 6, (3, 3), (1, 1), (1, 1), (1, 1), 1, None),
    # 1,056 output pixels: one image a step, grad_w from the padded planes per tap
    "one-image-taps": (3, 8, 33, 32, 6, (3, 3), (1, 1), (1, 1), (1, 1), 1, "gelu"),
    "1x1-stride2-groups2": (5, 4, 9, 9, 6, (1, 1), (2, 2), (0, 0), (1, 1), 2, "silu"),
    "7x7-dilation2-H!=W": (3, 2, 40, 37, 3, (7, 7), (2, 1), (3, 3), (2, 2), 1, None),
    "dilation2-taps": (2, 8, 34, 33, 4, (3, 3), (1, 1), (2, 2), (2, 2), 1, "gelu_tanh"),
    # 1,024 output pixels, 32 input channels: one image a step, grad_w from the columns, (K, OC)
    "one-image-columns": (3, 32, 32, 32, 5, (3, 3), (1, 1), (1, 1), (1, 1), 1, "relu"),
    "N1-depthwise": (1, 4, 32, 33, 8, (3, 3), (1, 1), (1, 1), (1, 1), 4, "relu"),
    "N1-few-channels": (1, 3, 32, 32, 8, (3, 3), (1, 1), (1, 1), (1, 1), 1, None),
    # 1,122 output pixels, a 3 x 5 kernel dilated 2 x 1: grad_w one product per kernel row
    "kw-rows-dilated": (2, 3, 34, 33, 4, (3, 5), (1, 1), (2, 2), (2, 1), 1, "gelu"),
}
TOLERANCE = {np.float32: 2e-5, np.float16: 1e-3, np.float64: 1e-12}
WANTS = {
    "all": (True, True, True),
    "no-input-grad": (False, True, True),
    "input-grad-only": (True, False, False),
}


def _out_size(size, k, s, p, d):
    return (size + 2 * p - d * (k - 1) - 1) // s + 1


def _f64(a):
    return None if a is None else a.astype(np.float64)


def _arrays(geometry, dtype, seed=0):
    n, c, h, w, oc, (kh, kw), stride, padding, dilation, groups, act = geometry
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, c, h, w)).astype(dtype)
    wt = (rng.standard_normal((oc, c // groups, kh, kw)) / np.sqrt(c // groups * kh * kw)).astype(dtype)
    shape = (n, oc, _out_size(h, kh, stride[0], padding[0], dilation[0]),
             _out_size(w, kw, stride[1], padding[1], dilation[1]))  # fmt: skip
    pre = rng.standard_normal(shape).astype(dtype) if act else None
    g = rng.standard_normal(shape).astype(dtype)
    return x, wt, pre, g


def _threads(count):
    if count > numba.config.NUMBA_NUM_THREADS:
        pytest.skip(f"needs {count} Numba threads")
    return count


def _backward(geometry, x, wt, pre, g, wants, threads):
    *_, stride, padding, dilation, groups, act = geometry
    gx, gw, gb = (np.empty(shape, x.dtype) if want else None
                  for shape, want in zip((x.shape, wt.shape, wt.shape[:1]), wants))  # fmt: skip
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(_threads(threads))
        nb_conv.conv2d_backward(x, wt, pre, g, stride, padding, dilation, groups, act, gx, gw, gb)
    finally:
        numba.set_num_threads(before)
    return gx, gw, gb


def _reference(geometry, x, wt, pre, g, act=None):
    *_, stride, padding, dilation, groups, _act = geometry
    out = np.empty(x.shape), np.empty(wt.shape), np.empty(wt.shape[0])
    ref.conv2d_backward(_f64(x), _f64(wt), _f64(pre), _f64(g), stride, padding, dilation, groups, act, *out)
    return out


def _scale(geometry, x, wt, gp):
    """The sums on magnitudes, for grad_pre's magnitude ``gp``."""
    return [np.maximum(1.0, s) for s in _reference(geometry, np.abs(x), np.abs(wt), None, gp)]


@pytest.mark.parametrize("wants", WANTS.values(), ids=WANTS.keys())
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("geometry", GEOMETRIES.values(), ids=GEOMETRIES.keys())
def test_numba_conv2d_backward_work_items_match_the_reference(geometry, dtype, threads, wants):
    x, wt, pre, g = _arrays(geometry, dtype)
    got = _backward(geometry, x, wt, pre, g, wants, threads)
    expected = _reference(geometry, x, wt, pre, g, geometry[-1])
    scale = _scale(geometry, x, wt, 1.2 * np.abs(g))
    for what, a, e, s in zip(("grad_x", "grad_w", "grad_b"), got, expected, scale):
        if a is not None:
            np.testing.assert_array_less(np.abs(a.astype(np.float64) - e), TOLERANCE[dtype] * s, err_msg=what)


@pytest.mark.parametrize("geometry", GEOMETRIES.values(), ids=GEOMETRIES.keys())
def test_numba_conv2d_backward_gives_the_same_bits_on_one_and_two_threads(geometry):
    """The parts are fixed by the batch (BACKWARD_PARTS, not the thread count, up to that many
    threads) and summed in their order: a run on two threads gives the one-thread bits, and so
    does the same run again."""
    x, wt, pre, g = _arrays(geometry, np.float32, seed=1)
    one = _backward(geometry, x, wt, pre, g, WANTS["all"], 1)
    for _ in range(2):
        two = _backward(geometry, x, wt, pre, g, WANTS["all"], 2)
        for what, a, b in zip(("grad_x", "grad_w", "grad_b"), one, two):
            np.testing.assert_array_equal(a, b, err_msg=what)


# geometry -> (grad_w per tap, grad_w's product as (K, OC) per group, one product per kernel row)
PATHS = {
    "small-images": (False, True, False),  # K = 27 > OC = 5, eleven images a step
    "steps-of-several": (False, True, False),
    "one-image-taps": (True, True, False),
    "1x1-stride2-groups2": (False, False, False),  # K = 2 < OCg = 3
    "7x7-dilation2-H!=W": (False, True, False),  # stride 2
    "dilation2-taps": (True, True, False),
    "one-image-columns": (False, True, True),
    "N1-depthwise": (False, True, False),  # K = 9 > OCg = 2, four groups
    "N1-few-channels": (False, True, True),
    "kw-rows-dilated": (False, True, True),
}


@pytest.mark.parametrize("geometry", PATHS, ids=PATHS.keys())
def test_numba_conv2d_backward_geometries_take_the_paths_named(geometry):
    """The geometries above reach the per-tap weight gradient, both orders of the columns' product
    (with one group and with several) and the products per kernel row, as their comments say."""
    n, c, h, w, oc, (kh, kw), stride, padding, dilation, groups, _act = GEOMETRIES[geometry]
    x = np.zeros((n, c, h, w), np.float32)
    wt = np.zeros((oc, c // groups, kh, kw), np.float32)
    oh, ow = (
        _out_size(h, kh, stride[0], padding[0], dilation[0]),
        _out_size(w, kw, stride[1], padding[1], dilation[1]),
    )
    gw = np.empty(wt.shape, np.float32)
    bw = nb_conv._Backward(x, wt, None, oc, stride, padding, dilation, groups, oh, ow, None, gw)
    assert (bw.taps, bw.kmajor, bw.kwrows) == PATHS[geometry]


def test_numba_conv2d_backward_takes_one_part_a_step():
    """Each step of images is a part of its own (its grad_w sum written by its first product), so
    that the worker to finish first waits at most one step: twenty 32 x 32 images, twenty parts;
    with steps of four 16 x 16 images, five parts; BACKWARD_PARTS caps them (ten images, two a part)."""

    def parts(n, size):
        x = np.zeros((n, 8, size, size), np.float32)
        wt = np.zeros((16, 8, 3, 3), np.float32)
        gw = np.empty(wt.shape, np.float32)
        bw = nb_conv._Backward(x, wt, None, 16, (1, 1), (1, 1), (1, 1), 1, size, size, None, gw)
        return [n1 - n0 for _, n0, n1 in bw.items]

    assert parts(20, 32) == [1] * 20
    assert parts(20, 16) == [4] * 5
    before = nb_conv.BACKWARD_PARTS
    try:
        nb_conv.BACKWARD_PARTS = 5
        assert parts(10, 32) == [2] * 5
    finally:
        nb_conv.BACKWARD_PARTS = before


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=lambda d: np.dtype(d).name)
def test_numba_sum_parts_gives_numpys_sum_over_the_parts(dtype):
    """The parts' grad_w sums are added on Numba's threads in the parts' order: NumPy's
    ``sum(axis=0)`` bits (each element summed in order), over a ragged last block of elements."""
    rng = np.random.default_rng(5)
    parts = (rng.standard_normal((13, 3 * 4096 + 77)) * 10.0 ** rng.integers(-3, 4, (13, 1))).astype(dtype)
    out = np.empty(parts.shape[1], dtype)
    nb_conv._sum_parts(parts, out)
    np.testing.assert_array_equal(out, np.sum(parts, axis=0))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("geometry", ["one-image-taps", "one-image-columns"])
def test_numba_conv2d_backward_keeps_infinities_where_the_reference_has_them(geometry):
    """The per-tap weight gradient reads each padded row's junk columns against zeros of grad_pre
    (0 * inf is NaN), so an image with an inf takes the columns instead, whose junk columns are
    zeroed before the product where the image holds an inf or NaN (skipped for a finite image:
    its junk times 0 adds only zeros); and the columns' gradient is zeroed in those columns before
    col2im where the weight holds one, so an infinite weight reaches only the input positions it
    multiplies. Inf and NaN land where the float64 reference puts them."""
    geometry = GEOMETRIES[geometry]
    x, wt, pre, g = _arrays(geometry, np.float32, seed=2)
    x[1, 2, 5, 31] = np.inf  # the last column: its padded row's junk columns read it
    wt[3, 1, 0, 2] = -np.inf
    got = _backward(geometry, x, wt, pre, g, WANTS["all"], 2)
    expected = _reference(geometry, x, wt, pre, g, geometry[-1])
    for what, a, e in zip(("grad_x", "grad_w"), got, expected):
        assert np.isfinite(e).sum() < e.size, what  # the case reaches the non-finite values
        np.testing.assert_array_equal(np.isnan(a), np.isnan(e), err_msg=what)
        np.testing.assert_array_equal(np.isinf(a) * np.sign(a), np.isinf(e) * np.sign(e), err_msg=what)
        fin = np.isfinite(e)
        np.testing.assert_allclose(a[fin], e[fin], rtol=1e-4, atol=1e-4, err_msg=what)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("geometry", ["steps-of-several", "one-image-taps", "1x1-stride2-groups2"])
def test_numba_conv2d_batch_norm_backward_work_items_match_the_reference(geometry, dtype, threads):
    """The fused block's backward writes batch norm's input gradient as the products' grad_pre,
    on the same work items."""
    geometry = GEOMETRIES[geometry]
    *_, stride, padding, dilation, groups, _act = geometry
    x, wt, _pre, g = _arrays(geometry, dtype, seed=3)
    rng = np.random.default_rng(4)
    y = rng.standard_normal(g.shape).astype(dtype)
    oc = g.shape[1]
    mean, invstd = rng.standard_normal(oc).astype(np.float32), rng.uniform(0.5, 2.0, oc).astype(np.float32)
    gamma, beta = rng.uniform(0.5, 1.5, oc).astype(np.float32), rng.standard_normal(oc).astype(np.float32)
    args = (mean, invstd, gamma, beta, "relu", stride, padding, dilation, groups)
    gx, gw = np.empty(x.shape, dtype), np.empty(wt.shape, dtype)
    gbw, gbb = np.empty(oc, np.float32), np.empty(oc, np.float32)
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(_threads(threads))
        nb_conv.conv2d_batch_norm_backward(x, wt, y, g, *args, gx, gw, None, gbw, gbb)
    finally:
        numba.set_num_threads(before)
    ex, ew = np.empty(x.shape), np.empty(wt.shape)
    ebw, ebb = np.empty(oc), np.empty(oc)
    ref.conv2d_batch_norm_backward(_f64(x), _f64(wt), _f64(y), _f64(g), *args, ex, ew, None, ebw, ebb)
    # grad_pre's magnitude: |gamma * invstd| (|g'| + |mean g'| + |xhat| |mean g' xhat|), per channel
    c4 = (1, oc, 1, 1)
    xhat = (_f64(y) - mean.reshape(c4)) * invstd.reshape(c4)
    gm = _f64(g) * (xhat * gamma.reshape(c4) + beta.reshape(c4) > 0)
    gp = np.abs(gm) + np.abs(gm.mean(axis=(0, 2, 3), keepdims=True))
    gp += np.abs(xhat) * np.abs((gm * xhat).mean(axis=(0, 2, 3), keepdims=True))
    scale = _scale(geometry, x, wt, gp * np.abs(gamma * invstd).reshape(c4))
    np.testing.assert_array_less(np.abs(gx.astype(np.float64) - ex), TOLERANCE[dtype] * scale[0])
    np.testing.assert_array_less(np.abs(gw.astype(np.float64) - ew), TOLERANCE[dtype] * scale[1])
    np.testing.assert_allclose(gbb, ebb, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(gbw, ebw, rtol=1e-5, atol=1e-4)


# Geometries whose parts one parallel Numba kernel runs, calling ?gemm itself (NOTE [ BLAS from
# Numba threads ]): both orders of grad_w's product, groups, stride 2, steps of several images, the
# products per kernel row.
IN_NUMBA = {
    "small-images": GEOMETRIES["small-images"],
    "1x1-stride2-groups2": GEOMETRIES["1x1-stride2-groups2"],
    "7x7-dilation2-H!=W": GEOMETRIES["7x7-dilation2-H!=W"],
    "N1-depthwise": GEOMETRIES["N1-depthwise"],
    "N2-odd": (2, 33, 13, 7, 5, (3, 3), (1, 1), (1, 1), (1, 1), 1, "relu"),
    "kw-rows-dilated": GEOMETRIES["kw-rows-dilated"],
}


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("geometry", IN_NUMBA.values(), ids=IN_NUMBA.keys())
def test_numba_conv2d_backward_gemm_from_numba_matches_the_python_items(
    geometry, dtype, threads, monkeypatch
):
    """The kernel's parts give the Python items' bits (the same products, summed in the same
    order), and where the library's ?gemm address is not found the Python items run."""
    if _blas.address(np.float32) is None:
        pytest.skip("no OpenBLAS with CBLAS loaded: the backward takes the Python items")
    taken = []
    in_numba = nb_conv._Backward._in_numba
    monkeypatch.setattr(
        nb_conv._Backward, "_in_numba", lambda self: taken.append(in_numba(self)) or taken[-1]
    )
    x, wt, pre, g = _arrays(geometry, dtype)
    new = _backward(geometry, x, wt, pre, g, WANTS["all"], threads)
    monkeypatch.setattr(_blas, "address", lambda dtype: None)
    old = _backward(geometry, x, wt, pre, g, WANTS["all"], threads)
    assert [t is not None for t in taken] == [True, False]
    for what, a, b in zip(("grad_x", "grad_w", "grad_b"), new, old):
        np.testing.assert_array_equal(a, b, err_msg=what)
