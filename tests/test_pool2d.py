"""``F.max_pool2d``, ``F.avg_pool2d``, ``F.adaptive_avg_pool2d``, ``Tensor.flatten`` and their
``nn`` layers on every backend, forward and backward.

Each case runs the Tensor op and the backward of ``sum(out * g)`` and compares with the float64
reference kernels (``backends/reference/conv.py``) on float64 copies, with output sizes worked
out here by PyTorch's rules. Pooling sums at most a window of values, so the bound is the
tolerance table's with the window sum of |x| (|g|) as the scale; max pooling's result and
indices must be exact. Then: finite differences of the reference backward (float64), PyTorch
parity (values, indices, gradients, layers) and bad input.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import F16, F32, F64, SUBSET, TOLERANCES, assert_close

import taifuse
import taifuse.functional as F
from taifuse import nn
from taifuse.backends import reference as R

torch = pytest.importorskip("torch")
TF = torch.nn.functional

# (input shape, kwargs): odd sizes, H != W, N = 1, ceil_mode, dilation, padding, 3-D input.
MAX_CASES = {
    "k2": ((2, 3, 8, 6), {"kernel_size": 2}),
    "k3_s2_p1_ceil": ((1, 2, 9, 10), {"kernel_size": 3, "stride": 2, "padding": 1, "ceil_mode": True}),
    "dilation2": ((2, 2, 11, 9), {"kernel_size": (3, 2), "stride": (2, 1), "dilation": 2}),
    "k7_overlap": ((1, 1, 12, 13), {"kernel_size": 7, "stride": 1, "padding": 3}),
    "unbatched": ((3, 7, 5), {"kernel_size": 2, "stride": 2, "ceil_mode": True}),
}
AVG_CASES = {
    "k2": ((2, 3, 8, 6), {"kernel_size": 2}),
    "k3_s2_p1_ceil": ((1, 2, 9, 10), {"kernel_size": 3, "stride": 2, "padding": 1, "ceil_mode": True}),
    "no_pad_count": ((2, 2, 7, 9), {"kernel_size": 3, "stride": 2, "padding": 1, "count_include_pad": False}),
    "divisor": ((1, 2, 6, 7), {"kernel_size": (2, 3), "padding": (1, 1), "divisor_override": 5}),
    "unbatched": ((3, 7, 5), {"kernel_size": 3, "stride": 1}),
}
ADAPTIVE_CASES = {
    "global": ((2, 3, 7, 5), 1),
    "uneven": ((1, 2, 9, 10), (4, 3)),
    "upsample": ((2, 2, 3, 5), (7, None)),
    "unbatched": ((3, 8, 6), 5),
}
VULKAN_CASES = ("k3_s2_p1_ceil", "dilation2", "no_pad_count", "uneven")


def _pair(v):
    return tuple(v) if isinstance(v, tuple) else (v, v)


def _pool_size(size, k, s, p, d, ceil):
    num = size + 2 * p - d * (k - 1) - 1
    out = (-(-num // s) if ceil else num // s) + 1
    if ceil and (out - 1) * s >= size + p:
        out -= 1
    return out


def _pool_geometry(shape4, kw):
    k = _pair(kw["kernel_size"])
    s = _pair(kw.get("stride") or kw["kernel_size"])
    p = _pair(kw.get("padding", 0))
    d = _pair(kw.get("dilation", 1))
    out = tuple(
        _pool_size(shape4[2 + i], k[i], s[i], p[i], d[i], kw.get("ceil_mode", False)) for i in range(2)
    )
    return k, s, p, d, shape4[:2] + out


def _adaptive_out(shape4, size):
    sizes = size if isinstance(size, tuple) else (size, size)
    return shape4[:2] + tuple(full if v is None else v for v, full in zip(sizes, shape4[2:]))


def _reference(kind, x, g, arg):
    """float64 (out, grad input), their scales, and max pooling's indices."""
    x4 = np.array(x, np.float64).reshape((1,) * (4 - x.ndim) + x.shape)
    idx = None

    def run(x4, g4):
        nonlocal idx
        if kind == "max":
            k, s, p, d, out_shape = _pool_geometry(x4.shape, arg)
            out, idx = np.empty(out_shape), np.empty(out_shape, np.int64)
            R.max_pool2d(x4, k, s, p, d, out, idx)
            gx = np.empty(x4.shape)
            R.max_pool2d_backward(idx, g4.reshape(out_shape), k, s, p, d, gx)
        elif kind == "avg":
            k, s, p, _, out_shape = _pool_geometry(x4.shape, arg)
            inc, div = arg.get("count_include_pad", True), arg.get("divisor_override") or 0
            out, gx = np.empty(out_shape), np.empty(x4.shape)
            R.avg_pool2d(x4, k, s, p, inc, div, out)
            R.avg_pool2d_backward(g4.reshape(out_shape), k, s, p, inc, div, gx)
        else:
            out_shape = _adaptive_out(x4.shape, arg)
            out, gx = np.empty(out_shape), np.empty(x4.shape)
            R.adaptive_avg_pool2d(x4, out)
            R.adaptive_avg_pool2d_backward(g4.reshape(out_shape), gx)
        return out, gx

    g64 = np.array(g, np.float64)
    out, gx = run(x4, g64)
    if kind == "max":
        scales = (0.0, np.maximum(1.0, np.abs(gx)).reshape(x.shape))
        return (out.reshape(g.shape), gx.reshape(x.shape)), scales, idx.reshape(g.shape)
    sout, sgx = run(np.abs(x4), np.abs(g64))
    scales = (np.maximum(1.0, sout).reshape(g.shape), np.maximum(1.0, sgx).reshape(x.shape))
    return (out.reshape(g.shape), gx.reshape(x.shape)), scales, None


