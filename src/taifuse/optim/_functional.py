"""The optimizer update rules as pure functions over a typed state.

Each optimizer is a pair: ``*_init`` makes its state (flat arrays the size of a run of
parameters, plus a step count), and ``*_update`` runs one fused step through a backend's kernel
table and returns the new state. The arrays are updated in place by the kernel (they are the
optimizer's flat buffers); the returned state carries the new step count. The math itself is
specified once, in ``taifuse.backends.reference.optim``, and implemented by every backend.

Hyperparameters are NamedTuples too, so an update is a function of (kernels, param, grad, state,
hyper) and nothing else; the optimizer classes only hold hyperparameters and state.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any, NamedTuple

from taifuse.backends.reference.optim import AdamHyper  # the spec's type, shared with the kernels

Zeros = Callable[[], Any]  # makes a zeroed array the size and dtype of the run


# ----------------------------------------------------------------------------- SGD (simplest first)


class SGDHyper(NamedTuple):
    lr: float
    momentum: float
    dampening: float
    weight_decay: float
    nesterov: bool
    maximize: bool


class SGDState(NamedTuple):
    # Steps taken WITH momentum: 0 means no momentum buffer yet (PyTorch's ``momentum_buffer is
    # None``), so the next step with momentum starts the buffer from the gradient, undamped, even
    # when momentum was switched on after plain steps.
    step: int
    momentum_buffer: Any | None  # None without momentum


def sgd_init(hyper: SGDHyper, zeros: Zeros) -> SGDState:
    """A fresh SGD state: a momentum buffer only when ``momentum != 0``."""
    return SGDState(0, zeros() if hyper.momentum != 0 else None)


def sgd_update(kernels: ModuleType, param: Any, grad: Any, state: SGDState, hyper: SGDHyper) -> SGDState:
    """One SGD step; the first step with momentum copies the gradient into the momentum buffer
    (PyTorch's rule), and a step without momentum leaves the count (and any buffer) as it was."""
    kernels.sgd_step(
        param,
        grad,
        state.momentum_buffer,
        hyper.lr,
        hyper.momentum,
        hyper.dampening,
        hyper.weight_decay,
        hyper.nesterov,
        hyper.maximize,
        state.step == 0,
    )
    return state._replace(step=state.step + 1) if hyper.momentum != 0 else state


# ----------------------------------------------------------------------------- Adam and AdamW


class AdamState(NamedTuple):
    step: int
    exp_avg: Any
    exp_avg_sq: Any
    max_exp_avg_sq: Any | None  # None without amsgrad


def adam_init(hyper: AdamHyper, zeros: Zeros) -> AdamState:
    """A fresh Adam state: zero moments (and a zero running max with amsgrad)."""
    return AdamState(0, zeros(), zeros(), zeros() if hyper.amsgrad else None)


def adam_update(kernels: ModuleType, param: Any, grad: Any, state: AdamState, hyper: AdamHyper) -> AdamState:
    """One Adam (or, with ``hyper.decoupled``, AdamW) step with bias correction for step ``state.step + 1``."""
    step = state.step + 1
    kernels.adam_step(
        param,
        grad,
        state.exp_avg,
        state.exp_avg_sq,
        state.max_exp_avg_sq,
        step,
        hyper.lr,
        hyper.beta1,
        hyper.beta2,
        hyper.eps,
        hyper.weight_decay,
        hyper.decoupled,
        hyper.amsgrad,
        hyper.maximize,
    )
    return state._replace(step=step)


# ----------------------------------------------------------------------------- Lion


class LionHyper(NamedTuple):
    lr: float
    beta1: float
    beta2: float
    weight_decay: float


class LionState(NamedTuple):
    step: int
    exp_avg: Any


def lion_init(hyper: LionHyper, zeros: Zeros) -> LionState:
    """A fresh Lion state: a zero momentum."""
    return LionState(0, zeros())


def lion_update(kernels: ModuleType, param: Any, grad: Any, state: LionState, hyper: LionHyper) -> LionState:
    """One Lion step: the sign of the interpolated momentum, decoupled weight decay."""
    kernels.lion_step(param, grad, state.exp_avg, hyper.lr, hyper.beta1, hyper.beta2, hyper.weight_decay)
    return state._replace(step=state.step + 1)
