"""Tensors and autograd on the taichi backend: device tensor math, class indices, and residency.

The gradients themselves are checked in test_autograd_ops.py (every op, against the float64
reference and PyTorch, on taichi-cpu and the GPU param too). Here:

* ``TaichiMath`` (backends/taichi/tensor_math.py) against NumPy's ``HostMath`` on the same inputs;
* integer data as int32 DeviceArrays (NOTE [ Class indices on the device ] in backends/taichi/backward.py);
* a full training step of an MLP stays on the device: no host<->device copy but the loss read.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import CUDA_PARAM, GPU_PARAM, BackendSpec, start

import taifuse
import taifuse.functional as F
from taifuse import nn
from taifuse._tensor_math import HOST_MATH

pytest.importorskip("taichi")


@pytest.fixture(scope="module", params=("taichi-cpu", GPU_PARAM, CUDA_PARAM))
def taichi(request: pytest.FixtureRequest):
    """The taichi backend module on one arch, active."""
    spec = BackendSpec(request.param)
    reason = start(spec)
    if reason is not None:
        pytest.skip(f"{spec.param} unavailable: {reason}")
    spec.activate()
    return spec.module()


def _close(got, expected, dtype) -> None:
    expected = np.asarray(expected, dtype=np.float64)
    # float32: a few roundings, or a float32 sum / dot product whose error grows with its length.
    rtol = 1e-5 if np.dtype(dtype) == np.float32 else 2e-3
    scale = max(1.0, float(np.abs(expected).max())) if expected.size else 1.0
    np.testing.assert_allclose(np.asarray(got, dtype=np.float64), expected, rtol=rtol, atol=rtol * scale)


# ----------------------------------------------------------------------------- tensor math


BINARY_SHAPES = [
    ((3, 4), (3, 4)),
    ((3, 4), (4,)),
    ((2, 1, 3), (4, 1)),
    ((5, 1, 2, 1, 3), (1, 4, 1, 6, 1)),
    ((), (3,)),
]


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("op", ["add", "sub", "mul", "div"])
def test_binary_ops_broadcast_like_numpy(taichi, op, dtype):
    from taifuse.backends.taichi.tensor_math import TENSOR_MATH as M

    rng = np.random.default_rng(0)
    for sa, sb in BINARY_SHAPES:
        a = rng.uniform(0.5, 2.0, sa).astype(dtype)
        b = rng.uniform(0.5, 2.0, sb).astype(dtype)
        da, db = taichi.from_numpy(a), taichi.from_numpy(b)
        expected = getattr(HOST_MATH, op)(a.astype(np.float32), b.astype(np.float32))
        got = getattr(M, op)(da, db)
        assert got.shape == expected.shape and got.dtype == dtype
        _close(got.numpy(), expected, dtype)
        # A Python scalar on either side.
        _close(getattr(M, op)(da, 1.5).numpy(), getattr(HOST_MATH, op)(a.astype(np.float32), 1.5), dtype)
        _close(getattr(M, op)(1.5, da).numpy(), getattr(HOST_MATH, op)(1.5, a.astype(np.float32)), dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
def test_in_place_ops_broadcast(taichi, dtype):
    from taifuse.backends.taichi.tensor_math import TENSOR_MATH as M

    rng = np.random.default_rng(1)
    acc = rng.standard_normal((3, 4, 5)).astype(np.float32)
    other = rng.standard_normal((4, 1)).astype(np.float32)
    d = taichi.from_numpy(acc.astype(dtype))
    M.add_(d, taichi.from_numpy(other.astype(dtype)))
    M.mul_(d, 0.5)
    M.sub_(d, taichi.from_numpy(other.astype(dtype)))
    a16 = acc.astype(dtype).astype(np.float32)
    o16 = other.astype(dtype).astype(np.float32)
    _close(d.numpy(), (a16 + o16) * 0.5 - o16, dtype)


@pytest.mark.parametrize(
    "shape, axis, keepdims",
    [
        ((3, 4, 5), None, False),
        ((3, 4, 5), (1,), True),
        ((3, 4, 5), (0, 2), False),
        ((2, 3, 4, 5), (1, 3), True),
        ((7,), (0,), False),
        ((0, 3), (0,), False),  # a sum over nothing is 0
    ],
)
def test_sum_matches_numpy(taichi, shape, axis, keepdims):
    from taifuse.backends.taichi.tensor_math import TENSOR_MATH as M

    a = np.random.default_rng(2).standard_normal(shape).astype(np.float32)
    got = M.sum(taichi.from_numpy(a), axis, keepdims)
    expected = a.astype(np.float64).sum(axis=axis, keepdims=keepdims)
    assert got.shape == expected.shape
    _close(got.numpy(), expected, np.float32)


def test_long_sums_take_several_passes(taichi):
    """NOTE [ Loop limits in reductions ]: 70000 terms per output is past what one lavapipe
    invocation may loop (about 65k), and past REDUCE_CHUNK**2 (three passes)."""
    from taifuse.backends.taichi.tensor_math import REDUCE_CHUNK
    from taifuse.backends.taichi.tensor_math import TENSOR_MATH as M

    n = 70000
    assert n > REDUCE_CHUNK**2
    a = np.random.default_rng(3).uniform(0.0, 1.0, (3, n)).astype(np.float32)
    d = taichi.from_numpy(a)
    rows = M.sum(d, (1,), False).numpy()
    np.testing.assert_allclose(rows, a.astype(np.float64).sum(axis=1), rtol=1e-6)
    cols = M.sum(taichi.from_numpy(np.ascontiguousarray(a.T)), (0,), False).numpy()
    np.testing.assert_allclose(cols, a.astype(np.float64).sum(axis=1), rtol=1e-6)


@pytest.mark.parametrize("op", ["sum", "max"])
@pytest.mark.parametrize("partials", [1024, 1025, 16384, 16385, 3 * 20000])
def test_sum_on_each_launch_size(taichi, partials, op, monkeypatch):
    """A GPU launches a reduction pass of at most 1024 (16384) partials as a constant range of
    exactly 1024 (16384) threads, a larger one as a runtime range (NOTE [ The dispatch size of a
    runtime range ] in forward.py): sizes on each side of both bounds, one pass each (rows of 3
    terms), and a two-pass one (3 rows of 20000: 237 partials, then 3)."""
    from taifuse.backends.taichi import tensor_math as tm
    from taifuse.backends.taichi._runtime import _on_gpu

    rows, cols = (partials, 3) if partials < 3 * 20000 else (3, 20000)
    a = np.random.default_rng(partials).standard_normal((rows, cols)).astype(np.float32)
    launched = []
    if _on_gpu():
        kernels = tm.reduce_kernels_for(np.dtype(np.float32))
        for name, kernel in list(vars(kernels).items()):
            monkeypatch.setattr(
                kernels, name, lambda *args, _n=name, _k=kernel: (launched.append(_n), _k(*args))
            )
    got = getattr(tm.TENSOR_MATH, op)(taichi.from_numpy(a), (1,), False).numpy()
    _close(got, getattr(a.astype(np.float64), op)(axis=1), np.float32)
    if launched:
        stem = "reduce" if op == "sum" else "max"
        want = {
            1024: [f"{stem}_same_1024"],
            1025: [f"{stem}_same_16384"],
            16384: [f"{stem}_same_16384"],
            16385: [f"{stem}_same"],
            3 * 20000: [f"{stem}_to_f32_1024", f"{stem}_same_1024"],
        }[partials]
        assert launched == want


@pytest.mark.parametrize("tiles", [(1, 32, 32), (5, 5, 41), (4, 64, 64), (1, 113, 145)], ids=str)
def test_matmul_on_each_launch_size(taichi, tiles):
    """A GPU launches a matmul of at most 1024 (16384) output tiles of TILE x TILE, batches
    included, as a constant range of exactly 1024 (16384) threads, a larger one as a runtime range
    (NOTE [ The dispatch size of a runtime range ] in forward.py): 1024, 1025, 16384 and 16385
    tiles, each with ragged edge tiles."""
    from taifuse.backends.taichi import tensor_math as tm
    from taifuse.backends.taichi._runtime import _on_gpu

    batch, tn, tm_ = tiles
    rng = np.random.default_rng(sum(tiles))
    a = rng.standard_normal((batch, tm.TILE * tn - 1, 3)).astype(np.float32)
    b = rng.standard_normal((batch, 3, tm.TILE * tm_ - 3)).astype(np.float32)
    kernels = tm.matmul_kernels_for(np.dtype(np.float32))
    launched = []
    names = ["matmul", *(f"matmul_{g}" for g in tm.SMALL_GRIDS)]
    with pytest.MonkeyPatch.context() as mp:
        for name in names:
            kernel = getattr(kernels, name)
            mp.setattr(kernels, name, lambda *args, _n=name, _k=kernel: (launched.append(_n), _k(*args)))
        got = tm.TENSOR_MATH.matmul(taichi.from_numpy(a), taichi.from_numpy(b)).numpy()
    _close(got, a.astype(np.float64) @ b.astype(np.float64), np.float32)
    count = batch * tn * tm_
    want = next((f"matmul_{g}" for g in (1024, 16384) if count <= g), "matmul") if _on_gpu() else "matmul"
    assert launched == [want], f"{count} tiles launched {launched}"


@pytest.mark.parametrize("n", [1024, 1025, 16384, 16385])
def test_add_inplace_on_each_launch_size(taichi, n):
    """A GPU launches an in-place op with an array operand on at most 1024 (16384) elements as a
    constant range of exactly 1024 (16384) threads, a larger one as a runtime range (NOTE [ The
    dispatch size of a runtime range ] in forward.py): sizes on each side of both bounds, the
    operand broadcast along the first axis (a strided read)."""
    from taifuse.backends.taichi import tensor_math as tm
    from taifuse.backends.taichi._runtime import _on_gpu

    rng = np.random.default_rng(n)
    acc = rng.standard_normal((n // 5, 5) if n % 5 == 0 else (n,)).astype(np.float32)
    b = rng.standard_normal(acc.shape[-1]).astype(np.float32)
    kernels = tm.elementwise_kernels_for(np.dtype(np.float32))
    launched = []
    with pytest.MonkeyPatch.context() as mp:
        for name in ["inplace", *(f"inplace_{g}" for g in tm.SMALL_GRIDS)]:
            kernel = getattr(kernels, name)
            mp.setattr(kernels, name, lambda *args, _n=name, _k=kernel: (launched.append(_n), _k(*args)))
        d = taichi.from_numpy(acc)
        tm.TENSOR_MATH.sub_(d, taichi.from_numpy(b))
        got = d.numpy()
    _close(got, acc.astype(np.float64) - b, np.float32)
    want = next((f"inplace_{g}" for g in (1024, 16384) if n <= g), "inplace") if _on_gpu() else "inplace"
    assert launched == [want], f"{n} elements launched {launched}"


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
@pytest.mark.parametrize(
    "sa, sb",
    [((37, 53), (53, 29)), ((53,), (53, 29)), ((37, 53), (53,)), ((2, 1, 5, 6), (3, 6, 4)), ((6,), (6,))],
)
def test_matmul_matches_numpy(taichi, sa, sb, dtype):
    from taifuse.backends.taichi.tensor_math import TENSOR_MATH as M

    rng = np.random.default_rng(4)
    a, b = rng.standard_normal(sa).astype(dtype), rng.standard_normal(sb).astype(dtype)
    got = M.matmul(taichi.from_numpy(a), taichi.from_numpy(b))
    expected = a.astype(np.float64) @ b.astype(np.float64)
    assert got.shape == expected.shape
    _close(got.numpy(), expected, dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int32], ids=["f32", "f16", "i32"])
def test_fill_overwrites_every_element_nan_and_inf_too(taichi, dtype):
    from taifuse.backends.taichi.tensor_math import TENSOR_MATH as M

    host = np.array([[1, -2, 3], [4, 5, -6]], dtype=dtype)
    if dtype != np.int32:
        host[0, 1], host[1, 2] = np.nan, -np.inf
    arr = taichi.from_numpy(host)
    M.fill_(arr, 0.0)
    np.testing.assert_array_equal(arr.numpy(), np.zeros((2, 3), dtype), strict=True)
    M.fill_(arr.reshape(6), 2.0)  # through a view: the same storage
    np.testing.assert_array_equal(arr.numpy(), np.full((2, 3), 2, dtype), strict=True)
    M.fill_(taichi.empty((0, 3), dtype), 1.0)  # nothing to fill


def test_layout_ops_and_pow(taichi):
    from taifuse.backends.taichi.tensor_math import TENSOR_MATH as M

    a = np.random.default_rng(5).standard_normal((2, 3, 4)).astype(np.float32)
    d = taichi.from_numpy(a)
    np.testing.assert_array_equal(M.transpose(d, (2, 0, 1)).numpy(), a.transpose(2, 0, 1))
    np.testing.assert_array_equal(M.transpose(d).numpy(), a.T)
    b = taichi.from_numpy(a[:, :1, :].copy())
    np.testing.assert_array_equal(
        M.broadcast_to(b, (5, 2, 3, 4)).numpy(), np.broadcast_to(a[:, :1, :], (5, 2, 3, 4))
    )
    np.testing.assert_array_equal(M.full((2, 2), -0.5, np.float32).numpy(), np.full((2, 2), -0.5))
    np.testing.assert_array_equal(M.neg(d).numpy(), -a)
    view = M.reshape(d, (6, 4))
    assert view._storage is d._storage, "reshape of a contiguous array is a view"
    _close(M.pow_scalar(d, 3).numpy(), a.astype(np.float64) ** 3, np.float32)
    # Like NumPy: a negative base gives nan for a fractional exponent.
    half = M.pow_scalar(d, 0.5).numpy()
    np.testing.assert_array_equal(np.isnan(half), a < 0)
    _close(half[a >= 0], np.sqrt(a[a >= 0].astype(np.float64)), np.float32)
    assert M.item(M.sum(d, None, False)) == pytest.approx(float(a.astype(np.float64).sum()), rel=1e-5)


# ----------------------------------------------------------------------------- class indices


def test_integer_data_is_int32_on_the_device(taichi):
    t = taifuse.tensor([0, 2, 1])
    assert t.dtype == np.int32 and t.backend == "taichi"
    np.testing.assert_array_equal(t.numpy(), [0, 2, 1])
    with pytest.raises(ValueError, match="int32"):
        taichi.from_numpy(np.array([2**40]))


def test_device_target_matches_host_target_and_flags_bad_indices(taichi):
    x = np.random.default_rng(6).standard_normal((4, 3)).astype(np.float32)
    logits = taifuse.tensor(x, requires_grad=True)
    host = F.cross_entropy(logits, np.array([0, 2, 1, 2]))
    device = F.cross_entropy(logits, taifuse.tensor([0, 2, 1, 2]))
    assert host.item() == pytest.approx(device.item(), rel=1e-6)
    with pytest.raises(ValueError, match="class index 3"):
        F.cross_entropy(logits, np.array([0, 3, 1, 2]))  # host targets are range-checked
    # A device target is not copied back to be checked: the bad row's loss is nan instead.
    loss = F.cross_entropy(logits, taifuse.tensor([0, 3, 1, 2]), reduction="none").numpy()
    assert math.isnan(loss[1]) and np.isfinite(loss[[0, 2, 3]]).all()
    with pytest.raises(TypeError, match="integer"):
        F.cross_entropy(logits, taifuse.tensor([0.0, 1.0, 1.0, 2.0]))


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
def test_abs_max_minimum_maximum_and_astype_match_numpy(taichi, dtype):
    """The methods clip_grad_norm_ composes: NaN-propagating like NumPy's, max over several passes."""
    M = taichi.TENSOR_MATH
    rng = np.random.default_rng(5)
    a = rng.standard_normal((3, 700)).astype(dtype)
    b = rng.standard_normal((700,)).astype(dtype)
    a[1, 650] = np.nan
    d = taichi.from_numpy(a)
    np.testing.assert_array_equal(M.abs(d).numpy(), np.abs(a))
    np.testing.assert_array_equal(M.max(d, (1,), False).numpy(), np.max(a, axis=1))  # NaN in row 1
    np.testing.assert_array_equal(M.max(d, None, True).numpy(), np.max(a, keepdims=True))
    np.testing.assert_array_equal(M.maximum(d, taichi.from_numpy(b)).numpy(), np.maximum(a, b))
    np.testing.assert_array_equal(M.minimum(d, 0.25).numpy(), np.minimum(a, dtype(0.25)))
    np.testing.assert_array_equal(M.minimum(0.25, d).numpy(), np.minimum(dtype(0.25), a))
    other = np.float16 if dtype == np.float32 else np.float32
    cast = M.astype(d, other)
    assert cast.dtype == other
    np.testing.assert_array_equal(cast.numpy(), a.astype(other))
    with pytest.raises(ValueError, match="empty"):
        M.max(taichi.empty((0, 3), dtype), (0,), False)


