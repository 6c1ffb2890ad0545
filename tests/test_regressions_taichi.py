"""Regression tests for defects found on the taichi backend.

Most tests run on every backend (the ``backend`` fixture in conftest.py): the numpy and numba
backends already behaved, and the taichi params (taichi-cpu and the GPU param) are held to them.
Each test failed on taichi-cpu and taichi-vulkan before its fix.
"""

from __future__ import annotations

import operator
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from helpers import F16, F32, TOLERANCES, assert_close, check_op

import taifuse
import taifuse.functional as F
from taifuse.backends import reference as R


def _rng() -> np.random.Generator:
    return np.random.default_rng(20240611)


def _skip_host(backend) -> None:
    if backend.name != "taichi":
        pytest.skip(f"{backend.param} keeps its data in NumPy: the defect is the taichi backend's")


# ----------------------------------------------------------------------------- NumPy operands of Tensor ops

# Every op with more than one array operand: (fn, operand shapes). Each operand in turn is passed as a
# NumPy array while the others are Tensors that require grad.
MULTI_OPERAND_OPS = {
    "add_relu": (F.add_relu, [(3, 4), (4,)]),
    "mul_relu": (F.mul_relu, [(2, 1, 4), (3, 4)]),
    "affine": (F.affine, [(2, 3, 4), (4,), (4,)]),
    "linear": (F.linear, [(3, 5), (4, 5), (4,)]),
    # 'gelu' takes the path that keeps the pre-activation for the backward.
    "linear_gelu": (lambda x, w, b: F.linear(x, w, b, activation="gelu"), [(2, 3, 5), (4, 5), (4,)]),
    "linear_relu_no_bias": (lambda x, w: F.linear(x, w, activation="relu"), [(3, 5), (4, 5)]),
    "layer_norm": (lambda x, w, b: F.layer_norm(x, 4, w, b), [(3, 4), (4,), (4,)]),
    "mse_loss": (F.mse_loss, [(3, 4), (3, 4)]),
    "add": (operator.add, [(3, 4), (4,)]),
    "sub": (operator.sub, [(3, 4), (3, 1)]),
    "mul": (operator.mul, [(3, 4), (3, 4)]),
    "truediv": (operator.truediv, [(3, 4), (4,)]),
    "matmul": (operator.matmul, [(3, 5), (5, 2)]),
}
_NUMPY_OPERAND_CASES = [
    pytest.param(name, k, id=f"{name}-operand{k}")
    for name, (_, shapes) in MULTI_OPERAND_OPS.items()
    for k in range(len(shapes))
]


def _run(fn, operands, numpy_at: int | None, as_tensor_const: bool):
    """fn on the operands, operand ``numpy_at`` as NumPy (or a constant Tensor); the output and the
    Tensor operands (whose .grad the backward filled)."""
    args, tensors = [], []
    for k, a in enumerate(operands):
        if k == numpy_at and not as_tensor_const:
            args.append(a)
        else:
            t = taifuse.tensor(a, requires_grad=k != numpy_at)
            args.append(t)
            if k != numpy_at:
                tensors.append(t)
    out = fn(*args)
    out.sum().backward()  # the next op, then the backward: both read every saved operand
    return out, tensors


@pytest.mark.parametrize("name, numpy_at", _NUMPY_OPERAND_CASES)
def test_tensor_op_with_a_numpy_operand_keeps_the_graph_on_the_backend(backend, name, numpy_at):
    """A NumPy operand of a Tensor op is brought to the backend once, as a constant Tensor would be:
    the output lives on the backend, and forward and gradients equal the all-Tensor call's."""
    fn, shapes = MULTI_OPERAND_OPS[name]
    rng = _rng()
    operands = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    before = [a.copy() for a in operands]

    got, got_tensors = _run(fn, operands, numpy_at, as_tensor_const=False)
    expected, expected_tensors = _run(fn, operands, numpy_at, as_tensor_const=True)

    be = backend.module()
    assert isinstance(got, taifuse.Tensor) and got.requires_grad
    assert be.is_array(got._data), f"{name}: the output holds {type(got._data).__name__}, not a {backend.param} array"
    np.testing.assert_array_equal(got.numpy(), expected.numpy(), strict=True)
    for t, e in zip(got_tensors, expected_tensors):
        np.testing.assert_array_equal(t.grad.numpy(), e.grad.numpy(), strict=True)
    for a, b in zip(operands, before):
        np.testing.assert_array_equal(a, b, err_msg=f"{name} modified its NumPy operand")


