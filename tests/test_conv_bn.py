"""The fused Conv2d -> BatchNorm -> ReLU block: ``F.conv2d_batch_norm``, ``nn.ConvBn2d``, ``nn.ConvBnReLU2d``.

* In training, forward and backward on every backend against the numpy backend (the float64
  reference kernels) and against PyTorch's conv2d -> batch_norm -> relu in float64: the output,
  the gradients of input, weight, batch norm's weight and bias, and the running statistics, over
  odd geometries (1x1 and 7x7 kernels, stride 2 with padding that does not divide, dilation 2,
  groups = channels, N = 1, H != W), with and without the ReLU and the convolution's bias.
* The unfused composition of taifuse's own ops gives the same values (outputs, gradients, running
  statistics), in training and evaluation, and under autocast.
* float64 finite differences of the reference path.
* The modules: the state_dict of ``nn.Sequential(conv, bn, relu)``, the same losses, gradients and
  running statistics as that Sequential over SGD steps, in train and eval mode, momentum=None and
  track_running_stats=False.
* Bad input raises before anything (running statistics, num_batches_tracked) is written.

Tolerances: float32 kernels against float64 references. The outputs are normalized (unit scale):
atol 2e-5. The gradients are sums over N * OH * OW of products of unit-scale terms and batch
norm's sums: rtol 1e-4 with atol 1e-4 times the largest magnitude of the compared gradient.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import REFUSED_BY_DESIGN

import taifuse
import taifuse.amp
import taifuse.functional as F
import taifuse.optim
from taifuse import nn

torch = pytest.importorskip("torch")

# (N, C, H, W, OC, kernel, stride, padding, dilation, groups)
GEOMETRIES = {
    "3x3": (2, 3, 7, 6, 5, 3, 1, 1, 1, 1),
    "1x1-N1": (1, 2, 5, 4, 6, 1, 1, 0, 1, 1),
    "7x7-stride2": (2, 3, 11, 9, 4, 7, 2, 2, 1, 1),
    "dilation2": (2, 4, 8, 7, 8, 3, 1, 2, 2, 2),
    "depthwise": (3, 4, 9, 8, 4, 3, 2, 1, 1, 4),
}


def _case(rng, geometry, bias: bool, dtype=np.float32):
    n, c, h, w, oc, k, _s, _p, _d, g = geometry
    x = rng.standard_normal((n, c, h, w)).astype(dtype)
    wt = (rng.standard_normal((oc, c // g, k, k)) / np.sqrt(c // g * k * k)).astype(dtype)
    b = rng.standard_normal(oc).astype(dtype) if bias else None
    bw = (rng.uniform(0.5, 1.5, oc) * np.where(rng.random(oc) < 0.3, -1, 1)).astype(dtype)
    bb = rng.standard_normal(oc).astype(dtype)
    rm = rng.standard_normal(oc).astype(dtype)
    rv = rng.uniform(0.5, 2.0, oc).astype(dtype)
    return x, wt, b, bw, bb, rm, rv


def _run(arrays, geometry, activation, grad_out, training=True, momentum=0.1):
    """The block on the active backend: (output, {gradient name: array}, running_mean, running_var)."""
    x, wt, b, bw, bb, rm, rv = arrays
    *_, s, p, d, g = geometry
    params = {"input": x, "weight": wt, "bias": b, "bn_weight": bw, "bn_bias": bb}
    ts = {name: None if v is None else taifuse.tensor(v, requires_grad=True) for name, v in params.items()}
    rmt, rvt = taifuse.tensor(rm.copy()), taifuse.tensor(rv.copy())
    y = F.conv2d_batch_norm(
        ts["input"], ts["weight"], ts["bias"], rmt, rvt, ts["bn_weight"], ts["bn_bias"], s, p, d, g,
        training, momentum, 1e-5, activation=activation,
    )  # fmt: skip
    (y * taifuse.tensor(grad_out)).sum().backward()
    grads = {name: t.grad.numpy() for name, t in ts.items() if t is not None}
    return y.numpy(), grads, rmt.numpy(), rvt.numpy()


def _torch(arrays, geometry, activation, grad_out, training=True):
    """PyTorch's conv2d -> batch_norm -> relu in float64."""
    x, wt, b, bw, bb, rm, rv = (None if a is None else torch.tensor(a, dtype=torch.float64) for a in arrays)
    *_, s, p, d, g = geometry
    params = {"input": x, "weight": wt, "bias": b, "bn_weight": bw, "bn_bias": bb}
    for t in params.values():
        if t is not None:
            t.requires_grad_(True)
    y = torch.nn.functional.conv2d(x, wt, b, s, p, d, g)
    y = torch.nn.functional.batch_norm(y, rm, rv, bw, bb, training, 0.1, 1e-5)
    if activation == "relu":
        y = torch.relu(y)
    (y * torch.tensor(grad_out, dtype=torch.float64)).sum().backward()
    grads = {name: t.grad.numpy() for name, t in params.items() if t is not None}
    return y.detach().numpy(), grads, rm.numpy(), rv.numpy()


