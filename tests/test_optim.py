"""taifuse.optim: fused update kernels against the NumPy reference on every backend, optimizers
against ``torch.optim`` (Lion against the paper's pseudocode), convergence, dtypes, state_dict
round trips, flat buffers, skipped parameters, bad input and non-finite gradients.

# NOTE [ Trajectory tolerance ]
# Trajectories are compared normwise: at every step, max|got - ref| <= TRAJ_RTOL * max|ref| over
# all parameters as one vector. An elementwise relative error is meaningless where a trajectory crosses zero (a
# 1-ulp difference at 1.0 becomes "100%" at 1e-7). Against the float32 NumPy reference the Numba
# kernels agree to the last bit (same operation order, no FMA contraction); against PyTorch,
# whose CPU kernels contract multiply-adds into FMAs, the measured worst over these 100-step runs
# was ~4e-7, so TRAJ_RTOL = 1e-6 (the issue's bound) holds with room.
"""

from __future__ import annotations

import importlib.util
import inspect
import math
from dataclasses import dataclass, field

import numpy as np
import pytest

import taifuse
from taifuse import optim
from taifuse._tensor_math import math_for
from taifuse.backends.reference import optim as R
from taifuse.nn import Parameter

HAS_TORCH = importlib.util.find_spec("torch") is not None
needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")

TRAJ_RTOL = 1e-6
STEPS = 100
SHAPES = [(7, 5), (5,), (3, 4, 2), (1,)]


# ----------------------------------------------------------------------------- the registry


@dataclass(frozen=True)
class OptCase:
    """One optimizer with one option combination."""

    name: str
    cls: type
    kwargs: dict
    torch_name: str | None  # torch.optim class with the same semantics, None for Lion
    converge: dict = field(default_factory=dict)  # settings that converge on the test problems

    @property
    def id(self) -> str:
        return self.name


CASES = [
    OptCase("sgd", optim.SGD, {"lr": 0.02}, "SGD"),
    OptCase("sgd-momentum", optim.SGD, {"lr": 0.02, "momentum": 0.9}, "SGD"),
    OptCase(
        "sgd-dampening-wd",
        optim.SGD,
        {"lr": 0.02, "momentum": 0.9, "dampening": 0.3, "weight_decay": 0.01},
        "SGD",
    ),
    OptCase(
        "sgd-nesterov-maximize",
        optim.SGD,
        {"lr": 0.02, "momentum": 0.8, "nesterov": True, "maximize": True},
        "SGD",
    ),
    OptCase("adam", optim.Adam, {"lr": 0.01}, "Adam"),
    OptCase("adam-l2-amsgrad", optim.Adam, {"lr": 0.01, "weight_decay": 0.05, "amsgrad": True}, "Adam"),
    OptCase(
        "adam-small-beta1-maximize", optim.Adam, {"lr": 0.01, "betas": (0.3, 0.9), "maximize": True}, "Adam"
    ),
    OptCase("adamw", optim.AdamW, {"lr": 0.01}, "AdamW"),
    OptCase("adamw-decay-amsgrad", optim.AdamW, {"lr": 0.01, "weight_decay": 0.2, "amsgrad": True}, "AdamW"),
    OptCase("lion", optim.Lion, {"lr": 0.003}, None),
    OptCase("lion-decay", optim.Lion, {"lr": 0.003, "betas": (0.8, 0.95), "weight_decay": 0.5}, None),
]
# Converging settings per optimizer class and problem (registry-driven: every class in
# optim.OPTIMIZERS). AdamW without decay here: its decay pulls the minimum toward 0.
CONVERGE_QUADRATIC = {
    optim.SGD: {"lr": 0.05, "momentum": 0.9},
    optim.Adam: {"lr": 5e-2},
    optim.AdamW: {"lr": 5e-2, "weight_decay": 0.0},
    optim.Lion: {"lr": 6e-2},
}
# Both problems run under a cosine schedule (Lion and Adam otherwise circle the minimum at lr's scale).
CONVERGE_ROSENBROCK = {
    optim.SGD: {"lr": 2e-3, "momentum": 0.9},
    optim.Adam: {"lr": 0.1},
    optim.AdamW: {"lr": 0.1, "weight_decay": 0.0},
    optim.Lion: {"lr": 1e-2},
}


def test_every_optimizer_is_in_the_registry():
    assert (
        {c.cls for c in CASES} == set(optim.OPTIMIZERS) == set(CONVERGE_QUADRATIC) == set(CONVERGE_ROSENBROCK)
    )


def _grad(p: np.ndarray, target: np.ndarray, k: int) -> np.ndarray:
    """A fixed, parameter-dependent gradient (float32): a pull to ``target`` plus a step-dependent push."""
    return ((p - target) * np.float32(0.5) + np.float32(0.1 * math.sin(k + 1))).astype(p.dtype)


