"""Optimizer state in bfloat16 (``state_dtype="bfloat16"``): the conversion against an independent
formula (and torch's), every backend's fused kernels against the reference, an AdamW training run
against the float32-state run, state_dict round trips and bad input.

# NOTE [ bfloat16 state tolerances ]
# Kernels: the Numba and Taichi kernels run the reference's operations in its order and store
# with the same rounding, so they are compared bit for bit on float32 parameters and bfloat16
# state (measured equal on numba, taichi-cpu and taichi-vulkan over 60 steps of every case). A
# contracted multiply-add on some GPU compiler could move a moment by one float32 ulp and so,
# rarely, flip its bfloat16 rounding; should that ever need allowing, the bound is one bfloat16
# ulp (2**-8 relative) per state element and lr * 2**-8 per parameter per step, not "close".
# Training: bfloat16 keeps 8 significant bits, so each stored moment is off by up to 2**-9
# relative. Over 200 AdamW steps of the MLP below (numpy and numba, measured) the two loss curves
# stay within 0.05% of each other through step 100 and part as the loss keeps falling: the worst
# gap, 1.9% of the float32 run's loss, is at the last step, where the loss is 1% of its start.
# LOSS_RTOL = 5% of the float32 run's loss at every step leaves 2.5x room for other BLAS builds;
# the float32 run must also have trained (its loss below a quarter of the initial one).
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

import taifuse
from taifuse import optim
from taifuse.backends.reference import optim as R
from taifuse.backends.reference.optim import from_bfloat16_bits, to_bfloat16_bits
from taifuse.nn import GELU, Linear, Parameter, Sequential

HAS_TORCH = importlib.util.find_spec("torch") is not None
LOSS_RTOL = 0.05
STEPS = 60

# ----------------------------------------------------------------------------- the conversion


def _independent_bf16(x: np.ndarray) -> np.ndarray:
    """The bfloat16 nearest to each float32 by distances in float64 (ties to the even pattern):
    not the bit trick under test. NaN -> its upper half with the quiet bit set."""
    with np.errstate(invalid="ignore"):  # NaN and inf lanes are computed and then replaced
        return _independent_bf16_lanes(x)


def _independent_bf16_lanes(x: np.ndarray) -> np.ndarray:
    bits = x.view(np.uint32).astype(np.int64)
    sign = np.where(bits >> 31, -1.0, 1.0)
    mag = bits & 0x7FFFFFFF
    lo = mag & 0x7FFF0000  # the candidate towards zero; the other is lo + 0x10000 (inf past the top)
    exponent = np.maximum(lo >> 23, 1)  # subnormals share the smallest normal's spacing
    spacing = np.ldexp(1.0, (exponent - 127 - 7).astype(np.int32))
    lo_value = lo.astype(np.uint32).view(np.float32).astype(np.float64)
    dist_lo = np.abs(x.astype(np.float64)) - lo_value
    dist_hi = spacing - dist_lo
    up = (dist_hi < dist_lo) | ((dist_hi == dist_lo) & ((lo >> 16) & 1 == 1))
    out = ((lo + np.where(up, 0x10000, 0)) >> 16) | np.where(sign < 0, 0x8000, 0)
    is_nan = mag > 0x7F800000
    is_inf = mag == 0x7F800000
    out = np.where(is_nan, (bits >> 16) | 0x0040, out)
    out = np.where(is_inf, bits >> 16, out)
    return out.astype(np.uint16)


def _every_kind_of_float32() -> np.ndarray:
    """Every bfloat16 upper half (normals, subnormals, +-0, +-inf, NaNs) with lower halves that
    are exact, just below, exactly at and just above a tie, and the largest."""
    upper = np.arange(1 << 16, dtype=np.uint32) << 16
    lower = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], np.uint32)
    rng = np.random.default_rng(0)
    random = rng.integers(0, 1 << 32, 200_000, dtype=np.uint64).astype(np.uint32)
    return np.concatenate([(upper[:, None] | lower[None, :]).ravel(), random]).view(np.float32)


def test_to_bfloat16_bits_matches_an_independent_formula():
    x = _every_kind_of_float32()
    got, want = to_bfloat16_bits(x), _independent_bf16(x)
    assert got.dtype == np.uint16
    np.testing.assert_array_equal(got, want)


def test_to_bfloat16_bits_special_values():
    f = np.float32
    cases = [
        (0.0, 0x0000),
        (-0.0, 0x8000),
        (np.inf, 0x7F80),
        (-np.inf, 0xFF80),
        (1.0, 0x3F80),
        (1 + 2**-8, 0x3F80),  # a tie, the kept part even: down
        (1 + 3 * 2**-8, 0x3F82),  # a tie, the kept part odd: up to even
        (-(1 + 3 * 2**-8), 0xBF82),
        (1 + 2**-8 + 2**-20, 0x3F81),  # just past the tie: up
        (float(np.finfo(np.float32).max), 0x7F80),  # rounds past bfloat16's largest: inf
    ]
    # Subnormals are written as float32 bit patterns: the conversion from a Python float would
    # flush them to zero when some library earlier in the process set the FPU's flush-to-zero
    # mode (it happened in the full suite; the conversion under test is integer arithmetic).
    subnormals = [
        (0x00000001, 0x0000),  # 2**-149, the smallest float32 subnormal: rounds to zero
        (0x00010000, 0x0001),  # 2**-133, the smallest bfloat16 subnormal: exact
        (0x80018000, 0x8002),  # -1.5 * 2**-133, a subnormal tie, odd: away to even
    ]
    x = np.concatenate(
        [np.array([x for x, _ in cases], f), np.array([b for b, _ in subnormals], np.uint32).view(f)]
    )
    got = to_bfloat16_bits(x)
    want = np.array([b for _, b in cases] + [b for _, b in subnormals], np.uint16)
    np.testing.assert_array_equal(got, want)
    nan = to_bfloat16_bits(np.array([np.nan, -np.nan], f))
    widened = from_bfloat16_bits(nan)
    assert np.isnan(widened).all() and (nan & 0x0040).all()  # quiet
    # A signalling NaN whose payload lies only in the low half stays a NaN (the quiet bit set).
    snan = np.array([0x7F800001, 0xFF800001], np.uint32).view(np.float32)
    np.testing.assert_array_equal(to_bfloat16_bits(snan), np.array([0x7FC0, 0xFFC0], np.uint16))


def test_from_bfloat16_bits_is_exact_and_round_trips():
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    wide = from_bfloat16_bits(bits)
    assert wide.dtype == np.float32
    np.testing.assert_array_equal(wide.view(np.uint32), bits.astype(np.uint32) << 16)
    quiet_or_number = ~((bits & 0x7F80 == 0x7F80) & (bits & 0x007F != 0) & (bits & 0x0040 == 0))
    np.testing.assert_array_equal(to_bfloat16_bits(wide)[quiet_or_number], bits[quiet_or_number])


@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
def test_to_bfloat16_bits_matches_torch():
    import torch

    x = _every_kind_of_float32()
    want = torch.tensor(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    got = to_bfloat16_bits(x)
    nan = np.isnan(x)
    np.testing.assert_array_equal(got[~nan], want[~nan])
    assert np.isnan(from_bfloat16_bits(got[nan])).all()


# ----------------------------------------------------------------------------- kernels vs the reference

KERNEL_CASES = {
    "sgd-momentum": ("sgd", {"lr": 0.02, "momentum": 0.9, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False, "maximize": False}),
    "sgd-dampening-wd": ("sgd", {"lr": 0.02, "momentum": 0.9, "dampening": 0.3, "weight_decay": 0.01, "nesterov": False, "maximize": False}),
    "sgd-nesterov-maximize": ("sgd", {"lr": 0.02, "momentum": 0.8, "dampening": 0.0, "weight_decay": 0.0, "nesterov": True, "maximize": True}),
    "adam": ("adam", {"lr": 0.01, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0, "decoupled": False, "amsgrad": False, "maximize": False}),
    "adam-l2-amsgrad": ("adam", {"lr": 0.01, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.05, "decoupled": False, "amsgrad": True, "maximize": False}),
    "adam-small-beta1-maximize": ("adam", {"lr": 0.01, "beta1": 0.3, "beta2": 0.9, "eps": 1e-8, "weight_decay": 0.0, "decoupled": False, "amsgrad": False, "maximize": True}),
    "adamw": ("adam", {"lr": 0.01, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01, "decoupled": True, "amsgrad": False, "maximize": False}),
    "adamw-decay-amsgrad": ("adam", {"lr": 0.01, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.2, "decoupled": True, "amsgrad": True, "maximize": False}),
    "lion": ("lion", {"lr": 0.003, "beta1": 0.9, "beta2": 0.99, "weight_decay": 0.0}),
    "lion-decay": ("lion", {"lr": 0.003, "beta1": 0.8, "beta2": 0.95, "weight_decay": 0.5}),
}  # fmt: skip


def _bf16_trajectory(kernels, case: str, n: int, to_dev, to_host) -> list[tuple[np.ndarray, ...]]:
    """STEPS steps of ``case``'s kernel with bfloat16 state; parameters and state after each."""
    kind, kw = KERNEL_CASES[case]
    rng = np.random.default_rng(1)
    p = to_dev(rng.standard_normal(n).astype(np.float32))
    target = rng.standard_normal(n).astype(np.float32)
    m, v, vmax = (to_dev(np.zeros(n, np.uint16)) for _ in range(3))
    out = []
    for k in range(1, STEPS + 1):
        g = to_dev((to_host(p) - target) * np.float32(0.5) + np.float32(0.1 * np.sin(k)))
        if kind == "sgd":
            kernels.sgd_step(p, g, m, *kw.values(), k == 1)
        elif kind == "adam":
            kernels.adam_step(
                p, g, m, v, vmax if kw["amsgrad"] else None, k, kw["lr"], kw["beta1"], kw["beta2"],
                kw["eps"], kw["weight_decay"], kw["decoupled"], kw["amsgrad"], kw["maximize"],
            )  # fmt: skip
        else:
            kernels.lion_step(p, g, m, *kw.values())
        out.append(tuple(to_host(a).copy() for a in (p, m, v, vmax)))
    return out