def _assert_results(ours, theirs, context: str) -> None:
    y, grads, rm, rv = ours
    ty, tgrads, trm, trv = theirs
    np.testing.assert_allclose(y, ty, rtol=1e-5, atol=2e-5, err_msg=f"{context}: output")
    np.testing.assert_allclose(rm, trm, rtol=1e-5, atol=1e-6, err_msg=f"{context}: running_mean")
    np.testing.assert_allclose(rv, trv, rtol=1e-5, atol=1e-6, err_msg=f"{context}: running_var")
    assert set(grads) == set(tgrads), context
    for name, g in grads.items():
        scale = max(1.0, float(np.abs(tgrads[name]).max()))
        np.testing.assert_allclose(
            g, tgrads[name], rtol=1e-4, atol=1e-4 * scale, err_msg=f"{context}: {name}"
        )


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("activation", [None, "relu"])
@pytest.mark.parametrize("geometry", GEOMETRIES.values(), ids=GEOMETRIES.keys())
def test_block_in_training_matches_the_reference_and_torch(backend, geometry, activation, bias):
    rng = np.random.default_rng(7)
    arrays = _case(rng, geometry, bias)
    n, _, h, w, oc, k, s, p, d, _ = geometry
    oh, ow = (h + 2 * p - d * (k - 1) - 1) // s + 1, (w + 2 * p - d * (k - 1) - 1) // s + 1
    grad_out = rng.standard_normal((n, oc, oh, ow)).astype(np.float32)
    expected = _torch(arrays, geometry, activation, grad_out)
    with taifuse.use_backend("numpy"):
        reference = _run(arrays, geometry, activation, grad_out)
    backend.activate()
    ours = _run(arrays, geometry, activation, grad_out)
    _assert_results(reference, expected, "reference vs torch")
    _assert_results(ours, reference, f"{backend.param} vs reference")
    if bias:  # batch norm absorbs the convolution's bias: its gradient is exactly 0
        np.testing.assert_array_equal(ours[1]["bias"], 0.0)


def _unfused(arrays, geometry, activation, grad_out, training, fused_relu):
    """taifuse's F.conv2d -> F.batch_norm (-> F.relu), or with batch norm's fused ReLU."""
    x, wt, b, bw, bb, rm, rv = arrays
    *_, s, p, d, g = geometry
    params = {"input": x, "weight": wt, "bias": b, "bn_weight": bw, "bn_bias": bb}
    ts = {name: None if v is None else taifuse.tensor(v, requires_grad=True) for name, v in params.items()}
    rmt, rvt = taifuse.tensor(rm.copy()), taifuse.tensor(rv.copy())
    y = F.conv2d(ts["input"], ts["weight"], ts["bias"], s, p, d, g)
    y = F.batch_norm(
        y, rmt, rvt, ts["bn_weight"], ts["bn_bias"], training, 0.1, 1e-5,
        activation=activation if fused_relu else None,
    )  # fmt: skip
    if activation == "relu" and not fused_relu:
        y = F.relu(y)
    (y * taifuse.tensor(grad_out)).sum().backward()
    grads = {name: t.grad.numpy() for name, t in ts.items() if t is not None}
    return y.numpy(), grads, rmt.numpy(), rvt.numpy()


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("fused_relu", [False, True], ids=["relu-op", "bn-relu"])
def test_block_equals_the_unfused_composition(backend, training, fused_relu):
    backend.activate()
    rng = np.random.default_rng(3)
    geometry = GEOMETRIES["3x3"]
    arrays = _case(rng, geometry, bias=True)
    grad_out = rng.standard_normal((2, 5, 7, 6)).astype(np.float32)
    ours = _run(arrays, geometry, "relu", grad_out, training=training)
    theirs = _unfused(arrays, geometry, "relu", grad_out, training, fused_relu)
    if training:  # the unfused bias gradient is the rounding error of a sum that is 0
        assert np.abs(theirs[1]["bias"]).max() < 1e-4
        theirs[1]["bias"] = np.zeros_like(theirs[1]["bias"])
    _assert_results(ours, theirs, f"{backend.param} fused vs unfused")


