"""The autograd Tensor: graph bookkeeping, grad mode, errors, and what ``import taifuse`` costs.

Op gradients themselves are checked in test_autograd_ops.py.
"""

from __future__ import annotations

import subprocess
import sys
import threading

import numpy as np
import pytest

import taifuse
import taifuse.functional as F
from taifuse.tensor import Tensor

# grad_backend: the fixture in conftest.py (every backend).


def work_dtype():
    """float64 where the active backend has it; the taichi backend refuses float64 by design."""
    return np.dtype(np.float32 if taifuse.get_backend() == "taichi" else np.float64)


def t64(values, requires_grad=True):
    return taifuse.tensor(np.asarray(values, dtype=work_dtype()), requires_grad=requires_grad)


# ----------------------------------------------------------------------------- creation


def test_tensor_creation_and_attributes(grad_backend):
    a = taifuse.tensor([[1.0, 2.0], [3.0, 4.0]])
    assert a.dtype == np.float32 and a.shape == (2, 2) and a.ndim == 2 and a.size == 4
    assert not a.requires_grad and a.grad is None and a.is_leaf and a.grad_fn is None
    assert a.backend == grad_backend.name
    assert taifuse.tensor(np.ones(3, np.float16)).dtype == np.float16
    assert taifuse.tensor(np.ones(3), dtype=np.float32).dtype == np.float32
    # Integers are int32 on the taichi backend (NOTE [ Class indices on the device ]).
    assert taifuse.tensor([1, 2]).dtype == (np.int32 if grad_backend.name == "taichi" else np.int64)
    assert taifuse.tensor(2.5).item() == 2.5
    src = np.ones(3, np.float32)
    b = taifuse.tensor(src)
    src[0] = 7.0
    assert b.numpy()[0] == 1.0, "tensor() copies its data"
    assert "requires_grad=True" in repr(taifuse.tensor([1.0], requires_grad=True))
    assert "grad_fn" in repr(taifuse.tensor([1.0], requires_grad=True) * 2)


def test_tensor_creation_errors(grad_backend):
    with pytest.raises(TypeError, match="floating-point"):
        taifuse.tensor([1, 2], requires_grad=True)
    with pytest.raises(TypeError, match="numbers"):
        taifuse.tensor(["a", "b"])
    with pytest.raises(ValueError, match="one element"):
        taifuse.tensor([1.0, 2.0]).item()


# ----------------------------------------------------------------------------- graph structure


def test_tensor_used_twice_accumulates(grad_backend):
    x = t64([1.0, -2.0, 3.0])
    y = (x * x + x).sum()  # dy/dx = 2x + 1
    y.backward()
    np.testing.assert_array_equal(x.grad.numpy(), [3.0, -3.0, 7.0])


def test_diamond_graph(grad_backend):
    x = t64([0.5, 2.0])
    a = x * 2.0
    b = a + 1.0
    c = F.tanh(a)
    d = (b * c).sum()  # d = sum((2x + 1) tanh(2x))
    d.backward()
    xs = np.array([0.5, 2.0])
    expected = 2 * np.tanh(2 * xs) + (2 * xs + 1) * (1 - np.tanh(2 * xs) ** 2) * 2
    np.testing.assert_allclose(x.grad.numpy(), expected, rtol=1e-12 if work_dtype() == np.float64 else 1e-6)


def test_grads_accumulate_across_backward_calls(grad_backend):
    x = t64([1.0, 2.0])
    (x * 3.0).sum().backward()
    (x * x).sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), [3.0 + 2.0, 3.0 + 4.0])


def test_shared_gradient_arrays_are_not_aliased(grad_backend):
    # add() hands the same gradient array to both inputs; accumulating into one leaf must not
    # change the other.
    a, b = t64([1.0]), t64([1.0])
    (a + b).sum().backward()
    (a * 5.0).sum().backward()
    assert a.grad.item() == 6.0 and b.grad.item() == 1.0


def test_deep_chain_does_not_recurse(grad_backend):
    x = t64([1.0])
    y = x
    # Past Python's default recursion limit of 1000; shorter on taichi, where each of the ~4 kernel
    # launches per link costs lavapipe (a CPU Vulkan) milliseconds.
    depth = 1500 if grad_backend.name == "taichi" else 5000
    for _ in range(depth):
        y = y * 1.0 + 0.0
    y.sum().backward()
    assert x.grad.item() == 1.0


def test_broadcast_gradients_sum_to_input_shape(grad_backend):
    x = t64(np.ones((2, 3)))
    b = t64(np.arange(3.0))
    s = t64(2.0)
    ((x + b) * s).sum().backward()
    np.testing.assert_array_equal(b.grad.numpy(), [4.0, 4.0, 4.0])
    assert s.grad.shape == () and s.grad.item() == (6.0 + 2 * (0 + 1 + 2))
    np.testing.assert_array_equal(x.grad.numpy(), np.full((2, 3), 2.0))