@pytest.mark.parametrize("case", list(KERNEL_CASES))
def test_bf16_kernels_match_the_reference_bit_for_bit(backend, case):
    """NOTE [ bfloat16 state tolerances ]: same operations, same order, same rounding: equal bits."""
    be = backend.module()
    backend.activate()
    n = (1 << 20) + 1  # past the Numba parallel threshold (NOTE [ A launch wakes the worker ]), odd
    ref = _bf16_trajectory(R, case, n, np.array, np.asarray)
    got = _bf16_trajectory(be, case, n, be.from_numpy, be.to_numpy)
    for k, (a, b) in enumerate(zip(got, ref)):
        for name, x, y in zip(("param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"), a, b):
            assert x.dtype == y.dtype == (np.float32 if name == "param" else np.uint16)
            what = f"{case} step {k + 1}: {name}"
            if backend.arch == "cuda":
                # Taichi's CUDA code generator marks every function unsafe-fp-math
                # (taichi/runtime/cuda/jit_cuda.cpp): products fuse into FMAs and sqrt and division
                # are approximate there, so "same operations, same rounding" does not hold. Found on
                # the H100 (issue 31): up to 0.6% of the float32 parameters off by a few ulps. There:
                # parameters within 64 float32 ulps, the bfloat16 state within one bfloat16 ulp.
                if name == "param":
                    np.testing.assert_allclose(x, y, rtol=2.0**-17, atol=1e-30, err_msg=what)
                else:
                    assert np.abs(x.astype(np.int32) - y.astype(np.int32)).max(initial=0) <= 1, what
                continue
            np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8), what)


