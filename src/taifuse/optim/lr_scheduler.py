"""Learning-rate schedules with ``torch.optim.lr_scheduler``'s semantics.

A scheduler rewrites ``group['lr']`` of its optimizer's parameter groups each time :meth:`step`
is called (once per epoch or per iteration, after ``optimizer.step()``). As in PyTorch, creating
one records ``group['initial_lr']`` and applies the schedule's value for epoch 0; ``last_epoch``
resumes a schedule (the groups must then hold ``'initial_lr'``, as a loaded optimizer state
does), and the per-step rules are PyTorch's recursive ones, so values match it step for step.
"""

from __future__ import annotations

import math
from typing import Any

from taifuse.optim.optimizer import Optimizer

__all__ = ["CosineAnnealingLR", "ExponentialLR", "LRScheduler", "LinearLR", "StepLR"]


class LRScheduler:
    """Base class: ``step()`` advances ``last_epoch`` and sets every group's lr to ``get_lr()``."""

    def __init__(self, optimizer: Optimizer, last_epoch: int = -1) -> None:
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"{type(optimizer).__name__} is not an Optimizer")
        if isinstance(last_epoch, bool) or not isinstance(last_epoch, int) or last_epoch < -1:
            raise ValueError(f"{type(self).__name__} last_epoch should be an int >= -1, got {last_epoch!r}")
        self.optimizer = optimizer
        if last_epoch == -1:
            for group in optimizer.param_groups:
                group.setdefault("initial_lr", group["lr"])
        else:
            for i, group in enumerate(optimizer.param_groups):
                if "initial_lr" not in group:
                    raise KeyError(
                        f"param 'initial_lr' is not specified in param_groups[{i}] when resuming a scheduler "
                        "with last_epoch >= 0 (load the optimizer's state first)"
                    )
        self.base_lrs: list[float] = [group["initial_lr"] for group in optimizer.param_groups]
        self.last_epoch = last_epoch
        self._step_count = 0
        self._is_initial = True
        try:
            self.step()
        finally:
            self._is_initial = False

    def get_lr(self) -> list[float]:
        """The learning rates for the current ``last_epoch`` (called by :meth:`step`)."""
        raise NotImplementedError

    def get_last_lr(self) -> list[float]:
        """The learning rates the last :meth:`step` set, one per parameter group."""
        return list(self._last_lr)

    def step(self) -> None:
        """Advance the schedule by one epoch (or iteration) and set each group's lr."""
        self._step_count += 1
        self.last_epoch += 1
        values = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, values):
            group["lr"] = lr
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        """Everything but the optimizer, as PyTorch's schedulers save."""
        return {key: value for key, value in self.__dict__.items() if key != "optimizer"}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved."""
        self.__dict__.update(state_dict)

    def _group_lrs(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]


class StepLR(LRScheduler):
    """Multiply the lr by ``gamma`` every ``step_size`` epochs.

    Example::

        >>> import numpy as np, taifuse
        >>> from taifuse.optim import SGD
        >>> from taifuse.optim.lr_scheduler import StepLR
        >>> taifuse.set_backend("numpy")
        >>> opt = SGD([taifuse.tensor(np.zeros(1, np.float32), requires_grad=True)], lr=1.0)
        >>> sched = StepLR(opt, step_size=2, gamma=0.5)
        >>> lrs = []
        >>> for _ in range(5):
        ...     lrs.append(sched.get_last_lr()[0]); opt.step(); sched.step()
        >>> lrs
        [1.0, 1.0, 0.5, 0.5, 0.25]
    """

    def __init__(
        self, optimizer: Optimizer, step_size: int, gamma: float = 0.1, last_epoch: int = -1
    ) -> None:
        if isinstance(step_size, bool) or not isinstance(step_size, int) or step_size < 1:
            raise ValueError(f"StepLR step_size should be a positive int, got {step_size!r}")
        self.step_size = step_size
        self.gamma = gamma
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        if self.last_epoch == 0 or self.last_epoch % self.step_size != 0:
            return self._group_lrs()
        return [lr * self.gamma for lr in self._group_lrs()]


class ExponentialLR(LRScheduler):
    """Multiply the lr by ``gamma`` every epoch."""

    def __init__(self, optimizer: Optimizer, gamma: float, last_epoch: int = -1) -> None:
        self.gamma = gamma
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        if self._is_initial:
            return self._group_lrs()
        return [lr * self.gamma for lr in self._group_lrs()]


class CosineAnnealingLR(LRScheduler):
    r"""Cosine annealing from the initial lr down to ``eta_min`` over ``T_max`` epochs.

    :math:`\eta_t = \eta_{min} + \frac{1}{2}(\eta_0 - \eta_{min})(1 + \cos(\pi t / T_{max}))`,
    computed with PyTorch's recursive rule (which also rises again after ``T_max``).
    """

    def __init__(self, optimizer: Optimizer, T_max: int, eta_min: float = 0.0, last_epoch: int = -1) -> None:
        if isinstance(T_max, bool) or not isinstance(T_max, int) or T_max < 1:
            raise ValueError(f"CosineAnnealingLR T_max should be a positive int, got {T_max!r}")
        self.T_max = T_max
        self.eta_min = eta_min
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        t, t_max, eta_min = self.last_epoch, self.T_max, self.eta_min
        if self._is_initial:
            return self._group_lrs()
        if self._step_count == 1 and t > 0:
            return [
                eta_min + (base - eta_min) * (1 + math.cos(t * math.pi / t_max)) / 2 for base in self.base_lrs
            ]
        if (t - 1 - t_max) % (2 * t_max) == 0:
            return [
                lr + (base - eta_min) * (1 - math.cos(math.pi / t_max)) / 2
                for base, lr in zip(self.base_lrs, self._group_lrs())
            ]
        return [
            (1 + math.cos(math.pi * t / t_max)) / (1 + math.cos(math.pi * (t - 1) / t_max)) * (lr - eta_min)
            + eta_min
            for lr in self._group_lrs()
        ]


class LinearLR(LRScheduler):
    """Scale the lr linearly from ``start_factor`` to ``end_factor`` over ``total_iters`` epochs (warm-up)."""

    def __init__(
        self,
        optimizer: Optimizer,
        start_factor: float = 1.0 / 3,
        end_factor: float = 1.0,
        total_iters: int = 5,
        last_epoch: int = -1,
    ) -> None:
        if not 0 < start_factor <= 1:
            raise ValueError(f"LinearLR start_factor should be in (0, 1], got {start_factor}")
        if not 0 <= end_factor <= 1:
            raise ValueError(f"LinearLR end_factor should be in [0, 1], got {end_factor}")
        if isinstance(total_iters, bool) or not isinstance(total_iters, int) or total_iters < 1:
            raise ValueError(f"LinearLR total_iters should be a positive int, got {total_iters!r}")
        self.start_factor = start_factor
        self.end_factor = end_factor
        self.total_iters = total_iters
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        if self.last_epoch == 0:
            return [lr * self.start_factor for lr in self._group_lrs()]
        if self._is_initial or self.last_epoch > self.total_iters:
            return self._group_lrs()
        delta = self.end_factor - self.start_factor
        return [
            lr * (1.0 + delta / (self.total_iters * self.start_factor + (self.last_epoch - 1) * delta))
            for lr in self._group_lrs()
        ]