def _problem(dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    init = [rng.standard_normal(s).astype(dtype) for s in SHAPES]
    targets = [rng.standard_normal(s).astype(dtype) for s in SHAPES]
    return init, targets


def _cat(arrays) -> np.ndarray:
    """All parameters as one vector: the trajectory compared normwise (NOTE [ Trajectory tolerance ])."""
    return np.concatenate([np.asarray(a).ravel() for a in arrays])


def _assert_close_normwise(got: np.ndarray, ref: np.ndarray, rtol: float, what: str) -> None:
    got64, ref64 = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    err = float(np.max(np.abs(got64 - ref64))) if ref64.size else 0.0
    scale = max(float(np.max(np.abs(ref64))), 1e-30)
    assert err <= rtol * scale, f"{what}: max|diff| {err:.3g} > {rtol:g} * max|ref| {scale:.3g}"


# ----------------------------------------------------------------------------- kernels vs the reference


def _kernel_call(kernels, case: OptCase, p, g, state: dict, step: int) -> None:
    """Call a backend's kernel for ``case`` (a thin copy of what the optimizer classes do)."""
    kw = {**_defaults(case.cls), **case.kwargs}
    if case.cls is optim.SGD:
        kernels.sgd_step(
            p, g, state.get("buf"), kw["lr"], kw["momentum"], kw["dampening"], kw["weight_decay"],
            kw["nesterov"], kw["maximize"], step == 1,
        )  # fmt: skip
    elif case.cls in (optim.Adam, optim.AdamW):
        b1, b2 = kw["betas"]
        kernels.adam_step(
            p, g, state["m"], state["v"], state.get("vmax"), step, kw["lr"], b1, b2, kw["eps"],
            kw["weight_decay"], case.cls is optim.AdamW, kw["amsgrad"], kw["maximize"],
        )  # fmt: skip
    else:
        b1, b2 = kw["betas"]
        kernels.lion_step(p, g, state["m"], kw["lr"], b1, b2, kw["weight_decay"])


def _defaults(cls: type) -> dict:
    params = inspect.signature(cls.__init__).parameters.values()
    return {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}


def _kernel_trajectory(kernels, case: OptCase, dtype, to_dev, to_host) -> list[np.ndarray]:
    init, targets = _problem(dtype)
    p0, target = np.concatenate([a.ravel() for a in init]), np.concatenate([a.ravel() for a in targets])
    n = p0.size
    p = to_dev(p0)
    state = {name: to_dev(np.zeros(n, dtype)) for name in ("buf", "m", "v", "vmax")}
    if not case.kwargs.get("momentum"):
        state["buf"] = None
    if not case.kwargs.get("amsgrad"):
        state["vmax"] = None
    out = []
    for k in range(STEPS):
        g = to_dev(_grad(to_host(p), target, k))
        _kernel_call(kernels, case, p, g, state, k + 1)
        out.append(to_host(p).copy())
    return out


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_kernel_trajectory_matches_reference(backend, case):
    """100 steps of each backend's fused kernel against the NumPy reference, float32 (and float16)."""
    be = backend.module()
    backend.activate()
    dtypes = [np.float32, np.float16] + ([np.float64] if backend.supports_f64 else [])
    for dtype in dtypes:
        ref = _kernel_trajectory(R, case, dtype, np.array, np.asarray)
        got = _kernel_trajectory(be, case, dtype, be.from_numpy, be.to_numpy)
        for k, (a, b) in enumerate(zip(got, ref)):
            assert a.dtype == dtype
            if dtype == np.float16:
                # float16 storage: a 1-ulp rounding difference (2**-10 relative) may flip once and
                # then propagate; the trajectory must stay within a few float16 ulps.
                _assert_close_normwise(a, b, 8e-3, f"{case.id} {np.dtype(dtype).name} step {k + 1}")
            else:
                _assert_close_normwise(a, b, TRAJ_RTOL, f"{case.id} {np.dtype(dtype).name} step {k + 1}")


def test_all_finite_kernel(backend):
    be = backend.module()
    backend.activate()
    for dtype in (np.float32, np.float16):
        x = np.linspace(-3, 3, 100_003).astype(dtype)
        small = np.ones(5, dtype)
        assert be.all_finite([be.from_numpy(x), be.from_numpy(small)])
        assert be.all_finite([])
        for bad in (np.nan, np.inf, -np.inf):
            y = x.copy()
            y[77_777] = bad
            assert not be.all_finite([be.from_numpy(y)])
            assert not be.all_finite([be.from_numpy(small), be.from_numpy(y)])
            # the answer of one call does not leak into the next
            assert be.all_finite([be.from_numpy(small)])


# ----------------------------------------------------------------------------- optimizers vs torch.optim


def _run_ours(case: OptCase, init, targets, steps=STEPS, kwargs=None):
    params = [Parameter(a.copy()) for a in init]
    opt = case.cls(params, **(case.kwargs if kwargs is None else kwargs))
    traj = []
    for k in range(steps):
        for p, t in zip(params, targets):
            p.grad = taifuse.tensor(_grad(p.numpy(), t, k))
        opt.step()
        traj.append([p.numpy().copy() for p in params])
    return traj, params, opt


def _torch_kwargs(case: OptCase) -> dict:
    return dict(case.kwargs)


@needs_torch
@pytest.mark.parametrize("case", [c for c in CASES if c.torch_name], ids=lambda c: c.id)
def test_trajectory_matches_torch(grad_backend, case):
    import torch

    init, targets = _problem()
    ours, _, _ = _run_ours(case, init, targets)
    tparams = [torch.tensor(a.copy(), requires_grad=True) for a in init]
    topt = getattr(torch.optim, case.torch_name)(tparams, **_torch_kwargs(case))
    for k in range(STEPS):
        for p, t in zip(tparams, targets):
            p.grad = torch.from_numpy(_grad(p.detach().numpy(), t, k))
        topt.step()
        theirs = [p.detach().numpy() for p in tparams]
        _assert_close_normwise(_cat(ours[k]), _cat(theirs), TRAJ_RTOL, f"{case.id} step {k + 1}")


def _lion_paper(init, targets, lr, beta1, beta2, wd, steps=STEPS):
    """Algorithm 2 of Chen et al. 2023 ("Lion"), written out in float32 NumPy."""
    params = [a.copy() for a in init]
    moments = [np.zeros_like(a) for a in init]
    f32 = np.float32
    traj = []
    for k in range(steps):
        for i, (theta, t) in enumerate(zip(params, targets)):
            g = _grad(theta, t, k)
            m = moments[i]
            c = f32(beta1) * m + f32(1 - beta1) * g  # update = interp(m, g, beta1)
            theta = theta * f32(1 - lr * wd) - f32(lr) * np.sign(c)  # theta -= lr * (sign(c) + wd * theta)
            moments[i] = f32(beta2) * m + f32(1 - beta2) * g
            params[i] = theta.astype(np.float32)
        traj.append([a.copy() for a in params])
    return traj


@pytest.mark.parametrize("case", [c for c in CASES if c.cls is optim.Lion], ids=lambda c: c.id)
def test_lion_matches_the_paper(grad_backend, case):
    init, targets = _problem()
    ours, _, _ = _run_ours(case, init, targets)
    kw = {"betas": (0.9, 0.99), "weight_decay": 0.0, **case.kwargs}
    paper = _lion_paper(init, targets, kw["lr"], *kw["betas"], kw["weight_decay"])
    for k in range(STEPS):
        _assert_close_normwise(_cat(ours[k]), _cat(paper[k]), TRAJ_RTOL, f"{case.id} step {k + 1}")


@needs_torch
def test_param_groups_and_add_param_group_match_torch(grad_backend):
    import torch

    init, targets = _problem()
    params = [Parameter(a.copy()) for a in init]
    opt = optim.AdamW(
        [{"params": params[:2]}, {"params": params[2:3], "lr": 0.05, "weight_decay": 0.3}], lr=0.01
    )
    opt.add_param_group({"params": [params[3]], "betas": (0.5, 0.9)})
    tparams = [torch.tensor(a.copy(), requires_grad=True) for a in init]
    topt = torch.optim.AdamW(
        [{"params": tparams[:2]}, {"params": tparams[2:3], "lr": 0.05, "weight_decay": 0.3}], lr=0.01
    )
    topt.add_param_group({"params": [tparams[3]], "betas": (0.5, 0.9)})
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in topt.param_groups]
    for k in range(30):
        for p, tp, t in zip(params, tparams, targets):
            p.grad = taifuse.tensor(_grad(p.numpy(), t, k))
            tp.grad = torch.from_numpy(_grad(tp.detach().numpy(), t, k))
        opt.step()
        topt.step()
    _assert_close_normwise(
        _cat(p.numpy() for p in params),
        _cat(tp.detach().numpy() for tp in tparams),
        TRAJ_RTOL,
        "param groups",
    )