def test_block_on_arrays_updates_the_callers_running_statistics(backend):
    backend.activate()
    rng = np.random.default_rng(5)
    geometry = GEOMETRIES["dilation2"]
    x, wt, b, bw, bb, rm, rv = _case(rng, geometry, bias=False)
    *_, s, p, d, g = geometry
    rm_arr, rv_arr = rm.copy(), rv.copy()
    out = F.conv2d_batch_norm(
        x, wt, None, rm_arr, rv_arr, bw, bb, s, p, d, g, True, 0.1, 1e-5, activation="relu"
    )
    assert isinstance(out, np.ndarray) and out.dtype == np.float32
    y, _, trm, trv = _torch((x, wt, b, bw, bb, rm, rv), geometry, "relu", np.zeros(out.shape, np.float32))
    np.testing.assert_allclose(out, y, rtol=1e-5, atol=2e-5)
    np.testing.assert_allclose(rm_arr, trm, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(rv_arr, trv, rtol=1e-5, atol=1e-6)
    # Evaluation: the running statistics are read, not written.
    before = rm_arr.copy()
    out = F.conv2d_batch_norm(x, wt, None, rm_arr, rv_arr, bw, bb, s, p, d, g, False, activation="relu")
    y, *_ = _torch(
        (x, wt, b, bw, bb, rm_arr, rv_arr), geometry, "relu", np.zeros(out.shape, np.float32), False
    )
    np.testing.assert_allclose(out, y, rtol=1e-5, atol=2e-5)
    np.testing.assert_array_equal(rm_arr, before)


def test_block_under_autocast_matches_the_unfused_ops_under_autocast(backend):
    backend.activate()
    rng = np.random.default_rng(11)
    geometry = GEOMETRIES["3x3"]
    arrays = _case(rng, geometry, bias=False)
    grad_out = rng.standard_normal((2, 5, 7, 6)).astype(np.float32)
    with taifuse.amp.autocast():
        ours = _run(arrays, geometry, "relu", grad_out)
        theirs = _unfused(arrays, geometry, "relu", grad_out, True, fused_relu=False)
    assert ours[0].dtype == np.float16 and ours[2].dtype == np.float32  # float16 out, float32 statistics
    np.testing.assert_allclose(ours[0], theirs[0], rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(ours[2], theirs[2], rtol=1e-3, atol=1e-4)
    for name, g in ours[1].items():
        scale = max(1.0, float(np.abs(theirs[1][name]).max()))
        np.testing.assert_allclose(g, theirs[1][name], rtol=2e-2, atol=2e-2 * scale, err_msg=name)


def test_block_gradients_match_float64_finite_differences():
    taifuse.set_backend("numpy")
    rng = np.random.default_rng(2)
    geometry = (2, 2, 5, 4, 3, 3, 2, 1, 1, 1)
    x, wt, b, bw, bb, _rm, _rv = _case(rng, geometry, bias=True, dtype=np.float64)
    *_, s, p, d, g = geometry
    grad_out = rng.standard_normal((2, 3, 3, 2))

    def loss(x_, w_, b_, bw_, bb_):
        y = F.conv2d_batch_norm(x_, w_, b_, None, None, bw_, bb_, s, p, d, g, True, activation="relu")
        return float((y * grad_out).sum())

    params = [x, wt, b, bw, bb]
    ts = [taifuse.tensor(v, requires_grad=True) for v in params]
    y = F.conv2d_batch_norm(*ts[:3], None, None, ts[3], ts[4], s, p, d, g, True, activation="relu")
    (y * taifuse.tensor(grad_out)).sum().backward()
    h = 1e-6
    for i, (value, t) in enumerate(zip(params, ts)):
        numeric = np.empty_like(value)
        for j in np.ndindex(value.shape):
            plus, minus = [v.copy() for v in params], [v.copy() for v in params]
            plus[i][j] += h
            minus[i][j] -= h
            numeric[j] = (loss(*plus) - loss(*minus)) / (2 * h)
        np.testing.assert_allclose(t.grad.numpy(), numeric, rtol=1e-6, atol=1e-7, err_msg=f"argument {i}")


# ----------------------------------------------------------------------------- the modules


def _twins(stride=1, bias=False, momentum=0.1, track=True):
    taifuse.manual_seed(0)
    conv = nn.Conv2d(3, 4, 3, stride=stride, padding=1, bias=bias)
    bn = nn.BatchNorm2d(4, momentum=momentum, track_running_stats=track)
    fused = nn.ConvBnReLU2d(conv, bn, nn.ReLU())
    taifuse.manual_seed(0)
    plain = nn.Sequential(
        nn.Conv2d(3, 4, 3, stride=stride, padding=1, bias=bias),
        nn.BatchNorm2d(4, momentum=momentum, track_running_stats=track),
        nn.ReLU(),
    )
    return fused, plain


@pytest.mark.parametrize(
    "momentum, track", [(0.1, True), (None, True), (0.1, False)], ids=["momentum", "cumulative", "untracked"]
)
def test_conv_bn_relu_module_trains_as_its_sequential(backend, momentum, track):
    if backend.param not in ("numpy", "numba") and not backend.param.startswith("taichi-"):
        pytest.skip("runs on every backend")
    backend.activate()
    fused, plain = _twins(momentum=momentum, track=track)
    assert list(fused.state_dict()) == list(plain.state_dict())
    opts = [taifuse.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (fused, plain)]
    rng = np.random.default_rng(0)
    for step in range(4):
        x = taifuse.tensor(rng.standard_normal((3, 3, 6, 5)).astype(np.float32))
        target = rng.standard_normal((3, 4, 6, 5)).astype(np.float32)
        losses = []
        for model, opt in zip((fused, plain), opts):
            opt.zero_grad()
            loss = F.mse_loss(model(x), taifuse.tensor(target))
            loss.backward()
            opt.step()
            losses.append(float(loss.numpy()))
        np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5, err_msg=f"step {step}")
    for (name, a), (_, b) in zip(fused.state_dict().items(), plain.state_dict().items()):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-5, err_msg=name)
    fused.eval(), plain.eval()
    x = taifuse.tensor(rng.standard_normal((2, 3, 6, 5)).astype(np.float32))
    with taifuse.no_grad():
        np.testing.assert_allclose(fused(x).numpy(), plain(x).numpy(), rtol=1e-5, atol=1e-5)


