"""Every op of ``taifuse.functional`` on every backend, against the float64 reference.

All comparisons go through ``helpers.check_op`` (one tolerance table, ``helpers.TOLERANCES``);
hypothesis draws the shapes and values (``helpers.shapes`` / ``helpers.arrays``).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import DTYPES, F32, F64, arrays, assert_close, check_op, shapes, tolerance
from hypothesis import given
from hypothesis import strategies as st

import taifuse
import taifuse.functional as F
from taifuse import _random
from taifuse.backends import reference as R

dtype_param = pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)

UNARY = [
    ("gelu", {"approximate": "none"}),
    ("gelu", {"approximate": "tanh"}),
    ("relu", {}),
    ("leaky_relu", {}),
    ("silu", {}),
    ("sigmoid", {}),
    ("tanh", {}),
]


def _id(case) -> str:
    op, kwargs = case
    return "-".join([op] + [str(v) for v in kwargs.values()])


# ----------------------------------------------------------------------------- elementwise


@dtype_param
@pytest.mark.parametrize("case", UNARY, ids=_id)
@given(data=st.data())
def test_unary(backend, case, dtype, data):
    op, kwargs = case
    x = data.draw(arrays(data.draw(shapes()), dtype), label="x")
    check_op(backend, op, x, **kwargs)


@dtype_param
@given(data=st.data())
def test_leaky_relu_slopes(backend, dtype, data):
    slope = data.draw(st.one_of(st.sampled_from([0.0, 1.0, -0.5, 0.2]), st.floats(-3.0, 3.0)), label="slope")
    x = data.draw(arrays(data.draw(shapes(max_dims=2)), dtype), label="x")
    check_op(backend, "leaky_relu", x, negative_slope=slope)


@st.composite
def broadcast_pair(draw, dtype):
    """(a, b) with b of a's shape, a suffix of it, or with some axes set to 1."""
    shape = draw(shapes(min_dims=1))
    kind = draw(st.sampled_from(["same", "suffix", "ones"]))
    if kind == "suffix":
        b_shape = shape[draw(st.integers(0, len(shape))):]
    elif kind == "ones":
        b_shape = tuple(1 if draw(st.booleans()) else n for n in shape)
    else:
        b_shape = shape
    return draw(arrays(shape, dtype), label="a"), draw(arrays(b_shape, dtype), label="b")


@dtype_param
@pytest.mark.parametrize("op", ["add_relu", "mul_relu"])
@given(data=st.data())
def test_binary(backend, op, dtype, data):
    a, b = data.draw(broadcast_pair(dtype))
    check_op(backend, op, a, b)
    if a.shape != b.shape:
        check_op(backend, op, b, a)  # the broadcast operand first


@dtype_param
@given(data=st.data())
def test_affine(backend, dtype, data):
    x = data.draw(arrays(data.draw(shapes(min_dims=1)), dtype), label="x")
    c = x.shape[-1]
    scale = data.draw(st.one_of(arrays((c,), dtype), st.floats(-4, 4)), label="scale")
    bias = data.draw(st.one_of(arrays((c,), dtype), st.floats(-4, 4)), label="bias")
    check_op(backend, "affine", x, scale, bias)


# ----------------------------------------------------------------------------- linear


@dtype_param
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("activation", [None, "relu", "gelu", "gelu_tanh", "silu"])
@given(data=st.data())
def test_linear(backend, activation, with_bias, dtype, data):
    if data.draw(st.integers(0, 9), label="large") == 0:
        lead, k, m = (301,), 257, 129  # past any tile size, none of them a multiple of one
    else:
        lead = tuple(data.draw(st.lists(st.integers(0, 40), max_size=2), label="lead"))
        k, m = data.draw(st.integers(1, 70), label="in"), data.draw(st.integers(1, 70), label="out")
    # Scaled like a real layer's init (1/sqrt(k)) so float16 outputs stay finite.
    x = data.draw(arrays(lead + (k,), dtype, scales=(0.1, 1.0, 3.0), specials=(0.0, -0.0, 4.0, -4.0)), label="x")
    w = (data.draw(arrays((m, k), dtype, scales=(1.0,), specials=()), label="w") / np.sqrt(k)).astype(dtype)
    bias = data.draw(arrays((m,), dtype, scales=(0.1, 1.0), specials=()), label="b") if with_bias else None
    check_op(backend, "linear", x, w, bias, activation=activation)