# ----------------------------------------------------------------------------- residency


def _mlp_step(model, x, y, lr):
    model.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    with taifuse.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
    return loss


def test_a_training_step_copies_nothing_but_the_loss(taichi):
    taifuse.manual_seed(0)
    rng = np.random.default_rng(7)
    model = nn.Sequential(
        nn.Linear(20, 32, activation="gelu"),
        nn.Linear(32, 32, activation="gelu"),
        nn.Linear(32, 4),
    )
    # The batch goes to the device once, as a data loader would put it there.
    x = taifuse.tensor(rng.standard_normal((64, 20)).astype(np.float32))
    y = taifuse.tensor(rng.integers(0, 4, 64))
    first = _mlp_step(model, x, y, 0.2).item()  # compiles every kernel
    taichi.reset_transfer_stats()
    loss = _mlp_step(model, x, y, 0.2)
    assert taichi.transfer_stats() == {
        "host_to_device": 0,
        "device_to_host": 0,
        "bytes_host_to_device": 0,
        "bytes_device_to_host": 0,
    }
    value = loss.item()
    stats = taichi.transfer_stats()
    assert stats["host_to_device"] == 0 and stats["device_to_host"] == 1
    assert stats["bytes_device_to_host"] == 4  # one float32
    for _ in range(10):
        last = _mlp_step(model, x, y, 0.2).item()
    assert math.isfinite(value) and last < first, f"loss went from {first} to {last}"
    assert all(p.grad.backend == "taichi" for p in model.parameters())


