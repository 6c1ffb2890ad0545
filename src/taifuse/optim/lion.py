"""Lion, from Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"."""

from __future__ import annotations

from typing import Any

import numpy as np

from taifuse.optim import _functional as fn
from taifuse.optim.optimizer import Optimizer, check_betas, check_number


class Lion(Optimizer):
    r"""Lion: the sign of an interpolated momentum, with decoupled weight decay.

    Args:
        params: an iterable of Tensors, or of dicts (parameter groups with their own settings).
        lr: learning rate, >= 0 (typically 3-10x smaller than AdamW's).
        betas: (beta1, beta2), each in [0, 1): beta1 interpolates the update, beta2 the momentum.
        weight_decay: decoupled decay, >= 0 (typically 3-10x larger than AdamW's).
        check_finite: when True, refuse a step with a NaN or infinite gradient before writing
            anything (``ValueError``), at the cost of one more read of every gradient. Default
            False: a non-finite gradient spreads into the parameters, as in ``torch.optim``
            (NOTE [ Non-finite gradients ] in ``optimizer.py``).
        state_dtype: ``np.float32`` (the default: the state in the parameters' dtype) or
            ``"bfloat16"``: momentum and moments stored in bfloat16 (as uint16 bit patterns), half
            the bytes, widened to float32 for the update and rounded to nearest even when stored
            (float32 parameters only).

    .. math::
        c = \beta_1 m + (1 - \beta_1) g, \quad
        p \leftarrow p - \eta\,(\operatorname{sign}(c) + \lambda p), \quad
        m \leftarrow \beta_2 m + (1 - \beta_2) g

    Example::

        >>> import numpy as np, taifuse
        >>> from taifuse.nn import Parameter
        >>> taifuse.set_backend("numpy")
        >>> w = Parameter(np.array([1.0, -2.0], dtype=np.float32))
        >>> opt = taifuse.optim.Lion([w], lr=0.25)
        >>> (w * w).sum().backward()
        >>> opt.step()
        >>> w.numpy()
        array([ 0.75, -1.75], dtype=float32)
    """

    _init = staticmethod(fn.lion_init)
    _update = staticmethod(fn.lion_update)

    def __init__(
        self,
        params: Any,
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        *,
        check_finite: bool = False,
        state_dtype: Any = np.float32,
    ) -> None:
        defaults = {"lr": lr, "betas": betas, "weight_decay": weight_decay}
        super().__init__(params, defaults, check_finite=check_finite, state_dtype=state_dtype)

    def _hyper(self, group: dict[str, Any]) -> fn.LionHyper:
        beta1, beta2 = check_betas("Lion", group["betas"])
        return fn.LionHyper(
            lr=check_number("Lion", "lr", group["lr"], 0.0),
            beta1=beta1,
            beta2=beta2,
            weight_decay=check_number("Lion", "weight_decay", group["weight_decay"], 0.0),
        )