def test_non_leaf_and_constant_inputs_get_no_grad(grad_backend):
    x = t64([1.0, 2.0])
    c = t64([3.0, 4.0], requires_grad=False)
    y = x * c
    y.sum().backward()
    assert c.grad is None and y.grad is None
    np.testing.assert_array_equal(x.grad.numpy(), [3.0, 4.0])


def test_backward_on_a_leaf(grad_backend):
    x = t64([1.0])
    x.backward()
    assert x.grad.item() == 1.0


# ----------------------------------------------------------------------------- grad mode, detach


def test_no_grad_context_and_decorator(grad_backend):
    x = t64([1.0])
    with taifuse.no_grad():
        y = x * 2.0
        assert not taifuse.is_grad_enabled()
        with taifuse.enable_grad():
            assert (x * 2.0).requires_grad
    assert taifuse.is_grad_enabled()
    assert not y.requires_grad and y.grad_fn is None

    @taifuse.no_grad()
    def f(t):
        return F.gelu(t)

    assert not f(x).requires_grad
    assert (x * 2.0).requires_grad


def test_no_grad_is_thread_local(grad_backend):
    seen = []
    with taifuse.no_grad():
        worker = threading.Thread(target=lambda: seen.append(taifuse.is_grad_enabled()))
        worker.start()
        worker.join()
    assert seen == [True]


def test_detach(grad_backend):
    x = t64([1.0, 2.0])
    d = (x * 2.0).detach()
    assert not d.requires_grad and d.is_leaf
    (x * d).sum().backward()  # d is a constant here
    np.testing.assert_array_equal(x.grad.numpy(), [2.0, 4.0])


# ----------------------------------------------------------------------------- errors


def test_backward_twice_raises_without_retain_graph(grad_backend):
    x = t64([1.0, 2.0])
    y = F.gelu(x * x).sum()
    y.backward()
    with pytest.raises(RuntimeError, match="second time.*retain_graph=True"):
        y.backward()


def test_retain_graph_allows_a_second_backward(grad_backend):
    x = t64([1.0, 2.0])
    y = (x * x).sum()
    y.backward(retain_graph=True)
    y.backward()
    np.testing.assert_array_equal(x.grad.numpy(), [4.0, 8.0])


def test_backward_needs_grad_for_non_scalars(grad_backend):
    x = t64([1.0, 2.0])
    y = x * 3.0
    with pytest.raises(RuntimeError, match="one-element"):
        y.backward()
    with pytest.raises(ValueError, match="shape"):
        y.backward(np.ones(3))
    y.backward(np.array([1.0, 10.0]))
    np.testing.assert_array_equal(x.grad.numpy(), [3.0, 30.0])


def test_backward_without_requires_grad_raises(grad_backend):
    with pytest.raises(RuntimeError, match="does not require grad"):
        taifuse.tensor([1.0]).backward()


def test_matmul_shape_mismatch_names_shapes(grad_backend):
    a, b = t64(np.ones((2, 3))), t64(np.ones((4, 5)))
    with pytest.raises(ValueError, match=r"\(2, 3\).*\(4, 5\)"):
        a @ b
    with pytest.raises(ValueError, match="at least 1 dimension"):
        a @ t64(1.0)


# NOTE [ Mixed dtypes ] in _tensor_functions.py: the rule these pin, and why.
F16, F32, F64 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)


def _mixed_cases(backend_name: str) -> list:
    """(a, b, op, expected result dtype): a and b are (dtype, shape, Tensor or not); the dtype is torch's."""
    cases = [
        ((F32, (3,), True), (F16, (3,), True), "mul", F32),
        ((F16, (2, 3), True), (F32, (3,), True), "add", F32),
        ((F16, (3,), True), (F32, (3,), False), "sub", F32),  # a float32 array widens a float16 Tensor
        ((F32, (2, 3), True), (F16, (3, 2), True), "matmul", F32),
        ((F16, (3,), True), (F32, (), True), "div", F16),  # a 0-d Tensor does not widen a dimensioned one
        ((F32, (3,), True), (np.dtype(np.int64), (3,), False), "mul", F32),  # integers take the float dtype
    ]
    if backend_name != "taichi":
        cases += [
            ((F32, (3,), True), (F64, (3,), True), "mul", F64),
            ((F32, (3,), True), (F64, (3,), False), "add", F64),  # the float64 NumPy default promotes too
            ((F64, (3,), False), (F32, (3,), True), "radd", F64),  # np_array + tensor
            ((F32, (2, 3), True), (F64, (3, 2), False), "matmul", F64),
            ((F32, (3,), True), (F64, (), True), "mul", F32),
            ((F64, (), True), (F32, (3,), True), "sub", F32),
        ]
    return cases


