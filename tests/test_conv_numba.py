"""The Numba convolution forward's work items (NOTE [ Convolution on the host: im2col in blocks ]).

``conv2d`` and ``conv2d_stats`` share a batch out between threads in items of whole images: an
item of one image lands its product in the output (or ``pre``) in place, an item of several
images (small ones, under ``ITEM_MIN_COLUMNS`` output pixels) goes through channel-major scratch
and a transposing epilogue, float16 storage always through float32 scratch, and more than one
group through one stacked product per item. The geometries below reach each of those with one and
two threads (the one-thread run keeps everything on the calling thread), at odd sizes: 1 x 1 and
7 x 7 kernels, stride 2, dilation 2, groups, N = 1, H != W, a last item shorter than the others.
``banded`` lowers ``ITEM_MAX_BYTES`` to 4 KiB so that every image is split into items of a few
output rows each (an image's columns above the cap), the last band shorter where it does not divide.
``path`` runs the stride-1 geometries both ways (NOTE [ Implicit GEMM on the host ]): as an implicit
GEMM (``IMPLICIT_MIN_K`` lowered to 0, so that every stride-1 convolution takes it: the planes of
each kernel column at the output's width, one accumulating ``?gemm`` per kernel row and group, in
place for items of one image, the epilogue over junk rows for items of several images) and through
im2col (the library's ``?gemm`` hidden). ``_tap_planes`` builds the planes of a "same" convolution
(input as wide as the output, a kernel column reading it unshifted) as shifts of that column's, the
others row by row: "dilation2-same" and "kernel-wider-than-input" (a 5-wide kernel over a 1-wide
input, its shifts past the row, no padding above) take the first, "same-width-no-unshifted-column"
(padding 3 at dilation 2: the input as wide as the output, no column reading it unshifted) and
"groups3-in-place" the second.

Tolerances: against the float64 reference kernels on the same (stored) values, relative to the
dot products on magnitudes (``scale``): float32 sums of up to 98 products 1e-5 (98 * 2**-24 is
6e-6); float16 storage 2e-3 (the stored pre-activation may round one ulp, 2**-10, the other way
than the reference's, times an activation's slope of at most 1.13, then half an ulp for the
output); float64 1e-12.
"""

from __future__ import annotations

import numpy as np
import pytest

numba = pytest.importorskip("numba")

from taifuse.backends import reference as ref
from taifuse.backends.numba import _blas
from taifuse.backends.numba import conv as nb_conv

# (N, C, H, W, OC, (kh, kw), stride, padding, dilation, groups, activation, bias)
GEOMETRIES = {
    # 99 output pixels: several images an item, the last item shorter
    "small-images": (7, 3, 9, 11, 5, (3, 3), (1, 1), (1, 1), (1, 1), 1, "relu", True),
    # 1,056 output pixels: one image an item, the product in place
    "one-image-items": (3, 4, 33, 32, 6, (3, 3), (1, 1), (1, 1), (1, 1), 1, "gelu", True),
    "1x1-stride2-groups2": (5, 4, 9, 9, 6, (1, 1), (2, 2), (0, 0), (1, 1), 2, "silu", True),
    "7x7-dilation2-H!=W": (3, 2, 40, 37, 3, (7, 7), (2, 1), (3, 3), (2, 2), 1, None, False),
    "N1": (1, 3, 32, 33, 4, (3, 3), (1, 1), (1, 1), (1, 1), 1, "gelu_tanh", False),
    "groups3-in-place": (4, 6, 34, 35, 9, (3, 2), (1, 1), (0, 0), (1, 1), 3, None, True),
    "dilation2-same": (3, 4, 10, 9, 5, (3, 3), (1, 1), (2, 2), (2, 2), 1, "relu", True),
    "same-width-no-unshifted-column": (2, 3, 8, 7, 4, (3, 4), (1, 1), (1, 3), (1, 2), 1, "silu", False),
    "kernel-wider-than-input": (2, 4, 5, 1, 3, (3, 5), (1, 1), (0, 2), (1, 1), 1, "relu", True),
}
TOLERANCE = {np.float32: 1e-5, np.float16: 2e-3, np.float64: 1e-12}
_SPLIT = ("gelu", "gelu_tanh", "silu")  # the activations whose pre-activation the forward keeps


def _out_size(size, k, s, p, d):
    return (size + 2 * p - d * (k - 1) - 1) // s + 1


