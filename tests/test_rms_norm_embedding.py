"""``F.rms_norm`` and ``F.embedding`` (and ``nn.RMSNorm``, ``nn.Embedding``) on every backend.

Forward against the float64 reference through ``helpers.check_op`` (rms_norm) or exactly
(embedding is a gather); the backward kernels against the reference's, with repeated indices and
``padding_idx``; the layers against ``torch.nn``. The float64 finite-difference and PyTorch
gradient checks of both ops are cases of ``test_autograd_ops.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import DTYPES, F64, arrays, check_op
from hypothesis import given
from hypothesis import strategies as st

import taifuse
import taifuse.functional as F
from taifuse import nn
from taifuse._internal import wrap
from taifuse.backends import reference as R

try:
    import torch
except ImportError:  # the torch comparison skips
    torch = None

dtype_param = pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)


def _skip_f64(spec, dtype) -> None:
    if np.dtype(dtype) == F64 and not spec.supports_f64:
        pytest.skip(f"{spec.param} has no float64 (by design)")


# ----------------------------------------------------------------------------- rms_norm forward


@st.composite
def rms_norm_case(draw, dtype):
    norm = tuple(draw(st.lists(st.integers(1, 40), min_size=1, max_size=2)))
    lead = tuple(draw(st.lists(st.integers(0, 6), max_size=2)))
    if draw(st.integers(0, 9)) == 0:
        lead, norm = (67,), (1031,)  # past the GPU row kernels' block and the Numba parallel threshold
    x = draw(arrays(lead + norm, dtype, scales=(1e-2, 1.0, 30.0)), label="x")
    return x, norm


@dtype_param
@pytest.mark.parametrize("with_weight", [False, True], ids=["noweight", "weight"])
@given(data=st.data())
def test_rms_norm(backend, with_weight, dtype, data):
    x, norm = data.draw(rms_norm_case(dtype))
    weight = None
    if with_weight:
        weight = data.draw(arrays(norm, dtype, scales=(1.0,), specials=(0.0, -1.0)), label="weight")
    eps = data.draw(st.sampled_from([None, 1e-5, 0.5]), label="eps")
    normalized_shape = norm[0] if len(norm) == 1 and data.draw(st.booleans()) else norm
    check_op(backend, "rms_norm", x, normalized_shape, weight, eps=eps)


def test_rms_norm_zero_rows_are_zero(backend):
    # mean(x^2) = 0: rstd = 1 / sqrt(eps), the result exactly 0, never NaN.
    got = check_op(backend, "rms_norm", np.zeros((3, 8), np.float32), 8)
    np.testing.assert_array_equal(got, np.zeros((3, 8), np.float32))


def test_rms_norm_default_eps_is_the_compute_dtype_epsilon(backend):
    # Tiny rows make eps matter: float16 storage takes float32's epsilon (PyTorch's opmath eps).
    backend.activate()
    x = np.full((1, 4), 1e-3, np.float16)
    got = F.rms_norm(x, 4).astype(np.float64)
    expected = 1e-3 / np.sqrt(1e-6 + np.finfo(np.float32).eps)
    np.testing.assert_allclose(got, expected, rtol=1e-3)


# ----------------------------------------------------------------------------- embedding forward


@dtype_param
@pytest.mark.parametrize("index_shape", [(), (7,), (2, 3, 4), (0,), (3, 0)], ids=str)
@pytest.mark.parametrize("index_dtype", [np.int64, np.int32, np.uint8])
def test_embedding_is_an_exact_gather(backend, dtype, index_shape, index_dtype):
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((11, 5)).astype(dtype)
    idx = rng.integers(0, 11, index_shape).astype(index_dtype)
    got = check_op_embedding(backend, idx, weight)
    if got is not None:
        np.testing.assert_array_equal(got, weight[idx.astype(np.int64)], strict=True)


def check_op_embedding(spec, idx, weight, **kwargs):
    """F.embedding on NumPy inputs: NumPy out, inputs untouched, float64 refused on taichi."""
    spec.activate()
    if weight.dtype == F64 and not spec.supports_f64:
        with pytest.raises(TypeError, match="float64"):
            F.embedding(idx, weight, **kwargs)
        return None
    before = weight.copy(), idx.copy()
    got = F.embedding(idx, weight, **kwargs)
    assert isinstance(got, np.ndarray) and got.dtype == weight.dtype
    assert got.shape == idx.shape + (weight.shape[1],)
    np.testing.assert_array_equal(weight, before[0])
    np.testing.assert_array_equal(idx, before[1])
    return got


def test_embedding_backend_arrays_stay_on_the_backend(backend):
    backend.activate()
    be = backend.module()
    weight = be.from_numpy(np.arange(12, dtype=np.float32).reshape(4, 3))
    idx = be.from_numpy(np.array([[3, 1], [0, 3]]))
    got = F.embedding(idx, weight)
    assert be.is_array(got) and tuple(got.shape) == (2, 2, 3)
    np.testing.assert_array_equal(
        be.to_numpy(got), np.arange(12, dtype=np.float32).reshape(4, 3)[[[3, 1], [0, 3]]]
    )


# ----------------------------------------------------------------------------- backward kernels

KERNEL_TOL = {
    np.dtype(np.float64): (1e-12, 1e-13),
    np.dtype(np.float32): (1e-5, 2e-6),
    np.dtype(np.float16): (2e-3, 1e-3),
}


def _kernel_backend(spec, dtype):
    if spec.name == "numpy":
        pytest.skip("the reference is the numpy backend itself")
    _skip_f64(spec, dtype)
    spec.activate()
    return spec.module()


def _compare(got, ref, dtype, what):
    rtol, atol = KERNEL_TOL[np.dtype(dtype)]
    ref64 = ref.astype(np.float64)
    scale = max(1.0, float(np.abs(ref64).max()))
    np.testing.assert_allclose(got.astype(np.float64), ref64, rtol=rtol, atol=atol * scale, err_msg=what)


# These two kernel tests run on grad_backend (as the backward-kernel tests of test_autograd_ops.py):
# their float64 and forced-path cases do not exist on some backends and skip there, which the
# required-Vulkan CI check reads as a failure on the `backend` fixture.
@dtype_param
@pytest.mark.parametrize("force", ["serial", "parallel"])
@pytest.mark.parametrize("n, vocab, dim", [(1, 1, 1), (40, 7, 9), (3000, 70, 33), (500, 3000, 4)], ids=str)
def test_embedding_backward_kernel(grad_backend, dtype, n, vocab, dim, force, monkeypatch):
    """Repeated indices accumulate, untouched rows are zero, the padding row gets nothing."""
    be = _kernel_backend(grad_backend, dtype)
    if grad_backend.name == "numba":
        from taifuse.backends.numba import _jit

        monkeypatch.setattr(_jit, "_parallel", lambda size, transcendental=False: force == "parallel")
    elif force == "parallel":
        pytest.skip("one path on this backend")
    rng = np.random.default_rng(n)
    idx = rng.integers(0, max(1, vocab // 2), n)  # half the rows never seen; most seen many times
    idx[: n // 2] = idx[0]
    g = rng.standard_normal((n, dim)).astype(dtype)
    for pad in (-1, int(idx[0]), vocab - 1):
        expected = np.full((vocab, dim), np.nan, dtype)
        R.embedding_backward(idx, g, expected, pad)
        out = be.from_numpy(np.full((vocab, dim), np.nan, dtype))
        be.embedding_backward(be.from_numpy(idx), be.from_numpy(g), out, pad)
        got = be.to_numpy(out)
        _compare(got, expected, dtype, f"embedding_backward pad={pad} on {grad_backend.param}")
        if pad >= 0:
            assert not got[pad].any()


def test_embedding_backward_is_deterministic(backend):
    be = _kernel_backend(backend, np.float32)
    rng = np.random.default_rng(5)
    idx = rng.integers(0, 5, 4000)
    g = (rng.standard_normal((4000, 16)) * 10.0 ** rng.integers(-3, 4, (4000, 1))).astype(np.float32)
    runs = []
    for _ in range(3):
        out = be.from_numpy(np.empty((5, 16), np.float32))
        be.embedding_backward(be.from_numpy(idx), be.from_numpy(g), out, -1)
        runs.append(be.to_numpy(out))
    np.testing.assert_array_equal(runs[0], runs[1])
    np.testing.assert_array_equal(runs[0], runs[2])


@dtype_param
@pytest.mark.parametrize("with_weight", [False, True], ids=["noweight", "weight"])
@pytest.mark.parametrize("rows, cols", [(9, 37), (260, 301), (3, 1031)], ids=str)
def test_rms_norm_kernels(grad_backend, dtype, with_weight, rows, cols):
    be = _kernel_backend(grad_backend, dtype)
    rng = np.random.default_rng(rows)
    x, g = (rng.standard_normal((rows, cols)).astype(dtype) for _ in range(2))
    w = rng.standard_normal(cols).astype(dtype) if with_weight else None
    stats = np.float64 if np.dtype(dtype) == F64 else np.float32
    out, rstd = np.empty_like(x), np.empty(rows, stats)
    R.rms_norm(x, w, 1e-5, out, rstd)
    got_out, got_rstd = be.from_numpy(np.full_like(x, np.nan)), be.from_numpy(np.full(rows, np.nan, stats))
    on = lambda a: None if a is None else be.from_numpy(a)
    be.rms_norm(on(x), on(w), 1e-5, got_out, got_rstd)
    _compare(be.to_numpy(got_out), out, dtype, f"rms_norm on {grad_backend.param}")
    _compare(be.to_numpy(got_rstd), rstd, dtype, f"rms_norm rstd on {grad_backend.param}")
    gx, gw = np.empty_like(x), np.empty(cols, dtype)
    R.rms_norm_backward(x, w, rstd, g, gx, gw)
    got_gx, got_gw = be.from_numpy(np.full_like(x, np.nan)), be.from_numpy(np.full(cols, np.nan, dtype))
    be.rms_norm_backward(on(x), on(w), on(rstd), on(g), got_gx, got_gw)
    _compare(be.to_numpy(got_gx), gx, dtype, f"rms_norm_backward grad_x on {grad_backend.param}")
    _compare(be.to_numpy(got_gw), gw, dtype, f"rms_norm_backward grad_weight on {grad_backend.param}")


# ----------------------------------------------------------------------------- autograd


def test_embedding_gradient_accumulates_and_skips_padding(backend):
    backend.activate()
    rng = np.random.default_rng(1)
    weight = rng.standard_normal((6, 4)).astype(np.float32)
    idx = np.array([[1, 5, 1], [1, 0, 5]])
    g = rng.standard_normal((2, 3, 4)).astype(np.float32)
    for padding_idx, pad_row in ((None, None), (5, 5), (-1, 5), (-6, 0)):
        w = taifuse.tensor(weight, requires_grad=True)
        out = F.embedding(taifuse.tensor(idx), w, padding_idx=padding_idx)
        (out * taifuse.tensor(g)).sum().backward()
        expected = np.zeros((6, 4))
        np.add.at(expected, idx.reshape(-1), g.reshape(-1, 4).astype(np.float64))
        if pad_row is not None:
            expected[pad_row] = 0.0
        np.testing.assert_allclose(w.grad.numpy(), expected, rtol=1e-6, atol=1e-6, err_msg=f"{padding_idx}")


def test_embedding_numpy_weight_with_tensor_indices_gives_numpy(backend):
    backend.activate()
    weight = np.eye(3, dtype=np.float32)
    got = F.embedding(taifuse.tensor(np.array([2, 0])), weight)
    assert isinstance(got, np.ndarray)
    np.testing.assert_array_equal(got, weight[[2, 0]])


def test_embedding_device_indices_out_of_range_give_nan(backend):
    """Indices already on a device are not copied back to be checked (NOTE [ Class indices on the device ])."""
    if backend.name != "taichi":
        pytest.skip("host indices are always range-checked")
    backend.activate()
    be = backend.module()
    w = taifuse.tensor(np.ones((3, 2), np.float32), requires_grad=True)
    out = F.embedding(wrap(be.from_numpy(np.array([0, 7])), be), w)
    assert np.isnan(out.numpy()[1]).all() and (out.numpy()[0] == 1).all()
    out.sum().backward()
    np.testing.assert_array_equal(w.grad.numpy(), [[1, 1], [0, 0], [0, 0]])


# ----------------------------------------------------------------------------- layers


def test_embedding_layer_init(grad_backend):
    taifuse.manual_seed(3)
    emb = nn.Embedding(400, 50, padding_idx=-2)
    w = emb.weight.numpy()
    assert emb.padding_idx == 398 and not w[398].any()
    rest = np.delete(w, 398, axis=0)
    assert abs(rest.mean()) < 0.02 and abs(rest.std() - 1.0) < 0.02  # N(0, 1), as torch.nn.Embedding
    taifuse.manual_seed(3)
    np.testing.assert_array_equal(nn.Embedding(400, 50, padding_idx=-2).weight.numpy(), w)
    assert [n for n, _ in emb.named_parameters()] == ["weight"]


def test_rms_norm_layer_init():
    norm = nn.RMSNorm((2, 3))
    np.testing.assert_array_equal(norm.weight.numpy(), np.ones((2, 3), np.float32))
    assert nn.RMSNorm(4, elementwise_affine=False).weight is None
    assert [n for n, _ in nn.RMSNorm(4).named_parameters()] == ["weight"]


@pytest.mark.parametrize(
    "make, exc, match",
    [
        (lambda: nn.Embedding(-1, 3), ValueError, "num_embeddings"),
        (lambda: nn.Embedding(4, 2.5), ValueError, "embedding_dim"),
        (lambda: nn.Embedding(4, 2, padding_idx=4), ValueError, "padding_idx"),
        (lambda: nn.RMSNorm(4, eps=-1.0), ValueError, "eps"),
        (lambda: nn.RMSNorm("4"), TypeError, "normalized_shape"),
    ],
)
def test_layers_validate(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


@pytest.mark.skipif(torch is None, reason="torch is not installed")
def test_layers_match_torch(grad_backend):
    """A small embedding -> RMSNorm -> sum chain, taifuse and torch.nn with the same weights."""
    grad_backend.activate()
    dtype = np.float64 if grad_backend.supports_f64 else np.float32
    taifuse.manual_seed(0)
    emb, norm = nn.Embedding(10, 6, padding_idx=2, dtype=dtype), nn.RMSNorm(6, dtype=dtype)
    rng = np.random.default_rng(0)
    norm.weight.numpy()  # the layer's own init, then a non-trivial weight
    norm.load_state_dict({"weight": rng.uniform(0.5, 1.5, 6).astype(dtype)})
    t_emb = torch.nn.Embedding(10, 6, padding_idx=2, dtype=torch.float64)
    t_norm = torch.nn.RMSNorm(6, dtype=torch.float64)
    with torch.no_grad():
        t_emb.weight.copy_(torch.from_numpy(emb.weight.numpy().astype(np.float64)))
        t_norm.weight.copy_(torch.from_numpy(norm.weight.numpy().astype(np.float64)))
    idx = np.array([[1, 2, 9, 1], [0, 2, 2, 5]])
    g = rng.standard_normal((2, 4, 6))
    y = norm(emb(taifuse.tensor(idx)))
    (y * taifuse.tensor(g.astype(dtype))).sum().backward()
    ty = t_norm(t_emb(torch.from_numpy(idx)))
    (ty * torch.from_numpy(g)).sum().backward()
    tol = {"rtol": 1e-9, "atol": 1e-12} if dtype == np.float64 else {"rtol": 1e-4, "atol": 1e-5}
    np.testing.assert_allclose(y.numpy(), ty.detach().numpy(), **tol)
    np.testing.assert_allclose(emb.weight.grad.numpy(), t_emb.weight.grad.numpy(), **tol)
    np.testing.assert_allclose(norm.weight.grad.numpy(), t_norm.weight.grad.numpy(), **tol)
    assert not emb.weight.grad.numpy()[2].any()


# ----------------------------------------------------------------------------- numba embedding backward


def _numba_embedding_backward(idx, g, vocab, pad, force, monkeypatch):
    """The numba kernel's grad_weight on its serial or parallel path, from a NaN-filled buffer."""
    from taifuse.backends import numba as NB
    from taifuse.backends.numba import _jit

    monkeypatch.setattr(_jit, "_parallel", lambda size, transcendental=False: force == "parallel")
    out = np.full((vocab, g.shape[1]), np.nan, g.dtype)
    NB.embedding_backward(idx, g, out, pad)
    return out