@pytest.mark.parametrize("tiles", [(1, 8), (3, 3), (8, 8), (9, 8)], ids=lambda t: f"{t[0]}x{t[1]}")
def test_linear_on_each_launch_size(backend, tiles, monkeypatch):
    # The shared-memory linear launches 8 or 64 blocks for a product of at most 8 or 64 output
    # tiles of 64 x 64, else one block per tile (NOTE [ The dispatch size of a runtime range ]):
    # 8, 9, 64 and 72 tiles, each with a ragged last tile, land on each side of both bounds.
    (tn, tm), rng = tiles, np.random.default_rng(sum(tiles))
    n, m = 64 * tn - 5, 64 * tm - 3
    x = rng.standard_normal((n, 19)).astype(F32)
    w = (rng.standard_normal((m, 19)) / np.sqrt(19)).astype(F32)
    launched = []
    if backend.name == "taichi" and backend.arch != "cpu":
        from taifuse.backends.taichi import forward

        kernels = forward.linear_kernels_for(np.dtype(F32))
        def spy(name, kernel):
            return lambda *args: (launched.append(name), kernel(*args))

        for name in ("linear_act_shared", *(f"linear_act_shared_{g}" for g in forward.SHARED_GRIDS)):
            monkeypatch.setattr(kernels, name, spy(name, getattr(kernels, name)))
    check_op(backend, "linear", x, w, rng.standard_normal(m).astype(F32), activation="relu")
    if launched:
        tile_count = tn * tm
        want = next((f"linear_act_shared_{g}" for g in (8, 64) if tile_count <= g), "linear_act_shared")
        assert set(launched) == {want}, f"{tile_count} tiles launched {launched}"


# ----------------------------------------------------------------------------- row reductions


@st.composite
def array_and_dim(draw, dtype):
    x = draw(arrays(draw(shapes(min_dims=0)), dtype, scales=(1e-3, 1.0, 10.0, 1e3)), label="x")
    n = max(x.ndim, 1)
    return x, draw(st.integers(-n, n - 1), label="dim")


@dtype_param
@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
@given(data=st.data())
def test_softmax_like(backend, op, dtype, data):
    x, dim = data.draw(array_and_dim(dtype))
    check_op(backend, op, x, dim=dim)


@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
def test_softmax_like_every_dim_of_3d(backend, op):
    x = np.random.default_rng(0).standard_normal((3, 5, 7)).astype(np.float32) * 5
    for dim in (0, 1, 2, -1, -2, -3):
        check_op(backend, op, x, dim=dim)


@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
def test_softmax_like_extreme_rows(backend, op):
    # One huge logit per row, rows of equal logits, a row spanning far past exp's range, and a
    # row whose log-sum-exp (4.5e-5) is below the spacing of float32 at its max (6.1e-5): it
    # must be subtracted from x - max, not added to max first.
    x = np.array(
        [[1e4, 0.0, -1e4, 5.0], [7.0, 7.0, 7.0, 7.0], [-100.0, -200.0, 0.0, 88.5], [1000.0, 990.0, 0.0, -5.0]],
        np.float32,
    )
    if backend.arch == "cuda" and op == "log_softmax":
        # Taichi's CUDA code generator marks every function unsafe-fp-math
        # (taichi/runtime/cuda/jit_cuda.cpp), so LLVM may reassociate (x - max) - lse into
        # x - (max + lse), which rounds at |max|'s scale, and no ti.init flag turns that off (on
        # ti.cpu, fast_math=False does: _runtime.init). Found on the H100 (issue 31): the last row's
        # first element came out -6.1e-5 against -4.5e-5. There the last row is held to one ulp of
        # its max; the other rows as everywhere.
        check_op(backend, op, x[:3], dim=-1)
        backend.activate()
        got = F.log_softmax(x[3:], dim=-1)
        row = x[3].astype(np.float64)
        want = row - row.max() - np.log(np.exp(row - row.max()).sum())
        np.testing.assert_allclose(got[0], want, rtol=0, atol=float(np.spacing(np.float32(1000.0))))
    else:
        check_op(backend, op, x, dim=-1)
    check_op(backend, op, x, dim=0)