def test_conv_bn_module_has_no_relu_and_loads_a_sequential_checkpoint():
    taifuse.set_backend("numpy")
    conv, bn = nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3)
    block = nn.ConvBn2d(conv, bn)
    plain = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3))
    block.load_state_dict(plain.state_dict())
    x = taifuse.tensor(np.random.default_rng(0).standard_normal((2, 2, 4, 4)).astype(np.float32))
    y = block(x).numpy()
    np.testing.assert_allclose(y, plain(x).numpy(), rtol=1e-5, atol=1e-5)
    assert y.min() < 0  # no ReLU
    np.testing.assert_allclose(block[1].running_mean.numpy(), plain[1].running_mean.numpy(), rtol=1e-6)


@pytest.mark.parametrize(
    "build, error, message",
    [
        (lambda: nn.ConvBnReLU2d(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(4)), ValueError, r"num_features \(4\)"),
        (
            lambda: nn.ConvBnReLU2d(nn.Conv2d(2, 3, 3, activation="relu"), nn.BatchNorm2d(3)),
            ValueError,
            "activation",
        ),
        (
            lambda: nn.ConvBnReLU2d(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3, activation="relu")),
            ValueError,
            "activation",
        ),
        (lambda: nn.ConvBnReLU2d(nn.Linear(2, 3), nn.BatchNorm2d(3)), TypeError, "conv should be"),
        (lambda: nn.ConvBnReLU2d(nn.Conv2d(2, 3, 3), nn.BatchNorm1d(3)), TypeError, "bn should be"),
        (
            lambda: nn.ConvBnReLU2d(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.GELU()),
            TypeError,
            "relu should be",
        ),
    ],
)
def test_fused_modules_refuse_blocks_they_cannot_fuse(build, error, message):
    taifuse.set_backend("numpy")
    with pytest.raises(error, match=message):
        build()


