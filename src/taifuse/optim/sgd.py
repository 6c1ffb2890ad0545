"""Stochastic gradient descent with momentum, as ``torch.optim.SGD``."""

from __future__ import annotations

from typing import Any

import numpy as np

from taifuse.optim import _functional as fn
from taifuse.optim.optimizer import Optimizer, check_number


class SGD(Optimizer):
    r"""Stochastic gradient descent with momentum, Nesterov momentum, weight decay and maximize.

    Args:
        params: an iterable of Tensors, or of dicts (parameter groups with their own settings).
        lr: learning rate, >= 0.
        momentum: momentum factor, >= 0 (0 keeps no buffer).
        dampening: dampening of the momentum, >= 0.
        weight_decay: L2 penalty, >= 0 (added to the gradient).
        nesterov: Nesterov momentum (needs momentum > 0 and dampening = 0).
        maximize: ascend the objective instead of descending it.
        check_finite: when True, refuse a step with a NaN or infinite gradient before writing
            anything (``ValueError``), at the cost of one more read of every gradient. Default
            False: a non-finite gradient spreads into the parameters, as in ``torch.optim``
            (NOTE [ Non-finite gradients ] in ``optimizer.py``).
        state_dtype: ``np.float32`` (the default: the state in the parameters' dtype) or
            ``"bfloat16"``: momentum and moments stored in bfloat16 (as uint16 bit patterns), half
            the bytes, widened to float32 for the update and rounded to nearest even when stored
            (float32 parameters only).

    The update, with :math:`d = \pm g + \lambda p` (minus when maximizing) and buffer :math:`b`:

    .. math::
        b \leftarrow d \text{ (first step with momentum)}, \quad b \leftarrow \mu b + (1 - \tau) d, \quad
        p \leftarrow p - \eta \,(d + \mu b \text{ if nesterov else } b)

    Example::

        >>> import numpy as np, taifuse
        >>> from taifuse.nn import Parameter
        >>> taifuse.set_backend("numpy")
        >>> w = Parameter(np.array([1.0, -2.0], dtype=np.float32))
        >>> opt = taifuse.optim.SGD([w], lr=0.1, momentum=0.9)
        >>> (w * w).sum().backward()
        >>> opt.step()
        >>> w.numpy()
        array([ 0.8, -1.6], dtype=float32)
    """

    _init = staticmethod(fn.sgd_init)
    _update = staticmethod(fn.sgd_update)

    def __init__(
        self,
        params: Any,
        lr: float,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        maximize: bool = False,
        *,
        check_finite: bool = False,
        state_dtype: Any = np.float32,
    ) -> None:
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "dampening": dampening,
            "weight_decay": weight_decay,
            "nesterov": nesterov,
            "maximize": maximize,
        }
        super().__init__(params, defaults, check_finite=check_finite, state_dtype=state_dtype)

    def _hyper(self, group: dict[str, Any]) -> fn.SGDHyper:
        hyper = fn.SGDHyper(
            lr=check_number("SGD", "lr", group["lr"], 0.0),
            momentum=check_number("SGD", "momentum", group["momentum"], 0.0),
            dampening=check_number("SGD", "dampening", group["dampening"], 0.0),
            weight_decay=check_number("SGD", "weight_decay", group["weight_decay"], 0.0),
            nesterov=bool(group["nesterov"]),
            maximize=bool(group["maximize"]),
        )
        if hyper.nesterov and (hyper.momentum <= 0 or hyper.dampening != 0):
            raise ValueError(
                "SGD nesterov momentum requires momentum > 0 and dampening = 0, got "
                f"momentum={hyper.momentum}, dampening={hyper.dampening}"
            )
        return hyper