@needs_torch
@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_momentum_switched_on_mid_training_matches_torch(grad_backend, nesterov):
    """torch.optim.SGD starts a momentum buffer from the gradient the first time a parameter steps
    with momentum (its ``momentum_buffer is None`` branch), however many plain steps came before,
    and keeps it while momentum is switched off; dampening applies only after that first step."""
    import torch

    kwargs = {"lr": 0.05, "momentum": 0.0, "dampening": 0.0 if nesterov else 0.4}
    schedule = [0.0] * 3 + [0.9] * 4 + [0.0] * 2 + [0.8] * 3  # momentum per step
    init, targets = _problem()
    params = [Parameter(a.copy()) for a in init]
    opt = optim.SGD(params, **kwargs)
    tparams = [torch.tensor(a.copy(), requires_grad=True) for a in init]
    topt = torch.optim.SGD(tparams, **kwargs)
    for k, momentum in enumerate(schedule):
        for group in (opt.param_groups[0], topt.param_groups[0]):
            group["momentum"] = momentum
            group["nesterov"] = nesterov and momentum > 0
        for i, (p, tp, t) in enumerate(zip(params, tparams, targets)):
            if k == 3 and i == 1:
                p.grad = tp.grad = None  # this one's buffer starts a step later
                continue
            p.grad = taifuse.tensor(_grad(p.numpy(), t, k))
            tp.grad = torch.from_numpy(_grad(tp.detach().numpy(), t, k))
        opt.step()
        topt.step()
        _assert_close_normwise(
            _cat(p.numpy() for p in params),
            _cat(tp.detach().numpy() for tp in tparams),
            TRAJ_RTOL,
            f"step {k + 1}",
        )
    ours, theirs = opt.state_dict()["state"], topt.state_dict()["state"]
    assert sorted(ours) == sorted(theirs)
    for key, entry in theirs.items():
        np.testing.assert_allclose(ours[key]["momentum_buffer"], entry["momentum_buffer"].numpy(), rtol=1e-5)


@needs_torch
def test_parameters_without_grad_are_skipped_like_torch(grad_backend):
    """Alternating missing gradients: skipped parameters keep their values and state, and their step
    counts drift apart (so a bucket needs several launches), exactly as in torch.optim."""
    import torch

    init, targets = _problem()
    params = [Parameter(a.copy()) for a in init]
    opt = optim.Adam(params, lr=0.01, amsgrad=True)
    tparams = [torch.tensor(a.copy(), requires_grad=True) for a in init]
    topt = torch.optim.Adam(tparams, lr=0.01, amsgrad=True)
    for k in range(40):
        opt.zero_grad()
        topt.zero_grad()
        for i, (p, tp, t) in enumerate(zip(params, tparams, targets)):
            if (k + i) % 3 == 0 or (i == 3 and k < 10):
                continue  # no gradient for this parameter at this step
            p.grad = taifuse.tensor(_grad(p.numpy(), t, k))
            tp.grad = torch.from_numpy(_grad(tp.detach().numpy(), t, k))
        opt.step()
        topt.step()
        _assert_close_normwise(
            _cat(p.numpy() for p in params),
            _cat(tp.detach().numpy() for tp in tparams),
            TRAJ_RTOL,
            f"step {k + 1}",
        )
    ours, theirs = opt.state_dict(), topt.state_dict()
    assert sorted(ours["state"]) == sorted(theirs["state"])
    for key, entry in theirs["state"].items():
        assert ours["state"][key]["step"] == float(entry["step"])


# ----------------------------------------------------------------------------- registry: behaviour


def _quadratic_loss(params, centers, scales):
    total = None
    for p, c, s in zip(params, centers, scales):
        d = p - taifuse.tensor(c)
        term = (d * d * taifuse.tensor(s)).sum()
        total = term if total is None else total + term
    return total


@pytest.mark.parametrize("cls", optim.OPTIMIZERS, ids=lambda c: c.__name__)
def test_converges_on_a_quadratic(grad_backend, cls):
    """sum(s * (p - c)**2) over several parameters; the first steps' gradients come from autograd
    (through the flat gradient slots), the rest from the closed form to keep the test quick."""
    rng = np.random.default_rng(1)
    centers = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    scales = [rng.uniform(0.5, 2.0, s).astype(np.float32) for s in SHAPES]
    params = [Parameter(np.zeros(s, np.float32)) for s in SHAPES]
    steps = 250
    opt = cls(params, **CONVERGE_QUADRATIC[cls])
    sched = optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    first = _quadratic_loss(params, centers, scales).item()
    for k in range(steps):
        opt.zero_grad()
        if k < 5:
            _quadratic_loss(params, centers, scales).backward()
        else:
            for p, c, s in zip(params, centers, scales):
                p.grad = taifuse.tensor(2 * s * (p.numpy() - c))
        opt.step()
        sched.step()
    final = _quadratic_loss(params, centers, scales).item()
    assert final < 1e-3 * first, f"{cls.__name__}: loss {first:.3g} -> {final:.3g}"


