"""Tensor views and the methods a transformer needs (issue 16): indexing, view/reshape, permute,
transpose, unsqueeze/squeeze, split/chunk, cat/stack, expand, masked_fill, exp/log/sqrt, max/amax and
batched ``@``.

Every method runs on every backend (the ``backend`` fixture) against NumPy, forward and backward:
the backward of a linear method (every view) is checked against its exact vector-Jacobian product
built from NumPy (``<f(e_i), g>`` for each basis vector ``e_i``), the others against their
derivatives written out in NumPy. On numpy a float64 finite-difference check covers every method,
and a representative set is compared with PyTorch. Bad input raises what PyTorch raises (``IndexError``
for an index or dim out of range, also a ``ValueError`` as every bad argument in taifuse), naming the
argument. On taichi a chain of them copies nothing between host and device.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from helpers import CUDA_PARAM, GPU_PARAM, BackendSpec, start

import taifuse

F32, F64 = np.dtype(np.float32), np.dtype(np.float64)


def work_dtype(backend: BackendSpec) -> np.dtype:
    return F64 if backend.supports_f64 else F32


def rtol(dtype: np.dtype) -> float:
    # float32: a few roundings (a matmul's sums of 4-8 terms); float64: exact up to summation order.
    return 2e-5 if dtype == F32 else 1e-12


def close(got, expected, dtype) -> None:
    expected = np.asarray(expected, dtype=np.float64)
    tol = rtol(dtype)
    scale = max(1.0, float(np.abs(expected).max())) if expected.size else 1.0
    np.testing.assert_allclose(np.asarray(got, dtype=np.float64), expected, rtol=tol, atol=tol * scale)


def linear_vjp(fn, x: np.ndarray, g: np.ndarray) -> np.ndarray:
    """The exact vector-Jacobian product of a linear ``fn`` at any point: <fn(e_i), g> for each i."""
    out = np.zeros(x.size)
    for i in range(x.size):
        e = np.zeros(x.size)
        e[i] = 1.0
        out[i] = np.sum(np.asarray(fn(e.reshape(x.shape)), dtype=np.float64) * g)
    return out.reshape(x.shape)


MASK = np.array([[True, False, False, True, False]])

# (id, input shape, taifuse fn, NumPy fn): every method that is linear in its input.
LINEAR_CASES = [
    ("int", (3, 4, 5), lambda t: t[1], lambda a: a[1]),
    ("neg_int_slice_step", (3, 4, 5), lambda t: t[-1, 1::2], lambda a: a[-1, 1::2]),
    ("negative_step", (3, 4, 5), lambda t: t[::-2, :, 4:0:-3], lambda a: a[::-2, :, 4:0:-3]),
    ("none_ellipsis", (3, 4, 5), lambda t: t[None, ..., 2, None], lambda a: a[None, ..., 2, None]),
    ("empty_slice", (3, 4, 5), lambda t: t[:, 3:1], lambda a: a[:, 3:1]),
    ("int_array_repeats", (3, 4, 5), lambda t: t[:, [0, 2, 2, -1]], lambda a: a[:, [0, 2, 2, -1]]),
    (
        "int_array_2d",
        (3, 4, 5),
        lambda t: t[..., np.array([[0, 4], [4, 4]])],
        lambda a: a[..., np.array([[0, 4], [4, 4]])],
    ),
    ("int_and_array_adjacent", (3, 4, 5), lambda t: t[1, [3, 0]], lambda a: a[1, [3, 0]]),
    (
        "int_and_array_apart",
        (3, 4, 5),
        lambda t: t[:, 1, :, None][[2, 0], ..., 0],
        lambda a: a[:, 1, :, None][[2, 0], ..., 0],
    ),
    ("array_first_int_last", (3, 4, 5), lambda t: t[[2, 0], 1:3, 0], lambda a: a[[2, 0], 1:3, 0]),
    ("array_int_apart", (3, 4, 5), lambda t: t[[2, 0], :, 1], lambda a: a[[2, 0], :, 1]),
    ("int_slice_array", (3, 4, 5), lambda t: t[0, :, [1, 2]], lambda a: a[0, :, [1, 2]]),
    ("view", (3, 4, 5), lambda t: t.view(5, -1), lambda a: a.reshape(5, -1)),
    ("reshape", (3, 4, 5), lambda t: t.reshape((4, 15)), lambda a: a.reshape(4, 15)),
    ("permute", (3, 4, 5), lambda t: t.permute(2, 0, 1), lambda a: a.transpose(2, 0, 1)),
    ("permute_neg", (3, 4, 5), lambda t: t.permute((-1, 1, 0)), lambda a: a.transpose(2, 1, 0)),
    ("transpose", (3, 4, 5), lambda t: t.transpose(0, -1), lambda a: a.swapaxes(0, -1)),
    ("unsqueeze", (3, 4, 5), lambda t: t.unsqueeze(-1).unsqueeze(1), lambda a: a[:, None, :, :, None]),
    ("squeeze_all", (3, 1, 5, 1), lambda t: t.squeeze(), lambda a: a.squeeze()),
    ("squeeze_dim", (3, 1, 5, 1), lambda t: t.squeeze(-1), lambda a: a.squeeze(-1)),
    ("squeeze_dims", (3, 1, 5, 1), lambda t: t.squeeze((0, 1)), lambda a: a.squeeze(1)),
    ("split_int", (3, 4, 5), lambda t: t.split(2, dim=2)[2], lambda a: a[:, :, 4:]),
    ("split_sections", (3, 4, 5), lambda t: t.split([1, 3], 1)[1], lambda a: a[:, 1:]),
    ("chunk", (3, 4, 5), lambda t: t.chunk(2, -1)[0] * 2.0, lambda a: a[..., :3] * 2.0),
    (
        "split_all_pieces",
        (3, 4, 5),
        lambda t: t.split(2, dim=1)[0] * 2.0 + t.split(2, dim=1)[1],
        lambda a: a[:, :2] * 2.0 + a[:, 2:],
    ),
    ("expand", (3, 1, 5), lambda t: t.expand(2, 3, 4, 5), lambda a: np.broadcast_to(a, (2, 3, 4, 5))),
    ("expand_keep", (3, 1, 5), lambda t: t.expand(-1, 4, -1), lambda a: np.broadcast_to(a, (3, 4, 5))),
    ("masked_fill", (3, 4, 5), lambda t: t.masked_fill(MASK, 0.0), lambda a: np.where(MASK, 0.0, a)),
    ("masked_fill_broadcast", (4, 1), lambda t: t.masked_fill(MASK, 0.0), lambda a: np.where(MASK, 0.0, a)),
    (
        "cat",
        (3, 4, 5),
        lambda t: taifuse.cat([t, t[:, :1] * 2.0, t], dim=1),
        lambda a: np.concatenate([a, a[:, :1] * 2.0, a], axis=1),
    ),
    (
        "cat_neg_dim",
        (3, 4, 5),
        lambda t: taifuse.cat([t[..., :2], t], -1),
        lambda a: np.concatenate([a[..., :2], a], -1),
    ),
    (
        "stack",
        (3, 4, 5),
        lambda t: taifuse.stack([t, t * 3.0], dim=2),
        lambda a: np.stack([a, a * 3.0], axis=2),
    ),
    ("stack_last", (3, 4), lambda t: taifuse.stack([t, t], dim=-1), lambda a: np.stack([a, a], axis=-1)),
]


def _linear_id(case):
    return case[0]


@pytest.mark.parametrize("case", LINEAR_CASES, ids=_linear_id)
def test_linear_methods_forward_and_backward_match_numpy(backend, case):
    _, shape, fn, ref = case
    dtype = work_dtype(backend)
    rng = np.random.default_rng(zlib.crc32(case[0].encode()))
    a = rng.standard_normal(shape).astype(dtype)
    x = taifuse.tensor(a, requires_grad=True)
    y = fn(x)
    expected = ref(a.astype(np.float64))
    assert y.shape == expected.shape and y.dtype == dtype and y.backend == backend.name
    close(y.numpy(), expected, dtype)
    g = rng.standard_normal(expected.shape).astype(dtype)
    y.backward(taifuse.tensor(g))
    assert x.grad.shape == a.shape and x.grad.dtype == dtype
    close(x.grad.numpy(), linear_vjp(ref, a.astype(np.float64), g.astype(np.float64)), dtype)


def _pos(shape, rng):
    return rng.uniform(0.5, 2.0, shape)


# (id, input shapes, taifuse fn, NumPy forward, NumPy VJP: (inputs, g) -> grads)
def _amax_vjp(dims):
    def vjp(ins, g):
        (a,) = ins
        v = a.max(axis=dims, keepdims=True)
        ties = (a == v).astype(np.float64)
        return (ties * np.reshape(g, v.shape) / ties.sum(axis=dims, keepdims=True),)

    return vjp


def _max_dim_vjp(dim, keepdim):
    def vjp(ins, g):
        (a,) = ins
        out = np.zeros_like(a)
        idx = np.expand_dims(a.argmax(dim), dim)
        np.put_along_axis(out, idx, np.reshape(g, idx.shape), axis=dim)
        return (out,)

    return vjp


def _matmul_vjp(ins, g):
    a, b = ins
    a2 = a[None] if a.ndim == 1 else a
    b2 = b[:, None] if b.ndim == 1 else b
    g2 = np.reshape(g, np.broadcast_shapes(a2.shape[:-2], b2.shape[:-2]) + (a2.shape[-2], b2.shape[-1]))
    ga = g2 @ np.swapaxes(b2, -1, -2)
    gb = np.swapaxes(a2, -1, -2) @ g2

    def reduce(grad, shape):
        lead = grad.ndim - len(shape)
        grad = grad.sum(axis=tuple(range(lead)))
        return grad.sum(axis=tuple(i for i, n in enumerate(shape) if n == 1), keepdims=True)

    return reduce(ga, a2.shape).reshape(a.shape), reduce(gb, b2.shape).reshape(b.shape)


TIES = np.array([[1.0, 3.0, 3.0], [0.5, 0.5, -1.0]])

NONLINEAR_CASES = [
    ("exp", [(3, 4)], lambda x: x.exp(), np.exp, lambda ins, g: (g * np.exp(ins[0]),)),
    ("log", [(3, 4)], lambda x: x.log(), np.log, lambda ins, g: (g / ins[0],)),
    ("sqrt", [(3, 4)], lambda x: x.sqrt(), np.sqrt, lambda ins, g: (g / (2 * np.sqrt(ins[0])),)),
    ("amax_all", [(3, 4)], lambda x: x.amax(), lambda a: a.max(), _amax_vjp((0, 1))),
    ("max_all", [(3, 4)], lambda x: x.max(), lambda a: a.max(), _amax_vjp((0, 1))),
    ("amax_dim", [(3, 4, 2)], lambda x: x.amax(1), lambda a: a.max(1), _amax_vjp((1,))),
    (
        "amax_dims_keepdim",
        [(3, 4, 2)],
        lambda x: x.amax((0, -1), keepdim=True),
        lambda a: a.max((0, 2), keepdims=True),
        _amax_vjp((0, 2)),
    ),
    ("max_dim", [(3, 4, 2)], lambda x: x.max(1).values, lambda a: a.max(1), _max_dim_vjp(1, False)),
    (
        "max_dim_keepdim",
        [(3, 4, 2)],
        lambda x: x.max(dim=-1, keepdim=True)[0],
        lambda a: a.max(-1, keepdims=True),
        _max_dim_vjp(2, True),
    ),
    ("matmul_4d", [(2, 3, 4, 5), (2, 3, 5, 6)], lambda a, b: a @ b, np.matmul, _matmul_vjp),
    ("matmul_batch_broadcast", [(2, 1, 4, 5), (3, 5, 2)], lambda a, b: a @ b, np.matmul, _matmul_vjp),
    ("matmul_3d_2d", [(2, 4, 5), (5, 3)], lambda a, b: a @ b, np.matmul, _matmul_vjp),
    ("matmul_1d_3d", [(5,), (2, 5, 3)], lambda a, b: a @ b, np.matmul, _matmul_vjp),
    ("matmul_3d_1d", [(2, 4, 5), (5,)], lambda a, b: a @ b, np.matmul, _matmul_vjp),
    ("matmul_1d_1d", [(5,), (5,)], lambda a, b: a @ b, np.matmul, _matmul_vjp),
]


@pytest.mark.parametrize("case", NONLINEAR_CASES, ids=_linear_id)
def test_nonlinear_methods_forward_and_backward_match_numpy(backend, case):
    name, shapes, fn, ref, vjp = case
    dtype = work_dtype(backend)
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    ins = [_pos(s, rng).astype(dtype) for s in shapes]
    xs = [taifuse.tensor(a, requires_grad=True) for a in ins]
    y = fn(*xs)
    ins64 = [a.astype(np.float64) for a in ins]
    expected = np.asarray(ref(*ins64))
    assert y.shape == expected.shape and y.dtype == dtype
    close(y.numpy(), expected, dtype)
    g = rng.standard_normal(expected.shape).astype(dtype)
    y.backward(taifuse.tensor(g))
    for x, want in zip(xs, vjp(ins64, g.astype(np.float64))):
        close(x.grad.numpy(), want, dtype)


def test_max_and_amax_ties_and_indices(backend):
    """amax (and max of everything) split the gradient among ties; max(dim) gives it to the first."""
    dtype = work_dtype(backend)
    x = taifuse.tensor(TIES.astype(dtype), requires_grad=True)
    x.amax(1).sum().backward()
    close(x.grad.numpy(), [[0, 0.5, 0.5], [0.5, 0.5, 0]], dtype)
    x.grad = None
    x.max().backward()
    close(x.grad.numpy(), [[0, 0.5, 0.5], [0, 0, 0]], dtype)
    x.grad = None
    result = x.max(dim=1)
    values, indices = result
    assert result.values is values and result.indices is indices
    np.testing.assert_array_equal(indices.numpy(), [1, 0])
    assert indices.dtype == (np.int32 if backend.name == "taichi" else np.int64)
    values.sum().backward()
    close(x.grad.numpy(), [[0, 1, 0], [1, 0, 0]], dtype)
    # A NaN is the maximum, and its index the first NaN's, as NumPy and PyTorch.
    v, i = taifuse.tensor(np.array([[1.0, np.nan, 2.0, np.nan]], dtype)).max(1)
    assert np.isnan(v.numpy()).all() and i.numpy().tolist() == [1]
    # A 0-d tensor: dim 0 and -1 name its one value.
    v, i = taifuse.tensor(np.array(2.0, dtype)).max(0, keepdim=True)
    assert v.shape == () and i.shape == () and v.item() == 2.0 and i.item() == 0


def test_max_along_a_long_dimension_takes_several_passes(backend):
    """argmax on taichi scans at most INDEX_CHUNK entries per launch; the first maximum still wins."""
    dtype = work_dtype(backend)
    a = np.zeros((2, 2500), dtype)
    a[0, [1500, 2400]] = 5.0
    a[1, [3, 2499]] = 7.0
    v, i = taifuse.tensor(a).max(1)
    np.testing.assert_array_equal(i.numpy(), [1500, 3])
    close(v.numpy(), [5.0, 7.0], dtype)


def test_index_backward_accumulates_many_repeats(backend):
    """More indices than one taichi launch scans (INDEX_CHUNK): repeated entries still accumulate."""
    dtype = work_dtype(backend)
    rng = np.random.default_rng(3)
    idx = rng.integers(-7, 7, 2500)
    x = taifuse.tensor(np.ones((2, 7), dtype), requires_grad=True)
    y = x[:, idx]
    g = rng.standard_normal(y.shape).astype(dtype)
    y.backward(taifuse.tensor(g))
    want = np.zeros((2, 7))
    np.add.at(want, (slice(None), idx), g.astype(np.float64))
    close(x.grad.numpy(), want, dtype)
    # The same with the index as a Tensor on the backend.
    x.grad = None
    x[:, taifuse.tensor(idx)].backward(taifuse.tensor(g))
    close(x.grad.numpy(), want, dtype)


def test_f16_storage(backend):
    """float16 data stays float16 through the views, gathers and reductions (float32 arithmetic)."""
    a = np.random.default_rng(1).uniform(0.5, 2, (2, 3, 4)).astype(np.float16)
    x = taifuse.tensor(a, requires_grad=True)
    y = taifuse.cat([x[:, ::-1].permute(0, 2, 1), x.transpose(1, 2).exp()], dim=1).amax(-1)
    ref = np.concatenate(
        [a[:, ::-1].transpose(0, 2, 1), np.exp(a.astype(np.float32)).transpose(0, 2, 1)], 1
    ).max(-1)
    assert y.dtype == np.float16
    np.testing.assert_allclose(y.numpy().astype(np.float32), ref, rtol=2e-3)
    y.sum().backward()
    assert x.grad.dtype == np.float16 and np.isfinite(x.grad.numpy()).all()


def test_views_share_on_the_host_and_reshape_shares_everywhere(backend):
    """NOTE [ Views ]: indexing shares the memory on the host backends (a copy on taichi, whose
    device arrays have no strides); view and reshape share on every backend."""
    x = taifuse.tensor(np.zeros((2, 2), work_dtype(backend)))
    y, v = x[0], x.view(4)
    with taifuse.no_grad():
        x += 1.0
    host = backend.name in ("numpy", "numba")
    assert y.numpy().tolist() == ([1.0, 1.0] if host else [0.0, 0.0])
    assert v.numpy().tolist() == [1.0] * 4
    assert v._version == x._version == 1 and v._base is x
    assert (y._version, y._base) == ((1, x) if host else (0, None))


def test_iteration_goes_along_the_first_dimension(backend):
    a = np.arange(6, dtype=work_dtype(backend)).reshape(3, 2)
    rows = list(taifuse.tensor(a))
    assert len(rows) == 3 and all(r.shape == (2,) for r in rows)
    np.testing.assert_array_equal(rows[2].numpy(), a[2])
    with pytest.raises(TypeError, match="0-d"):
        iter(taifuse.tensor(np.array(1.0, a.dtype)))


def test_non_float_tensors_are_refused_by_the_float_methods(backend):
    ints = taifuse.tensor([[1, 2]])
    for method in ("exp", "log", "sqrt", "amax", "max"):
        with pytest.raises(TypeError, match="floating-point"):
            getattr(ints, method)()
    with pytest.raises(TypeError, match="floating-point"):
        ints.masked_fill(np.array([True, False]), 0.0)


# ----------------------------------------------------------------------------- float64 finite differences


def _finite_difference(fn, ins, g, eps=1e-6):
    grads = []
    for k, a in enumerate(ins):
        grad = np.zeros_like(a)
        for i in np.ndindex(a.shape):
            plus = [b.copy() for b in ins]
            minus = [b.copy() for b in ins]
            plus[k][i] += eps
            minus[k][i] -= eps
            fp = fn(*(taifuse.tensor(b) for b in plus)).numpy()
            fm = fn(*(taifuse.tensor(b) for b in minus)).numpy()
            grad[i] = np.sum((fp - fm) * g) / (2 * eps)
        grads.append(grad)
    return grads


FD_CASES = [(c[0], [c[1]], c[2]) for c in LINEAR_CASES] + [(c[0], c[1], c[2]) for c in NONLINEAR_CASES]


@pytest.mark.parametrize("case", FD_CASES, ids=_linear_id)
def test_float64_finite_differences(case):
    name, shapes, fn = case
    with taifuse.backends.preserved_choice():
        taifuse.set_backend("numpy")
        rng = np.random.default_rng(zlib.crc32(name.encode()))
        ins = [_pos(s, rng) for s in shapes]  # positive and tie-free: every method is smooth there
        xs = [taifuse.tensor(a, requires_grad=True) for a in ins]
        y = fn(*xs)
        g = rng.standard_normal(y.shape)
        y.backward(taifuse.tensor(g))
        for x, want in zip(xs, _finite_difference(fn, ins, g)):
            np.testing.assert_allclose(x.grad.numpy(), want, rtol=1e-6, atol=1e-8)


# ----------------------------------------------------------------------------- PyTorch parity

TORCH_CASES = [
    ("getitem", [(3, 4, 5)], lambda x: x[1:, [2, 0, 2], ::2]),
    ("getitem_none_ellipsis", [(3, 4, 5)], lambda x: x[None, ..., -1]),
    ("permute_transpose", [(3, 4, 5)], lambda x: x.permute(2, 0, 1).transpose(0, 1)),
    ("unsqueeze_squeeze_view", [(3, 1, 5)], lambda x: x.squeeze(1).unsqueeze(0).view(5, 3)),
    ("expand", [(3, 1, 5)], lambda x: x.expand(2, -1, 4, 5)),
    ("split_chunk", [(6, 4)], lambda x: x.split([2, 4])[1] * x.chunk(3, dim=0)[2].sum()),
    ("masked_fill", [(3, 4)], lambda x: x.masked_fill(MASK[:, :4], -1.5)),
    ("exp_log_sqrt", [(3, 4)], lambda x: x.exp() + x.log() * x.sqrt()),
    ("amax_ties", [(2, 3)], lambda x: (x * 0 + TIES_T(x)).amax(-1)),
    ("max_dim", [(3, 4)], lambda x: x.max(dim=0).values),
    ("attention_scores", [(2, 2, 3, 4), (2, 2, 4, 3)], lambda q, k: (q @ k).amax(-1)),
    ("matmul_3d_2d", [(2, 3, 4), (4, 5)], lambda a, b: a @ b),
]


def TIES_T(x):
    """TIES as a constant of x's library (taifuse or torch)."""
    if isinstance(x, taifuse.Tensor):
        return taifuse.tensor(TIES)
    import torch

    return torch.tensor(TIES)