# ----------------------------------------------------------------------------- bad input


def _bad_calls():
    x, w = np.ones((2, 3, 5, 5), np.float32), np.ones((4, 3, 3, 3), np.float32)
    c4 = np.ones(4, np.float32)
    return [
        ("channels", {"input": np.ones((2, 2, 5, 5), np.float32)}, ValueError, r"input has 2 channels"),
        ("groups", {"groups": 2}, ValueError, r"groups=2 should divide the input's 3 channels"),
        ("kernel", {"input": np.ones((2, 3, 2, 2), np.float32), "padding": 0}, ValueError, r"larger than the padded"),
        ("3-d", {"input": np.ones((3, 5, 5), np.float32)}, ValueError, r"input should be 4-D"),
        ("one value", {"input": np.ones((1, 3, 3, 3), np.float32), "padding": 0}, ValueError,
         r"more than 1 value per channel"),
        ("bn_weight", {"bn_weight": np.ones(3, np.float32)}, ValueError, r"bn_weight should have shape \(4,\)"),
        ("activation", {"activation": "gelu"}, ValueError, r"activation should be one of"),
        ("momentum", {"momentum": float("nan")}, ValueError, r"momentum"),
    ], (x, w, c4)  # fmt: skip


@pytest.mark.parametrize("tensors", [False, True], ids=["arrays", "tensors"])
def test_bad_input_raises_before_anything_is_written(tensors):
    taifuse.set_backend("numpy")
    calls, (x, w, c4) = _bad_calls()
    for what, change, error, message in calls:
        rm, rv = np.zeros(4, np.float32), np.ones(4, np.float32)
        args = {"input": x, "weight": w, "running_mean": rm, "running_var": rv, "bn_weight": c4, "bn_bias": c4, "padding": 1,
                    "training": True}  # fmt: skip
        args.update(change)
        if tensors:
            args["input"] = taifuse.tensor(args["input"], requires_grad=True)
            rm_t, rv_t = taifuse.tensor(rm), taifuse.tensor(rv)
            args["running_mean"], args["running_var"] = rm_t, rv_t
        with pytest.raises(error, match=message):
            F.conv2d_batch_norm(**args)
        if tensors:
            rm, rv = rm_t.numpy(), rv_t.numpy()
        np.testing.assert_array_equal(rm, 0.0, err_msg=what)
        np.testing.assert_array_equal(rv, 1.0, err_msg=what)