@st.composite
def layer_norm_case(draw, dtype):
    norm = tuple(draw(st.lists(st.integers(1, 40), min_size=1, max_size=2)))
    lead = tuple(draw(st.lists(st.integers(0, 6), max_size=2)))
    if draw(st.integers(0, 9)) == 0:
        lead, norm = (67,), (1031,)
    # An offset far above the spread catches one-pass variance (E[x^2] - E[x]^2 cancels).
    offset = draw(st.sampled_from([0.0, 0.0, 10.0, 1e3]))
    x = draw(arrays(lead + norm, dtype, scales=(1e-2, 1.0, 30.0)), label="x") + np.asarray(offset, dtype)
    return x.astype(dtype), norm


@dtype_param
@pytest.mark.parametrize("affine_params", ["none", "weight", "bias", "both"])
@given(data=st.data())
def test_layer_norm(backend, affine_params, dtype, data):
    x, norm = data.draw(layer_norm_case(dtype))
    weight = bias = None
    if affine_params in ("weight", "both"):
        weight = data.draw(arrays(norm, dtype, scales=(1.0,), specials=(0.0, -1.0)), label="weight")
    if affine_params in ("bias", "both"):
        bias = data.draw(arrays(norm, dtype, scales=(1.0,), specials=()), label="bias")
    eps = data.draw(st.sampled_from([1e-5, 1e-3, 0.5]), label="eps")
    normalized_shape = norm[0] if len(norm) == 1 and data.draw(st.booleans()) else norm
    check_op(backend, "layer_norm", x, normalized_shape, weight, bias, eps=eps)


def test_layer_norm_constant_rows(backend):
    # Zero variance: the result is exactly bias (the normalized row is 0), never NaN.
    x = np.full((4, 16), 3.25, np.float32)
    bias = np.arange(16, dtype=np.float32)
    got = check_op(backend, "layer_norm", x, (16,), None, bias)
    np.testing.assert_array_equal(got, np.broadcast_to(bias, x.shape))


# ----------------------------------------------------------------------------- dropout


def _seed_for_next_call(seed: int) -> int:
    """The kernel seed the next random op draws after ``manual_seed(seed)``."""
    taifuse.manual_seed(seed)
    drawn = _random.next_seed()
    taifuse.manual_seed(seed)
    return drawn


def _reference_dropout(x: np.ndarray, p: float, kernel_seed: int) -> np.ndarray:
    x64 = np.array(x, dtype=np.float64)
    out = np.empty_like(x64)
    if x64.size:
        R.dropout(x64, out, p, kernel_seed)
    return out


@dtype_param
@given(data=st.data())
def test_dropout_matches_reference_mask(backend, dtype, data):
    x = data.draw(arrays(data.draw(shapes()), dtype, specials=(1.0, -1.0, 3.0)), label="x")
    x[x == 0] = 1.0  # a dropped zero and a kept zero look alike; keep the mask visible
    p = data.draw(st.one_of(st.sampled_from([1e-7, 0.1, 0.5, 0.9, 1 - 1e-7]), st.floats(0.0, 1.0)), label="p")
    seed = data.draw(st.integers(0, 2**31), label="seed")
    backend.activate()
    kernel_seed = _seed_for_next_call(seed)
    if dtype == F64 and not backend.supports_f64:
        with pytest.raises(TypeError, match="float64"):
            F.dropout(x, p)
        return
    got = F.dropout(x, p)
    expected = _reference_dropout(x, p, kernel_seed)
    assert got.dtype == dtype and got.shape == x.shape
    if p > 0:
        # Same mask, element for element, as the reference on every backend: the counter hash.
        np.testing.assert_array_equal(got == 0, expected == 0, err_msg=f"dropout mask differs (p={p})")
    scale = np.maximum(1.0, np.abs(expected))
    assert_close(got, expected, scale, tolerance("dropout", dtype), f"dropout p={p} on {backend.param}")


