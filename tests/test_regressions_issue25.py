"""Regressions from issue 25 section 2 (PyTorch's OpInfo samples run through taifuse), each against
PyTorch on every backend: 0-d operands kept 0-d, the activations' gradients at NaN and +-inf, and
``cat`` of a legacy empty ``(0,)`` tensor."""

from __future__ import annotations

import numpy as np
import pytest

import taifuse
import taifuse.functional as F

torch = pytest.importorskip("torch")
# The NaN and inf inputs below are the point: NumPy's warnings about them are expected.
pytestmark = pytest.mark.filterwarnings(
    "ignore:invalid value encountered:RuntimeWarning", "ignore:overflow encountered:RuntimeWarning"
)
TF = torch.nn.functional

F32 = np.dtype(np.float32)


# ----------------------------------------------------------------------------- 0-d operands
# Reported: tensor(np.float32(1.5), requires_grad=True) * np.array(2.0, np.float32) had shape (1,)
# (np.ascontiguousarray turns a 0-d array into (1,)); on taichi masked_fill of a 0-d tensor with a
# 0-d mask returned (1,) and tensor(np.float32(1.5)).copy_(np.float32(3)) raised.

BINARY = ["__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__"]


@pytest.mark.parametrize("op", BINARY)
@pytest.mark.parametrize("other_dtype", [np.float32, np.float16, np.int64])
def test_a_0d_numpy_operand_keeps_the_result_0d(grad_backend, op, other_dtype):
    x = taifuse.tensor(np.float32(1.5), requires_grad=True)
    other = np.array(2, other_dtype)
    y = getattr(x, op)(other)
    tx = torch.tensor(np.float32(1.5), requires_grad=True)
    ty = getattr(tx, op)(torch.from_numpy(other))
    assert y.shape == tuple(ty.shape) == ()
    assert y.dtype == F32
    y.backward()
    ty.backward()
    assert x.grad.shape == ()
    np.testing.assert_allclose(y.numpy(), ty.detach().numpy(), rtol=1e-6)
    np.testing.assert_allclose(x.grad.numpy(), tx.grad.numpy(), rtol=1e-6)


def test_a_0d_numpy_operand_beside_a_dimensioned_tensor_broadcasts(grad_backend):
    x = taifuse.tensor(np.array([1.0, 2.0], np.float32), requires_grad=True)
    y = x * np.array(3.0, np.float32)
    assert y.shape == (2,)
    y.sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), [3.0, 3.0])


@pytest.mark.parametrize("mask", [np.array(True), np.array(False)])
def test_masked_fill_of_a_0d_tensor_with_a_0d_mask(grad_backend, mask):
    x = taifuse.tensor(np.float32(1.5), requires_grad=True)
    y = x.masked_fill(mask, -1.0)
    tx = torch.tensor(np.float32(1.5), requires_grad=True)
    ty = tx.masked_fill(torch.from_numpy(mask), -1.0)
    assert y.shape == tuple(ty.shape) == ()
    y.backward()
    ty.backward()
    np.testing.assert_array_equal(y.numpy(), ty.detach().numpy())
    assert x.grad.shape == ()
    np.testing.assert_array_equal(x.grad.numpy(), tx.grad.numpy())


@pytest.mark.parametrize("src", [np.float32(3), 3.0, np.array(3.0, np.float32), np.array(3.0)])
def test_copy_into_a_0d_tensor(grad_backend, src):
    t = taifuse.tensor(np.float32(1.5))
    assert t.copy_(src) is t
    assert t.shape == ()
    assert t.item() == 3.0


@pytest.mark.parametrize("op", ["__iadd__", "__isub__", "__imul__"])
def test_in_place_op_on_a_0d_tensor_with_a_0d_array(grad_backend, op):
    t = taifuse.tensor(np.float32(1.5))
    getattr(t, op)(np.array(2.0, np.float32))
    expected = getattr(torch.tensor(1.5), op)(torch.tensor(2.0))
    assert t.shape == ()
    assert t.item() == expected.item()