@pytest.mark.parametrize("cls", optim.OPTIMIZERS, ids=lambda c: c.__name__)
def test_converges_on_rosenbrock(grad_backend, cls):
    """f(x, y) = (1 - x)**2 + 100 (y - x**2)**2 from (-1.5, 2), cosine-annealed: the minimum is (1, 1)."""
    steps = 2000
    xy = Parameter(np.array([-1.5, 2.0], np.float32))
    opt = cls([xy], **CONVERGE_ROSENBROCK[cls])
    sched = optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    for _ in range(steps):
        x, y = (float(v) for v in xy.numpy())
        grad = np.array([-2 * (1 - x) - 400 * x * (y - x * x), 200 * (y - x * x)], np.float32)
        xy.grad = taifuse.tensor(grad)
        opt.step()
        sched.step()
    assert np.allclose(xy.numpy(), [1.0, 1.0], atol=0.02), f"{cls.__name__} ended at {xy.numpy()}"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_dtypes_are_kept(grad_backend, case):
    dtypes = [np.float16, np.float32] + ([np.float64] if grad_backend.supports_f64 else [])
    params = [Parameter(np.ones((3, 2), dtype)) for dtype in dtypes]
    opt = case.cls(params, **case.kwargs)
    for _ in range(3):
        for p in params:
            p.grad = taifuse.tensor(np.full(p.shape, 0.5, p.dtype))
        opt.step()
    for p, dtype in zip(params, dtypes):
        assert p.dtype == dtype
        assert p.grad.dtype == dtype
        assert np.all(p.numpy() != 1)  # it moved
        for value in opt.state.get(p, {}).values():
            if isinstance(value, taifuse.Tensor):
                assert value.dtype == dtype


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_state_dict_round_trip_continues_identically(grad_backend, case):
    init, targets = _problem()
    params = [Parameter(a.copy()) for a in init]
    opt = case.cls(params, **case.kwargs)

    def run(ps, o, first, count):
        for k in range(first, first + count):
            for p, t in zip(ps, targets):
                p.grad = taifuse.tensor(_grad(p.numpy(), t, k))
            o.step()

    run(params, opt, 0, 10)
    saved = opt.state_dict()
    snapshot = [p.numpy().copy() for p in params]
    run(params, opt, 10, 10)
    # A fresh optimizer (other defaults) over a copy of the mid-run parameters, loaded from the
    # state dict, continues bit for bit; the saved dict was a copy, not a view of live state.
    params2 = [Parameter(a.copy()) for a in snapshot]
    opt2 = case.cls(params2, **{**case.kwargs, "lr": 123.0})
    opt2.load_state_dict(saved)
    assert opt2.param_groups[0]["lr"] == case.kwargs["lr"]
    run(params2, opt2, 10, 10)
    for a, b in zip(params, params2):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert sorted(saved["state"]) == list(range(len(params))) or not saved["state"]


@needs_torch
def test_state_dict_layout_loads_into_torch(grad_backend):
    """Our Adam state_dict, tensors converted, loads into torch.optim.Adam and continues alike."""
    import torch

    case = next(c for c in CASES if c.id == "adam-l2-amsgrad")
    init, targets = _problem()
    _, params, opt = _run_ours(case, init, targets, steps=10)
    saved = opt.state_dict()
    tparams = [torch.tensor(p.numpy().copy(), requires_grad=True) for p in params]
    topt = torch.optim.Adam(tparams, lr=1.0)
    state = {
        k: {n: (torch.tensor(v) if n == "step" else torch.from_numpy(v.copy())) for n, v in entry.items()}
        for k, entry in saved["state"].items()
    }
    topt.load_state_dict({"state": state, "param_groups": [dict(g) for g in saved["param_groups"]]})
    for k in range(10, 20):
        for p, tp, t in zip(params, tparams, targets):
            p.grad = taifuse.tensor(_grad(p.numpy(), t, k))
            tp.grad = torch.from_numpy(_grad(tp.detach().numpy(), t, k))
        opt.step()
        topt.step()
    _assert_close_normwise(
        _cat(p.numpy() for p in params),
        _cat(tp.detach().numpy() for tp in tparams),
        TRAJ_RTOL,
        "after loading",
    )


@needs_torch
def test_torch_state_dict_loads_into_ours(grad_backend):
    """torch.optim.Adam's state_dict (its 'step' a 0-d tensor) loads and continues alike."""
    import torch

    init, targets = _problem()
    tparams = [torch.tensor(a.copy(), requires_grad=True) for a in init]
    topt = torch.optim.Adam(tparams, lr=0.01, amsgrad=True)
    for k in range(5):
        for tp, t in zip(tparams, targets):
            tp.grad = torch.from_numpy(_grad(tp.detach().numpy(), t, k))
        topt.step()
    params = [Parameter(tp.detach().numpy().copy()) for tp in tparams]
    opt = optim.Adam(params, lr=1.0)
    opt.load_state_dict(topt.state_dict())
    assert opt.param_groups[0]["amsgrad"] and opt.state_dict()["state"][0]["step"] == 5.0
    for k in range(5, 10):
        for p, tp, t in zip(params, tparams, targets):
            p.grad = taifuse.tensor(_grad(p.numpy(), t, k))
            tp.grad = torch.from_numpy(_grad(tp.detach().numpy(), t, k))
        opt.step()
        topt.step()
    _assert_close_normwise(
        _cat(p.numpy() for p in params),
        _cat(tp.detach().numpy() for tp in tparams),
        TRAJ_RTOL,
        "after loading",
    )


# ----------------------------------------------------------------------------- flat buffers


def test_one_launch_per_group_and_dtype_and_grads_land_in_place(grad_backend, monkeypatch):
    """A 200-parameter model steps with one kernel call and backward writes into the flat gradient
    buffer (host backends); on taichi, whose DeviceArray has no offset views yet, one call per
    parameter (NOTE [ Flat buffers ]), shown on 20."""
    be = grad_backend.module()
    calls = []
    original = be.adam_step
    monkeypatch.setattr(be, "adam_step", lambda *a, **k: (calls.append(a[0].size), original(*a, **k))[1])
    rng = np.random.default_rng(0)
    host = grad_backend.name != "taichi"
    count = 200 if host else 20  # autograd on lavapipe is slow, and the taichi claim is per parameter
    params = [Parameter(rng.standard_normal((8, 8)).astype(np.float32)) for _ in range(count)]
    opt = optim.AdamW(params, lr=1e-3)
    assert host == isinstance(params[0]._data, np.ndarray)
    if host:
        buffer = params[0]._data.base
        assert all(np.shares_memory(p._data, buffer) and p._data.flags.c_contiguous for p in params)
    for _ in range(2):
        opt.zero_grad()
        assert all(p.grad is None for p in params)
        loss = None
        for p in params:
            term = (p * p).sum()
            loss = term if loss is None else loss + term
        loss.backward()
        if host:  # each gradient lies at its parameter's offset in the flat buffer the kernel reads
            flat = opt._buckets[0][0].grad_flat()
            start = flat.__array_interface__["data"][0]
            addresses = [p.grad._data.__array_interface__["data"][0] for p in params]
            assert addresses == [start + 4 * 64 * i for i in range(count)]
        opt.step()
    assert calls == ([count * 64] * 2 if host else [64] * (2 * count))