@pytest.mark.parametrize("case", TORCH_CASES, ids=_linear_id)
def test_torch_parity(case):
    torch = pytest.importorskip("torch")
    name, shapes, fn = case
    with taifuse.backends.preserved_choice():
        taifuse.set_backend("numpy")
        rng = np.random.default_rng(5)
        ins = [_pos(s, rng) for s in shapes]
        xs = [taifuse.tensor(a, requires_grad=True) for a in ins]
        ts = [torch.tensor(a, requires_grad=True) for a in ins]
        if name == "getitem":  # torch refuses negative steps; ::2 stays positive here
            y, yt = fn(*xs), ts[0][1:, [2, 0, 2], ::2]
        elif name == "masked_fill":
            y, yt = fn(*xs), ts[0].masked_fill(torch.from_numpy(MASK[:, :4]), -1.5)
        else:
            y, yt = fn(*xs), fn(*ts)
        np.testing.assert_allclose(y.numpy(), yt.detach().numpy(), rtol=1e-12, atol=1e-12)
        g = rng.standard_normal(y.shape)
        y.backward(taifuse.tensor(g))
        yt.backward(torch.from_numpy(g))
        for x, t in zip(xs, ts):
            np.testing.assert_allclose(x.grad.numpy(), t.grad.numpy(), rtol=1e-12, atol=1e-12)
        if name == "max_dim":
            np.testing.assert_array_equal(xs[0].max(0).indices.numpy(), ts[0].max(0).indices.numpy())


