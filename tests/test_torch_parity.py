"""Every op matches PyTorch's float64 result for the same float32 inputs, on every backend.

PyTorch defines the semantics taifuse follows (``F.gelu``, ``F.linear``, ``F.layer_norm``, ...);
this checks taifuse against it directly, independently of taifuse's own reference kernels, within
the float32 entry of the tolerance table (``helpers.TOLERANCES``). Skipped when torch is absent.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import F32, arrays, assert_close, reference, shapes, tolerance
from hypothesis import given, settings
from hypothesis import strategies as st

import taifuse
import taifuse.functional as F

torch = pytest.importorskip("torch")
TF = torch.nn.functional

_ACTIVATIONS = {
    None: lambda y: y,
    "relu": TF.relu,
    "gelu": TF.gelu,
    "gelu_tanh": lambda y: TF.gelu(y, approximate="tanh"),
    "silu": TF.silu,
}

# taifuse op -> the same computation in PyTorch, on float64 tensors.
TORCH_OPS = {
    "gelu": lambda x, approximate="none": TF.gelu(x, approximate=approximate),
    "relu": TF.relu,
    "leaky_relu": lambda x, negative_slope=0.01: TF.leaky_relu(x, negative_slope),
    "silu": TF.silu,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "add_relu": lambda a, b: TF.relu(a + b),
    "mul_relu": lambda a, b: TF.relu(a * b),
    "affine": lambda x, scale, bias: x * scale + bias,
    "linear": lambda x, w, b=None, activation=None: _ACTIVATIONS[activation](TF.linear(x, w, b)),
    "softmax": lambda x, dim=-1: TF.softmax(x, dim=dim),
    "log_softmax": lambda x, dim=-1: TF.log_softmax(x, dim=dim),
    "layer_norm": lambda x, shape, w=None, b=None, eps=1e-5: TF.layer_norm(
        x, (shape,) if isinstance(shape, int) else shape, w, b, eps
    ),
    "rms_norm": lambda x, shape, w=None, eps=None: TF.rms_norm(
        x, (shape,) if isinstance(shape, int) else shape, w, eps
    ),
    # (_to_torch hands the indices over as float64; they are small integers, exact in it)
    "embedding": lambda i, w, padding_idx=None: TF.embedding(i.long(), w, padding_idx),
}


def _to_torch(value):
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value.astype(np.float64))
    return value


def check_torch(spec, op: str, *args, **kwargs) -> None:
    """F.<op> on ``spec``'s backend against PyTorch in float64, within the float32 tolerance."""
    spec.activate()
    got = getattr(F, op)(*args, **kwargs)
    with torch.no_grad():
        expected = TORCH_OPS[op](*map(_to_torch, args), **kwargs).numpy()
    _, scale = reference(op, *args, **kwargs)  # the op's magnitude, as in every other comparison
    assert_close(got, expected, scale, tolerance(op, F32), f"{op} vs torch on {spec.param}")


small = settings(max_examples=max(5, settings().max_examples // 2))

UNARY = [
    ("gelu", {"approximate": "none"}),
    ("gelu", {"approximate": "tanh"}),
    ("relu", {}),
    ("leaky_relu", {"negative_slope": 0.2}),
    ("silu", {}),
    ("sigmoid", {}),
    ("tanh", {}),
]


@pytest.mark.parametrize("case", UNARY, ids=lambda c: "-".join([c[0], *map(str, c[1].values())]))
@small
@given(data=st.data())
def test_unary(backend, case, data):
    op, kwargs = case
    check_torch(backend, op, data.draw(arrays(data.draw(shapes()), F32), label="x"), **kwargs)


@pytest.mark.parametrize("op", ["add_relu", "mul_relu"])
@small
@given(data=st.data())
def test_binary(backend, op, data):
    shape = data.draw(shapes(min_dims=1))
    check_torch(backend, op, data.draw(arrays(shape, F32)), data.draw(arrays(shape[1:], F32)))


def test_affine(backend):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 5, 6)).astype(np.float32)
    check_torch(backend, "affine", x, rng.standard_normal(6).astype(np.float32), rng.standard_normal(6).astype(np.float32))


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("activation", list(_ACTIVATIONS))
@small
@given(data=st.data())
def test_linear(backend, activation, with_bias, data):
    lead = tuple(data.draw(st.lists(st.integers(1, 33), min_size=1, max_size=2), label="lead"))
    k, m = data.draw(st.integers(1, 80), label="in"), data.draw(st.integers(1, 80), label="out")
    x = data.draw(arrays(lead + (k,), F32, scales=(1.0, 3.0), specials=(0.0, -0.0)))
    w = (data.draw(arrays((m, k), F32, scales=(1.0,), specials=())) / np.sqrt(k)).astype(np.float32)
    b = data.draw(arrays((m,), F32, scales=(1.0,), specials=())) if with_bias else None
    check_torch(backend, "linear", x, w, b, activation=activation)