@pytest.mark.parametrize("dtype", [np.float32, F64], ids=["f32", "f64"])
@pytest.mark.parametrize("force", ["serial", "parallel"])
def test_numba_embedding_backward_is_the_references_bits(dtype, force, monkeypatch):
    """NOTE [ Embedding backward without races ]: every row summed in float64 in the order of n,
    from 0.0, as the reference's np.add.at, so float32 and float64 give the reference's bits,
    with one thread or two, however skewed the indices (the work cuts move, the sums do not)."""
    numba = pytest.importorskip("numba")
    rng = np.random.default_rng(11)
    vocab, n = 3001, 5000
    idx = rng.integers(0, vocab, n)
    idx[: n // 2] = 17  # one row holds half the indices
    idx[idx == vocab - 2] = 18
    idx[n // 2] = vocab - 2  # a row with one index, whose gradient is -0.0: the sum makes it +0.0
    g = (rng.standard_normal((n, 24)) * 10.0 ** rng.integers(-4, 5, (n, 1))).astype(dtype)
    g[n // 2] = -0.0
    threads = [1, 2] if force == "parallel" and numba.config.NUMBA_NUM_THREADS >= 2 else [1]
    before = numba.get_num_threads()
    try:
        for pad in (-1, 17, 3):
            ref = np.empty((vocab, 24), dtype)
            R.embedding_backward(idx, g, ref, pad)
            for t in threads:
                numba.set_num_threads(t)
                got = _numba_embedding_backward(idx, g, vocab, pad, force, monkeypatch)
                np.testing.assert_array_equal(
                    got.view(np.uint8), ref.view(np.uint8), f"pad={pad} threads={t}"
                )
    finally:
        numba.set_num_threads(before)
    assert not np.signbit(got[vocab - 2]).any()


@pytest.mark.parametrize("force", ["serial", "parallel"])
def test_numba_embedding_backward_skips_indices_out_of_range(force, monkeypatch):
    """The array path rejects them; a direct kernel call adds nothing for them, never writing
    outside grad_weight (NOTE [ Embedding backward without races ])."""
    pytest.importorskip("numba")
    idx = np.array([0, -1, 5, 2, 99, 2, -7])
    g = np.random.default_rng(2).standard_normal((idx.size, 3)).astype(np.float32)
    keep = (idx >= 0) & (idx < 5)
    ref = np.empty((5, 3), np.float32)
    R.embedding_backward(idx[keep], g[keep], ref, -1)
    got = _numba_embedding_backward(idx, g, 5, -1, force, monkeypatch)
    np.testing.assert_array_equal(got, ref)


def test_numba_embedding_backward_scratch_comes_from_the_pool():
    """The sort's arrays and the float64 rows are pool leases: a repeat call allocates nothing."""
    pytest.importorskip("numba")
    from taifuse import pool
    from taifuse.backends import numba as NB

    idx = np.random.default_rng(4).integers(0, 300, 2000)
    g = np.ones((2000, 40), np.float32)
    out = np.empty((300, 40), np.float32)
    host = pool.host_pool()
    NB.embedding_backward(idx, g, out, -1)
    first = host.stats()
    NB.embedding_backward(idx, g, out, -1)
    second = host.stats()
    assert second.allocations == first.allocations
    assert second.reuses == first.reuses + 2
