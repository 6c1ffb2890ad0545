"""``F.conv2d`` / ``F.conv1d`` and ``nn.Conv2d`` on every backend, forward and backward.

Each case runs the Tensor op (forward, then the backward of ``sum(out * g)``) and compares the
output and the three gradients with the float64 reference kernels
(``backends/reference/conv.py``) run here on float64 copies, with the geometry worked out here
from PyTorch's rules (independently of ``taifuse/_conv_ops.py``). The bound is the tolerance
table's (``helpers.TOLERANCES``) with the scale of a dot product: the same op run on |inputs|
(as ``helpers.check_op`` scales ``linear``). Then: float64 finite differences of the reference
gradients, PyTorch parity (``F.conv2d``, ``conv1d``, ``nn.Conv2d``'s init and state_dict keys),
autocast's cast, and bad input raising before anything is written.
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

# (N, C, H, W, OC, (kh, kw), stride, padding, dilation, groups, activation): the odd sizes the
# issue lists, each once.
CASES = {
    "3x3": (2, 3, 7, 9, 4, (3, 3), 1, 1, 1, 1, None),
    "1x1_stride2": (2, 4, 9, 9, 6, (1, 1), 2, 0, 1, 2, "gelu"),
    "7x7_N1": (1, 2, 12, 11, 3, (7, 7), 1, 3, 1, 1, "relu"),
    "stride2_pad_not_dividing": (2, 3, 10, 11, 5, (3, 3), 2, 2, 1, 1, "silu"),
    "dilation2": (2, 2, 11, 10, 3, (3, 3), 1, 2, 2, 1, "gelu_tanh"),
    "depthwise": (2, 4, 8, 6, 4, (3, 3), 2, 1, 1, 4, "relu"),
    "depthwise_multiplier": (1, 3, 7, 8, 6, (3, 3), 1, 1, 1, 3, None),
    "same_even_kernel": (2, 3, 5, 7, 4, (2, 4), 1, "same", 1, 1, None),
    "rect_kernel_valid": (1, 5, 6, 9, 7, (2, 3), (1, 2), "valid", (2, 1), 1, "relu"),
}
# lavapipe runs the GPU kernels on the CPU, slowly: a few cases cover the shared-memory paths.
VULKAN_CASES = ("3x3", "depthwise", "stride2_pad_not_dividing")


def _pair(v):
    return tuple(v) if isinstance(v, tuple) else (v, v)


def _geometry(x_shape, w_shape, stride, padding, dilation):
    """(stride, padding before, dilation, output size) by PyTorch's rules."""
    stride, dilation = _pair(stride), _pair(dilation)
    k = w_shape[2:]
    span = [d * (kk - 1) + 1 for d, kk in zip(dilation, k)]
    if padding == "valid":
        before, total = (0, 0), (0, 0)
    elif padding == "same":
        total = tuple(s - 1 for s in span)
        before = tuple(t // 2 for t in total)
    else:
        before = _pair(padding)
        total = tuple(2 * p for p in before)
    out = tuple((size + t - s) // st + 1 for size, t, s, st in zip(x_shape[2:], total, span, stride))
    return stride, before, dilation, out


def _reference(x, w, b, g, stride, padding, dilation, groups, activation):
    """float64 (out, gx, gw, gb) and their scales, from the reference kernels."""
    st, pad, dil, (oh, ow) = _geometry(x.shape, w.shape, stride, padding, dilation)

    def run(x, w, b, g, act):
        dtype = x.dtype  # the activation reads pre as stored (rounded to the storage dtype), as the kernels
        x, w, g = (np.array(a, np.float64) for a in (x, w, g))
        b = None if b is None else np.array(b, np.float64)
        out = np.empty((x.shape[0], w.shape[0], oh, ow))
        pre = np.empty(out.shape, dtype)
        R.conv2d(x, w, b, st, pad, dil, groups, act, out, pre)
        gx, gw, gb = np.empty(x.shape), np.empty(w.shape), np.empty(w.shape[0])
        R.conv2d_backward(x, w, pre, g, st, pad, dil, groups, act, gx, gw, gb)
        return out, gx, gw, gb

    exact = run(x, w, b, g, activation)
    absb = None if b is None else np.abs(b)
    # Scales: the dot products on magnitudes (an activation's slope is at most ~1.13).
    scale = run(np.abs(x), np.abs(w), absb, np.abs(g), None)
    return exact, [np.maximum(1.0, 1.2 * s) for s in scale]


def _run(backend, x, w, b, g, stride, padding, dilation, groups, activation):
    X, W = taifuse.tensor(x, requires_grad=True), taifuse.tensor(w, requires_grad=True)
    B = None if b is None else taifuse.tensor(b, requires_grad=True)
    y = F.conv2d(X, W, B, stride, padding, dilation, groups, activation)
    (y * taifuse.tensor(g)).sum().backward()
    return y.numpy(), X.grad.numpy(), W.grad.numpy(), None if B is None else B.grad.numpy()


def _case_arrays(case, dtype, seed=0, bias=True):
    n, c, h, w, oc, k, stride, padding, dilation, groups, act = case
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, c, h, w)).astype(dtype)
    wt = (rng.standard_normal((oc, c // groups) + k) / np.sqrt(c // groups * k[0] * k[1])).astype(dtype)
    b = rng.standard_normal(oc).astype(dtype) if bias else None
    _, _, _, out = _geometry(x.shape, wt.shape, stride, padding, dilation)
    g = rng.standard_normal((n, oc) + out).astype(dtype)
    return x, wt, b, g, (stride, padding, dilation, groups, act)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("dtype", [F32, F16], ids=lambda d: d.name)
def test_conv2d_forward_backward_against_reference(backend, name, dtype):
    if backend.arch in ("vulkan", "metal") and name not in VULKAN_CASES:
        pytest.skip(SUBSET + "a few cases on the GPU proxy keep the suite's time down")
    if dtype == F16 and name not in ("3x3", "depthwise", "dilation2"):
        pytest.skip(SUBSET + "float16 storage: three cases")
    backend.activate()
    x, w, b, g, args = _case_arrays(CASES[name], dtype, bias=name != "depthwise_multiplier")
    got = _run(backend, x, w, b, g, *args)
    ref, scales = _reference(x, w, b, g, *args)
    tol = TOLERANCES[dtype]
    for what, gv, rv, sv in zip(("out", "grad input", "grad weight", "grad bias"), got, ref, scales):
        if gv is None:
            continue
        assert gv.dtype == dtype
        assert_close(gv, rv, sv, tol, f"conv2d {name} {what} on {backend.param} {dtype}")


def test_conv2d_float64_on_host_backends(backend):
    backend.activate()
    x, w, b, g, args = _case_arrays(CASES["stride2_pad_not_dividing"], F64)
    if not backend.supports_f64:
        with pytest.raises(TypeError, match="float64"):
            F.conv2d(x, w, b)
        return
    got = _run(backend, x, w, b, g, *args)
    ref, scales = _reference(x, w, b, g, *args)
    for gv, rv, sv in zip(got, ref, scales):
        assert_close(gv, rv, sv, TOLERANCES[F64], f"conv2d float64 on {backend.param}")


def test_conv2d_numpy_in_numpy_out(backend):
    backend.activate()
    x, w, b, g, args = _case_arrays(CASES["1x1_stride2"], F32)
    y = F.conv2d(x, w, b, *args)
    assert isinstance(y, np.ndarray) and y.dtype == np.float32
    ref, scales = _reference(x, w, b, g, *args)
    assert_close(y, ref[0], scales[0], TOLERANCES[F32], f"conv2d arrays on {backend.param}")


@pytest.mark.parametrize("name", ["3x3", "depthwise", "dilation2", "same_even_kernel"])
def test_reference_gradients_match_float64_finite_differences(name):
    """The reference backward against central differences of sum(out * g), in float64."""
    x, w, b, g, (stride, padding, dilation, groups, act) = _case_arrays(CASES[name], F64, seed=1)
    if act == "relu":
        act = "silu"  # smooth: finite differences of relu are wrong at its kink
    (_out, gx, gw, gb), _ = _reference(x, w, b, g, stride, padding, dilation, groups, act)

    def loss(x, w, b):
        (o, *_), _ = _reference(x, w, b, g, stride, padding, dilation, groups, act)
        return float((o * g).sum())

    rng = np.random.default_rng(2)
    eps = 1e-6
    for arr, grad, name_ in ((x, gx, "input"), (w, gw, "weight"), (b, gb, "bias")):
        for _ in range(6):
            i = tuple(rng.integers(0, s) for s in arr.shape)
            keep = arr[i]
            arr[i] = keep + eps
            up = loss(x, w, b)
            arr[i] = keep - eps
            down = loss(x, w, b)
            arr[i] = keep
            fd = (up - down) / (2 * eps)
            assert abs(fd - grad[i]) <= 1e-6 * max(1.0, abs(fd)), (
                f"{name} d/d{name_}{i}: fd {fd}, backward {grad[i]}"
            )


@pytest.mark.parametrize("name", ["3x3", "depthwise_multiplier", "same_even_kernel", "rect_kernel_valid"])
def test_conv2d_matches_pytorch(name):
    """taifuse (numba where installed, else numpy) against PyTorch in float64 on the same float32 values."""
    taifuse.set_backend("numba" if "numba" in taifuse.available_backends() else "numpy")
    x, w, b, g, (stride, padding, dilation, groups, act) = _case_arrays(CASES[name], F32, seed=3)
    got = _run(None, x, w, b, g, stride, padding, dilation, groups, act)
    tx, tw, tb = (torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in (x, w, b))
    y = TF.conv2d(tx, tw, tb, stride, padding, dilation, groups)
    y = {None: lambda v: v, "relu": torch.relu, "silu": TF.silu}[act](y)
    y.backward(torch.tensor(g, dtype=torch.float64))
    _, scales = _reference(x, w, b, g, stride, padding, dilation, groups, act)
    for what, gv, tv, sv in zip(("out", "gx", "gw", "gb"), got, (y, tx.grad, tw.grad, tb.grad), scales):
        assert_close(gv, tv.detach().numpy(), sv, TOLERANCES[F32], f"conv2d {name} {what} vs PyTorch")


def test_conv1d_matches_pytorch(backend):
    backend.activate()
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 4, 13)).astype(np.float32)
    w = rng.standard_normal((6, 2, 3)).astype(np.float32)
    b = rng.standard_normal(6).astype(np.float32)
    for kwargs in ({"stride": 2, "padding": 1, "dilation": 2, "groups": 2}, {"padding": "same", "groups": 1}):
        if kwargs["groups"] == 1:
            w1 = rng.standard_normal((6, 4, 3)).astype(np.float32)
        else:
            w1 = w
        X, W, B = (taifuse.tensor(a, requires_grad=True) for a in (x, w1, b))
        y = F.conv1d(X, W, B, **kwargs)
        y.sum().backward()
        tx, tw, tb = (torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in (x, w1, b))
        ty = TF.conv1d(tx, tw, tb, **kwargs)
        ty.sum().backward()
        tol = TOLERANCES[F32]
        for got, want in (
            (y.numpy(), ty),
            (X.grad.numpy(), tx.grad),
            (W.grad.numpy(), tw.grad),
            (B.grad.numpy(), tb.grad),
        ):
            assert_close(got, want.detach().numpy(), 40.0, tol, f"conv1d {kwargs} on {backend.param}")
        assert isinstance(F.conv1d(x, w1, b, **kwargs), np.ndarray)


def test_conv2d_layer_init_and_state_dict_match_pytorch():
    taifuse.set_backend("numpy")
    taifuse.manual_seed(0)
    conv = nn.Conv2d(6, 8, (3, 5), stride=2, padding=1, groups=2)
    ref = torch.nn.Conv2d(6, 8, (3, 5), stride=2, padding=1, groups=2)
    assert list(conv.state_dict()) == list(ref.state_dict()) == ["weight", "bias"]
    assert conv.weight.shape == tuple(ref.weight.shape)
    bound = 1.0 / np.sqrt(3 * 3 * 5)  # PyTorch's: 1 / sqrt(fan_in), fan_in = in / groups * kh * kw
    assert np.abs(conv.weight.numpy()).max() <= bound and np.abs(conv.weight.numpy()).max() > 0.9 * bound
    assert np.abs(conv.bias.numpy()).max() <= bound
    ref.load_state_dict({k: torch.tensor(v.numpy()) for k, v in conv.state_dict().items()})
    x = np.random.default_rng(5).standard_normal((2, 6, 9, 10)).astype(np.float32)
    got = conv(taifuse.tensor(x)).numpy()
    want = ref(torch.tensor(x)).detach().numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert nn.Conv2d(2, 2, 3, bias=False).bias is None


def test_conv2d_under_autocast_runs_in_float16(backend):
    """conv2d is on PyTorch's CUDA autocast lower-precision list; the pools are not cast."""
    backend.activate()
    from taifuse.amp import autocast

    rng = np.random.default_rng(6)
    x = taifuse.tensor(rng.standard_normal((1, 2, 6, 6)).astype(np.float32), requires_grad=True)
    w = taifuse.tensor(rng.standard_normal((3, 2, 3, 3)).astype(np.float32), requires_grad=True)
    with autocast():
        y = F.conv2d(x, w, padding=1)
        p = F.max_pool2d(x, 2)
    assert y.dtype == np.float16 and p.dtype == np.float32
    y.float().sum().backward()
    assert x.grad.dtype == np.float32 and w.grad.dtype == np.float32
    want = TF.conv2d(torch.tensor(x.numpy()), torch.tensor(w.numpy()), padding=1).numpy()
    np.testing.assert_allclose(y.numpy().astype(np.float32), want, rtol=2e-2, atol=2e-2)


# ----------------------------------------------------------------------------- bad input


def _bad_cases():
    x = np.zeros((1, 4, 5, 5), np.float32)
    w = np.zeros((6, 2, 3, 3), np.float32)
    return [
        ("channels", (x, np.zeros((6, 3, 3, 3), np.float32)), {}, ValueError, "input has 4 channels"),
        (
            "groups_not_dividing",
            (x, np.zeros((6, 4, 3, 3), np.float32)),
            {"groups": 3},
            ValueError,
            "groups=3",
        ),
        ("groups_out", (x, np.zeros((5, 2, 3, 3), np.float32)), {"groups": 2}, ValueError, "groups=2"),
        (
            "kernel_too_large",
            (x, np.zeros((6, 4, 7, 7), np.float32)),
            {"padding": 0},
            ValueError,
            "larger than",
        ),
        ("input_3d", (x[0], w), {"groups": 2}, ValueError, "input should be 4-D"),
        ("weight_3d", (x, w[0]), {}, ValueError, "weight should be 4-D"),
        ("bias_shape", (x, w, np.zeros(5, np.float32)), {"groups": 2}, ValueError, "bias should have shape"),
        ("stride_zero", (x, w), {"groups": 2, "stride": 0}, ValueError, "stride"),
        ("padding_word", (x, w), {"groups": 2, "padding": "full"}, ValueError, "padding"),
        ("same_strided", (x, w), {"groups": 2, "padding": "same", "stride": 2}, ValueError, "padding='same'"),
        ("groups_float", (x, w), {"groups": 2.0}, TypeError, "groups"),
        ("activation", (x, w), {"groups": 2, "activation": "tanh"}, ValueError, "activation"),
        ("dtype", (x, w.astype(np.float16)), {"groups": 2}, TypeError, "weight"),
    ]


@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_conv2d_bad_input_raises_naming_the_argument(backend, case):
    backend.activate()
    _, args, kwargs, exc, match = case
    with pytest.raises(exc, match=match):
        F.conv2d(*args, **kwargs)
    tensors = [taifuse.tensor(a, requires_grad=True) for a in args]
    with pytest.raises(exc, match=match):
        F.conv2d(*tensors, **kwargs)
    assert all(t.grad is None for t in tensors)


def test_conv2d_layer_bad_arguments():
    for kwargs, match in (
        (
            {"in_channels": 4, "out_channels": 6, "kernel_size": 3, "groups": 4},
            "groups=4 should divide out_channels",
        ),
        ({"in_channels": 4, "out_channels": 6, "kernel_size": 0}, "kernel_size"),
        ({"in_channels": 0, "out_channels": 6, "kernel_size": 3}, "in_channels"),
        ({"in_channels": 4, "out_channels": 6, "kernel_size": 3, "padding_mode": "reflect"}, "padding_mode"),
        ({"in_channels": 4, "out_channels": 6, "kernel_size": 3, "padding": "same", "stride": 2}, "stride 1"),
    ):
        with pytest.raises(ValueError, match=match):
            nn.Conv2d(**kwargs)


def test_conv2d_empty_batch_gives_empty_output_and_zero_gradients(backend):
    """N = 0, as PyTorch: an empty output, zero weight and bias gradients."""
    backend.activate()
    x = taifuse.tensor(np.zeros((0, 2, 5, 4), np.float32), requires_grad=True)
    w = taifuse.tensor(np.ones((3, 2, 3, 3), np.float32), requires_grad=True)
    b = taifuse.tensor(np.ones(3, np.float32), requires_grad=True)
    y = F.conv2d(x, w, b, padding=1)
    assert y.shape == (0, 3, 5, 4)
    y.sum().backward()
    assert x.grad.shape == (0, 2, 5, 4)
    np.testing.assert_array_equal(w.grad.numpy(), np.zeros((3, 2, 3, 3), np.float32))
    np.testing.assert_array_equal(b.grad.numpy(), np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="non-empty height and width"):
        F.conv2d(np.zeros((1, 2, 0, 4), np.float32), np.ones((3, 2, 1, 1), np.float32), padding=1)


def test_conv2d_input_without_grad_gets_no_input_gradient(backend, monkeypatch):
    """As PyTorch, an input that does not require grad (a network's first layer reads data) gets no
    gradient: the backward kernel is passed ``grad_x=None`` (numba skips the columns' gradient and
    col2im), and the weight's and bias's gradients are those of the full backward."""
    backend.activate()
    x, w, b, g, args = _case_arrays(CASES["stride2_pad_not_dividing"], F32)
    be = taifuse.backends.active()
    passed = []
    kernel = be.conv2d_backward

    def spy(*a):
        passed.append(a[9])  # grad_x
        return kernel(*a)

    monkeypatch.setattr(be, "conv2d_backward", spy)
    X, W, B = taifuse.tensor(x), taifuse.tensor(w, requires_grad=True), taifuse.tensor(b, requires_grad=True)
    y = F.conv2d(X, W, B, *args)
    (y * taifuse.tensor(g)).sum().backward()
    assert passed == [None] and X.grad is None
    ref, scales = _reference(x, w, b, g, *args)
    for what, got, i in (("grad weight", W.grad, 2), ("grad bias", B.grad, 3)):
        assert_close(got.numpy(), ref[i], scales[i], TOLERANCES[F32], f"conv2d {what} on {backend.param}")


@pytest.mark.parametrize("step", [1, 2], ids=["one-image-steps", "two-image-steps"])
@pytest.mark.parametrize("name", list(CASES))
def test_numba_backward_in_several_parts_matches_the_reference(monkeypatch, name, step):
    """numba's backward shares the images out in parts, each summing its own grad_w (NOTE
    [ Convolution on the host: im2col in blocks ]): five images in two parts (3 + 2 in steps of
    one image, 4 + 1 in steps of two, the last step short) give the reference's results, every
    geometry of CASES (1x1 and 7x7 kernels, stride 2, dilation 2, groups, H != W)."""
    if "numba" not in taifuse.available_backends():
        pytest.skip("numba is not installed")
    from taifuse.backends.numba import conv as numba_conv

    case = (5,) + CASES[name][1:]
    x, w, b, g, args = _case_arrays(case, F32, seed=4, bias=name != "depthwise_multiplier")
    monkeypatch.setattr(numba_conv, "BACKWARD_PARTS", 2)
    monkeypatch.setattr(numba_conv, "ITEM_MIN_COLUMNS", step * g.shape[2] * g.shape[3])
    with taifuse.use_backend("numba"):
        got = _run(None, x, w, b, g, *args)
    ref, scales = _reference(x, w, b, g, *args)
    for what, gv, rv, sv in zip(("out", "grad input", "grad weight", "grad bias"), got, ref, scales):
        if gv is not None:
            assert_close(gv, rv, sv, TOLERANCES[F32], f"conv2d {name} {what} on numba, two parts")