def _out_shape(kind, shape, arg):
    shape4 = (1,) * (4 - len(shape)) + tuple(shape)
    full = _adaptive_out(shape4, arg) if kind == "adaptive" else _pool_geometry(shape4, arg)[-1]
    return full[4 - len(shape) :]


def _arrays(kind, shape, arg, dtype, seed=0):
    rng = np.random.default_rng(seed)
    # Distinct values: a max with ties would pick by order, which is tested on its own.
    x = rng.permutation(np.prod(shape)).reshape(shape).astype(np.float64) / np.prod(shape) - 0.5
    x = (x * 4).astype(dtype)
    g = rng.standard_normal(_out_shape(kind, shape, arg)).astype(dtype)
    return x, g


def _call(kind, x, arg):
    if kind == "max":
        return F.max_pool2d(x, **arg)
    if kind == "avg":
        return F.avg_pool2d(x, **arg)
    return F.adaptive_avg_pool2d(x, arg)


ALL = [("max", n, c) for n, c in MAX_CASES.items()]
ALL += [("avg", n, c) for n, c in AVG_CASES.items()]
ALL += [("adaptive", n, c) for n, c in ADAPTIVE_CASES.items()]


@pytest.mark.parametrize("dtype", [F32, F16], ids=lambda d: d.name)
@pytest.mark.parametrize("kind,name,case", ALL, ids=[f"{k}-{n}" for k, n, _ in ALL])
def test_pool_forward_backward_against_reference(backend, kind, name, case, dtype):
    if backend.arch in ("vulkan", "metal") and name not in VULKAN_CASES:
        pytest.skip(SUBSET + "a few cases on the GPU proxy keep the suite's time down")
    if dtype == F16 and name not in ("k3_s2_p1_ceil", "uneven"):
        pytest.skip(SUBSET + "float16 storage: a case per op")
    backend.activate()
    shape, arg = case
    x, g = _arrays(kind, shape, arg, dtype)
    X = taifuse.tensor(x, requires_grad=True)
    y = _call(kind, X, arg)
    (y * taifuse.tensor(g)).sum().backward()
    (ref, gref), (sout, sgx), idx = _reference(kind, x, g, arg)
    tol = TOLERANCES[dtype]
    assert y.dtype == dtype and X.grad.dtype == dtype
    if kind == "max":
        np.testing.assert_array_equal(
            y.numpy(), ref.astype(dtype), err_msg=f"max_pool2d {name} on {backend.param}"
        )
        _, indices = F.max_pool2d(X, **arg, return_indices=True)
        np.testing.assert_array_equal(indices.numpy(), idx)
    else:
        assert_close(y.numpy(), ref, sout, tol, f"{kind} {name} out on {backend.param} {dtype}")
    assert_close(X.grad.numpy(), gref, sgx, tol, f"{kind} {name} grad on {backend.param} {dtype}")
    # NumPy in, NumPy out, the same values.
    np.testing.assert_array_equal(np.asarray(_call(kind, x, arg)), y.numpy())