def _arrays(geometry, dtype, seed=0):
    n, c, h, w, oc, (kh, kw), stride, padding, dilation, groups, _act, bias = geometry
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, c, h, w)).astype(dtype)
    wt = (rng.standard_normal((oc, c // groups, kh, kw)) / np.sqrt(c // groups * kh * kw)).astype(dtype)
    b = rng.standard_normal(oc).astype(dtype) if bias else None
    oh = _out_size(h, kh, stride[0], padding[0], dilation[0])
    ow = _out_size(w, kw, stride[1], padding[1], dilation[1])
    return x, wt, b, (n, oc, oh, ow)


def _f64(a):
    return None if a is None else a.astype(np.float64)


def _scale(x, wt, b, geometry, shape):
    *_, stride, padding, dilation, groups, _act, _bias = geometry
    s = np.empty(shape)
    ref.conv2d(np.abs(_f64(x)), np.abs(_f64(wt)), None if b is None else np.abs(_f64(b)), stride, padding,
               dilation, groups, None, s)  # fmt: skip
    return np.maximum(1.0, s)


def _threads(count):
    if count > numba.config.NUMBA_NUM_THREADS:
        pytest.skip(f"needs {count} Numba threads")
    return count


@pytest.fixture(params=[False, True], ids=["whole-images", "banded"])
def banded(request, monkeypatch):
    if request.param:
        monkeypatch.setattr(nb_conv, "ITEM_MAX_BYTES", 4096)
    return request.param


@pytest.fixture(params=["implicit", "im2col"])
def path(request, monkeypatch):
    if request.param == "implicit":
        if _blas.gemm(np.float32) is None:
            pytest.skip("no OpenBLAS with CBLAS loaded: the forward takes im2col")
        monkeypatch.setattr(nb_conv, "IMPLICIT_MIN_K", 0)
    else:
        monkeypatch.setattr(_blas, "gemm", lambda dtype: None)
    return request.param


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("geometry", GEOMETRIES.values(), ids=GEOMETRIES.keys())
def test_numba_conv2d_work_items_match_the_reference(geometry, dtype, threads, banded, path):
    x, wt, b, shape = _arrays(geometry, dtype)
    *_, stride, padding, dilation, groups, act, _bias = geometry
    keep = act in _SPLIT
    out = np.empty(shape, dtype)
    pre = np.empty(shape, dtype) if keep else None
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(_threads(threads))
        nb_conv.conv2d(x, wt, b, stride, padding, dilation, groups, act, out, pre)
    finally:
        numba.set_num_threads(before)
    expected, expected_pre = np.empty(shape), np.empty(shape, dtype)  # pre rounded as stored
    ref.conv2d(_f64(x), _f64(wt), _f64(b), stride, padding, dilation, groups, act, expected, expected_pre)
    scale = _scale(x, wt, b, geometry, shape)
    tol = TOLERANCE[dtype]
    np.testing.assert_array_less(np.abs(out.astype(np.float64) - expected), tol * scale)
    if keep:
        np.testing.assert_array_less(np.abs(pre.astype(np.float64) - expected_pre), tol * scale)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("geometry", GEOMETRIES.values(), ids=GEOMETRIES.keys())
def test_numba_conv2d_stats_work_items_match_the_reference(geometry, dtype, threads, banded, path):
    """The statistics' shift is the first output value, computed before the items run."""
    x, wt, b, shape = _arrays(geometry, dtype, seed=1)
    *_, stride, padding, dilation, groups, _act, _bias = geometry
    oc = shape[1]
    out = np.empty(shape, dtype)
    mean, var = np.empty(oc, np.float32), np.empty(oc, np.float32)
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(_threads(threads))
        nb_conv.conv2d_stats(x, wt, b, stride, padding, dilation, groups, out, mean, var)
    finally:
        numba.set_num_threads(before)
    expected = np.empty(shape)
    ref.conv2d(_f64(x), _f64(wt), _f64(b), stride, padding, dilation, groups, None, expected)
    tol = TOLERANCE[dtype]
    np.testing.assert_array_less(
        np.abs(out.astype(np.float64) - expected), tol * _scale(x, wt, b, geometry, shape)
    )
    # The statistics of the output as stored, against NumPy's float64 ones of the same values.
    stored = out.astype(np.float64).transpose(1, 0, 2, 3).reshape(oc, -1)
    np.testing.assert_allclose(mean, stored.mean(axis=1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(var, stored.var(axis=1), rtol=1e-5, atol=1e-6)


def test_conv2d_keeps_an_infinite_input_to_the_outputs_that_read_it(path):
    """Regression, two defects: the reference's im2col masked the taps outside the input by
    multiplying with 0, and an outside tap reads a clipped index, so an inf at the border gave
    NaN in the padded outputs beside it; and numba's epilogue took its zero bias as ``first
    product * 0``, so an infinite first product made the whole plane NaN. Only the outputs whose
    taps read the inf are infinite (PyTorch's answer), in conv2d and conv2d_stats; on both paths
    (the implicit GEMM's junk rows between the item's two images read the inf too, and must not
    reach a kept output)."""
    x = np.random.default_rng(2).standard_normal((2, 2, 6, 5)).astype(np.float32)
    x[0, 0, 0, 0] = np.inf
    w = np.abs(np.random.default_rng(3).standard_normal((3, 2, 3, 3))).astype(np.float32) + 0.1
    args = ((1, 1), (1, 1), (1, 1), 1)
    expected = np.empty((2, 3, 6, 5))
    ref.conv2d(_f64(x), _f64(w), None, *args, None, expected)
    assert np.isinf(expected).sum() == 3 * 4 and not np.isnan(expected).any()  # the reference
    torch = pytest.importorskip("torch")
    theirs = torch.nn.functional.conv2d(torch.from_numpy(x).double(), torch.from_numpy(w).double(), padding=1)
    np.testing.assert_allclose(expected, theirs.numpy(), rtol=1e-12)
    for act in (None, "relu"):
        out = np.empty((2, 3, 6, 5), np.float32)
        nb_conv.conv2d(x, w, None, *args, act, out)
        want = expected if act is None else np.maximum(expected, 0.0)
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5, err_msg=act)
    out = np.empty((2, 3, 6, 5), np.float32)
    nb_conv.conv2d_stats(x, w, None, *args, out, np.empty(3, np.float32), np.empty(3, np.float32))
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_im2col_writes_no_column_past_its_row_where_the_padding_passes_every_output():
    """Regression: ``_valid`` returned a first output column past the last where a tap's padding
    reached past every output (a 7-wide kernel, padding 3, stride 2 over a 1-wide input: one
    output column, whose tap 0 first lies inside at column 2), and ``_im2col_row`` zeroed the
    columns before it, writing one element past the item's columns (into the next worker's
    scratch, or past the buffer). A guard column after the columns stays as it was, and the
    convolution matches the reference."""
    assert nb_conv._valid(1, 2, -3, 1) == (1, 1)
    geometry = (2, 2, 3, 1, 3, (1, 7), (1, 2), (0, 3), (1, 1), 1, "relu", True)
    x, wt, b, shape = _arrays(geometry, np.float32)
    n, _oc, oh, ow = shape
    rows, span = 2 * 7, oh * ow
    cols = np.full((rows, n * span + 1), 7.0, np.float32)
    nb_conv._im2col_block(x, 0, n, 0, oh, 1, 7, 1, 2, 0, 3, 1, 1, oh, ow, cols[:, : n * span])
    np.testing.assert_array_equal(cols[:, -1], 7.0)
    out = np.empty(shape, np.float32)
    nb_conv.conv2d(x, wt, b, (1, 2), (0, 3), (1, 1), 1, "relu", out)
    expected = np.empty(shape)
    ref.conv2d(_f64(x), _f64(wt), _f64(b), (1, 2), (0, 3), (1, 1), 1, "relu", expected)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("stats", [False, True], ids=["conv2d", "conv2d_stats"])
def test_numba_conv2d_returns_its_scratch_without_the_garbage_collector(stats):
    """Regression: the forward's epilogue closure read ``fw.pitch`` while ``fw`` (the work items,
    which hold the workers' scratch leases) held the closure, a reference cycle: the scratch went
    back to the pool only when the cycle collector ran, so every call allocated new blocks (and
    touched fresh pages: ~1,300 page faults a call at 32 -> 64). The second call must reuse the
    first's blocks with the collector off."""
    import gc

    from taifuse import pool

    x, wt, b, shape = _arrays(GEOMETRIES["one-image-items"], np.float32)
    out = np.empty(shape, np.float32)
    mean, var = np.empty(shape[1], np.float32), np.empty(shape[1], np.float32)
    args = ((1, 1), (1, 1), (1, 1), 1)

    def call():
        if stats:
            nb_conv.conv2d_stats(x, wt, b, *args, out, mean, var)
        else:
            nb_conv.conv2d(x, wt, b, *args, "relu", out)

    host = pool.host_pool()
    if host._disabled:
        pytest.skip("the host pool is disabled (TAIFUSE_POOL=0)")
    gc.collect()
    gc.disable()
    try:
        call()
        before = host.stats().allocations
        for _ in range(3):
            call()
        assert host.stats().allocations == before
    finally:
        gc.enable()


def test_blas_gemm_is_numpys_and_accumulates_strided_operands(monkeypatch):
    """``_blas.gemm``: row-major c = a @ b + beta * c on operands whose rows are further apart than
    their length, float32 and float64, against NumPy; and the library is NumPy's own, first among
    the OpenBLAS copies threadpoolctl lists (SciPy's, loaded here by importing scipy.linalg where
    it is installed, has threads that ``_blas_single_threaded`` may not hold)."""
    pytest.importorskip("scipy.linalg")
    from threadpoolctl import threadpool_info

    for dtype, tol in ((np.float32, 1e-5), (np.float64, 1e-12)):
        gemm = _blas.gemm(dtype)
        if gemm is None:
            pytest.skip("no OpenBLAS with CBLAS loaded")
        rng = np.random.default_rng(4)
        a = rng.standard_normal((5, 9)).astype(dtype)[:, 2:7]  # (5, 5), rows 9 apart
        b = rng.standard_normal((5, 13)).astype(dtype)[:, 1:12]  # (5, 11), rows 13 apart
        c = rng.standard_normal((5, 20)).astype(dtype)
        want = c.astype(np.float64)
        want[:, :11] = a.astype(np.float64) @ b.astype(np.float64) + want[:, :11]
        gemm(5, 11, 5, a.ctypes.data, 9, b.ctypes.data, 13, 1.0, c.ctypes.data, 20)
        np.testing.assert_allclose(c, want, rtol=tol, atol=tol)
        gemm(5, 11, 5, a.ctypes.data, 9, b.ctypes.data, 13, 0.0, c.ctypes.data, 20)
        np.testing.assert_allclose(c[:, :11], a.astype(np.float64) @ b.astype(np.float64), rtol=tol, atol=tol)
    # Regression: the first OpenBLAS listed was bound, SciPy's in some processes (the list's order
    # varies), whose threads then spun beside each worker's calls: 20-30x the time. Listed first here.
    libs = [lib for lib in threadpool_info() if lib.get("internal_api") == "openblas"]
    ours = [lib for lib in libs if _blas._numpy_first(lib["filepath"]) == 0]
    if not ours or len(libs) < 2:
        pytest.skip("needs NumPy's OpenBLAS inside its install and another one loaded")
    others = [lib for lib in libs if lib not in ours]
    monkeypatch.setattr("threadpoolctl.threadpool_info", lambda: others + ours)
    monkeypatch.setattr(_blas, "_found", None)
    assert _blas.gemm(np.float32) is not None
    assert _blas._found["library"] == ours[0]["filepath"]


# Geometries whose items are implicit GEMMs of one image landing in place, which one parallel
# Numba kernel runs, calling ?gemm itself (NOTE [ BLAS from Numba threads ]): odd sizes, N = 1.
IN_NUMBA = {
    "one-image-items": GEOMETRIES["one-image-items"],
    "N1-odd": (1, 5, 7, 13, 7, (3, 3), (1, 1), (1, 1), (1, 1), 1, "relu", True),
    "groups3-in-place": GEOMETRIES["groups3-in-place"],
    "N1-dilation2-pre": (1, 3, 11, 40, 5, (3, 3), (1, 1), (2, 2), (2, 2), 1, "gelu", False),
}


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("geometry", IN_NUMBA.values(), ids=IN_NUMBA.keys())
def test_numba_conv2d_gemm_from_numba_matches_the_python_items(geometry, dtype, threads, banded, monkeypatch):
    if _blas.address(dtype) is None:
        pytest.skip("no OpenBLAS with CBLAS loaded: the forward takes the Python items")
    monkeypatch.setattr(nb_conv, "IMPLICIT_MIN_K", 0)
    taken = []
    in_numba = nb_conv._Forward.in_numba
    monkeypatch.setattr(nb_conv._Forward, "in_numba", lambda self: taken.append(in_numba(self)) or taken[-1])
    x, wt, b, shape = _arrays(geometry, dtype)
    *_, stride, padding, dilation, groups, act, _bias = geometry
    keep = act in _SPLIT
    results = []
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(_threads(threads))
        for hidden in (False, True):  # the library's ?gemm address found, then not found: the fallback
            if hidden:
                monkeypatch.setattr(_blas, "address", lambda dtype: None)
            out = np.empty(shape, dtype)
            pre = np.empty(shape, dtype) if keep else None
            nb_conv.conv2d(x, wt, b, stride, padding, dilation, groups, act, out, pre)
            results.append((out, pre))
    finally:
        numba.set_num_threads(before)
    assert taken == [True, False]
    (out, pre), (out_py, pre_py) = results
    np.testing.assert_array_equal(out, out_py)  # the same products on the same operands
    if keep:
        np.testing.assert_array_equal(pre, pre_py)
    expected = np.empty(shape)
    ref.conv2d(_f64(x), _f64(wt), _f64(b), stride, padding, dilation, groups, act, expected)
    np.testing.assert_array_less(np.abs(out - expected), TOLERANCE[dtype] * _scale(x, wt, b, geometry, shape))
