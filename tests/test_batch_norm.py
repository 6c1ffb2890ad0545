"""F.batch_norm, nn.BatchNorm1d/2d and Module buffers.

* The four kernels against the float64 reference on every backend, forward and backward, in
  every dtype the backend takes (float16 also with float32 parameters), at (N, C), (N, C, L),
  (N, C, H, W), N = 1 with H * W > 1, odd sizes, training and evaluation, with and without the
  fused ReLU; numba's serial and parallel paths both.
* float64 finite differences of the reference path (the numpy backend's Tensors).
* PyTorch parity: F.batch_norm and the modules over several steps (outputs, gradients, running
  statistics, num_batches_tracked), eval mode, momentum=None, state_dict round trips.
* Bad input raises before anything (running statistics included) is written.

Tolerances (``BN_TOL``, the table's): the per-channel statistics are float32 sums over M values,
so every quantity's bound is scaled by what it sums: the output by
(|x| + |mean|) * invstd * |w| + |b| (the error of the mean, times the factor it is multiplied by),
the variance by the mean square about the kernels' shift (NOTE [ Batch norm statistics in one
pass ]), the gradients by the sums of the magnitudes of their terms.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import F16, F32, F64, TOLERANCES, assert_close

import taifuse
import taifuse.amp
import taifuse.functional as F
import taifuse.optim
from taifuse import nn
from taifuse.backends import reference as R

torch = pytest.importorskip("torch")

# Shapes: (N, C), (N, C, L), (N, C, H, W), N = 1 with H * W > 1, odd sizes; and, in fewer
# combinations, counts past one first-level block: numba's (N, C) rows in 6 blocks of 256, the
# taichi kernels' 2 parts per channel (the (N, C) thread order and the other).
SHAPES = ((7, 3), (3, 4, 9), (2, 3, 5, 7), (1, 2, 3, 3))
LARGE_SHAPES = ((1500, 3), (3, 2, 25, 27))
# The table's tolerances with the scales of _scales: over these cases on numba and taichi-vulkan the
# worst err/bound was 0.06 in float32 with atol 4e-6 (so at most 0.25 with the table's 1e-6) and
# 0.48 in float16 (the half-ulp rounding).
BN_TOL = TOLERANCES


def _stats_dtype(dtype: np.dtype) -> np.dtype:
    return F64 if dtype == F64 else F32


def _param_dtypes(backend, dtype: np.dtype) -> tuple[np.dtype, ...]:
    return (F16, F32) if dtype == F16 else (dtype,)


def _dtypes(backend) -> tuple[np.dtype, ...]:
    return (F32, F16, F64) if backend.supports_f64 else (F32, F16)


def _case(rng, shape, dtype, pdt, offset=0.0):
    c = shape[1]
    x = (rng.standard_normal(shape) * 2.0 + offset).astype(dtype)
    g = rng.standard_normal(shape).astype(dtype)
    w = rng.uniform(0.5, 1.5, c).astype(pdt) * np.where(rng.random(c) < 0.5, -1, 1).astype(pdt)
    b = rng.standard_normal(c).astype(pdt)
    rm = rng.standard_normal(c).astype(pdt)
    rv = rng.uniform(0.5, 2.0, c).astype(pdt)
    return x, g, w, b, rm, rv


def _view3(a: np.ndarray) -> np.ndarray:
    return a.reshape(a.shape[0], a.shape[1], -1)


def _kernels(module, be, x, g, w, b, rm, rv, training, activation, to_be, to_np):
    """Run the four kernels of ``module`` as the array path composes them; host results."""
    n, c, s = _view3(x).shape
    sd = _stats_dtype(x.dtype)
    xa, ga = to_be(_view3(x)), to_be(_view3(g))
    wa, ba, rma, rva = (to_be(a.copy()) for a in (w, b, rm, rv))  # the caller's stay as they were
    mean, var, invstd = (be.empty((c,), sd) for _ in range(3))
    if training:
        module.batch_norm_stats(xa, mean, var)
        module.batch_norm_update(mean, var, n * s, 1e-3, 0.3, rma, rva, invstd)
    else:
        mean, var = to_be(rm.astype(sd)), to_be(rv.astype(sd))
        module.batch_norm_update(mean, var, 1, 1e-3, 0.0, None, None, invstd)
    out = be.empty(xa.shape, x.dtype)
    module.batch_norm_elemt(xa, mean, invstd, wa, ba, activation, out)
    gx = be.empty(xa.shape, x.dtype)
    gw, gb = be.empty((c,), w.dtype), be.empty((c,), w.dtype)
    module.batch_norm_backward(xa, ga, mean, invstd, wa, ba, activation, training, gx, gw, gb)
    results = {"mean": mean, "var": var, "invstd": invstd, "running_mean": rma, "running_var": rva,
               "out": out, "gx": gx, "gw": gw, "gb": gb}  # fmt: skip
    return {k: to_np(v) for k, v in results.items()}


def _reference(x, g, w, b, rm, rv, training, activation):
    """The reference kernels on float64 copies, and the scale of each result (module docstring)."""
    f = lambda a: np.array(a, np.float64)
    x64, g64 = _view3(f(x)), _view3(f(g))
    return _kernels(R, R, x64, g64, f(w), f(b), f(rm), f(rv), training, activation, lambda a: a, lambda a: a)


def _scales(x, g, w, b, ref):
    x64, g64 = _view3(np.abs(np.asarray(x, np.float64))), _view3(np.abs(np.asarray(g, np.float64)))
    col = lambda a: np.asarray(a, np.float64)[None, :, None]
    inv, mean = col(ref["invstd"]), col(ref["mean"])
    aw = np.abs(col(w))
    xhat = np.abs(_view3(np.asarray(x, np.float64)) - mean) * inv
    shift = _view3(np.asarray(x, np.float64))[:1, :, :1]
    count = x64.shape[0] * x64.shape[2]
    sum_g = (g64).sum(axis=(0, 2))
    sum_gx = (g64 * (xhat + np.abs(mean) * inv)).sum(axis=(0, 2))
    return {
        "mean": x64.mean(axis=(0, 2)),
        "var": ((_view3(np.asarray(x, np.float64)) - shift) ** 2).mean(axis=(0, 2)),
        "invstd": np.asarray(ref["invstd"], np.float64),
        "running_mean": x64.mean(axis=(0, 2)),
        "running_var": ((_view3(np.asarray(x, np.float64)) - shift) ** 2).mean(axis=(0, 2)) + 1.0,
        "out": (x64 + np.abs(mean)) * inv * aw + np.abs(col(b)),
        "gx": aw * inv * (g64 + sum_g[None, :, None] / count + (xhat + 1) * sum_gx[None, :, None] / count),
        "gw": sum_gx,
        "gb": sum_g,
    }


def _kernel_cases(backend):
    for shape in SHAPES:
        for dtype in _dtypes(backend):
            for pdt in _param_dtypes(backend, dtype):
                for training in (True, False):
                    for activation in (None, "relu"):
                        yield shape, dtype, pdt, training, activation
    for shape in LARGE_SHAPES:
        for dtype, pdt in ((F32, F32), (F16, F32)):
            yield shape, dtype, pdt, True, "relu"


def test_kernels_match_the_reference(backend, monkeypatch):
    rng = np.random.default_rng(28)
    be = backend.module()
    # numba: serial and parallel paths both (the threshold decides which runs).
    paths = (False, True) if backend.name == "numba" else (None,)
    for parallel in paths:
        if parallel is not None:
            from taifuse.backends.numba import _jit

            monkeypatch.setattr(_jit, "_parallel", lambda size, transcendental=False, p=parallel: p)
        for shape, dtype, pdt, training, activation in _kernel_cases(backend):
            x, g, w, b, rm, rv = _case(rng, shape, dtype, pdt, offset=3.0)
            got = _kernels(be, be, x, g, w, b, rm, rv, training, activation, be.from_numpy,
                           be.to_numpy)  # fmt: skip
            ref = _reference(x, g, w, b, rm, rv, training, activation)
            scales = _scales(x, g, w, b, ref)
            what = f"{backend.param} {shape} {dtype} params {pdt} training={training} {activation}"
            keys = ("invstd", "out", "gx", "gw", "gb")
            if training:
                keys += ("mean", "var", "running_mean", "running_var")
            for key in keys:
                tol = BN_TOL[np.dtype(got[key].dtype) if key not in ("mean", "var", "invstd")
                             else _stats_dtype(dtype)]  # fmt: skip
                ref_v = ref[key].reshape(got[key].shape)
                assert_close(got[key], ref_v, scales[key].reshape(got[key].shape), tol,
                             f"{key}: {what}")  # fmt: skip


def test_statistics_keep_their_digits_far_from_zero(backend):
    # A channel at 1e4 +- 1 in float32: E[x^2] - E[x]^2 would cancel every digit of the variance;
    # the shifted sums keep it (NOTE [ Batch norm statistics in one pass ]).
    rng = np.random.default_rng(1)
    x = (1e4 + rng.standard_normal((64, 2, 16))).astype(np.float32)
    be = backend.module()
    mean, var = be.empty((2,), np.float32), be.empty((2,), np.float32)
    be.batch_norm_stats(be.from_numpy(x), mean, var)
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(be.to_numpy(var), x64.var(axis=(0, 2)), rtol=1e-4)
    np.testing.assert_allclose(be.to_numpy(mean), x64.mean(axis=(0, 2)), rtol=1e-7)


def test_functional_arrays_update_the_callers_running_statistics(backend):
    backend.activate()
    rng = np.random.default_rng(2)
    x = rng.standard_normal((6, 3, 4)).astype(np.float32)
    rm, rv = np.zeros(3, np.float32), np.ones(3, np.float32)
    y = F.batch_norm(x, rm, rv, training=True, momentum=0.25, eps=1e-4, activation="relu")
    assert isinstance(y, np.ndarray) and y.dtype == np.float32
    t = torch.tensor(x)
    trm, trv = torch.zeros(3), torch.ones(3)
    ty = torch.relu(torch.nn.functional.batch_norm(t, trm, trv, training=True, momentum=0.25, eps=1e-4))
    np.testing.assert_allclose(y, ty.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(rm, trm.numpy(), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(rv, trv.numpy(), rtol=1e-6, atol=1e-7)
    y_eval = F.batch_norm(x, rm, rv, training=False)
    ty_eval = torch.nn.functional.batch_norm(t, trm, trv, training=False)
    np.testing.assert_allclose(y_eval, ty_eval.numpy(), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- finite differences


@pytest.mark.parametrize("training", [True, False])
def test_float64_gradients_match_finite_differences(training):
    with taifuse.use_backend("numpy"):
        rng = np.random.default_rng(3)
        for shape, activation in (((5, 3), None), ((2, 2, 3, 2), "relu"), ((1, 2, 5), None)):
            c = shape[1]
            x0 = rng.standard_normal(shape)
            w0, b0 = rng.standard_normal(c), rng.standard_normal(c)
            rm, rv = rng.standard_normal(c), rng.uniform(0.5, 2, c)
            up = rng.standard_normal(shape)

            def loss(x, w, b, rm=rm, rv=rv, up=up, activation=activation):
                y = F.batch_norm(x, rm.copy(), rv.copy(), w, b, training, 0.1, 1e-3, activation)
                return float(np.sum(y * up))

            X, W, B = (taifuse.tensor(a, requires_grad=True) for a in (x0, w0, b0))
            y = F.batch_norm(X, taifuse.tensor(rm), taifuse.tensor(rv), W, B, training, 0.1, 1e-3, activation)
            (y * taifuse.tensor(up)).sum().backward()
            h = 1e-6
            for name, arr, grad in (("input", x0, X.grad), ("weight", w0, W.grad), ("bias", b0, B.grad)):
                numeric = np.zeros_like(arr)
                for i in np.ndindex(arr.shape):
                    plus, minus = arr.copy(), arr.copy()
                    plus[i] += h
                    minus[i] -= h
                    args = {"input": (x0, w0, b0), "weight": (x0, w0, b0), "bias": (x0, w0, b0)}[name]
                    p_args = [plus if a is arr else a for a in args]
                    m_args = [minus if a is arr else a for a in args]
                    numeric[i] = (loss(*p_args) - loss(*m_args)) / (2 * h)
                np.testing.assert_allclose(grad.numpy(), numeric, rtol=1e-6, atol=1e-7,
                                           err_msg=f"{name} {shape} training={training} {activation}")  # fmt: skip


# ----------------------------------------------------------------------------- PyTorch parity


def _parity_backend(backend) -> None:
    if backend.param in ("numpy", "taichi-cpu"):
        pytest.skip("parity runs on numba and the GPU param (the kernels' own tests cover the others)")
    backend.activate()


def test_modules_match_pytorch_over_several_steps(backend):
    _parity_backend(backend)
    rng = np.random.default_rng(4)
    for cls, tcls, shape, kwargs in (
        (nn.BatchNorm2d, torch.nn.BatchNorm2d, (4, 3, 5, 6), {}),
        (nn.BatchNorm1d, torch.nn.BatchNorm1d, (8, 5), {"momentum": None}),
        (nn.BatchNorm1d, torch.nn.BatchNorm1d, (3, 4, 7), {"momentum": 0.3, "eps": 1e-3}),
        (nn.BatchNorm2d, torch.nn.BatchNorm2d, (1, 2, 3, 3), {"affine": False}),
        (nn.BatchNorm1d, torch.nn.BatchNorm1d, (6, 3), {"track_running_stats": False}),
    ):
        ours, theirs = cls(shape[1], **kwargs), tcls(shape[1], **kwargs)
        assert list(ours.state_dict()) == list(theirs.state_dict())
        if ours.affine:
            with torch.no_grad():
                theirs.weight.copy_(torch.tensor(rng.uniform(0.5, 1.5, shape[1]), dtype=torch.float32))
                theirs.bias.copy_(torch.tensor(rng.standard_normal(shape[1]), dtype=torch.float32))
        ours.load_state_dict(theirs.state_dict())
        opt = taifuse.optim.SGD(list(ours.parameters()), lr=0.1) if ours.affine else None
        topt = torch.optim.SGD(theirs.parameters(), lr=0.1) if ours.affine else None
        for step in range(5):
            x = (rng.standard_normal(shape) * 1.5 + 0.5).astype(np.float32)
            up = rng.standard_normal(shape).astype(np.float32)
            X, tx = taifuse.tensor(x, requires_grad=True), torch.tensor(x, requires_grad=True)
            y, ty = ours(X), theirs(tx)
            (y * taifuse.tensor(up)).sum().backward()
            (ty * torch.tensor(up)).sum().backward()
            what = f"{cls.__name__}{shape} {kwargs} step {step}"
            np.testing.assert_allclose(y.numpy(), ty.detach().numpy(), rtol=1e-5, atol=2e-5, err_msg=what)
            np.testing.assert_allclose(X.grad.numpy(), tx.grad.numpy(), rtol=1e-4, atol=2e-5, err_msg=what)
            if opt is not None:
                opt.step(), topt.step()
                opt.zero_grad(), topt.zero_grad()
            for key, value in theirs.state_dict().items():
                np.testing.assert_allclose(ours.state_dict()[key].numpy(), value.numpy(), rtol=1e-5, atol=2e-6,
                                           err_msg=f"{key}: {what}")  # fmt: skip
        ours.eval(), theirs.eval()
        x = rng.standard_normal(shape).astype(np.float32)
        np.testing.assert_allclose(ours(taifuse.tensor(x)).numpy(), theirs(torch.tensor(x)).detach().numpy(),
                                   rtol=1e-5, atol=2e-5, err_msg=f"eval {cls.__name__}{shape} {kwargs}")  # fmt: skip


def test_fused_relu_module_matches_batch_norm_then_relu(backend):
    _parity_backend(backend)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 4, 5, 5)).astype(np.float32)
    ours, theirs = nn.BatchNorm2d(4, activation="relu"), torch.nn.BatchNorm2d(4)
    X, tx = taifuse.tensor(x, requires_grad=True), torch.tensor(x, requires_grad=True)
    ours(X).sum().backward()
    torch.relu(theirs(tx)).sum().backward()
    np.testing.assert_allclose(X.grad.numpy(), tx.grad.numpy(), rtol=1e-4, atol=2e-5)
    np.testing.assert_allclose(ours.weight.grad.numpy(), theirs.weight.grad.numpy(), rtol=1e-4, atol=2e-5)
    np.testing.assert_allclose(ours.running_var.numpy(), theirs.running_var.numpy(), rtol=1e-6)
    assert "activation='relu'" in repr(ours)


def test_float16_input_with_float32_parameters_under_autocast(backend):
    # NOTE [ Batch norm under autocast ]: not cast; float16 in, float16 out, float32 statistics.
    backend.activate()
    rng = np.random.default_rng(6)
    x = rng.standard_normal((4, 3, 6)).astype(np.float16)
    bn = nn.BatchNorm1d(3)
    with taifuse.amp.autocast():
        y = bn(taifuse.tensor(x, requires_grad=True))
        y32 = bn(taifuse.tensor(x.astype(np.float32)))
    assert y.dtype == np.float16 and y32.dtype == np.float32
    assert bn.running_mean.dtype == np.float32
    trm, trv = torch.zeros(3), torch.ones(3)
    ref = torch.nn.functional.batch_norm(torch.tensor(x, dtype=torch.float64), trm.double(), trv.double(),
                                         torch.ones(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64),
                                         training=True)  # fmt: skip
    np.testing.assert_allclose(y.numpy().astype(np.float64), ref.numpy(), rtol=2e-3, atol=2e-3)


# ----------------------------------------------------------------------------- modules and buffers


def test_state_dict_round_trip_with_torch_keys():
    with taifuse.use_backend("numpy"):
        model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
        twin = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
        assert list(model.state_dict()) == list(twin.state_dict())
        with torch.no_grad():
            twin[1].running_mean.copy_(torch.tensor([1.0, 2.0, 3.0]))
            twin[1].num_batches_tracked.fill_(7)
        model.load_state_dict(twin.state_dict())
        assert int(model[1].num_batches_tracked.item()) == 7
        np.testing.assert_array_equal(model[1].running_mean.numpy(), [1, 2, 3])
        model.train()
        model(taifuse.tensor(np.ones((2, 4), np.float32)))
        assert int(model[1].num_batches_tracked.item()) == 8  # counted on from the loaded value
        back = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
        back.load_state_dict({k: torch.tensor(v.numpy()) for k, v in model.state_dict().items()})
        assert int(back[1].num_batches_tracked) == 8
        assert [n for n, _ in model.named_buffers()] == [
            "1.running_mean",
            "1.running_var",
            "1.num_batches_tracked",
        ]
        assert len(list(model.buffers())) == 3 and len(list(model.parameters())) == 4
        no_stats = nn.BatchNorm2d(2, affine=False, track_running_stats=False)
        assert list(no_stats.state_dict()) == list(
            torch.nn.BatchNorm2d(2, affine=False, track_running_stats=False).state_dict()
        )


def test_register_buffer_persistence_assignment_and_errors():
    with taifuse.use_backend("numpy"):
        m = nn.Module()
        m.register_buffer("kept", taifuse.tensor(np.zeros(2, np.float32)))
        m.register_buffer("scratch", taifuse.tensor(np.ones(2, np.float32)), persistent=False)
        assert list(m.state_dict()) == ["kept"]
        assert [n for n, _ in m.named_buffers()] == ["kept", "scratch"]
        m.kept = taifuse.tensor(np.full(2, 5.0, np.float32))  # replaces the buffer
        assert list(m.state_dict()) == ["kept"] and m.state_dict()["kept"].numpy()[0] == 5.0
        with pytest.raises(KeyError, match="already exists"):
            m.register_buffer("training", None)
        with pytest.raises(ValueError, match="'.'"):
            m.register_buffer("a.b", None)
        with pytest.raises(TypeError, match="buffer 'p'"):
            m.register_buffer("p", nn.Parameter(np.zeros(1, np.float32)))
        with pytest.raises(ValueError, match="'kept' has shape"):
            m.load_state_dict({"kept": np.zeros(3, np.float32)})
        del m.kept
        assert [n for n, _ in m.named_buffers()] == ["scratch"]


def test_train_and_eval_switch_the_statistics():
    with taifuse.use_backend("numpy"):
        rng = np.random.default_rng(7)
        bn = nn.Sequential(nn.BatchNorm2d(2))
        x = taifuse.tensor(rng.standard_normal((3, 2, 2, 2)).astype(np.float32) + 4.0)
        train_out = bn(x).numpy()
        np.testing.assert_allclose(train_out.mean(axis=(0, 2, 3)), 0.0, atol=1e-6)  # batch statistics
        before = bn[0].running_mean.numpy().copy()
        bn.eval()
        assert not bn[0].training
        eval_out = bn(x).numpy()
        np.testing.assert_array_equal(bn[0].running_mean.numpy(), before)  # evaluation updates nothing
        expected = (x.numpy() - before[None, :, None, None]) / np.sqrt(
            bn[0].running_var.numpy()[None, :, None, None] + 1e-5
        )
        np.testing.assert_allclose(eval_out, expected, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- bad input


def _bad_calls():
    x = np.ones((4, 3, 2), np.float32)
    rm, rv, w = np.zeros(3, np.float32), np.ones(3, np.float32), np.ones(3, np.float32)
    return [
        (
            (np.ones((1, 3), np.float32), rm, rv),
            {"training": True},
            ValueError,
            "more than 1 value per channel",
        ),
        (
            (np.ones((1, 3, 1, 1), np.float32), rm, rv),
            {"training": True},
            ValueError,
            "more than 1 value per channel",
        ),
        ((x, np.zeros(4, np.float32), rv), {"training": True}, ValueError, "running_mean should have shape"),
        ((x, rm, np.ones(2, np.float32)), {"training": True}, ValueError, "running_var should have shape"),
        ((x, rm, rv, np.ones(4, np.float32)), {"training": True}, ValueError, "weight should have shape"),
        (
            (x, rm, rv, w, np.ones((3, 1), np.float32)),
            {"training": True},
            ValueError,
            "bias should have shape",
        ),
        ((x, rm, None), {"training": True}, ValueError, "running_var is None"),
        ((x, None, None), {"training": False}, ValueError, "required in evaluation"),
        ((np.ones(3, np.float32), rm, rv), {"training": True}, ValueError, "at least 2 dimensions"),
        ((x, rm, rv), {"training": True, "momentum": None}, TypeError, "momentum"),
        ((x, rm, rv), {"training": True, "momentum": float("nan")}, ValueError, "momentum"),
        ((x, rm, rv), {"training": True, "eps": -1.0}, ValueError, "eps"),
        ((x, rm, rv), {"training": True, "activation": "gelu"}, ValueError, "activation"),
        (([[1.0, 2.0]], rm, rv), {"training": True}, TypeError, "input should be an array"),
        (
            (x, rm.astype(np.float16), rv.astype(np.float16)),
            {"training": True},
            TypeError,
            "running_mean has dtype",
        ),
        ((x, rm, rv, w.astype(np.float64)), {"training": True}, TypeError, "weight has dtype"),
    ]


@pytest.mark.parametrize("tensors", [False, True])
def test_bad_input_raises_before_anything_is_written(backend, tensors):
    backend.activate()
    for args, kwargs, exc, match in _bad_calls():
        if tensors and not backend.supports_f64 and any(getattr(a, "dtype", None) == F64 for a in args):
            continue  # a float64 Tensor is refused on creation there (tests/test_validation.py)
        args = [a.copy() if isinstance(a, np.ndarray) else a for a in args]
        running = [a for a in args[1:3] if a is not None]
        saved = [a.copy() for a in running]
        call = [taifuse.tensor(a) if tensors and a is not None and i != 0 else a for i, a in enumerate(args)]
        if tensors:
            if isinstance(args[0], np.ndarray):
                call[0] = taifuse.tensor(args[0], requires_grad=True)
            running = [a for a in call[1:3] if a is not None]
        with pytest.raises(exc, match=match):
            F.batch_norm(*call, **kwargs)
        for before, now in zip(saved, running):
            np.testing.assert_array_equal(
                now.numpy() if tensors else now, before, err_msg=f"{match}: written"
            )


def test_modules_refuse_bad_input_without_counting_a_batch():
    with taifuse.use_backend("numpy"):
        bn = nn.BatchNorm2d(3)
        with pytest.raises(ValueError, match="expected 4D input"):
            bn(taifuse.tensor(np.ones((2, 3), np.float32)))
        with pytest.raises(ValueError, match="more than 1 value per channel"):
            bn(taifuse.tensor(np.ones((1, 3, 1, 1), np.float32)))
        with pytest.raises(ValueError, match="running_mean should have shape"):
            bn(taifuse.tensor(np.ones((2, 4, 1, 1), np.float32)))
        assert int(bn.num_batches_tracked.item()) == 0
        np.testing.assert_array_equal(bn.running_var.numpy(), np.ones(3, np.float32))
        with pytest.raises(ValueError, match="expected 2D or 3D input"):
            nn.BatchNorm1d(3)(taifuse.tensor(np.ones((2, 3, 1, 1), np.float32)))
        with pytest.raises(ValueError, match="num_features"):
            nn.BatchNorm1d(0)
        with pytest.raises(ValueError, match="activation"):
            nn.BatchNorm1d(2, activation="tanh")


def test_empty_batch_gives_an_empty_output_and_keeps_the_statistics(backend):
    backend.activate()
    rm, rv = np.zeros(3, np.float32), np.ones(3, np.float32)
    assert F.batch_norm(np.zeros((0, 3, 4), np.float32), rm, rv, training=True).shape == (0, 3, 4)
    np.testing.assert_array_equal(rm, np.zeros(3, np.float32))
    x = taifuse.tensor(np.zeros((0, 3), np.float32), requires_grad=True)
    w = taifuse.tensor(np.ones(3, np.float32), requires_grad=True)
    F.batch_norm(x, taifuse.tensor(rm), taifuse.tensor(rv), w, None, training=True).sum().backward()
    assert x.grad.shape == (0, 3)
    np.testing.assert_array_equal(w.grad.numpy(), np.zeros(3, np.float32))  # as PyTorch's


def test_relu_mask_passes_the_gradient_of_a_nan_output_as_pytorch(backend):
    # PyTorch's ReLU backward zeroes where its output is <= 0, so a NaN output passes its gradient.
    backend.activate()
    x = np.array([[1.0, -2.0], [np.nan, 3.0], [-1.0, 0.5]], np.float32)
    rm, rv = np.array([0.5, 0.0], np.float32), np.array([2.0, 1.0], np.float32)
    X = taifuse.tensor(x, requires_grad=True)
    y = F.batch_norm(X, taifuse.tensor(rm), taifuse.tensor(rv), training=False, activation="relu")
    y.backward(taifuse.tensor(np.ones_like(x)))
    tx = torch.tensor(x, requires_grad=True)
    torch.relu(torch.nn.functional.batch_norm(tx, torch.tensor(rm), torch.tensor(rv))).backward(
        torch.ones(3, 2)
    )
    np.testing.assert_allclose(X.grad.numpy(), tx.grad.numpy(), rtol=1e-6)
    assert np.isnan(y.numpy()[1, 0])