def test_torch_parity_cat_and_stack():
    torch = pytest.importorskip("torch")
    with taifuse.backends.preserved_choice():
        taifuse.set_backend("numpy")
        rng = np.random.default_rng(8)
        a, b = rng.standard_normal((2, 3)), rng.standard_normal((2, 1))
        xa, xb = taifuse.tensor(a, requires_grad=True), taifuse.tensor(b, requires_grad=True)
        ta, tb = torch.tensor(a, requires_grad=True), torch.tensor(b, requires_grad=True)
        y = taifuse.cat([xa, xb], 1) * taifuse.stack([xb.squeeze(1)] * 4, -1)
        yt = torch.cat([ta, tb], 1) * torch.stack([tb.squeeze(1)] * 4, -1)
        np.testing.assert_allclose(y.numpy(), yt.detach().numpy(), rtol=1e-12)
        g = rng.standard_normal(y.shape)
        y.backward(taifuse.tensor(g))
        yt.backward(torch.from_numpy(g))
        np.testing.assert_allclose(xa.grad.numpy(), ta.grad.numpy(), rtol=1e-12)
        np.testing.assert_allclose(xb.grad.numpy(), tb.grad.numpy(), rtol=1e-12)


# ----------------------------------------------------------------------------- bad input

BAD_INPUT = [
    ("x[3]", IndexError, "index 3 is out of bounds for dimension 0 with size 3"),
    ("x[0, -5]", IndexError, "index -5 is out of bounds for dimension 1"),
    ("x[:, [0, 4]]", IndexError, "index 4 is out of bounds for dimension 1 with size 4"),
    ("x[0, 0, 0]", IndexError, "too many indices"),
    ("x[..., ...]", IndexError, "single ellipsis"),
    ("x[::0]", ValueError, "slice step"),
    ("x[[0.5]]", TypeError, "integers"),
    ("x[np.array([True, False, True])]", TypeError, "boolean"),
    ("x[[0], [1]]", TypeError, "only one integer array"),
    ("x['a']", TypeError, "unsupported index"),
    ("x.permute(1, 2)", IndexError, "dims is out of range"),
    ("x.permute(0)", ValueError, "permute: dims"),
    ("x.permute(0, 0)", ValueError, "repeats"),
    ("x.transpose(0, 2)", IndexError, "dim1 is out of range"),
    ("x.unsqueeze(3)", IndexError, r"unsqueeze: dim is out of range \(expected to be in range of \[-3, 2\]"),
    ("x.squeeze(2)", IndexError, "squeeze: dim"),
    ("x.split(0)", ValueError, "split_size_or_sections"),
    ("x.split([1, 1])", ValueError, "split_size_or_sections .* sum exactly to 3"),
    ("x.split(1, dim=2)", IndexError, "split: dim"),
    ("x.chunk(0)", ValueError, "chunks"),
    ("x.expand(3)", ValueError, "number of sizes"),
    ("x.expand(3, 5)", ValueError, r"expanded size of the tensor \(5\) must match the existing size \(4\)"),
    ("x.expand(-1, 4, 4)", ValueError, "size -1 is not allowed"),
    ("x.view(5, -1)", ValueError, "reshape"),
    ("x.masked_fill(np.ones(3, bool), 0.0)", ValueError, "mask of shape"),
    ("x.masked_fill(np.ones(4), 0.0)", TypeError, "mask should be a boolean"),
    ("x.masked_fill(np.ones(4, bool), x)", TypeError, "value"),
    ("x.max(2)", IndexError, "max: dim is out of range"),
    ("x.amax((0, 0))", ValueError, "repeats"),
    ("x.amax(-3)", IndexError, "amax: dim"),
    ("x[:0].max(0)", IndexError, "non-zero size"),
    ("taifuse.cat([])", ValueError, "tensors should not be empty"),
    ("taifuse.cat(x)", TypeError, "sequence of Tensors"),
    ("taifuse.cat([x, x.numpy()])", TypeError, r"tensors\[1\] should be a Tensor"),
    (
        "taifuse.cat([x, x[:, :2]])",
        ValueError,
        r"must match except in dimension 0.*tensors\[1\] has shape \(3, 2\)",
    ),
    ("taifuse.cat([x, x], dim=2)", IndexError, "cat: dim"),
    ("taifuse.cat([x.sum(), x.sum()])", ValueError, "zero-dimensional"),
    ("taifuse.stack([x, x[:2]])", ValueError, "equal size"),
    ("taifuse.stack([x, x], dim=3)", IndexError, "stack: dim"),
    ("x @ x", ValueError, "not aligned"),
    ("x.reshape(2, 3, 2) @ x.reshape(3, 2, 2)", ValueError, "cannot be broadcast"),
]


