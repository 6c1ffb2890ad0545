"""taifuse.optim.lr_scheduler against torch.optim.lr_scheduler: the same lr at every step, for two
parameter groups, from a fresh start, across a state_dict round trip and when resumed with
``last_epoch``; plus the argument checks."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

import taifuse
from taifuse import optim
from taifuse.optim import lr_scheduler as ours

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")

# (class name, constructor arguments): every scheduler, with arguments that exercise its corners
# (StepLR's multiples, cosine past T_max where PyTorch's recursion rises again, warm-up end).
SCHEDULES = [
    ("StepLR", {"step_size": 3, "gamma": 0.5}),
    ("ExponentialLR", {"gamma": 0.9}),
    ("CosineAnnealingLR", {"T_max": 10, "eta_min": 1e-4}),
    ("CosineAnnealingLR", {"T_max": 7}),
    ("LinearLR", {"start_factor": 0.1, "end_factor": 1.0, "total_iters": 6}),
    ("LinearLR", {"start_factor": 1.0, "end_factor": 0.25, "total_iters": 4}),
]
EPOCHS = 25


def test_every_scheduler_is_covered():
    assert {name for name, _ in SCHEDULES} == {n for n in ours.__all__ if n != "LRScheduler"}


def _pair(lrs=(0.1, 0.02)):
    import torch

    taifuse.set_backend("numpy")
    params = [taifuse.tensor(np.zeros(2, np.float32), requires_grad=True) for _ in lrs]
    opt = optim.SGD([{"params": [p], "lr": lr} for p, lr in zip(params, lrs)], lr=1.0)
    tparams = [torch.zeros(2, requires_grad=True) for _ in lrs]
    topt = torch.optim.SGD([{"params": [p], "lr": lr} for p, lr in zip(tparams, lrs)], lr=1.0)
    return opt, topt


def _schedulers(name, kwargs, opt, topt, **extra):
    import torch

    return getattr(ours, name)(opt, **kwargs, **extra), getattr(torch.optim.lr_scheduler, name)(
        topt, **kwargs, **extra
    )


def _assert_same(sched, tsched, opt, topt, where):
    assert sched.get_last_lr() == pytest.approx(tsched.get_last_lr(), rel=1e-12, abs=1e-15), where
    assert [g["lr"] for g in opt.param_groups] == pytest.approx(
        [g["lr"] for g in topt.param_groups], rel=1e-12
    ), where
    assert sched.last_epoch == tsched.last_epoch, where


@pytest.mark.parametrize("name, kwargs", SCHEDULES)
def test_schedule_matches_torch(name, kwargs):
    opt, topt = _pair()
    sched, tsched = _schedulers(name, kwargs, opt, topt)
    _assert_same(sched, tsched, opt, topt, "after construction")
    for epoch in range(EPOCHS):
        opt.step()
        topt.step()
        sched.step()
        tsched.step()
        _assert_same(sched, tsched, opt, topt, f"epoch {epoch + 1}")


@pytest.mark.parametrize("name, kwargs", SCHEDULES)
def test_state_dict_round_trip_matches_torch(name, kwargs):
    opt, topt = _pair()
    sched, tsched = _schedulers(name, kwargs, opt, topt)
    for _ in range(8):
        topt.step()
        sched.step()
        tsched.step()
    saved_sched, saved_opt = sched.state_dict(), opt.state_dict()
    assert "optimizer" not in saved_sched
    # Resume into fresh objects in PyTorch's documented order: the scheduler is created before the
    # optimizer's state is loaded (creating it rewrites the groups' lr), then both states load.
    opt2, _ = _pair(lrs=(5.0, 5.0))
    sched2 = getattr(ours, name)(opt2, **kwargs)
    opt2.load_state_dict(saved_opt)
    sched2.load_state_dict(saved_sched)
    for epoch in range(8, EPOCHS):
        topt.step()
        sched.step()
        sched2.step()
        tsched.step()
        assert sched2.get_last_lr() == pytest.approx(tsched.get_last_lr(), rel=1e-12), f"epoch {epoch + 1}"
        assert sched2.get_last_lr() == sched.get_last_lr()


@pytest.mark.parametrize("name, kwargs", SCHEDULES)
def test_resuming_with_last_epoch_matches_torch(name, kwargs):
    opt, topt = _pair()
    for group in opt.param_groups + topt.param_groups:
        group["initial_lr"] = group["lr"]
    sched, tsched = _schedulers(name, kwargs, opt, topt, last_epoch=4)
    _assert_same(sched, tsched, opt, topt, "resumed")
    for epoch in range(10):
        topt.step()
        sched.step()
        tsched.step()
        _assert_same(sched, tsched, opt, topt, f"resumed epoch {epoch + 1}")


def test_resuming_without_initial_lr_is_refused():
    opt, _ = _pair()
    with pytest.raises(KeyError, match="initial_lr"):
        ours.StepLR(opt, step_size=2, last_epoch=3)


@pytest.mark.parametrize(
    "name, kwargs, message",
    [
        ("StepLR", {"step_size": 0}, "step_size"),
        ("CosineAnnealingLR", {"T_max": 0}, "T_max"),
        ("LinearLR", {"start_factor": 0.0}, "start_factor"),
        ("LinearLR", {"end_factor": 1.5}, "end_factor"),
        ("LinearLR", {"total_iters": 0}, "total_iters"),
        ("ExponentialLR", {"gamma": 0.5, "last_epoch": -2}, "last_epoch"),
    ],
)
def test_bad_arguments_are_named(name, kwargs, message):
    opt, _ = _pair()
    before = [g["lr"] for g in opt.param_groups]
    with pytest.raises(ValueError, match=message):
        getattr(ours, name)(opt, **kwargs)
    assert [g["lr"] for g in opt.param_groups] == before


def test_scheduler_needs_an_optimizer():
    with pytest.raises(TypeError, match="not an Optimizer"):
        ours.StepLR(object(), step_size=1)