def test_pool_float64(backend):
    backend.activate()
    x, g = _arrays("avg", (1, 2, 9, 10), AVG_CASES["no_pad_count"][1], F64)
    if not backend.supports_f64:
        with pytest.raises(TypeError, match="float64"):
            F.avg_pool2d(x, 2)
        return
    for kind, arg in (
        ("max", MAX_CASES["dilation2"][1]),
        ("avg", AVG_CASES["no_pad_count"][1]),
        ("adaptive", (4, 3)),
    ):
        x, g = _arrays(kind, (1, 2, 11, 10), arg, F64)
        X = taifuse.tensor(x, requires_grad=True)
        y = _call(kind, X, arg)
        (y * taifuse.tensor(g)).sum().backward()
        (ref, gref), (sout, sgx), _ = _reference(kind, x, g, arg)
        assert_close(y.numpy(), ref, sout, TOLERANCES[F64], f"{kind} float64")
        assert_close(X.grad.numpy(), gref, sgx, TOLERANCES[F64], f"{kind} float64 grad")


def test_max_pool_ties_and_nan_follow_pytorch(backend):
    """The first maximum of a window wins; a NaN wins over any number."""
    backend.activate()
    x = np.zeros((1, 1, 4, 4), np.float32)
    x[0, 0, 2, 3] = np.nan
    X = taifuse.tensor(x, requires_grad=True)
    y, idx = F.max_pool2d(X, 2, return_indices=True)
    ty, tidx = TF.max_pool2d(torch.tensor(x, requires_grad=True), 2, return_indices=True)
    np.testing.assert_array_equal(y.numpy(), ty.detach().numpy())
    np.testing.assert_array_equal(idx.numpy(), tidx.numpy())


@pytest.mark.parametrize("kind,name,case", [a for a in ALL if a[1] != "unbatched"], ids=lambda v: str(v)[:24])
def test_reference_backward_matches_float64_finite_differences(kind, name, case):
    shape, arg = case
    x, g = _arrays(kind, shape, arg, F64, seed=1)
    (_, grad), _, _ = _reference(kind, x, g, arg)
    rng = np.random.default_rng(2)
    eps = 1e-6  # below the smallest gap between the distinct values: max pooling's choice is stable
    for _ in range(6):
        i = tuple(rng.integers(0, s) for s in x.shape)
        keep = x[i]
        x[i] = keep + eps
        up = float((_reference(kind, x, g, arg)[0][0] * g).sum())
        x[i] = keep - eps
        down = float((_reference(kind, x, g, arg)[0][0] * g).sum())
        x[i] = keep
        fd = (up - down) / (2 * eps)
        assert abs(fd - grad[i]) <= 1e-6 * max(1.0, abs(fd)), (
            f"{kind} {name} at {i}: fd {fd}, backward {grad[i]}"
        )


@pytest.mark.parametrize("kind,name,case", ALL, ids=[f"{k}-{n}" for k, n, _ in ALL])
def test_pool_matches_pytorch(kind, name, case):
    taifuse.set_backend("numba" if "numba" in taifuse.available_backends() else "numpy")
    shape, arg = case
    x, g = _arrays(kind, shape, arg, F32, seed=3)
    X = taifuse.tensor(x, requires_grad=True)
    y = _call(kind, X, arg)
    (y * taifuse.tensor(g)).sum().backward()
    tx = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    fn = {"max": TF.max_pool2d, "avg": TF.avg_pool2d}.get(kind)
    ty = fn(tx, **arg) if fn else TF.adaptive_avg_pool2d(tx, arg)
    ty.backward(torch.tensor(g, dtype=torch.float64))
    tol = TOLERANCES[F32]
    assert_close(
        y.numpy(), ty.detach().numpy(), np.maximum(1.0, np.abs(ty.detach().numpy())), tol, f"{kind} {name}"
    )
    assert_close(
        X.grad.numpy(), tx.grad.numpy(), np.maximum(1.0, np.abs(tx.grad.numpy())), tol, f"{kind} {name} grad"
    )