# ----------------------------------------------------------------------------- NaN and inf gradients
# Reported: relu's gradient at a NaN input was 0; PyTorch passes the incoming gradient through (its
# threshold backward masks only where the input <= 0). Checked beside it: every activation's
# backward, add_relu, mul_relu and linear's fused epilogue, at NaN, +-inf and signed zeros, with
# incoming gradients that are themselves non-finite (a masked entry is 0, not 0 * inf = NaN).

VALUES = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, -1.0, 5.0, -5.0])
GRADS = np.array([1.0, -2.0, 0.0, np.nan, np.inf, -np.inf])
# Finite entries: torch's float32 formulas against taifuse's (float64 on numpy; gelu_tanh's
# derivative at -5 cancels in torch's 1 + tanh form); NaN positions must agree exactly.
ATOL = {np.dtype(np.float32): 2e-5, np.dtype(np.float16): 2e-3}
RTOL = {np.dtype(np.float32): 1e-5, np.dtype(np.float16): 2e-3}


def _assert_like_torch(got, want, dtype, what: str) -> None:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"{what}: NaN positions")
    finite = ~np.isnan(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=RTOL[dtype], atol=ATOL[dtype], err_msg=what)


UNARY = {
    "relu": (F.relu, TF.relu),
    "gelu": (F.gelu, TF.gelu),
    "gelu_tanh": (lambda x: F.gelu(x, approximate="tanh"), lambda x: TF.gelu(x, approximate="tanh")),
    "silu": (F.silu, TF.silu),
    "sigmoid": (F.sigmoid, torch.sigmoid),
    "tanh": (F.tanh, torch.tanh),
    "leaky_relu": (F.leaky_relu, TF.leaky_relu),
    "leaky_relu_0.2": (lambda x: F.leaky_relu(x, 0.2), lambda x: TF.leaky_relu(x, 0.2)),
}


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("op", sorted(UNARY))
def test_activation_gradients_at_nan_and_inf_match_torch(grad_backend, op, dtype):
    dtype = np.dtype(dtype)
    xs, gs = (a.ravel().astype(dtype) for a in np.meshgrid(VALUES, GRADS, indexing="ij"))
    fn, torch_fn = UNARY[op]
    x = taifuse.tensor(xs, requires_grad=True)
    fn(x).backward(taifuse.tensor(gs))
    tx = torch.tensor(xs, requires_grad=True)
    torch_fn(tx).backward(torch.tensor(gs))
    _assert_like_torch(x.grad.numpy(), tx.grad.numpy(), dtype, f"{op} on {grad_backend.param}")


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("op", ["add_relu", "mul_relu"])
def test_fused_relu_gradients_at_nan_and_inf_match_torch(grad_backend, op, dtype):
    dtype = np.dtype(dtype)
    grid = np.meshgrid(VALUES, VALUES, np.array([1.0, np.inf, np.nan]), indexing="ij")
    a_v, b_v, g_v = (v.ravel().astype(dtype) for v in grid)
    a, b = taifuse.tensor(a_v, requires_grad=True), taifuse.tensor(b_v, requires_grad=True)
    getattr(F, op)(a, b).backward(taifuse.tensor(g_v))
    ta, tb = torch.tensor(a_v, requires_grad=True), torch.tensor(b_v, requires_grad=True)
    TF.relu(ta + tb if op == "add_relu" else ta * tb).backward(torch.tensor(g_v))
    _assert_like_torch(a.grad.numpy(), ta.grad.numpy(), dtype, f"{op} grad a on {grad_backend.param}")
    _assert_like_torch(b.grad.numpy(), tb.grad.numpy(), dtype, f"{op} grad b on {grad_backend.param}")