@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
@small
@given(data=st.data())
def test_softmax_like(backend, op, data):
    x = data.draw(arrays(data.draw(shapes(min_dims=1)), F32, scales=(1.0, 10.0, 1e3)), label="x")
    dim = data.draw(st.integers(-x.ndim, x.ndim - 1), label="dim")
    check_torch(backend, op, x, dim=dim)


@pytest.mark.parametrize("params", ["none", "both"])
@pytest.mark.parametrize("normalized", [(16,), (5, 7)], ids=["1d", "2d"])
def test_layer_norm(backend, normalized, params):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((3, 2) + normalized) * 4 + 2).astype(np.float32)
    w = b = None
    if params == "both":
        w = rng.standard_normal(normalized).astype(np.float32)
        b = rng.standard_normal(normalized).astype(np.float32)
    check_torch(backend, "layer_norm", x, normalized, w, b, eps=1e-5)


@pytest.mark.parametrize("eps", [None, 1e-5])
@pytest.mark.parametrize("with_weight", [False, True], ids=["noweight", "weight"])
@pytest.mark.parametrize("normalized", [(16,), (5, 7)], ids=["1d", "2d"])
def test_rms_norm(backend, normalized, with_weight, eps):
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((3, 2) + normalized) * 4 + 2).astype(np.float32)
    w = rng.standard_normal(normalized).astype(np.float32) if with_weight else None
    # eps=None: float32's epsilon here and in PyTorch's float32 (not float64's: torch runs float64).
    check_torch(backend, "rms_norm", x, normalized, w, eps=eps or float(np.finfo(np.float32).eps))


@pytest.mark.parametrize("padding_idx", [None, 3, -1])
def test_embedding(backend, padding_idx):
    rng = np.random.default_rng(3)
    idx = rng.integers(0, 9, (4, 5))
    weight = rng.standard_normal((9, 6)).astype(np.float32)
    check_torch(backend, "embedding", idx, weight, padding_idx=padding_idx)


def test_dropout_semantics(backend):
    """Masks come from different generators; what must agree is everything else PyTorch defines."""
    backend.activate()
    x = np.random.default_rng(2).standard_normal((64, 65)).astype(np.float32)
    xt = torch.from_numpy(x)
    for p in (0.0, 0.25):
        np.testing.assert_array_equal(F.dropout(x, p, training=False), TF.dropout(xt, p, training=False).numpy())
    np.testing.assert_array_equal(F.dropout(x, 1.0), TF.dropout(xt, 1.0).numpy())
    taifuse.manual_seed(0)
    ours, theirs = F.dropout(x, 0.25), TF.dropout(xt, 0.25).numpy()
    # Kept elements are scaled the same way (by 1 / (1 - p)) in both.
    rtol = tolerance("dropout", F32).rtol
    np.testing.assert_allclose(ours[ours != 0], x[ours != 0] / 0.75, rtol=rtol)
    np.testing.assert_allclose(theirs[theirs != 0], x[theirs != 0] / 0.75, rtol=rtol)
