"""taifuse.amp.GradScaler: the fused unscale_check kernel on every backend against the NumPy
reference, and the scaler step by step against ``torch.amp.GradScaler("cpu")`` (scale trajectory,
growth tracker, parameters) through injected inf and NaN gradients; skipped steps change nothing;
the once-per-iteration rules; clipping after ``unscale_``; state_dict; bad arguments; disabled."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

import taifuse
import taifuse.functional as F
from taifuse import optim
from taifuse.amp import GradScaler
from taifuse.backends.reference import optim as R
from taifuse.nn import Parameter

HAS_TORCH = importlib.util.find_spec("torch") is not None
needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")

# unscale_check multiplies by a float32 once, like the reference: the same product, rounded once
# to the storage dtype. One ulp of room for a device's conversion to float16.
KERNEL_RTOL = {np.dtype(np.float32): 1.2e-7, np.dtype(np.float16): 1e-3, np.dtype(np.float64): 0.0}
# Parameters against PyTorch: float32 forward/backward products in another order (BLAS), 12 steps.
PARAM_RTOL, PARAM_ATOL = 2e-5, 2e-6


# ----------------------------------------------------------------------------- the kernel


def _kernel_dtypes(backend) -> list[np.dtype]:
    dtypes = [np.dtype(np.float32), np.dtype(np.float16)]
    return dtypes + ([np.dtype(np.float64)] if backend.supports_f64 else [])


def _check_against_reference(be, arrays: list[np.ndarray], inv_scale: float, what: str) -> None:
    ref = [a.copy() for a in arrays]
    ref_found = R.unscale_check(ref, inv_scale)
    dev = [be.from_numpy(a.copy()) for a in arrays]
    found = be.unscale_check(dev, inv_scale)
    assert found == ref_found, f"{what}: found_inf {found}, reference {ref_found}"
    for k, (d, r) in enumerate(zip(dev, ref)):
        got = be.to_numpy(d)
        assert got.dtype == r.dtype
        np.testing.assert_allclose(got, r, rtol=KERNEL_RTOL[r.dtype], atol=0, err_msg=f"{what}: array {k}")


def test_unscale_check_kernel_against_reference(backend):
    be = backend.module()
    backend.activate()
    rng = np.random.default_rng(0)
    for dtype in _kernel_dtypes(backend):
        # Large enough for Numba's parallel path, an odd tail, a tiny array and a single element.
        big = (rng.standard_normal(100_003) * 3e3).astype(dtype)
        small = np.array([1.0, -2.5, 3e4, -0.0, 6e-5], dtype)
        one = np.array([7.0], dtype)
        for inv_scale in (2.0**-16, 1.0, float(np.float32(1 / 3)), 0.7):
            _check_against_reference(be, [big, small, one], inv_scale, f"{dtype.name} inv_scale={inv_scale}")
        for bad in (np.nan, np.inf, -np.inf):
            for where in (0, 50_001, big.size - 1):  # first, middle, last element
                x = big.copy()
                x[where] = bad
                what = f"{dtype.name} {bad} at {where}"
                _check_against_reference(be, [x], 2.0**-10, what)
                _check_against_reference(be, [small, x], 2.0**-10, what + " (second array)")
                # the flag of one call does not leak into the next
                _check_against_reference(be, [small, one], 2.0**-10, what + " (then clean)")
            y = small.copy()
            y[-1] = bad
            _check_against_reference(be, [one, y], 0.5, f"{dtype.name} {bad} last of a small array")
        assert be.unscale_check([], 0.5) is False


def test_unscale_check_reference_semantics():
    # Specified, not compared: every element is scaled (a non-finite one too), in float32 for
    # float16 storage, with inv_scale rounded to float32 first.
    x = np.array([2.0, np.inf, np.nan, -4.0], np.float32)
    assert R.unscale_check([x], 0.25) is True
    np.testing.assert_array_equal(x, np.array([0.5, np.inf, np.nan, -1.0], np.float32))
    h = np.array([65504.0, 1.0], np.float16)
    assert R.unscale_check([h], 1 / 3) is False
    expected = (np.array([65504.0, 1.0], np.float32) * np.float32(1 / 3)).astype(np.float16)
    np.testing.assert_array_equal(h, expected)
    d = np.array([1.0], np.float64)
    R.unscale_check([d], 0.1)
    assert d[0] == np.float64(np.float32(0.1))


# ----------------------------------------------------------------------------- a small model in both


def _init_values(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "w1": (rng.standard_normal((8, 4)) * 0.5).astype(np.float32),
        "b1": (rng.standard_normal(8) * 0.1).astype(np.float32),
        "w2": (rng.standard_normal((3, 8)) * 0.5).astype(np.float32),
        "b2": (rng.standard_normal(3) * 0.1).astype(np.float32),
    }


def _data(step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(100 + step)
    return rng.standard_normal((16, 4)).astype(np.float32), rng.standard_normal((16, 3)).astype(np.float32)


def _ours_loss(params: dict, x: np.ndarray, y: np.ndarray):
    h = F.relu(F.linear(taifuse.tensor(x), params["w1"], params["b1"]))
    return F.mse_loss(F.linear(h, params["w2"], params["b2"]), taifuse.tensor(y))


def _torch_loss(params: dict, x: np.ndarray, y: np.ndarray):
    import torch
    import torch.nn.functional as TF

    h = TF.relu(TF.linear(torch.from_numpy(x), params["w1"], params["b1"]))
    return TF.mse_loss(TF.linear(h, params["w2"], params["b2"]), torch.from_numpy(y))


OPTIMIZERS = {
    "SGD": ("SGD", {"lr": 0.05, "momentum": 0.9}),
    "AdamW": ("AdamW", {"lr": 0.01, "weight_decay": 0.1}),
}

# What goes wrong at which step: NaN in the input (NaN loss and gradients), an infinity written
# into a gradient in place, a gradient assigned by hand with -inf (it lies outside the flat buffer).
INJECT = {3: "nan_input", 7: "inf_in_place", 8: "neg_inf_assigned"}


def _inject(kind: str, grad_of, set_grad, x: np.ndarray) -> None:
    if kind == "inf_in_place":
        g = grad_of("w2")
        g.reshape(-1)[5] = np.inf
        set_grad("w2", g, in_place=True)
    elif kind == "neg_inf_assigned":
        g = grad_of("b1")
        g[-1] = -np.inf
        set_grad("b1", g, in_place=False)


@needs_torch
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("clip", [False, True], ids=["step_unscales", "unscale_clip_step"])
def test_matches_torch_step_by_step(grad_backend, opt_name, clip):
    import torch

    cls_name, kwargs = OPTIMIZERS[opt_name]
    init = _init_values()
    ours = {k: Parameter(v.copy()) for k, v in init.items()}
    theirs = {k: torch.tensor(v.copy(), requires_grad=True) for k, v in init.items()}
    opt = getattr(optim, cls_name)(list(ours.values()), **kwargs)
    topt = getattr(torch.optim, cls_name)(list(theirs.values()), **kwargs)
    scaler = GradScaler(growth_interval=3)
    tscaler = torch.amp.GradScaler("cpu", growth_interval=3)
    scales = []
    for step in range(12):
        x, y = _data(step)
        if INJECT.get(step) == "nan_input":
            x[2, 1] = np.nan
        opt.zero_grad()
        topt.zero_grad()
        scaler.scale(_ours_loss(ours, x, y)).backward()
        tscaler.scale(_torch_loss(theirs, x, y)).backward()
        if step in INJECT:
            kind = INJECT[step]

            def grad_of(name):
                return ours[name].grad.numpy().copy()

            def set_grad(name, g, in_place):
                if in_place:
                    ours[name].grad.copy_(g)
                else:
                    ours[name].grad = taifuse.tensor(g)
                theirs[name].grad.copy_(torch.from_numpy(g))

            _inject(kind, grad_of, set_grad, x)
        if clip:
            scaler.unscale_(opt)
            tscaler.unscale_(topt)
            for name in ours if step not in INJECT else ():  # the unscaled gradients, as torch's
                np.testing.assert_allclose(
                    ours[name].grad.numpy(), theirs[name].grad.numpy(), rtol=PARAM_RTOL, atol=PARAM_ATOL,
                    err_msg=f"step {step}: unscaled gradient of {name}",
                )  # fmt: skip
            norm = optim.clip_grad_norm_(list(ours.values()), max_norm=0.5)
            tnorm = torch.nn.utils.clip_grad_norm_(list(theirs.values()), max_norm=0.5)
            if np.isfinite(tnorm.item()):
                assert norm.item() == pytest.approx(tnorm.item(), rel=PARAM_RTOL)
            else:
                assert not np.isfinite(norm.item())
        ret = scaler.step(opt)
        tscaler.step(topt)
        assert ret is None
        scaler.update()
        tscaler.update()
        assert scaler.get_scale() == tscaler.get_scale(), f"step {step}"
        assert scaler._get_growth_tracker() == tscaler._get_growth_tracker(), f"step {step}"
        scales.append(scaler.get_scale())
        for name, p in ours.items():
            np.testing.assert_allclose(
                p.numpy(), theirs[name].detach().numpy(), rtol=PARAM_RTOL, atol=PARAM_ATOL,
                err_msg=f"step {step}: parameter {name}",
            )  # fmt: skip
    # The sequence did grow and back off: 3 finite steps grow, each injected step halves.
    s = 2.0**16
    assert scales[:4] == [s, s, s * 2, s]
    assert scales[7:9] == [s, s / 2]
    assert scales[-1] == s


def _state_equal(a: dict, b: dict) -> bool:
    if set(a["state"]) != set(b["state"]):
        return False
    for k in a["state"]:
        for name, va in a["state"][k].items():
            vb = b["state"][k][name]
            if isinstance(va, np.ndarray):
                if va.dtype != vb.dtype or va.tobytes() != vb.tobytes():
                    return False
            elif va != vb:
                return False
    return a["param_groups"] == b["param_groups"]


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_skipped_step_changes_nothing(grad_backend, opt_name, bad):
    cls_name, kwargs = OPTIMIZERS[opt_name]
    params = {k: Parameter(v.copy()) for k, v in _init_values().items()}
    opt = getattr(optim, cls_name)(list(params.values()), **kwargs)
    scaler = GradScaler(init_scale=2.0**8)
    for step in range(3):
        opt.zero_grad()
        scaler.scale(_ours_loss(params, *_data(step))).backward()
        scaler.step(opt)
        scaler.update()
    before = {k: p.numpy().copy() for k, p in params.items()}
    state = opt.state_dict()
    opt.zero_grad()
    scaler.scale(_ours_loss(params, *_data(3))).backward()
    g = params["w1"].grad.numpy().copy()
    g[-1, -1] = bad  # the very last element of a parameter's gradient
    params["w1"].grad.copy_(g)
    assert scaler.step(opt) is None
    for k, p in params.items():
        assert p.numpy().tobytes() == before[k].tobytes(), f"parameter {k} changed on a skipped step"
    assert _state_equal(opt.state_dict(), state), "optimizer state changed on a skipped step"
    scaler.update()
    assert scaler.get_scale() == 2.0**7
    assert scaler._get_growth_tracker() == 0


def test_stale_slot_of_a_parameter_without_gradient_is_not_checked():
    # A NaN left in the flat gradient buffer by a skipped step, in the slot of a parameter that
    # gets no gradient next time, must not skip the next step (it is not a gradient).
    taifuse.set_backend("numpy")
    a, b = Parameter(np.ones(4, np.float32)), Parameter(np.ones(3, np.float32))
    opt = optim.SGD([a, b], lr=0.1)
    scaler = GradScaler(init_scale=4.0)
    scaler.scale((a * 2.0).sum() + (b * float("nan")).sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0
    opt.zero_grad()
    scaler.scale((a * 2.0).sum()).backward()
    assert b.grad is None
    scaler.step(opt)
    scaler.update()
    np.testing.assert_allclose(a.numpy(), np.full(4, 0.8, np.float32), rtol=1e-6)
    np.testing.assert_array_equal(b.numpy(), np.ones(3, np.float32))


@needs_torch
def test_two_optimizers_one_skips(grad_backend):
    # An infinity in one optimizer's gradients skips that optimizer's step only; update() backs off.
    import torch

    init = _init_values()
    ours = {k: Parameter(v.copy()) for k, v in init.items()}
    theirs = {k: torch.tensor(v.copy(), requires_grad=True) for k, v in init.items()}
    opts = [optim.SGD([ours["w1"], ours["b1"]], lr=0.1), optim.Adam([ours["w2"], ours["b2"]], lr=0.01)]
    topts = [torch.optim.SGD([theirs["w1"], theirs["b1"]], lr=0.1), torch.optim.Adam([theirs["w2"], theirs["b2"]], lr=0.01)]  # fmt: skip
    scaler, tscaler = GradScaler(), torch.amp.GradScaler("cpu")
    x, y = _data(0)
    scaler.scale(_ours_loss(ours, x, y)).backward()
    tscaler.scale(_torch_loss(theirs, x, y)).backward()
    g = ours["b2"].grad.numpy().copy()
    g[0] = np.inf
    ours["b2"].grad.copy_(g)
    theirs["b2"].grad.copy_(torch.from_numpy(g))
    for o, t in zip(opts, topts):
        scaler.step(o)
        tscaler.step(t)
    scaler.update()
    tscaler.update()
    assert scaler.get_scale() == tscaler.get_scale() == 2.0**15
    for name, p in ours.items():
        np.testing.assert_allclose(p.numpy(), theirs[name].detach().numpy(), rtol=PARAM_RTOL, atol=PARAM_ATOL)
    np.testing.assert_array_equal(ours["w2"].numpy(), init["w2"])  # skipped
    assert not np.array_equal(ours["w1"].numpy(), init["w1"])  # stepped


# ----------------------------------------------------------------------------- the iteration's rules


def _one_param_setup(scale: float = 8.0):
    taifuse.set_backend("numpy")
    w = Parameter(np.ones(3, np.float32))
    opt = optim.SGD([w], lr=0.5)
    scaler = GradScaler(init_scale=scale)
    return w, opt, scaler


def test_unscale_twice_raises_and_changes_nothing():
    w, opt, scaler = _one_param_setup()
    scaler.scale((w * 3.0).sum()).backward()
    scaler.unscale_(opt)
    np.testing.assert_array_equal(w.grad.numpy(), np.full(3, 3.0, np.float32))
    with pytest.raises(RuntimeError, match="unscale_\\(\\) has already been called"):
        scaler.unscale_(opt)
    np.testing.assert_array_equal(w.grad.numpy(), np.full(3, 3.0, np.float32))  # not unscaled twice
    scaler.step(opt)
    np.testing.assert_allclose(w.numpy(), np.full(3, -0.5, np.float32))
    with pytest.raises(RuntimeError, match="after step"):
        scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="step\\(\\) has already been called"):
        scaler.step(opt)
    scaler.update()
    # a new iteration may unscale again
    opt.zero_grad()
    scaler.scale((w * 1.0).sum()).backward()
    scaler.unscale_(opt)


def test_out_of_order_calls_raise():
    w, opt, scaler = _one_param_setup()
    for call in (lambda: scaler.unscale_(opt), lambda: scaler.step(opt), lambda: scaler.update()):
        with pytest.raises(RuntimeError, match="scaler.scale"):
            call()
    scaler.scale((w * 1.0).sum())
    with pytest.raises(RuntimeError, match="No inf checks were recorded prior to update"):
        scaler.update()
    with pytest.raises(RuntimeError, match="No inf checks were recorded for this optimizer"):
        scaler.step(opt)  # no gradients at all
    with pytest.raises(RuntimeError, match="Closure"):
        scaler.step(opt, closure=lambda: 0.0)


def test_float16_gradients_refused_as_torch():
    taifuse.set_backend("numpy")
    w = Parameter(np.ones(3, np.float16))
    opt = optim.SGD([w], lr=0.5)
    scaler = GradScaler(init_scale=8.0)
    scaler.scale((w * 1.0).sum()).backward()
    with pytest.raises(ValueError, match="FP16"):
        scaler.unscale_(opt)
    np.testing.assert_array_equal(w.grad.numpy(), np.full(3, 8.0, np.float16))


def test_scale_outputs_structure():
    taifuse.set_backend("numpy")
    scaler = GradScaler(init_scale=4.0)
    a, b = taifuse.tensor([1.0, 2.0]), taifuse.tensor([3.0])
    out = scaler.scale([a, (b, [a])])
    assert isinstance(out, list) and isinstance(out[1], tuple) and isinstance(out[1][1], list)
    np.testing.assert_array_equal(out[0].numpy(), [4.0, 8.0])
    np.testing.assert_array_equal(out[1][0].numpy(), [12.0])
    h = taifuse.tensor(np.array([1.0], np.float16))
    assert scaler.scale(h).dtype == np.float16
    assert [x.numpy()[0] for x in scaler.scale(iter([b]))] == [12.0]
    for bad in (3.0, np.ones(2, np.float32), [a, "x"]):
        with pytest.raises(ValueError, match="outputs must be a Tensor"):
            scaler.scale(bad)


def test_update_with_new_scale():
    w, opt, scaler = _one_param_setup()
    scaler.scale((w * 1.0).sum()).backward()
    scaler.step(opt)
    scaler.update(3.0)
    assert scaler.get_scale() == 3.0
    scaler.update(taifuse.tensor(5.0))
    assert scaler.get_scale() == 5.0
    for bad in (0.0, -1.0, float("inf"), "2"):
        with pytest.raises(ValueError, match="new_scale"):
            scaler.update(bad)
    with pytest.raises(ValueError, match="new_scale"):
        scaler.update(taifuse.tensor([1.0, 2.0]))
    assert scaler.get_scale() == 5.0


def test_growth_stops_at_float32_max():
    w, opt, scaler = _one_param_setup(scale=2.0**127)
    scaler.set_growth_interval(1)
    scaler.scale((w * 0.0).sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0**127  # 2**128 is inf in float32: kept
    assert scaler._get_growth_tracker() == 0


# ----------------------------------------------------------------------------- state, settings, arguments


@needs_torch
def test_state_dict_round_trip_and_torch_keys():
    import torch

    w, opt, scaler = _one_param_setup()
    scaler.set_growth_interval(3)
    for step in range(4):
        opt.zero_grad()
        scaler.scale((w * (float("inf") if step == 1 else 1.0)).sum()).backward()
        scaler.step(opt)
        scaler.update()
    sd = scaler.state_dict()
    tsd = torch.amp.GradScaler("cpu").state_dict()
    assert set(sd) == set(tsd)
    assert sd == {
        "scale": 4.0,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 3,
        "_growth_tracker": 2,
    }
    other = GradScaler()
    other.load_state_dict(sd)  # before its first scale(): the scale starts from the loaded one
    assert other.state_dict() == sd

    def finite_iteration(s):
        p = Parameter(np.ones(3, np.float32))
        o = optim.SGD([p], lr=0.0)
        s.scale((p * 1.0).sum()).backward()
        s.step(o)
        s.update()

    finite_iteration(scaler)
    finite_iteration(other)
    assert scaler.state_dict() == other.state_dict()
    assert scaler.get_scale() == 8.0  # the third finite step in a row grew it
    # torch loads ours and we load torch's
    t = torch.amp.GradScaler("cpu")
    t.load_state_dict(sd)
    assert t.state_dict() == sd
    mine = GradScaler()
    mine.load_state_dict(t.state_dict())
    assert mine.state_dict() == sd
    with pytest.raises(RuntimeError, match="empty"):
        mine.load_state_dict({})
    with pytest.raises(ValueError, match="_growth_tracker"):
        mine.load_state_dict({k: v for k, v in sd.items() if k != "_growth_tracker"})
    with pytest.raises(ValueError, match="growth_factor"):
        mine.load_state_dict({**sd, "growth_factor": 0.5})
    assert mine.state_dict() == sd  # nothing changed


def test_settings_accessors():
    scaler = GradScaler(init_scale=16.0, growth_factor=3.0, backoff_factor=0.25, growth_interval=5)
    assert scaler.is_enabled()
    assert scaler.get_scale() == 16.0
    assert (scaler.get_growth_factor(), scaler.get_backoff_factor(), scaler.get_growth_interval()) == (
        3.0,
        0.25,
        5,
    )
    scaler.set_growth_factor(4.0)
    scaler.set_backoff_factor(0.125)
    scaler.set_growth_interval(7)
    assert (scaler.get_growth_factor(), scaler.get_backoff_factor(), scaler.get_growth_interval()) == (
        4.0,
        0.125,
        7,
    )
    with pytest.raises(ValueError, match="growth_factor"):
        scaler.set_growth_factor(1.0)
    with pytest.raises(ValueError, match="backoff_factor"):
        scaler.set_backoff_factor(1.0)
    with pytest.raises(ValueError, match="growth_interval"):
        scaler.set_growth_interval(0)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"init_scale": 0.0}, "init_scale"),
        ({"init_scale": -1.0}, "init_scale"),
        ({"init_scale": float("inf")}, "init_scale"),
        ({"init_scale": 1e39}, "init_scale"),  # infinite in float32
        ({"init_scale": "1"}, "init_scale"),
        ({"growth_factor": 1.0}, "growth_factor"),
        ({"growth_factor": 0.5}, "growth_factor"),
        ({"growth_factor": float("nan")}, "growth_factor"),
        ({"backoff_factor": 1.0}, "backoff_factor"),
        ({"backoff_factor": 2.0}, "backoff_factor"),
        ({"backoff_factor": 0.0}, "backoff_factor"),
        ({"growth_interval": 2.5}, "growth_interval"),
        ({"growth_interval": 2.0}, "growth_interval"),
        ({"growth_interval": 0}, "growth_interval"),
        ({"growth_interval": True}, "growth_interval"),
    ],
)
def test_bad_arguments_raise_naming_them(kwargs, name):
    with pytest.raises(ValueError, match=name):
        GradScaler(**kwargs)


def test_disabled_is_a_pass_through():
    taifuse.set_backend("numpy")
    w = Parameter(np.ones(3, np.float32))
    opt = optim.SGD([w], lr=0.5)
    scaler = GradScaler(enabled=False)
    assert not scaler.is_enabled()
    loss = (w * 2.0).sum()
    assert scaler.scale(loss) is loss
    loss.backward()
    scaler.unscale_(opt)
    scaler.unscale_(opt)  # no once-per-iteration rule either
    np.testing.assert_array_equal(w.grad.numpy(), np.full(3, 2.0, np.float32))
    assert scaler.step(opt) is None
    np.testing.assert_array_equal(w.numpy(), np.zeros(3, np.float32))
    w.grad.copy_(np.array([np.inf, 0.0, 0.0], np.float32))
    scaler.step(opt)  # not checked: the step runs, as optimizer.step() would
    assert np.isinf(w.numpy()[0])
    scaler.update()
    assert scaler.get_scale() == 1.0
    assert scaler.state_dict() == {}
    scaler.load_state_dict({})
    assert scaler._get_growth_tracker() == 0


def test_unscale_is_in_place_and_serves_any_optimizer_with_param_groups():
    # A reference to .grad taken before unscale_ sees the unscaled values, as torch's in-place
    # unscale; an optimizer that is not taifuse's (no flat buffers) is served gradient by gradient.
    taifuse.set_backend("numpy")

    class Plain:
        def __init__(self, params):
            self.param_groups = [{"params": params}]
            self.steps = 0

        def step(self):
            self.steps += 1
            return "stepped"

    a, b = Parameter(np.ones(2, np.float32)), Parameter(np.ones(3, np.float32))
    opt = Plain([a, b])
    scaler = GradScaler(init_scale=16.0)
    scaler.scale((a * 3.0).sum() + (b * 5.0).sum()).backward()
    kept = a.grad
    scaler.unscale_(opt)
    np.testing.assert_array_equal(kept.numpy(), np.full(2, 3.0, np.float32))
    np.testing.assert_array_equal(b.grad.numpy(), np.full(3, 5.0, np.float32))
    assert scaler.step(opt) == "stepped" and opt.steps == 1
    scaler.update()
    b.grad.copy_(np.array([0.0, np.nan, 0.0], np.float32))
    scaler.scale((a * 1.0).sum())
    assert scaler.step(opt) is None and opt.steps == 1
    scaler.update()
    assert scaler.get_scale() == 8.0