def test_replaced_parameter_data_and_foreign_grads_are_taken_back(grad_backend):
    p = Parameter(np.ones(4, np.float32))
    opt = optim.SGD([p], lr=0.5)
    p._data = p._be.from_numpy(np.full(4, 3.0, np.float32))  # as Module.load_state_dict may do
    p.grad = taifuse.tensor(np.full(4, 2.0, np.float32))
    opt.step()
    np.testing.assert_array_equal(p.numpy(), np.full(4, 2.0, np.float32))
    opt.step()
    np.testing.assert_array_equal(p.numpy(), np.full(4, 1.0, np.float32))


def _drop_grads(how: str, opt, params) -> None:
    if how == "optimizer":
        opt.zero_grad()
    elif how == "module":
        module = taifuse.nn.Module()
        for i, p in enumerate(params):
            setattr(module, f"p{i}", p)
        module.zero_grad()
    else:
        for p in params:
            p.grad = None


@pytest.mark.parametrize("how", ["optimizer", "module", "assignment"])
def test_a_kept_gradient_is_not_overwritten_by_the_next_backward(grad_backend, how):
    """PyTorch's .grad is a tensor of its own: dropping it (zero_grad(), or p.grad = None) makes the
    next backward create a new one, so a gradient the user kept, or an array or view of it, keeps
    its values through later backward passes and steps (NOTE [ Gradient slots ] in _grad_slots.py)."""
    w, v = Parameter(np.ones(3, np.float32)), Parameter(np.ones(2, np.float32))
    opt = optim.SGD([w, v], lr=0.1)
    ((w * 2.0).sum() + (v * 3.0).sum()).backward()
    g1 = w.grad
    a1 = g1.numpy()
    view = a1[1:]
    opt.step()
    _drop_grads(how, opt, [w, v])
    ((w * 5.0).sum() + (v * 7.0).sum()).backward()
    assert w.grad is not g1
    np.testing.assert_array_equal(w.grad.numpy(), [5.0, 5.0, 5.0])
    for kept in (g1.numpy(), a1, view):
        assert (kept == 2.0).all(), kept
    opt.step()
    np.testing.assert_allclose(w.numpy(), [0.3, 0.3, 0.3], rtol=1e-6)
    # v = (1 - 0.1 * 3) - 0.1 * 7 is 0 in exact arithmetic; a fused multiply-add (CUDA: Taichi
    # contracts there) rounds once and leaves -2.2e-8, as PyTorch's CUDA SGD would: atol for the 0.
    np.testing.assert_allclose(v.numpy(), 1.0 - 0.1 * (3.0 + 7.0), rtol=1e-6, atol=1e-7)
    assert (g1.numpy() == 2.0).all() and (a1 == 2.0).all()
    # Once nothing holds an old gradient, the next one lands in the optimizer's flat buffer again.
    del g1, a1, view, kept
    _drop_grads(how, opt, [w, v])
    ((w * 4.0).sum() + (v * 1.0).sum()).backward()
    if grad_backend.name != "taichi":
        flat = opt._buckets[0][0].grad_flat()
        assert np.shares_memory(w.grad.numpy(), flat) and np.shares_memory(v.grad.numpy(), flat)
    opt.step()
    np.testing.assert_allclose(w.numpy(), [-0.1, -0.1, -0.1], rtol=1e-5)


def test_grad_buffers_are_the_gradients_storage_per_bucket(grad_backend):
    """Optimizer.grad_buffers() (GradScaler's unscale pass; later a data-parallel all-reduce): per
    bucket, flat arrays on the bucket's backend that are the .grad storage itself, so that writing
    them changes p.grad; parameters without a gradient are left out."""
    be = grad_backend.module()
    w, v, u = (Parameter(np.ones(n, np.float32)) for n in (3, 2, 4))
    opt = optim.SGD([w, v, u], lr=0.1)
    assert opt.grad_buffers() == []  # no gradient yet
    ((w * 2.0).sum() + (v * 3.0).sum()).backward()  # u gets none
    buffers = opt.grad_buffers()
    assert all(b is be for b, _ in buffers)
    arrays = [a for _, parts in buffers for a in parts]
    if grad_backend.name == "taichi":  # one bucket per parameter, its .grad the one array
        assert [len(parts) for _, parts in buffers] == [1, 1]
    else:  # host: one bucket, w and v neighbours in its flat buffer: one slice for both
        assert len(buffers) == 1 and len(arrays) == 1
    np.testing.assert_array_equal(np.concatenate([be.to_numpy(a) for a in arrays]), [2.0] * 3 + [3.0] * 2)
    m = math_for(be)
    for a in arrays:
        m.mul_(a, 0.5)
    np.testing.assert_array_equal(w.grad.numpy(), [1.0, 1.0, 1.0])
    np.testing.assert_array_equal(v.grad.numpy(), [1.5, 1.5])
    assert u.grad is None


def test_zero_grad_without_set_to_none_zeroes_in_place_like_torch(grad_backend):
    """zero_grad(set_to_none=False) zeroes every existing gradient in place (a kept reference sees
    the zeros and the next accumulation) and leaves a missing one missing, as torch.optim does."""
    w, v = Parameter(np.ones(3, np.float32)), Parameter(np.ones(2, np.float32))
    opt = optim.SGD([w, v], lr=0.1, momentum=0.5)
    (w * 2.0).sum().backward()
    g = w.grad
    opt.zero_grad(set_to_none=False)
    assert w.grad is g and v.grad is None
    assert not g.numpy().any()
    (w * 5.0).sum().backward()
    assert w.grad is g
    np.testing.assert_array_equal(g.numpy(), [5.0, 5.0, 5.0])
    opt.step()
    np.testing.assert_allclose(w.numpy(), [0.5, 0.5, 0.5], rtol=1e-6)
    np.testing.assert_array_equal(v.numpy(), [1.0, 1.0])  # no gradient: skipped, no state
    assert v not in opt.state
    g2 = w.grad
    opt.zero_grad(set_to_none=False)
    assert w.grad is g2 and not g2.numpy().any()


