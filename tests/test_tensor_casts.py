"""Tensor.to(dtype), .half(), .float(), .double(): PyTorch's semantics on every backend.

A cast is one correctly rounded conversion (round to nearest even), so the values are held to the
NumPy reference (``ndarray.astype``) and to torch's ``Tensor.to`` exactly: tolerance zero, bit for
bit, NaN included. The gradient of a cast is the output's gradient cast back to the input's dtype.
"""

from __future__ import annotations

import numpy as np
import pytest

import taifuse
from taifuse.tensor import Tensor

F16, F32, F64 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)

# VALUES overflow float16 on purpose: NumPy's cast warns where torch's is silent.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")

# float32 values with every case a float16 cast meets: exact, rounded (ties to even among them),
# overflow to inf, float16 subnormals, underflow to zero, signed zero, inf and NaN.
VALUES = np.array(
    [0.0, -0.0, 1.0, -2.5, 0.1, 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, 65504.0, 65520.0, 1e5, -1e5,
     2.0**-20, -3.0 * 2.0**-24, 2.0**-26, np.inf, -np.inf, np.nan, 3.14159, -1234.5678],
    dtype=np.float32,
)  # fmt: skip


def _floats(backend_name: str) -> tuple[np.dtype, ...]:
    return (F16, F32) if backend_name == "taichi" else (F16, F32, F64)


def _same_bits(got: np.ndarray, expected: np.ndarray, what: str) -> None:
    assert got.dtype == expected.dtype, what
    np.testing.assert_array_equal(got, expected, err_msg=what)  # NaN == NaN here, and tolerance 0
    assert (np.signbit(got) == np.signbit(expected)).all(), what


def _source(dtype: np.dtype) -> np.ndarray:
    with np.errstate(over="ignore"):
        return VALUES.astype(dtype)


@pytest.mark.parametrize("method", ["to", "half", "float", "double"])
def test_casts_match_the_reference_values_and_dtypes(backend, method):
    targets = {"half": [F16], "float": [F32], "double": [F64]}.get(method, _floats(backend.name))
    for src in _floats(backend.name):
        x = taifuse.tensor(_source(src))
        for dst in targets:
            if dst == F64 and backend.name == "taichi":
                continue  # the refusal has its own test
            y = x.to(dst) if method == "to" else getattr(x, method)()
            with np.errstate(over="ignore"):
                expected = _source(src).astype(dst)
            assert isinstance(y, Tensor) and y.dtype == dst and y.backend == backend.name
            _same_bits(y.numpy(), expected, f"{method} {src} -> {dst} on {backend.param}")


def test_cast_to_the_same_dtype_returns_self(backend):
    for dtype in _floats(backend.name):
        x = taifuse.tensor(np.ones(3, dtype), requires_grad=True)
        assert x.to(dtype) is x and x.to(str(dtype)) is x and x.to(dtype.type) is x
    x = taifuse.tensor(np.ones(2, np.float32))
    assert x.float() is x and x.to(taifuse.tensor(np.zeros(1, np.float32))) is x
    assert x.half().half().dtype == F16


def test_cast_accepts_numpy_dtypes_strings_and_tensors(backend):
    x = taifuse.tensor([1.0, 2.0])
    for spelling in (np.float16, F16, "float16", "f2", "half", taifuse.tensor(np.zeros(1, np.float16))):
        assert x.to(spelling).dtype == F16, spelling


def test_cast_gradient_goes_back_in_the_source_dtype(backend):
    rng = np.random.default_rng(0)
    upstream = rng.uniform(-2.0, 2.0, 7)
    for src in _floats(backend.name):
        for dst in _floats(backend.name):
            if src == dst:
                continue
            x = taifuse.tensor(rng.uniform(-3.0, 3.0, 7).astype(src), requires_grad=True)
            y = x.to(dst)
            assert y.requires_grad and y.grad_fn is not None and not y.is_leaf
            g = upstream.astype(dst)
            y.backward(g)
            # The reference: the gradient of y = cast(x) is cast(g) back to x's dtype.
            _same_bits(x.grad.numpy(), g.astype(src), f"grad {src} -> {dst} on {backend.param}")


def test_cast_inside_a_graph_differentiates_through(backend):
    x = taifuse.tensor([0.5, -1.5, 2.0], requires_grad=True)
    loss = (x.half() * x.half()).float().sum()  # d/dx sum(x^2) = 2x, exact in float16 here
    assert loss.dtype == F32
    loss.backward()
    assert x.grad.dtype == F32
    np.testing.assert_array_equal(x.grad.numpy(), np.array([1.0, -3.0, 4.0], np.float32))


def test_cast_of_an_integer_tensor_has_no_graph(backend):
    idx = taifuse.tensor(np.array([0, 3, -2], np.int64))
    y = idx.float()
    assert y.dtype == F32 and not y.requires_grad
    np.testing.assert_array_equal(y.numpy(), np.array([0.0, 3.0, -2.0], np.float32))


def test_cast_under_no_grad_records_nothing(backend):
    x = taifuse.tensor([1.0], requires_grad=True)
    with taifuse.no_grad():
        y = x.half()
    assert not y.requires_grad and y.grad_fn is None


def test_bad_dtypes_raise_naming_dtype_before_anything_is_made(backend):
    x = taifuse.tensor([1.0, 2.0], requires_grad=True)
    for bad in ("bfloat16", "cpu", None, np.int64, "int32", bool, np.complex64, 3, object()):
        with pytest.raises(TypeError, match="dtype"):
            x.to(bad)
    assert x.grad is None and x.dtype == F32


def test_double_on_taichi_is_the_documented_refusal(backend):
    x = taifuse.tensor([1.0, 2.0], requires_grad=True)
    if backend.name == "taichi":
        for call in (x.double, lambda: x.to(np.float64), lambda: x.to("float64")):
            with pytest.raises(TypeError, match="float64.*taichi"):
                call()
    else:
        assert x.double().dtype == F64


def test_casts_match_torch(backend):
    torch = pytest.importorskip("torch")
    names = {F16: torch.float16, F32: torch.float32, F64: torch.float64}
    for src in _floats(backend.name):
        for dst in _floats(backend.name):
            x = taifuse.tensor(_source(src), requires_grad=True)
            tx = torch.tensor(_source(src), requires_grad=True)
            y, ty = x.to(dst), tx.to(names[dst])
            assert (y is x) == (ty is tx)
            _same_bits(y.numpy(), ty.detach().numpy(), f"{src} -> {dst} vs torch on {backend.param}")
            if y is x:
                continue
            upstream = np.linspace(-1.0, 1.0, len(VALUES)).astype(dst)
            y.backward(upstream)
            ty.backward(torch.from_numpy(upstream))
            _same_bits(x.grad.numpy(), tx.grad.numpy(), f"grad {src} -> {dst} vs torch on {backend.param}")
    x = taifuse.tensor([1.0])
    assert (x.half().dtype, x.float().dtype) == (F16, F32)
    torch_methods = {"half": torch.float16, "float": torch.float32}
    for method, expected in torch_methods.items():
        assert getattr(torch.ones(1), method)().dtype == expected