@pytest.mark.parametrize("expr,error,match", BAD_INPUT, ids=[b[0] for b in BAD_INPUT])
def test_bad_input_raises_naming_the_argument(backend, expr, error, match):
    x = taifuse.tensor(np.arange(12.0).reshape(3, 4).astype(work_dtype(backend)), requires_grad=True)
    with pytest.raises(error, match=match) as info:
        eval(expr)
    if error is IndexError:
        assert isinstance(info.value, ValueError) or "too many" in match or "ellipsis" in match
    assert x.grad is None


# ----------------------------------------------------------------------------- taichi residency


@pytest.fixture(scope="module", params=("taichi-cpu", GPU_PARAM, CUDA_PARAM))
def taichi(request: pytest.FixtureRequest):
    pytest.importorskip("taichi")
    spec = BackendSpec(request.param)
    reason = start(spec)
    if reason is not None:
        pytest.skip(f"{spec.param} unavailable: {reason}")
    spec.activate()
    return spec.module()


def test_a_device_index_is_not_copied_back_to_be_checked(taichi):
    """As a device class index (NOTE [ Class indices on the device ]): out of range gives NaN."""
    x = taifuse.tensor(np.ones((2, 3), np.float32))
    y = x[:, taifuse.tensor([0, 9, -1])].numpy()
    assert np.isnan(y[:, 1]).all() and (y[:, [0, 2]] == 1.0).all()