def test_zero_grad(grad_backend):
    params = [Parameter(np.ones(3, np.float32)), Parameter(np.ones(2, np.float32))]
    opt = optim.SGD(params, lr=0.1)
    for p in params:
        p.grad = taifuse.tensor(np.ones(p.shape, np.float32))
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.numpy().any() for p in params)
    opt.zero_grad()
    assert all(p.grad is None for p in params)


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "cls, kwargs, message",
    [
        (optim.SGD, {"lr": -0.1}, "SGD lr"),
        (optim.SGD, {"lr": float("nan")}, "SGD lr"),
        (optim.SGD, {"lr": 0.1, "momentum": -1}, "SGD momentum"),
        (optim.SGD, {"lr": 0.1, "weight_decay": -1e-3}, "SGD weight_decay"),
        (optim.SGD, {"lr": 0.1, "nesterov": True}, "nesterov"),
        (optim.SGD, {"lr": 0.1, "momentum": 0.9, "dampening": 0.1, "nesterov": True}, "nesterov"),
        (optim.Adam, {"lr": "fast"}, "Adam lr"),
        (optim.Adam, {"betas": (1.0, 0.999)}, "Adam beta1"),
        (optim.Adam, {"betas": (0.9, -0.1)}, "Adam beta2"),
        (optim.Adam, {"betas": 0.9}, "Adam betas"),
        (optim.Adam, {"eps": -1e-8}, "Adam eps"),
        (optim.AdamW, {"weight_decay": float("inf")}, "AdamW weight_decay"),
        (optim.Lion, {"betas": (0.9, 1.5)}, "Lion beta2"),
        (optim.Lion, {"lr": -1.0}, "Lion lr"),
    ],
)
def test_bad_hyperparameters_are_named(grad_backend, cls, kwargs, message):
    p = Parameter(np.ones(2, np.float32))
    with pytest.raises(ValueError, match=message):
        cls([p], **kwargs)
    np.testing.assert_array_equal(p.numpy(), np.ones(2, np.float32))


def test_bad_parameter_lists(grad_backend):
    a, b = Parameter(np.ones(2, np.float32)), Parameter(np.ones(3, np.float32))
    with pytest.raises(ValueError, match="empty parameter list"):
        optim.SGD([], lr=0.1)
    with pytest.raises(ValueError, match="more than one parameter group"):
        optim.SGD([{"params": [a]}, {"params": [a, b]}], lr=0.1)
    with pytest.raises(ValueError, match="twice"):
        optim.SGD([a, a], lr=0.1)
    opt = optim.SGD([a], lr=0.1)
    with pytest.raises(ValueError, match="more than one parameter group"):
        opt.add_param_group({"params": [a]})
    with pytest.raises(ValueError, match="SGD lr"):
        opt.add_param_group({"params": [b], "lr": -1})
    assert len(opt.param_groups) == 1
    with pytest.raises(TypeError, match="single Tensor"):
        optim.SGD(a, lr=0.1)


def test_a_bad_lr_set_on_a_group_raises_before_any_update(grad_backend):
    params = [Parameter(np.ones(2, np.float32)), Parameter(np.ones(2, np.float32))]
    opt = optim.SGD([{"params": [params[0]]}, {"params": [params[1]]}], lr=0.1)
    opt.param_groups[1]["lr"] = float("nan")
    for p in params:
        p.grad = taifuse.tensor(np.ones(2, np.float32))
    with pytest.raises(ValueError, match="SGD lr"):
        opt.step()
    assert all(np.array_equal(p.numpy(), np.ones(2, np.float32)) for p in params)


def _stepped(cls, kwargs, shapes=((3,), (2, 2))):
    params = [Parameter(np.ones(s, np.float32)) for s in shapes]
    opt = cls(params, **kwargs)
    for p in params:
        p.grad = taifuse.tensor(np.full(p.shape, 0.5, np.float32))
    opt.step()
    return params, opt


def test_load_state_dict_refuses_mismatches_before_changing_anything(grad_backend):
    _, adam = _stepped(optim.Adam, {"lr": 0.1})
    before = adam.state_dict()
    _, sgd = _stepped(optim.SGD, {"lr": 0.1, "momentum": 0.9})
    with pytest.raises(ValueError, match="not from a Adam"):
        adam.load_state_dict(sgd.state_dict())
    _, other_shape = _stepped(optim.Adam, {"lr": 0.1}, shapes=((3,), (4,)))
    with pytest.raises(ValueError, match="shape"):
        adam.load_state_dict(other_shape.state_dict())
    _, three = _stepped(optim.Adam, {"lr": 0.1}, shapes=((3,), (2, 2), (1,)))
    with pytest.raises(ValueError, match="parameters"):
        adam.load_state_dict(three.state_dict())
    _, ams = _stepped(optim.Adam, {"lr": 0.1, "amsgrad": True})
    truncated = ams.state_dict()  # amsgrad=True is loaded with the group, so its state must be complete
    del truncated["state"][1]["max_exp_avg_sq"]
    with pytest.raises(ValueError, match="max_exp_avg_sq"):
        adam.load_state_dict(truncated)
    bad_lr = adam.state_dict()
    bad_lr["param_groups"][0]["lr"] = -5.0
    with pytest.raises(ValueError, match="Adam lr"):
        adam.load_state_dict(bad_lr)
    after = adam.state_dict()
    assert after["param_groups"] == before["param_groups"]
    for key, entry in before["state"].items():
        for name, value in entry.items():
            np.testing.assert_array_equal(after["state"][key][name], value)


def _malformed(state_dict: dict) -> list:
    """(broken copy of ``state_dict``, exception type, message pattern) for each malformation."""
    import copy

    def broken(edit):
        sd = copy.deepcopy(state_dict)
        edit(sd)
        return sd

    def set_step(value):
        return lambda sd: sd["state"][0].__setitem__("step", value)

    return [
        (
            {**state_dict, "state": list(state_dict["state"].values())},
            TypeError,
            "'state' should be a dict.*list",
        ),
        (
            {**state_dict, "param_groups": state_dict["param_groups"][0]},
            TypeError,
            "'param_groups' should be a list",
        ),
        (broken(lambda sd: sd["param_groups"][0].pop("params")), ValueError, "group 0 has no 'params'"),
        (broken(lambda sd: sd["param_groups"].__setitem__(0, 3)), TypeError, "group 0 should be a dict"),
        (
            broken(lambda sd: sd["state"].__setitem__(1, [1, 2])),
            TypeError,
            "state of parameter 1 should be a dict",
        ),
        (broken(set_step(float("nan"))), ValueError, "'step' of parameter 0 .* got nan"),
        (broken(set_step(float("inf"))), ValueError, "'step' of parameter 0 .* got inf"),
        (broken(set_step(2.5)), ValueError, "'step' of parameter 0 .* got 2.5"),
        (broken(set_step("three")), TypeError, "'step' of parameter 0 .* got 'three'"),
        (
            broken(lambda sd: sd["state"][1].__setitem__("exp_avg", "x")),
            TypeError,
            "'exp_avg' of parameter 1",
        ),
    ]