def test_reference_kernel_is_the_float32_update_rounded_into_bf16():
    """One Adam step with bfloat16 state equals the float32-state step with the moments rounded
    when stored and the rounded moments used for the parameter, the bias correction folded into
    the scalars (the documented semantics): within a float32 ulp of the unfolded update."""
    rng = np.random.default_rng(2)
    n = 1000
    p0, g = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    m0 = to_bfloat16_bits(rng.standard_normal(n).astype(np.float32) * 0.1)
    v0 = to_bfloat16_bits(rng.random(n).astype(np.float32) * 0.01)
    args = (5, 0.01, 0.9, 0.999, 1e-8, 0.0, True, False, False)
    p, m, v = p0.copy(), m0.copy(), v0.copy()
    R.adam_step(p, g, m, v, None, *args)
    # float32 state, then round the stored moments and redo the parameter update from them
    m32, v32 = from_bfloat16_bits(m0), from_bfloat16_bits(v0)
    p32 = p0.copy()
    R.adam_step(p32, g, m32, v32, None, *args)
    np.testing.assert_array_equal(m, to_bfloat16_bits(m32))
    np.testing.assert_array_equal(v, to_bfloat16_bits(v32))
    hyper = R.AdamHyper(0.01, 0.9, 0.999, 1e-8, 0.0, False, False, True)
    folded = R.in_precision(R.adam_bf16_coefficients(hyper, 5), np.float32)
    mr, vr = from_bfloat16_bits(m), from_bfloat16_bits(v)
    np.testing.assert_array_equal(p, p0 + folded.neg_step_size * mr / (np.sqrt(vr) + folded.eps))
    c = R.in_precision(R.adam_coefficients(hyper, 5), np.float32)
    unfolded = p0 + c.neg_step_size * mr / (np.sqrt(vr) / c.bias_correction2_sqrt + c.eps)
    # Each parameter within one float32 ulp of itself (the two updates round differently, which
    # may move the sum's rounding), plus a few ulps of the update's size (0.01) near zero.
    np.testing.assert_allclose(p, unfolded, rtol=2**-23, atol=1e-8)