def test_module_bad_input_counts_no_batch():
    taifuse.set_backend("numpy")
    block = nn.ConvBnReLU2d(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    for x in (
        np.ones((1, 3, 3, 3), np.float32),
        np.ones((2, 2, 5, 5), np.float32),
        np.ones((3, 5, 5), np.float32),
    ):
        with pytest.raises(ValueError):
            block(taifuse.tensor(x))
    assert int(block[1].num_batches_tracked.item()) == 0
    np.testing.assert_array_equal(block[1].running_mean.numpy(), 0.0)


# ----------------------------------------------------------------------------- the profiler's count


def test_profiler_counts_fewer_activation_bytes_for_the_fused_block():
    from taifuse import _costs
    from taifuse.profiler import profile

    taifuse.set_backend("numpy")
    rng = np.random.default_rng(0)
    geometry = (4, 8, 16, 16, 16, 3, 1, 1, 1, 1)
    arrays = _case(rng, geometry, bias=False)
    grad_out = rng.standard_normal((4, 16, 16, 16)).astype(np.float32)
    with profile() as fused:
        _run(arrays, geometry, "relu", grad_out)
    with profile() as unfused:
        _unfused(arrays, geometry, "relu", grad_out, True, fused_relu=False)

    def cost(prof, name):
        return next(e.cost for e in prof.events() if e.name == name)

    shape = _costs.ConvShape(4, 8, 16, 16, 16, 72, 256)
    assert cost(fused, "conv2d_batch_norm") == _costs.conv2d_batch_norm(shape)
    assert cost(fused, "conv2d_batch_norm_backward") == _costs.conv2d_batch_norm(shape, backward=True)
    assert cost(unfused, "conv2d") == _costs.conv2d(shape, bias=False)
    assert cost(unfused, "batch_norm") == _costs.batch_norm(4 * 16 * 256, 16)
    # The activation is 4 * 16 * 256 float32 = 64 KiB; the block moves 3 of them forward, the ops 6.
    act = 4 * 16 * 256 * 4
    block_ops = ("conv2d", "batch_norm", "relu")
    fwd = sum(cost(unfused, name).bytes_moved for name in block_ops)
    assert fwd - cost(fused, "conv2d_batch_norm").bytes_moved == 3 * act
    bwd = sum(cost(unfused, f"{name}_backward").bytes_moved for name in block_ops)
    assert bwd > cost(fused, "conv2d_batch_norm_backward").bytes_moved + 4 * act
    table = fused.key_averages().table()
    assert "MB moved" in table.splitlines()[0]
    row = next(line for line in table.splitlines() if line.startswith("conv2d_batch_norm "))
    assert f"{cost(fused, 'conv2d_batch_norm').bytes_moved / 1e6:.3f}" in row
    # The array path is recorded under the same name and cost as the Tensor path.
    x, wt, _b, bw, bb, rm, rv = arrays
    with profile() as arrays_prof:
        F.conv2d_batch_norm(x, wt, None, rm.copy(), rv.copy(), bw, bb, 1, 1, 1, 1, True, activation="relu")
    assert cost(arrays_prof, "conv2d_batch_norm") == cost(fused, "conv2d_batch_norm")


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64], ids=["f32", "f16", "f64"])
@pytest.mark.parametrize("geometry", GEOMETRIES.values(), ids=GEOMETRIES.keys())
def test_conv2d_stats_kernel_matches_the_reference(backend, geometry, dtype):
    """The kernel alone (the im2col epilogue's statistics, the direct path's extra pass, the
    device's stats pass), with an offset channel mean (the shifted sums' case), in every dtype."""
    from taifuse.backends import reference as R

    dtype = np.dtype(dtype)
    if dtype == np.float64 and not backend.supports_f64:
        pytest.skip(f"{REFUSED_BY_DESIGN}{backend.param} has no float64 (Metal has none)")
    module = backend.module()
    rng = np.random.default_rng(4)
    n, c, h, w, oc, k, s, p, d, g = geometry
    x = (rng.standard_normal((n, c, h, w)) + 3.0).astype(dtype)
    wt = (rng.standard_normal((oc, c // g, k, k)) / np.sqrt(c // g * k * k)).astype(dtype)
    b = (rng.standard_normal(oc) + 10.0).astype(dtype)
    oh, ow = (h + 2 * p - d * (k - 1) - 1) // s + 1, (w + 2 * p - d * (k - 1) - 1) // s + 1
    stats = np.float64 if dtype == np.float64 else np.float32
    y, mean, var = np.empty((n, oc, oh, ow), dtype), np.empty(oc, stats), np.empty(oc, stats)
    R.conv2d_stats(x, wt, b, (s, s), (p, p), (d, d), g, y, mean, var)
    ya, ma, va = module.empty(y.shape, dtype), module.empty((oc,), stats), module.empty((oc,), stats)
    args = [module.from_numpy(a) for a in (x, wt, b)]
    module.conv2d_stats(*args, (s, s), (p, p), (d, d), g, ya, ma, va)
    tol = {np.dtype(np.float16): 2e-3, np.dtype(np.float32): 2e-6, np.dtype(np.float64): 1e-12}[dtype]
    y_got = module.to_numpy(ya).astype(np.float64)
    np.testing.assert_allclose(y_got, y.astype(np.float64), rtol=tol, atol=tol * 10)
    # The statistics of the output as each backend stored it (the reference's of its own y).
    spread = float(np.abs(y.astype(np.float64) - 10.0).max())
    np.testing.assert_allclose(module.to_numpy(ma), mean, rtol=tol, atol=tol * spread)
    np.testing.assert_allclose(module.to_numpy(va), var, rtol=10 * tol, atol=tol * spread**2)