def test_dropout_same_seed_same_mask_next_call_new_mask(backend):
    backend.activate()
    x = np.ones(10_000, np.float32)
    taifuse.manual_seed(123)
    first, second = F.dropout(x, 0.5), F.dropout(x, 0.5)
    taifuse.manual_seed(123)
    again = F.dropout(x, 0.5)
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, second), "consecutive dropout calls should draw different masks"


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_keep_rate_and_scaling(backend, p):
    backend.activate()
    n = 1 << 20
    taifuse.manual_seed(7)
    y = F.dropout(np.ones(n, np.float32), p)
    kept = y != 0
    rate = kept.mean()
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(rate - (1 - p)) < 6 * sigma, f"keep rate {rate:.5f} for p={p}, expected {1 - p} +- {6 * sigma:.1e}"
    # Survivors are scaled by 1 / (1 - p), so the expectation is unchanged.
    np.testing.assert_allclose(y[kept], 1.0 / (1.0 - p), rtol=tolerance("dropout", F32).rtol)
    # The mask has no structure along the index: the halves keep at the same rate.
    # No structure along the index: the two halves keep at the same rate (the difference of two
    # half-sample means has standard deviation 2 * sigma).
    half = n // 2
    assert abs(kept[:half].mean() - kept[half:].mean()) < 6 * 2 * sigma


def test_dropout_eval_and_p0_are_identity(backend):
    backend.activate()
    x = np.random.default_rng(1).standard_normal((5, 7)).astype(np.float32)
    for kwargs in ({"training": False}, {"p": 0.0}, {"p": 0.7, "training": False}):
        y = F.dropout(x, **kwargs)
        np.testing.assert_array_equal(y, x, strict=True)
        out = np.full_like(x, np.nan)
        assert F.dropout(x, out=out, **kwargs) is out
        np.testing.assert_array_equal(out, x, strict=True)


def test_dropout_p1_drops_everything(backend):
    backend.activate()
    x = np.array([1.0, -2.0, 3.5, np.nan, 0.0, 1e4], np.float32)
    y = F.dropout(x, 1.0)
    # Every element times zero: NaN stays NaN, as in PyTorch.
    np.testing.assert_array_equal(y, np.array([0, 0, 0, np.nan, 0, 0], np.float32))


def test_dropout_float16_mask_matches_float32(backend):
    backend.activate()
    x = np.ones((33, 65), np.float32)
    taifuse.manual_seed(5)
    y32 = F.dropout(x, 0.3)
    taifuse.manual_seed(5)
    y16 = F.dropout(x.astype(np.float16), 0.3)
    np.testing.assert_array_equal(y32 == 0, y16 == 0)


# ----------------------------------------------------------------------------- backend arrays


def test_backend_arrays_stay_on_the_backend(backend):
    """A backend array in gives a backend array out (no hidden trip to NumPy), with the same values."""
    backend.activate()
    be = backend.module()
    rng = np.random.default_rng(2)
    x = rng.standard_normal((6, 8)).astype(np.float32)
    w = rng.standard_normal((5, 8)).astype(np.float32)
    cases = {
        "gelu": lambda a: F.gelu(a(x), approximate="tanh"),
        "add_relu": lambda a: F.add_relu(a(x), a(x)),
        "affine(scalars)": lambda a: F.affine(a(x), 2.0, 0.5),
        "linear": lambda a: F.linear(a(x), a(w), activation="silu"),
        "softmax": lambda a: F.softmax(a(x), dim=0),
        "layer_norm": lambda a: F.layer_norm(a(x), 8),
        "dropout": lambda a: F.dropout(a(x), 0.5),
    }
    for name, run in cases.items():
        taifuse.manual_seed(0)
        on_host = run(lambda arr: arr)
        taifuse.manual_seed(0)
        on_device = run(be.from_numpy)
        assert be.is_array(on_device), f"{name}: got {type(on_device).__name__} back, not a {be.NAME} array"
        np.testing.assert_array_equal(be.to_numpy(on_device), on_host, err_msg=name)