@pytest.mark.parametrize("index", range(12))
def test_mixed_float_dtypes_promote_like_torch(grad_backend, index):
    """Binary ops compute in torch.result_type of their operands (Python numbers are weak), and each
    input's gradient comes back in that input's dtype, as in PyTorch."""
    cases = _mixed_cases(grad_backend.name)
    if index >= len(cases):
        pytest.skip("float64 cases: the taichi backend has no float64")
    (da, sa, ta), (db, sb, tb), op, expected = cases[index]
    rng = np.random.default_rng(index)
    va = rng.uniform(0.5, 2.0, sa).astype(da)
    vb = rng.uniform(0.5, 2.0, sb).astype(db) if db.kind == "f" else rng.integers(1, 4, sb).astype(db)
    a = taifuse.tensor(va, requires_grad=da.kind == "f") if ta else va
    b = taifuse.tensor(vb, requires_grad=db.kind == "f") if tb else vb
    fn = {
        "mul": lambda x, y: x * y,
        "add": lambda x, y: x + y,
        "sub": lambda x, y: x - y,
        "div": lambda x, y: x / y,
        "matmul": lambda x, y: x @ y,
        "radd": lambda x, y: x + y,
    }[op]
    out = fn(a, b)
    assert isinstance(out, Tensor) and out.dtype == expected, (op, out.dtype)
    ref = fn(va.astype(np.float64), vb.astype(np.float64))
    np.testing.assert_allclose(out.numpy().astype(np.float64), ref, rtol=2e-3 if expected == F16 else 1e-6)
    out.sum().backward()
    for t, d in ((a, da), (b, db)):
        if isinstance(t, Tensor) and t.requires_grad:
            assert t.grad is not None and t.grad.dtype == d and t.grad.shape == t.shape


def test_mixed_dtypes_refuse_float64_on_taichi(grad_backend):
    """The taichi backend has no float64 (Metal has none): a float64 operand raises TypeError rather than
    being cast down."""
    if grad_backend.name != "taichi":
        pytest.skip("numpy and numba compute in float64")
    x = taifuse.tensor([1.0, 2.0], requires_grad=True)
    for other in (np.array([1.0, 2.0]), np.array(3.0)):
        with pytest.raises(TypeError, match="float64"):
            x * other
        with pytest.raises(TypeError, match="float64"):
            other + x


def test_in_place_ops_keep_the_tensor_dtype_like_torch(grad_backend):
    other = F16 if grad_backend.name == "taichi" else F64
    a = taifuse.tensor(np.ones(3, np.float32))
    a += taifuse.tensor(np.full(3, 0.5, other))
    a *= np.full(3, 2.0)  # a float64 array: cast to the tensor's dtype, as torch's in-place ops do
    assert a.dtype == F32
    np.testing.assert_array_equal(a.numpy(), [3.0, 3.0, 3.0])
    i = taifuse.tensor(np.ones(3, np.int64))
    with pytest.raises(TypeError, match="can't be cast"):
        i += taifuse.tensor(np.ones(3, np.float32))


def test_backward_casts_its_gradient_to_the_output_dtype_like_torch(grad_backend):
    x = taifuse.tensor([1.0, 2.0, 3.0], requires_grad=True)
    (x * 3.0).backward(np.array([1.0, 2.0, 3.0]))  # a float64 array
    assert x.grad.dtype == F32
    np.testing.assert_array_equal(x.grad.numpy(), [3.0, 6.0, 9.0])
    x.grad = None
    (x * 3.0).backward(taifuse.tensor(np.ones(3, np.float16)))  # a Tensor of another dtype
    assert x.grad.dtype == F32
    np.testing.assert_array_equal(x.grad.numpy(), [3.0, 3.0, 3.0])


def test_bad_operands_raise(grad_backend):
    x = t64([1.0])
    with pytest.raises(TypeError, match="unsupported operand"):
        x + "a"
    with pytest.raises(TypeError, match="exponent"):
        x**x
    with pytest.raises(ValueError, match="reshape"):
        x.reshape(2)
    with pytest.raises(ValueError, match="out of range"):
        x.sum(dim=3)


@pytest.mark.parametrize(
    "op",
    ["sum(0)", "sum(-1)", "sum((0,))", "sum(0, keepdim=True)", "mean(-1)", "mean(0, keepdim=True)",
     "transpose(0, 0)", "transpose(-1, 0)"],
)  # fmt: skip
def test_dim_ops_on_a_0d_tensor(grad_backend, op):
    """PyTorch treats a 0-d tensor's one "dimension" as dims 0 and -1: reducing over it or swapping it
    with itself gives the tensor back (shape (), keepdim or not), and the gradient flows through."""
    x = taifuse.tensor(2.0, requires_grad=True)
    y = eval(f"x.{op}")
    assert y.shape == () and y.dtype == x.dtype and y.item() == 2.0
    (y * 3.0).backward()
    assert x.grad.shape == () and x.grad.item() == 3.0