# ----------------------------------------------------------------------------- the optimizers


def _mlp_losses(state_dtype, steps: int = 200) -> list[float]:
    taifuse.manual_seed(0)
    model = Sequential(Linear(16, 64), GELU(), Linear(64, 64), GELU(), Linear(64, 4))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 16)).astype(np.float32)
    w_true = rng.standard_normal((16, 4)).astype(np.float32)
    y = np.tanh(x @ w_true).astype(np.float32)
    xt, yt = taifuse.tensor(x), taifuse.tensor(y)
    opt = optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, state_dtype=state_dtype)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = taifuse.functional.mse_loss(model(xt), yt)
        loss.backward()
        opt.step()
        losses.append(float(loss.numpy()))
    return losses


@pytest.mark.parametrize("name", ["numpy", "numba"])
def test_adamw_run_with_bf16_state_tracks_the_float32_run(name):
    """NOTE [ bfloat16 state tolerances ]: the loss curve within LOSS_RTOL at every step."""
    if importlib.util.find_spec(name) is None:
        pytest.skip(f"{name} is not installed")
    with taifuse.use_backend(name):
        f32 = np.array(_mlp_losses(np.float32))
        bf16 = np.array(_mlp_losses("bfloat16"))
    assert f32[-1] < 0.25 * f32[0], f"the float32 run did not train: {f32[0]:.4g} -> {f32[-1]:.4g}"
    worst = float(np.max(np.abs(bf16 - f32) / f32))
    assert worst <= LOSS_RTOL, f"bf16-state loss curve off by {worst:.3%} of the float32 run's"
    assert not np.array_equal(bf16, f32)  # the state really was stored in bfloat16


def _stepped(cls, kwargs, state_dtype, steps=3, seed=0):
    rng = np.random.default_rng(seed)
    params = [Parameter(rng.standard_normal(s).astype(np.float32)) for s in ((5, 3), (4,))]
    opt = cls(params, **kwargs, state_dtype=state_dtype)
    for k in range(steps):
        opt.zero_grad()
        loss = None
        for p in params:
            term = (p * p).sum() * float(1 + k)
            loss = term if loss is None else loss + term
        loss.backward()
        opt.step()
    return params, opt