def _chain(q, k, index, mask):
    scores = (q @ k.transpose(-2, -1)).masked_fill(mask, -3.0)  # (B, H, T, T)
    weights = (scores - scores.amax(-1, keepdim=True)).exp()
    heads = weights.split(1, dim=1)
    mixed = taifuse.cat(list(heads), dim=1).permute(0, 2, 1, 3)  # (B, T, H, T)
    picked = mixed[:, index][..., ::-1, None].squeeze(-1)  # an index Tensor on the device
    stacked = taifuse.stack([picked, picked.sqrt()], dim=0).unsqueeze(1).expand(2, 3, *picked.shape)
    values, _ = stacked.max(dim=-1)
    return values.log().sum() + q.chunk(2, dim=-1)[0].reshape(-1).view(-1, 2).sum()


def test_a_chain_of_views_copies_nothing_to_or_from_the_host(taichi):
    rng = np.random.default_rng(11)
    q = taifuse.tensor(rng.standard_normal((2, 2, 4, 6)).astype(np.float32), requires_grad=True)
    k = taifuse.tensor(rng.standard_normal((2, 2, 4, 6)).astype(np.float32), requires_grad=True)
    index = taifuse.tensor([3, 0, 0])
    mask = taifuse.tensor(np.triu(np.ones((4, 4), bool), 1))
    _chain(q, k, index, mask).backward()  # compiles every kernel
    q.grad = k.grad = None
    taichi.reset_transfer_stats()
    loss = _chain(q, k, index, mask)
    loss.backward()
    assert taichi.transfer_stats() == {
        "host_to_device": 0,
        "device_to_host": 0,
        "bytes_host_to_device": 0,
        "bytes_device_to_host": 0,
    }
    # The same chain on numpy, in float32.
    got = (loss.item(), q.grad.numpy(), k.grad.numpy())
    with taifuse.backends.preserved_choice():
        taifuse.set_backend("numpy")
        qh = taifuse.tensor(q.detach().numpy(), requires_grad=True)
        kh = taifuse.tensor(k.detach().numpy(), requires_grad=True)
        ref = _chain(qh, kh, taifuse.tensor([3, 0, 0]), taifuse.tensor(np.triu(np.ones((4, 4), bool), 1)))
        ref.backward()
        assert got[0] == pytest.approx(ref.item(), rel=1e-5)
        close(got[1], qh.grad.numpy(), F32)
        close(got[2], kh.grad.numpy(), F32)