def test_cross_entropy_takes_numpy_targets_with_tensor_logits(backend):
    logits = _rng().standard_normal((4, 3)).astype(np.float32)
    target = np.array([0, 2, 1, 2])
    t = taifuse.tensor(logits, requires_grad=True)
    F.cross_entropy(t, target).backward()
    u = taifuse.tensor(logits, requires_grad=True)
    F.cross_entropy(u, taifuse.tensor(target)).backward()
    np.testing.assert_array_equal(t.grad.numpy(), u.grad.numpy(), strict=True)


def test_zero_d_numpy_operands_keep_their_shape(backend):
    a, b = np.array(1.5, np.float32), np.array(-0.5, np.float32)
    assert F.mse_loss(a, b, reduction="none").shape == ()
    out = F.add_relu(taifuse.tensor(a, requires_grad=True), b)
    assert out.shape == () and out.item() == 1.0


# ----------------------------------------------------------------------------- linear with in_features = 0


@pytest.mark.parametrize("dtype", [F32, F16], ids=["f32", "f16"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("activation", [None, "relu", "gelu", "gelu_tanh", "silu"])
def test_linear_without_input_features_is_the_activation_of_the_bias(backend, activation, with_bias, dtype):
    rng = _rng()
    x = np.empty((3, 0), dtype)
    w = np.empty((4, 0), dtype)
    b = rng.standard_normal(4).astype(dtype) if with_bias else None
    check_op(backend, "linear", x, w, b, activation=activation)
    batched = F.linear(np.empty((2, 3, 0), dtype), w, b, activation=activation)
    assert batched.shape == (2, 3, 4)


@pytest.mark.parametrize("activation", [None, "relu", "gelu", "gelu_tanh", "silu"])
def test_linear_backward_without_input_features(backend, activation):
    rows, features = 3, 4
    rng = _rng()
    b = rng.standard_normal(features).astype(np.float32)
    g = rng.standard_normal((rows, features)).astype(np.float32)
    x = taifuse.tensor(np.empty((rows, 0), np.float32), requires_grad=True)
    w = taifuse.tensor(np.empty((features, 0), np.float32), requires_grad=True)
    bt = taifuse.tensor(b, requires_grad=True)
    out = F.linear(x, w, bt, activation=activation)
    out.backward(taifuse.tensor(g))

    pre = np.broadcast_to(b.astype(np.float64), (rows, features)).copy()
    ref_out = np.empty((rows, features))
    R.linear_act(np.empty((rows, 0)), np.empty((features, 0)), b.astype(np.float64), activation, ref_out)
    gx, gw, gb, gp = np.empty((rows, 0)), np.empty((features, 0)), np.empty(features), np.empty((rows, features))
    R.linear_act_backward(np.empty((rows, 0)), np.empty((features, 0)), pre, g.astype(np.float64), activation,
                          gp, gx, gw, gb)  # fmt: skip
    tol = TOLERANCES[F32]
    assert_close(out.numpy(), ref_out, np.maximum(1.0, np.abs(pre)), tol, "linear forward")
    assert x.grad.shape == (rows, 0) and w.grad.shape == (features, 0)
    assert_close(bt.grad.numpy(), gb, np.maximum(1.0, np.abs(g).sum(axis=0)), tol, "linear grad_bias")


def _sum_leading(grad: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """The gradient of an operand that matmul broadcast over leading batch axes."""
    return grad.sum(axis=tuple(range(grad.ndim - len(shape))))


@pytest.mark.parametrize("sa, sb", [((2, 0), (0, 3)), ((0, 3), (3, 2)), ((2, 3), (3, 0)), ((2, 0), (2, 0, 3))])
def test_matmul_with_an_empty_dimension_matches_numpy(backend, sa, sb):
    rng = _rng()
    a, b = rng.standard_normal(sa).astype(np.float32), rng.standard_normal(sb).astype(np.float32)
    ta, tb = taifuse.tensor(a, requires_grad=True), taifuse.tensor(b, requires_grad=True)
    out = ta @ tb
    expected = a.astype(np.float64) @ b.astype(np.float64)
    np.testing.assert_array_equal(out.numpy(), expected.astype(np.float32), strict=True)
    g = rng.standard_normal(expected.shape).astype(np.float32)
    out.backward(taifuse.tensor(g))
    ga = _sum_leading(g.astype(np.float64) @ np.swapaxes(b, -1, -2), sa)
    gb = _sum_leading(np.swapaxes(a, -1, -2) @ g.astype(np.float64), sb)
    np.testing.assert_allclose(ta.grad.numpy(), ga, rtol=1e-6)
    np.testing.assert_allclose(tb.grad.numpy(), gb, rtol=1e-6)


# ----------------------------------------------------------------------------- integer Tensor arithmetic

# The taichi backend refuses arithmetic on integer tensors (Metal has no 64-bit integers; integer
# tensors there are int32 class indices): a TypeError naming the operand and its dtype.
INTEGER_EXPRESSIONS = {
    "mul_scalar": (lambda i, j: i * 2, "mul", "left operand"),
    "rsub_scalar": (lambda i, j: 2 - i, "sub", "right operand"),
    "add": (lambda i, j: i + j, "add", "left operand"),
    "sub": (lambda i, j: i - j, "sub", "left operand"),
    "truediv": (lambda i, j: i / 2, "div", "left operand"),
    "neg": (lambda i, j: -i, "neg", "operand"),
    "pow": (lambda i, j: i**3, "pow", "operand"),
    "sum": (lambda i, j: i.sum(), "sum", "operand"),
    "mean": (lambda i, j: i.mean(0), "sum", "operand"),
    "matmul": (lambda i, j: i @ j.reshape(3, 2), "matmul", "left operand"),
    "transpose": (lambda i, j: i.T, "transpose", "operand"),
}


@pytest.mark.parametrize("name", list(INTEGER_EXPRESSIONS))
def test_integer_tensor_arithmetic_is_refused_naming_the_operand_and_dtype(backend, name):
    _skip_host(backend)
    fn, op, argname = INTEGER_EXPRESSIONS[name]
    i = taifuse.tensor(np.arange(6).reshape(2, 3))
    j = taifuse.tensor(np.ones((2, 3), np.int64))
    assert i.dtype == np.int32  # class indices live on the device as int32
    with pytest.raises(TypeError) as info:
        fn(i, j)
    message = str(info.value)
    assert message.startswith(f"{op}: ") and argname in message and "int32" in message, message
    assert "KeyError" not in message


def test_integer_in_place_arithmetic_is_refused_before_writing(backend):
    _skip_host(backend)
    i = taifuse.tensor(np.arange(6).reshape(2, 3))
    for update in (lambda t: t.__iadd__(1), lambda t: t.__imul__(2), lambda t: t.__isub__(t)):
        with taifuse.no_grad(), pytest.raises(TypeError, match="int32"):
            update(i)
    np.testing.assert_array_equal(i.numpy(), np.arange(6).reshape(2, 3))


def test_integer_tensors_still_hold_class_indices(backend):
    target = taifuse.tensor(np.array([[1, 0], [2, 1]]))
    logits = taifuse.tensor(_rng().standard_normal((4, 3)).astype(np.float32), requires_grad=True)
    flat = target.reshape(4)  # a view, no arithmetic
    loss = F.cross_entropy(logits, flat)
    loss.backward()
    assert flat.shape == (4,) and np.isfinite(loss.item())
    np.testing.assert_array_equal(flat.numpy(), [1, 0, 2, 1])


# ----------------------------------------------------------------------------- quiet interpreter exit

_EXIT_SCRIPT = """
import torch  # noqa: F401  (its import changes the order in which modules are torn down at exit)
import numpy as np
import taifuse
from taifuse import nn, optim

taifuse.set_backend({name!r}, arch={arch!r})
model = nn.Linear(4, 3)
opt = optim.AdamW(model.parameters(), lr=1e-3)
x = taifuse.tensor(np.ones((2, 4), np.float32))
model(x).sum().backward()
opt.step()
print("stepped", taifuse.get_backend())
"""


def test_interpreter_exit_is_quiet_with_torch_and_an_optimizer_at_module_level(backend):
    """Pooled device leases held by module globals are dropped while Python tears modules down."""
    _skip_host(backend)
    pytest.importorskip("torch")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TAIFUSE_")}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_EXIT_SCRIPT.format(name=backend.name, arch=backend.arch))],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "stepped taichi" in proc.stdout, proc.stdout + proc.stderr
    assert "Exception ignored" not in proc.stderr, proc.stderr


# ----------------------------------------------------------------------------- bad operands are named

# (op, its array arguments, the position of the bad one). The first operand sets the dtype, so a bad
# first operand only fails on a backend that refuses float64 outright.
_NAMED_OPERANDS = {
    "mse_loss": (F.mse_loss, [("input", (3, 4)), ("target", (3, 4))]),
    "add_relu": (F.add_relu, [("a", (3, 4)), ("b", (3, 4))]),
    "mul_relu": (F.mul_relu, [("a", (3, 4)), ("b", (3, 4))]),
    "affine": (F.affine, [("x", (3, 4)), ("scale", (4,)), ("bias", (4,))]),
    "linear": (F.linear, [("x", (3, 5)), ("weight", (4, 5)), ("bias", (4,))]),
    "layer_norm": (lambda x, w, b: F.layer_norm(x, 4, w, b), [("x", (3, 4)), ("weight", (4,)), ("bias", (4,))]),
}
_BAD_OPERAND_CASES = [
    pytest.param(op, k, mode, id=f"{op}-{argname}-{mode}")
    for op, (_, params) in _NAMED_OPERANDS.items()
    for k, (argname, _) in enumerate(params)
    for mode in ("numpy", "tensors")
]


@pytest.mark.parametrize("bad_dtype", [np.float64, np.int32], ids=["float64", "int32"])
@pytest.mark.parametrize("op, bad_at, mode", _BAD_OPERAND_CASES)
def test_a_bad_operand_dtype_is_named_with_its_value(backend, op, bad_at, mode, bad_dtype):
    """A float64 or integer operand among float32 ones: a TypeError that names the argument and its
    dtype (NumPy arguments, or NumPy among Tensors), never an internal helper such as from_numpy."""
    fn, params = _NAMED_OPERANDS[op]
    argname = params[bad_at][0]
    if bad_at == 0 and bad_dtype == np.float64 and backend.supports_f64:
        pytest.skip("the first operand sets the dtype: the message names the other operand")
    rng = _rng()
    args = []
    for k, (_, shape) in enumerate(params):
        a = rng.standard_normal(shape)
        a = (a * 3).astype(bad_dtype) if k == bad_at else a.astype(np.float32)
        if mode == "tensors" and k != bad_at:
            a = taifuse.tensor(a, requires_grad=True)
        args.append(a)
    with pytest.raises(TypeError) as info:
        fn(*args)
    message = str(info.value)
    dtype_name = np.dtype(bad_dtype).name
    assert message.startswith(f"{op}: {argname} "), message
    assert dtype_name in message and "from_numpy" not in message, message


@pytest.mark.parametrize("mode", ["numpy", "tensors"])
def test_cross_entropy_names_its_bad_operands(backend, mode):
    rng = _rng()
    logits = rng.standard_normal((4, 3)).astype(np.float32)
    wrap = (lambda a: taifuse.tensor(a, requires_grad=True)) if mode == "tensors" else (lambda a: a)
    with pytest.raises(TypeError, match=r"^cross_entropy: target .*float32"):
        F.cross_entropy(wrap(logits), np.zeros(4, np.float32))
    with pytest.raises(TypeError, match=r"^cross_entropy: logits .*int32"):
        F.cross_entropy(np.zeros((4, 3), np.int32), np.zeros(4, np.int64))
    if not backend.supports_f64:
        with pytest.raises(TypeError, match=r"^cross_entropy: logits .*float64") as info:
            F.cross_entropy(logits.astype(np.float64), np.zeros(4, np.int64))
        assert "from_numpy" not in str(info.value)