OPTIMIZERS = [
    (optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    (optim.Adam, {"lr": 0.05, "amsgrad": True}),
    (optim.AdamW, {"lr": 0.05}),
    (optim.Lion, {"lr": 0.01}),
]


@pytest.mark.parametrize("cls, kwargs", OPTIMIZERS, ids=lambda v: getattr(v, "__name__", ""))
def test_state_is_stored_in_half_the_bytes_and_the_state_dict_round_trips(grad_backend, cls, kwargs):
    params, opt = _stepped(cls, kwargs, "bfloat16")
    _, f32_opt = _stepped(cls, kwargs, np.float32)
    for bucket, f32_bucket in zip(opt._buckets[0], f32_opt._buckets[0]):
        for name, arr in bucket.arrays.items():
            assert arr.dtype == np.uint16 and arr.nbytes * 2 == f32_bucket.arrays[name].nbytes
    saved = opt.state_dict()
    assert all(g["state_dtype"] == "bfloat16" for g in saved["param_groups"])
    names = [k for k in saved["state"][0] if k != "step"]
    assert names and all(saved["state"][i][n].dtype == np.uint16 for i in saved["state"] for n in names)
    # the state property shows the values, widened
    for i, p in enumerate(params):
        for n in names:
            np.testing.assert_array_equal(opt.state[p][n].numpy(), from_bfloat16_bits(saved["state"][i][n]))

    # bf16 -> bf16: the same bits, and the next step is the same as the original's
    twins = [Parameter(p.numpy().copy()) for p in params]
    twin_opt = cls(twins, **kwargs, state_dtype="bfloat16")
    twin_opt.load_state_dict(saved)
    again = twin_opt.state_dict()
    for i in saved["state"]:
        for n in names:
            np.testing.assert_array_equal(again["state"][i][n], saved["state"][i][n])
    for group, o in ((params, opt), (twins, twin_opt)):
        o.zero_grad()
        (group[0] * group[0]).sum().backward()
    opt.step()
    twin_opt.step()
    for t, p in zip(twins, params):
        np.testing.assert_array_equal(t.numpy(), p.numpy())

    # bf16 -> float32 widens; float32 -> bf16 rounds to nearest even
    _, widened = _stepped(cls, kwargs, np.float32, steps=0)
    widened.load_state_dict(saved)
    f32_saved = f32_opt.state_dict()
    _, rounded = _stepped(cls, kwargs, "bfloat16", steps=0)
    rounded.load_state_dict(f32_saved)
    for i in saved["state"]:
        for n in names:
            np.testing.assert_array_equal(
                widened.state_dict()["state"][i][n], from_bfloat16_bits(saved["state"][i][n])
            )
            np.testing.assert_array_equal(
                rounded.state_dict()["state"][i][n], to_bfloat16_bits(f32_saved["state"][i][n])
            )


@pytest.mark.parametrize("bad", [np.float64, np.float16, "float16", "bf16", None, 3])
@pytest.mark.parametrize("cls, kwargs", OPTIMIZERS, ids=lambda v: getattr(v, "__name__", ""))
def test_bad_state_dtype_is_named(cls, kwargs, bad):
    taifuse.set_backend("numpy")
    p = Parameter(np.ones(3, np.float32))
    with pytest.raises(ValueError, match="state_dtype"):
        cls([p], **kwargs, state_dtype=bad)


def test_bf16_state_needs_float32_parameters_and_a_known_saved_state_dtype():
    taifuse.set_backend("numpy")
    with pytest.raises(TypeError, match="state_dtype='bfloat16' needs float32 parameters, got float64"):
        optim.AdamW([Parameter(np.ones(3, np.float64))], state_dtype="bfloat16")
    _, opt = _stepped(optim.AdamW, {"lr": 0.01}, "bfloat16")
    saved = opt.state_dict()
    before = opt.state_dict()
    bad_dtype = {**saved, "param_groups": [{**saved["param_groups"][0], "state_dtype": "float16"}]}
    with pytest.raises(ValueError, match="'state_dtype' should be 'float32' or 'bfloat16'"):
        opt.load_state_dict(bad_dtype)
    floats = {i: {**e, "exp_avg": from_bfloat16_bits(e["exp_avg"])} for i, e in saved["state"].items()}
    with pytest.raises(TypeError, match="should hold bfloat16 bits"):
        opt.load_state_dict({**saved, "state": floats})
    after = opt.state_dict()
    for i in before["state"]:
        np.testing.assert_array_equal(after["state"][i]["exp_avg"], before["state"][i]["exp_avg"])


def test_the_optim_bench_suite_times_bf16_state_against_float32_state_and_torch():
    from taifuse.bench.suites import load_cases

    cases = {c.id: c for c in load_cases(["optim"], quick=True, compare_torch=True)}
    case = cases["optim/AdamW step, bfloat16 state, 10x(1000, 512)"]
    assert "state_dtype='bfloat16'" in case.candidate.prepare
    labels = {b.label: b for b in case.baselines}
    assert set(labels) == {"taifuse, float32 state", "torch fused"}
    assert "state_dtype" not in labels["taifuse, float32 state"].prepare
    assert labels["torch fused"].isolated and labels["torch fused"].peer
    elements = 10 * 1000 * 512
    assert case.extra["state_bytes"] == {"bfloat16": 4 * elements, "float32": 8 * elements}
    float32_case = cases["optim/AdamW step, 10x(1000, 512)"]
    assert (
        float32_case.bytes_moved - case.bytes_moved == 2 * 2 * 2 * elements
    )  # two moments, read and written