def test_dim_ops_on_a_0d_tensor_refuse_other_dims(grad_backend):
    x = taifuse.tensor(2.0, requires_grad=True)
    with pytest.raises(ValueError, match="out of range"):
        x.sum(1)
    with pytest.raises(ValueError, match="repeats"):
        x.mean((0, -1))
    with pytest.raises(ValueError, match="out of range"):
        x.transpose(0, 1)


def test_grad_setter_refuses_what_torch_refuses(grad_backend):
    """``.grad`` takes a Tensor of the tensor's shape, dtype and backend, or None; anything else raises
    at the assignment (as torch does), not later in an optimizer step."""
    p = taifuse.tensor(np.zeros(3, np.float32), requires_grad=True)
    with pytest.raises(TypeError, match="assigned grad expected to be a Tensor or None.*numpy.ndarray"):
        p.grad = np.ones(3, np.float32)
    with pytest.raises(ValueError, match=r"gradient of shape \(4,\) to a tensor of shape \(3,\)"):
        p.grad = taifuse.tensor(np.ones(4, np.float32))
    with pytest.raises(TypeError, match="gradient of dtype float16 to a tensor of dtype float32"):
        p.grad = taifuse.tensor(np.ones(3, np.float16))
    assert p.grad is None
    g = taifuse.tensor(np.ones(3, np.float32))
    p.grad = g
    assert p.grad is g
    p.grad = None
    assert p.grad is None
    other = "numpy" if grad_backend.name != "numpy" else "numba"
    if other in taifuse.available_backends():
        with taifuse.use_backend(other):
            foreign = taifuse.tensor(np.ones(3, np.float32))
        with pytest.raises(TypeError, match="backend"):
            p.grad = foreign


def test_zero_(grad_backend):
    """In place, NaN and infinity included (zero_grad(set_to_none=False) relies on it)."""
    g = taifuse.tensor(np.array([np.nan, np.inf, -2.0], np.float32))
    assert g.zero_() is g
    np.testing.assert_array_equal(g.numpy(), [0.0, 0.0, 0.0])
    w = taifuse.tensor([1.0], requires_grad=True)
    with pytest.raises(RuntimeError, match="no_grad"):
        w.zero_()
    with taifuse.no_grad():
        w.zero_()
    assert w.item() == 0.0


def test_copy_(grad_backend):
    """In place, as torch.Tensor.copy_: broadcast, cast to the tensor's dtype, signed zeros and NaN kept."""
    t = taifuse.tensor(np.ones((2, 3), np.float32))
    data = t._data
    src = np.array([-0.0, np.nan, -np.inf], np.float64)
    assert t.copy_(src) is t and t._data is data
    got = t.numpy()
    assert got.dtype == np.float32 and np.signbit(got[:, 0]).all()
    np.testing.assert_array_equal(got, np.broadcast_to(src.astype(np.float32), (2, 3)))
    t.copy_(taifuse.tensor(np.full((2, 3), 0.5, np.float16)))
    np.testing.assert_array_equal(t.numpy(), np.full((2, 3), 0.5, np.float32))
    t.copy_(2.0)
    np.testing.assert_array_equal(t.numpy(), np.full((2, 3), 2.0, np.float32))
    with pytest.raises(ValueError, match="broadcast"):
        t.copy_(np.ones(4, np.float32))
    w = taifuse.tensor([1.0], requires_grad=True)
    with pytest.raises(RuntimeError, match="no_grad"):
        w.copy_(2.0)
    with taifuse.no_grad():
        w.copy_(3.0)
    assert w.item() == 3.0


def test_mixing_backends_raises():
    with taifuse.use_backend("numpy"):
        a = taifuse.tensor([1.0], requires_grad=True)
    other = [b for b in taifuse.available_backends() if b == "numba"]
    if not other:
        pytest.skip("needs a second host backend (numba)")
    with taifuse.use_backend("numba"):
        b = taifuse.tensor([1.0])
        with pytest.raises(TypeError, match="different backends"):
            a + b
        with pytest.raises(TypeError, match="active backend"):
            F.gelu(a)


def test_numpy_interop(grad_backend):
    x = t64([1.0, 2.0])
    y = np.array([10.0, 20.0], x.dtype) + x  # NumPy defers to Tensor.__radd__
    assert isinstance(y, Tensor) and y.requires_grad
    y.sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), [1.0, 1.0])


# ----------------------------------------------------------------------------- import cost


def test_import_taifuse_imports_numpy_only():
    code = (
        "import sys, taifuse, taifuse.nn, taifuse.functional; "
        "heavy = [m for m in ('numba', 'taichi', 'torch', 'llvmlite') if m in sys.modules]; "
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