def _three_parameter_model_with_gradients(taichi):
    taifuse.manual_seed(1)
    rng = np.random.default_rng(11)
    model = nn.Sequential(nn.Linear(12, 8, activation="relu"), nn.Linear(8, 3, bias=False))
    assert len(list(model.parameters())) == 3
    x = taifuse.tensor(rng.standard_normal((16, 12)).astype(np.float32))
    y = taifuse.tensor(rng.integers(0, 3, 16))
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    return model


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_clip_grad_norm_copies_nothing_to_or_from_the_host(taichi, norm_type):
    """The norms, the coefficient and the scaling stay on the device; error_if_nonfinite reads the
    total norm back once (PyTorch syncs then too)."""
    from taifuse.optim import clip_grad_norm_

    model = _three_parameter_model_with_gradients(taichi)
    clip_grad_norm_(model.parameters(), 1e-3, norm_type=norm_type)  # compiles every kernel
    for check in (False, True):
        model = _three_parameter_model_with_gradients(taichi)
        grads = [p.grad.numpy().astype(np.float64).ravel() for p in model.parameters()]
        taichi.reset_transfer_stats()
        total = clip_grad_norm_(model.parameters(), 1e-3, norm_type=norm_type, error_if_nonfinite=check)
        stats = taichi.transfer_stats()
        assert stats["host_to_device"] == 0, stats
        assert stats["device_to_host"] == (1 if check else 0), stats
        assert total.backend == "taichi" and total.dtype == np.float32 and total.shape == ()
        flat = np.concatenate(grads)
        want = (
            np.max(np.abs(flat))
            if math.isinf(norm_type)
            else np.sum(np.abs(flat) ** norm_type) ** (1 / norm_type)
        )
        assert total.item() == pytest.approx(want, rel=1e-5)
        coef = min(1.0, 1e-3 / (want + 1e-6))
        for p, g in zip(model.parameters(), grads):
            np.testing.assert_allclose(p.grad.numpy().ravel(), g * coef, rtol=1e-5, atol=1e-9)


def test_backward_kernels_have_the_reference_signatures():
    import inspect

    from taifuse import backends
    from taifuse.backends import reference
    from taifuse.backends import taichi as taichi_gpu

    for name in backends.BACKWARD_KERNEL_NAMES:
        got = list(inspect.signature(getattr(taichi_gpu, name)).parameters)
        want = list(inspect.signature(getattr(reference, name)).parameters)
        assert got == want, f"taichi_gpu.{name}{got} differs from the reference {want}"
    assert taichi_gpu.TENSOR_MATH is not None
    host_methods = {n for n in vars(type(HOST_MATH)) if not n.startswith("_")}
    missing = [n for n in host_methods if not callable(getattr(taichi_gpu.TENSOR_MATH, n, None))]
    assert not missing, f"TaichiMath lacks {missing}"