def test_load_state_dict_names_malformed_entries_before_changing_anything(grad_backend):
    params, adam = _stepped(optim.Adam, {"lr": 0.1})
    before = adam.state_dict()
    values = [p.numpy().copy() for p in params]
    for bad, error, pattern in _malformed(before):
        with pytest.raises(error, match=pattern):
            adam.load_state_dict(bad)
    after = adam.state_dict()
    assert after["param_groups"] == before["param_groups"]
    for key, entry in before["state"].items():
        for name, value in entry.items():
            np.testing.assert_array_equal(after["state"][key][name], value)
    for p, v in zip(params, values):
        np.testing.assert_array_equal(p.numpy(), v)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_gradient_changes_nothing(grad_backend, case, bad):
    """NOTE [ Non-finite gradients ] (optimizer.py): with check_finite=True the step raises before
    writing anything."""
    init, targets = _problem()
    params = [Parameter(a.copy()) for a in init]
    opt = case.cls(params, **case.kwargs, check_finite=True)
    for k in range(3):
        for p, t in zip(params, targets):
            p.grad = taifuse.tensor(_grad(p.numpy(), t, k))
        opt.step()
    values = [p.numpy().copy() for p in params]
    state = opt.state_dict()
    for p, t in zip(params, targets):
        p.grad = taifuse.tensor(_grad(p.numpy(), t, 3))
    g = params[2].grad.numpy()
    g[1, 2, 0] = bad
    params[2].grad = taifuse.tensor(g)
    with pytest.raises(ValueError, match="gradient of parameter 2"):
        opt.step()
    for p, v in zip(params, values):
        np.testing.assert_array_equal(p.numpy(), v)
    after = opt.state_dict()
    for key, entry in state["state"].items():
        for name, value in entry.items():
            np.testing.assert_array_equal(after["state"][key][name], value)
    # Opting out behaves like torch.optim: the update runs and the NaN reaches the parameter.
    opt.check_finite = False
    opt.step()
    touched = [params[2].numpy()] + [np.asarray(v) for v in opt.state_dict()["state"].get(2, {}).values()]
    assert not all(np.isfinite(a).all() for a in touched)
    assert np.isfinite(params[0].numpy()).all()


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_default_step_lets_a_nan_gradient_spread_like_torch(grad_backend, case):
    """check_finite defaults to False, as torch.optim has no check: a NaN gradient raises nothing and
    reaches the parameters and state exactly where torch.optim puts it (Lion: where its update rule
    does), while the other parameters step on."""
    init, targets = _problem()
    params = [Parameter(a.copy()) for a in init]
    opt = case.cls(params, **case.kwargs)
    assert opt.check_finite is False
    torch = None
    if case.torch_name and HAS_TORCH:
        import torch

        tparams = [torch.tensor(a.copy(), requires_grad=True) for a in init]
        topt = getattr(torch.optim, case.torch_name)(tparams, **_torch_kwargs(case))
    for k in range(4):
        for i, (p, t) in enumerate(zip(params, targets)):
            g = _grad(p.numpy(), t, k)
            if k == 1 and i == 2:
                g[1, 2, 0] = np.nan
            p.grad = taifuse.tensor(g)
            if torch is not None:
                tg = _grad(tparams[i].detach().numpy(), t, k)
                if k == 1 and i == 2:
                    tg[1, 2, 0] = np.nan
                tparams[i].grad = torch.from_numpy(tg)
        opt.step()
        if torch is not None:
            topt.step()
            ours, theirs = _cat(p.numpy() for p in params), _cat(tp.detach().numpy() for tp in tparams)
            np.testing.assert_array_equal(np.isnan(ours), np.isnan(theirs), err_msg=f"step {k + 1}")
            finite = ~np.isnan(theirs)
            _assert_close_normwise(ours[finite], theirs[finite], TRAJ_RTOL, f"{case.id} step {k + 1}")
    assert np.isnan(params[2].numpy()).any()
    assert all(np.isfinite(p.numpy()).all() for i, p in enumerate(params) if i != 2)


# ----------------------------------------------------------------------------- clipping


@needs_torch
@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
@pytest.mark.parametrize("max_norm", [0.5, 1e3])
def test_clip_grad_norm_matches_torch(grad_backend, norm_type, max_norm):
    import torch

    rng = np.random.default_rng(3)
    grads = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    params = [taifuse.tensor(np.zeros(s, np.float32), requires_grad=True) for s in SHAPES]
    for p, g in zip(params, grads):
        p.grad = taifuse.tensor(g)
    tparams = [torch.zeros(s, requires_grad=True) for s in SHAPES]
    for p, g in zip(tparams, grads):
        p.grad = torch.from_numpy(g.copy())
    total = optim.clip_grad_norm_(params, max_norm, norm_type=norm_type)
    ttotal = torch.nn.utils.clip_grad_norm_(tparams, max_norm, norm_type=norm_type)
    assert isinstance(total, taifuse.Tensor) and total.dtype == np.float32
    np.testing.assert_allclose(total.item(), ttotal.item(), rtol=1e-6)
    for p, tp in zip(params, tparams):
        np.testing.assert_allclose(p.grad.numpy(), tp.grad.numpy(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend_name", ["numpy", "numba"])
def test_clip_grad_norm_sums_squares_in_float64_blocks(monkeypatch, backend_name):
    # The host backends accumulate in float64; a float64 copy of each gradient (and its square)
    # took 4x its float32 bytes at the GPT step's peak. Blocks of _SQUARES_BLOCK elements now
    # (HostMath.sum_of_squares, a tensor-math call so that a compiled step records it).
    from taifuse import _tensor_math as clip
    from taifuse import pool

    if backend_name not in taifuse.available_backends():
        pytest.skip(f"{backend_name} is not installed")
    shapes = [(3 * clip._SQUARES_BLOCK + 5,), (7, 3), (1,)]
    rng = np.random.default_rng(4)
    grads = [(rng.standard_normal(s) * 1e3).astype(np.float32) for s in shapes]
    requests = []
    acquire = pool.BufferPool.acquire

    def recording(self, shape, dtype, *, zero=False):
        requests.append((math.prod(shape), np.dtype(dtype)))
        return acquire(self, shape, dtype, zero=zero)

    with taifuse.use_backend(backend_name):
        params = [taifuse.tensor(np.zeros(s, np.float32), requires_grad=True) for s in shapes]
        for p, g in zip(params, grads):
            p.grad = taifuse.tensor(g)
        monkeypatch.setattr(pool.BufferPool, "acquire", recording)
        total = optim.clip_grad_norm_(params, 1.0)
    assert max(n for n, dt in requests if dt == np.float64) <= clip._SQUARES_BLOCK
    want = math.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in grads))
    assert total.item() == np.float32(want)