LINEAR_ACTS = {
    "relu": TF.relu,
    "gelu": TF.gelu,
    "gelu_tanh": lambda p: TF.gelu(p, approximate="tanh"),
    "silu": TF.silu,
}


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("activation", sorted(LINEAR_ACTS))
def test_linear_fused_activation_gradients_at_nan_and_inf_match_torch(grad_backend, activation, dtype):
    # x = 0, so that pre = x @ w.T + b is the bias exactly: each column of grad_pre is one
    # (pre, incoming gradient) pair, and grad_b its sum over the rows.
    dtype = np.dtype(dtype)
    pre, gs = (a.ravel().astype(dtype) for a in np.meshgrid(VALUES, GRADS, indexing="ij"))
    rows = 3
    x_v, w_v = np.zeros((rows, 2), dtype), np.ones((pre.size, 2), dtype)
    g_v = np.tile(gs, (rows, 1))
    x, w, b = (taifuse.tensor(v, requires_grad=True) for v in (x_v, w_v, pre))
    F.linear(x, w, b, activation=activation).backward(taifuse.tensor(g_v))
    tx, tw, tb = (torch.tensor(v, requires_grad=True) for v in (x_v, w_v, pre))
    LINEAR_ACTS[activation](TF.linear(tx, tw, tb)).backward(torch.tensor(g_v))
    what = f"linear {activation} on {grad_backend.param}"
    _assert_like_torch(b.grad.numpy(), tb.grad.numpy(), dtype, what + ": grad_b")
    _assert_like_torch(w.grad.numpy(), tw.grad.numpy(), dtype, what + ": grad_w")
    _assert_like_torch(x.grad.numpy(), tx.grad.numpy(), dtype, what + ": grad_x")


# ----------------------------------------------------------------------------- cat of a (0,) tensor
# Reported: cat([t, empty (0,)]) was refused with a message about `dim`; torch.cat skips 1-D
# empty tensors beside tensors of any rank.


def _cat_both(shapes, dim, dtypes=None):
    dtypes = dtypes or [np.float32] * len(shapes)
    values = [np.arange(int(np.prod(s)), dtype=dt).reshape(s) + 1 for s, dt in zip(shapes, dtypes)]
    ts = [taifuse.tensor(v, requires_grad=True) for v in values]
    tts = [torch.tensor(v, requires_grad=True) for v in values]
    out, tout = taifuse.cat(ts, dim=dim), torch.cat(tts, dim=dim)
    g = np.arange(out.size, dtype=out.dtype).reshape(out.shape)
    out.backward(taifuse.tensor(g))
    tout.backward(torch.from_numpy(g))
    return out, tout, ts, tts


@pytest.mark.parametrize(
    "shapes, dim",
    [
        ([(2, 3), (0,)], 0),
        ([(0,), (2, 3)], 1),
        ([(0,), (2, 3)], -1),
        ([(2, 3), (0,), (4, 3)], 0),
        ([(0,), (3,)], 0),
        ([(0,)], 0),
        ([(0,), (0,)], 5),  # all empty: torch returns (0,) whatever dim says
    ],
)
def test_cat_skips_legacy_empty_tensors_as_torch(grad_backend, shapes, dim):
    out, tout, ts, tts = _cat_both(shapes, dim)
    assert out.shape == tuple(tout.shape)
    np.testing.assert_array_equal(out.numpy(), tout.detach().numpy())
    for t, tt in zip(ts, tts):
        assert t.grad.shape == tuple(tt.grad.shape)
        np.testing.assert_array_equal(t.grad.numpy(), tt.grad.numpy())


def test_cat_promotes_with_a_skipped_empty_tensor_as_torch(grad_backend):
    out, tout, ts, _ = _cat_both([(2, 3), (0,)], 0, [np.float32, np.float16])
    assert out.dtype == F32 and str(tout.dtype) == "torch.float32"
    assert ts[1].grad.dtype == np.float16 and ts[1].grad.shape == (0,)


@pytest.mark.parametrize("shapes", [[(2, 3), (0, 0)], [(2, 3), (0, 2)]])
def test_cat_of_a_mismatched_empty_tensor_names_the_empty_tensor(grad_backend, shapes):
    ts = [taifuse.tensor(np.zeros(s, np.float32)) for s in shapes]
    with pytest.raises(RuntimeError):
        torch.cat([torch.zeros(s) for s in shapes])
    with pytest.raises(
        ValueError, match=r"tensors\[1\] has shape \(0, \d\).*empty tensor is skipped only when it is 1-D"
    ):
        taifuse.cat(ts)


def test_cat_refuses_a_0d_tensor_at_any_position(grad_backend):
    ts = [taifuse.tensor(np.zeros(0, np.float32)), taifuse.tensor(np.float32(1))]
    with pytest.raises(ValueError, match=r"zero-dimensional tensor \(at position 1\)"):
        taifuse.cat(ts)