def test_layers_match_pytorch(backend):
    backend.activate()
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 3, 9, 8)).astype(np.float32)
    pairs = [
        (nn.MaxPool2d(3, 2, 1, ceil_mode=True), torch.nn.MaxPool2d(3, 2, 1, ceil_mode=True)),
        (nn.AvgPool2d(2, count_include_pad=False), torch.nn.AvgPool2d(2, count_include_pad=False)),
        (nn.AdaptiveAvgPool2d((2, 3)), torch.nn.AdaptiveAvgPool2d((2, 3))),
        (nn.Flatten(), torch.nn.Flatten()),
        (nn.Flatten(0, 2), torch.nn.Flatten(0, 2)),
    ]
    for ours, theirs in pairs:
        X = taifuse.tensor(x, requires_grad=True)
        y = ours(X)
        y.sum().backward()
        tx = torch.tensor(x, requires_grad=True)
        ty = theirs(tx)
        ty.sum().backward()
        assert y.shape == tuple(ty.shape), type(ours).__name__
        np.testing.assert_allclose(y.numpy(), ty.detach().numpy(), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(X.grad.numpy(), tx.grad.numpy(), rtol=1e-6, atol=1e-6)
        assert ours.state_dict() == {}
    y, idx = nn.MaxPool2d(2, return_indices=True)(taifuse.tensor(x))
    np.testing.assert_array_equal(
        idx.numpy(), TF.max_pool2d(torch.tensor(x), 2, return_indices=True)[1].numpy()
    )


def test_tensor_flatten_matches_pytorch():
    taifuse.set_backend("numpy")
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    for args in ((), (1,), (0, 1), (-2, -1), (2, 2)):
        assert taifuse.tensor(x).flatten(*args).shape == tuple(torch.tensor(x).flatten(*args).shape)
    assert taifuse.tensor(np.float32(2.0)).flatten().shape == (1,)
    with pytest.raises(ValueError, match="start_dim"):
        taifuse.tensor(x).flatten(2, 1)
    with pytest.raises(IndexError, match="end_dim"):
        taifuse.tensor(x).flatten(0, 3)


# ----------------------------------------------------------------------------- numba's fast paths

# (kind, shape, arg, the general kernels the case must not reach): NOTE [ Pooling fast paths ] in
# backends/numba/conv.py. Ties and NaNs (two in one window) in every max case.
_BACKWARD = ("_max_pool_backward",)
FAST_CASES = {
    "max_2x2": ("max", (3, 5, 12, 10), {"kernel_size": 2}, ("_max_pool", "_max_pool_backward")),
    "max_2x2_odd_floor": ("max", (2, 3, 9, 7), {"kernel_size": 2}, ("_max_pool", "_max_pool_backward")),
    "max_2x2_ceil": ("max", (2, 3, 9, 7), {"kernel_size": 2, "ceil_mode": True}, _BACKWARD),
    "max_k3_s3_p1": ("max", (2, 2, 10, 11), {"kernel_size": 3, "stride": 3, "padding": 1}, _BACKWARD),
    "global": ("adaptive", (4, 6, 7, 9), 1, ("_avg_pool", "_avg_pool_backward")),
    "global_1x1": ("adaptive", (2, 3, 1, 1), 1, ("_avg_pool", "_avg_pool_backward")),
}


@pytest.mark.parametrize("dtype", [F32, F16], ids=lambda d: d.name)
@pytest.mark.parametrize("name", FAST_CASES)
def test_numba_pool_fast_paths_match_the_reference(monkeypatch, name, dtype):
    """MaxPool2d(2), max pooling's backward over windows that do not overlap and the global
    average take numba's fast paths (the general kernels they bypass raise here) and give the
    reference's values: max pooling's exactly (ties: the first maximum; NaN: the last NaN of a
    window), the averages within the tolerance table's bound."""
    if "numba" not in taifuse.available_backends():
        pytest.skip("numba is not installed")
    taifuse.set_backend("numba")
    from taifuse.backends.numba import conv as kernels

    kind, shape, arg, bypassed = FAST_CASES[name]
    rng = np.random.default_rng(5)
    x = rng.integers(-3, 4, shape).astype(dtype)  # few values: ties in most windows
    g = rng.standard_normal(_out_shape(kind, shape, arg)).astype(dtype)
    if kind == "max":
        x[0, 0, 0, 1] = x[0, 0, 1, 0] = np.nan  # two NaNs in the first window
        x[-1, -1, 2, 3] = np.nan
        # Signed zeros tie: -0.0 first, then +0.0 (the first maximum wins: -0.0 and its index).
        x[-1, 0, :2, :2] = -1
        x[-1, 0, 0, 0], x[-1, 0, 1, 1] = -0.0, 0.0
        g[0, 0, 0, 0] = -0.0
    for fn in bypassed:

        def refuse(*args, _fn=fn):
            raise AssertionError(f"{name} reached the general kernel {_fn}")

        monkeypatch.setattr(kernels, fn, refuse)
    X = taifuse.tensor(x, requires_grad=True)
    y = _call(kind, X, arg)
    y.backward(taifuse.tensor(g))
    (ref, gref), (sout, sgx), idx = _reference(kind, x, g, arg)
    if kind == "max":
        np.testing.assert_array_equal(y.numpy(), ref.astype(dtype))
        np.testing.assert_array_equal(np.signbit(y.numpy()), np.signbit(ref.astype(dtype)))
        np.testing.assert_array_equal(F.max_pool2d(X, **arg, return_indices=True)[1].numpy(), idx)
        # Each input gets at most one window's gradient, so the float64 sum is that gradient exactly.
        np.testing.assert_array_equal(X.grad.numpy(), gref.astype(dtype))
        assert not np.signbit(X.grad.numpy()[gref == 0]).any(), "a zero gradient should be +0.0"
    else:
        tol = TOLERANCES[dtype]
        assert_close(y.numpy(), ref, sout, tol, f"{name} out {dtype}")
        assert_close(X.grad.numpy(), gref, sgx, tol, f"{name} grad {dtype}")


def test_the_profiler_times_max_pool2d_forward_kernel_inside_the_op(backend, monkeypatch):
    """Regression: the Tensor path ran max pooling's kernel before its autograd op, so the profiler's
    max_pool2d forward event held microseconds and the kernel's time went to the enclosing module's
    range (a CNN step's MaxPool2d read as 'self' time of [model.1])."""
    import time

    from taifuse._internal import backend as backend_of
    from taifuse.profiler import profile

    backend.activate()
    x = taifuse.tensor(np.ones((1, 2, 4, 4), np.float32), requires_grad=True)
    be = backend_of(x)
    kernel = be.max_pool2d

    def slow(*args):
        time.sleep(0.05)
        return kernel(*args)

    monkeypatch.setattr(be, "max_pool2d", slow)
    with profile() as prof:
        y = F.max_pool2d(x, 2)
    events = [e for e in prof.events() if e.kind == "op" and e.name == "max_pool2d"]
    assert len(events) == 1 and events[0].duration_ns >= 45_000_000, events
    np.testing.assert_array_equal(y.numpy(), np.ones((1, 2, 2, 2), np.float32))


# ----------------------------------------------------------------------------- bad input


BAD = [
    ("max_pool2d", ((1, 1, 4, 4),), {"kernel_size": 2, "padding": 2}, ValueError, "padding"),
    ("max_pool2d", ((1, 1, 4, 4),), {"kernel_size": 0}, ValueError, "kernel_size"),
    ("max_pool2d", ((1, 1, 4, 4),), {"kernel_size": 2, "stride": 0}, ValueError, "stride"),
    ("max_pool2d", ((1, 1, 4, 4),), {"kernel_size": 2, "dilation": 0}, ValueError, "dilation"),
    ("max_pool2d", ((1, 1, 2, 2),), {"kernel_size": 3}, ValueError, "too small"),
    ("max_pool2d", ((4, 4),), {"kernel_size": 2}, ValueError, "3-D .* or 4-D"),
    ("max_pool2d", ((1, 1, 4, 4),), {"kernel_size": 2.0}, TypeError, "kernel_size"),
    (
        "avg_pool2d",
        ((1, 1, 4, 4),),
        {"kernel_size": 2, "divisor_override": 0},
        ValueError,
        "divisor_override",
    ),
    ("avg_pool2d", ((1, 1, 4, 4),), {"kernel_size": 3, "padding": 2}, ValueError, "padding"),
    ("avg_pool2d", ((1, 1, 4, 4),), {"kernel_size": 2, "ceil_mode": "yes"}, TypeError, "ceil_mode"),
    ("adaptive_avg_pool2d", ((1, 1, 4, 4),), {"output_size": (2, 2, 2)}, TypeError, "output_size"),
    ("adaptive_avg_pool2d", ((1, 1, 4, 4),), {"output_size": -1}, ValueError, "output_size"),
    ("adaptive_avg_pool2d", ((4, 4),), {"output_size": 2}, ValueError, "3-D or 4-D"),
]


@pytest.mark.parametrize("case", BAD, ids=lambda c: f"{c[0]}-{c[4]}"[:40])
def test_pool_bad_input_raises_naming_the_argument(backend, case):
    backend.activate()
    op, (shape,), kwargs, exc, match = case
    x = np.ones(shape, np.float32)
    with pytest.raises(exc, match=match):
        getattr(F, op)(x, **kwargs)
    t = taifuse.tensor(x, requires_grad=True)
    with pytest.raises(exc, match=match):
        getattr(F, op)(t, **kwargs)
    assert t.grad is None