@pytest.mark.parametrize("backend_name", ["numpy", "numba"])
def test_clip_grad_norm_pool_requests_do_not_grow_with_the_gradients(monkeypatch, backend_name):
    # The GPT example's 29 float32 gradients took ~3 ms per clip (a third of the step's work that does
    # not shrink with the batch, issue 30's scaling): a pool request and backend 0-d additions per
    # gradient for the norm, and a cast of the coefficient per gradient. Now a constant few, with
    # the same norm and gradients bit for bit (the float64 sums in the same order).
    from taifuse import pool

    if backend_name not in taifuse.available_backends():
        pytest.skip(f"{backend_name} is not installed")
    rng = np.random.default_rng(5)
    counts = []
    requests: list[np.dtype] = []
    acquire = pool.BufferPool.acquire

    def recording(self, shape, dtype, *, zero=False):
        requests.append(np.dtype(dtype))
        return acquire(self, shape, dtype, zero=zero)

    for n in (3, 30):
        grads = [rng.standard_normal((4, 5)).astype(np.float32) for _ in range(n)]
        requests.clear()
        with taifuse.use_backend(backend_name):
            params = [taifuse.tensor(np.zeros((4, 5), np.float32), requires_grad=True) for _ in grads]
            for p, g in zip(params, grads):
                p.grad = taifuse.tensor(g)
            with monkeypatch.context() as patch:
                patch.setattr(pool.BufferPool, "acquire", recording)
                total = optim.clip_grad_norm_(params, 1e-3)
            clipped = [p.grad.numpy() for p in params]
        counts.append(len(requests))
        want = math.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in grads))
        np.testing.assert_allclose(total.item(), want, rtol=1e-6)
        coef = np.float32(min(1.0, 1e-3 / (want + 1e-6)))
        for c, g in zip(clipped, grads):
            np.testing.assert_allclose(c, g * coef, rtol=1e-6)
    assert counts[1] == counts[0] <= 8, counts


@needs_torch
@pytest.mark.parametrize("norm_type", [float("inf"), 2.0, 1.0])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_clip_grad_norm_sees_a_non_finite_value_in_any_parameter_like_torch(grad_backend, norm_type, bad):
    """The non-finite value sits in the second parameter: the inf-norm's max must not drop it (a
    NaN compared with ``>`` loses to any number)."""
    import torch

    grads = [np.array([1.0, 0.5], np.float32), np.array([bad, 0.0], np.float32)]
    params = [taifuse.tensor(np.zeros(2, np.float32), requires_grad=True) for _ in grads]
    tparams = [torch.zeros(2, requires_grad=True) for _ in grads]
    for p, tp, g in zip(params, tparams, grads):
        p.grad = taifuse.tensor(g)
        tp.grad = torch.from_numpy(g.copy())
    with pytest.raises(RuntimeError):
        torch.nn.utils.clip_grad_norm_(tparams, 1.0, norm_type=norm_type, error_if_nonfinite=True)
    with pytest.raises(RuntimeError, match="non-finite"):
        optim.clip_grad_norm_(params, 1.0, norm_type=norm_type, error_if_nonfinite=True)
    for p, g in zip(params, grads):
        np.testing.assert_array_equal(p.grad.numpy(), g)
    total = optim.clip_grad_norm_(params, 1.0, norm_type=norm_type)
    ttotal = torch.nn.utils.clip_grad_norm_(tparams, 1.0, norm_type=norm_type)
    np.testing.assert_array_equal(total.numpy(), ttotal.numpy())
    for p, tp in zip(params, tparams):
        np.testing.assert_array_equal(p.grad.numpy(), tp.grad.numpy())


def test_clip_grad_norm_scales_the_gradients_in_place(grad_backend):
    """As torch's mul_: a reference to a gradient taken before clipping sees the clipped values."""
    p = taifuse.tensor(np.zeros(2, np.float32), requires_grad=True)
    p.grad = taifuse.tensor(np.array([3.0, 4.0], np.float32))
    held = p.grad
    optim.clip_grad_norm_([p], 1.0)
    assert p.grad is held
    np.testing.assert_allclose(held.numpy(), [0.6, 0.8], rtol=1e-5)


def test_clip_grad_norm_bad_input(grad_backend):
    p = taifuse.tensor(np.zeros(2, np.float32), requires_grad=True)
    p.grad = taifuse.tensor(np.array([np.inf, 1.0], np.float32))
    with pytest.raises(ValueError, match="max_norm"):
        optim.clip_grad_norm_([p], -1.0)
    with pytest.raises(RuntimeError, match="non-finite"):
        optim.clip_grad_norm_([p], 1.0, error_if_nonfinite=True)
    np.testing.assert_array_equal(p.grad.numpy(), np.array([np.inf, 1.0], np.float32))


def test_train_mlp_example_with_plain_sgd_reaches_its_stated_accuracy():
    """The example trains with AdamW by default (tests/test_nn.py runs that); its hand-written SGD
    loop on the Tensor API stays available behind --optimizer sgd and must reach the same target."""
    import importlib.util as iu
    from pathlib import Path

    spec = iu.spec_from_file_location(
        "train_mlp", Path(__file__).resolve().parents[1] / "examples" / "train_mlp.py"
    )
    example = iu.module_from_spec(spec)
    spec.loader.exec_module(example)
    with taifuse.use_backend("numba" if "numba" in taifuse.available_backends() else "numpy"):
        accuracy = example.main(quiet=True, optimizer="sgd")
    assert accuracy >= example.TARGET_ACCURACY


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_taichi_step_copies_nothing_but_the_finiteness_flag(grad_backend, case):
    """On the taichi backend parameters, gradients and state stay on the device: a step's only
    transfer is the 4-byte answer of the finiteness check (none with check_finite=False)."""
    if grad_backend.name != "taichi":
        pytest.skip("device residency is a property of the taichi backend")
    tg = grad_backend.module()
    init, _ = _problem()
    params = [Parameter(a.copy()) for a in init]
    for check in (True, False):
        opt = case.cls(params, **case.kwargs, check_finite=check)
        for p in params:
            p.grad = taifuse.tensor(np.full(p.shape, 0.25, np.float32))
        opt.step()  # first step: compiles and allocates the state
        tg.reset_transfer_stats()
        for _ in range(3):
            opt.step()
        stats = tg.transfer_stats()
        assert stats["host_to_device"] == 0, stats
        assert stats["device_to_host"] == (3 if check else 0), stats
        assert stats["bytes_device_to_host"] == (12 if check else 0), stats
