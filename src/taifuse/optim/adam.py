"""Adam and AdamW, as ``torch.optim.Adam`` and ``torch.optim.AdamW``."""

from __future__ import annotations

from typing import Any

import numpy as np

from taifuse.optim import _functional as fn
from taifuse.optim.optimizer import Optimizer, check_betas, check_number


class Adam(Optimizer):
    r"""Adam (Kingma & Ba, 2015) with bias correction, amsgrad, maximize and L2 weight decay.

    Args:
        params: an iterable of Tensors, or of dicts (parameter groups with their own settings).
        lr: learning rate, >= 0.
        betas: decay rates (beta1, beta2) of the first and second moments, each in [0, 1).
        eps: added to the denominator, >= 0.
        weight_decay: >= 0; L2 (added to the gradient) here, decoupled in :class:`AdamW`.
        amsgrad: use the running maximum of the second moment (Reddi et al., 2018).
        maximize: ascend the objective instead of descending it.
        check_finite: when True, refuse a step with a NaN or infinite gradient before writing
            anything (``ValueError``), at the cost of one more read of every gradient. Default
            False: a non-finite gradient spreads into the parameters, as in ``torch.optim``
            (NOTE [ Non-finite gradients ] in ``optimizer.py``).
        state_dtype: ``np.float32`` (the default: the state in the parameters' dtype) or
            ``"bfloat16"``: momentum and moments stored in bfloat16 (as uint16 bit patterns), half
            the bytes, widened to float32 for the update and rounded to nearest even when stored
            (float32 parameters only).

    With :math:`g` the gradient (plus :math:`\lambda p`) and :math:`t` the step:

    .. math::
        m \leftarrow \beta_1 m + (1 - \beta_1) g, \quad v \leftarrow \beta_2 v + (1 - \beta_2) g^2, \quad
        p \leftarrow p - \frac{\eta}{1 - \beta_1^t} \frac{m}{\sqrt{v} / \sqrt{1 - \beta_2^t} + \epsilon}

    Example::

        >>> import numpy as np, taifuse
        >>> from taifuse.nn import Parameter
        >>> taifuse.set_backend("numpy")
        >>> w = Parameter(np.array([1.0, -2.0], dtype=np.float32))
        >>> opt = taifuse.optim.Adam([w], lr=0.1)
        >>> (w * w).sum().backward()
        >>> opt.step()
        >>> w.numpy().round(4)  # the first Adam step moves each weight by lr against its gradient's sign
        array([ 0.9, -1.9], dtype=float32)
    """

    _init = staticmethod(fn.adam_init)
    _update = staticmethod(fn.adam_update)
    _STEP_IN_STATE = True
    _DECOUPLED = False

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        maximize: bool = False,
        *,
        check_finite: bool = False,
        state_dtype: Any = np.float32,
    ) -> None:
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "amsgrad": amsgrad,
            "maximize": maximize,
        }
        super().__init__(params, defaults, check_finite=check_finite, state_dtype=state_dtype)

    def _hyper(self, group: dict[str, Any]) -> fn.AdamHyper:
        name = self._name
        beta1, beta2 = check_betas(name, group["betas"])
        return fn.AdamHyper(
            lr=check_number(name, "lr", group["lr"], 0.0),
            beta1=beta1,
            beta2=beta2,
            eps=check_number(name, "eps", group["eps"], 0.0),
            weight_decay=check_number(name, "weight_decay", group["weight_decay"], 0.0),
            amsgrad=bool(group["amsgrad"]),
            maximize=bool(group["maximize"]),
            decoupled=self._DECOUPLED,
        )


class AdamW(Adam):
    r"""AdamW (Loshchilov & Hutter, 2019): :class:`Adam` with decoupled weight decay.

    Identical to :class:`Adam` except that the decay shrinks the parameters directly,
    :math:`p \leftarrow p (1 - \eta \lambda)`, instead of entering the gradient (and so the
    moments); the default ``weight_decay`` is 0.01, as PyTorch's.

    Example::

        >>> import numpy as np, taifuse
        >>> from taifuse.nn import Parameter
        >>> taifuse.set_backend("numpy")
        >>> w = Parameter(np.array([1.0, -2.0], dtype=np.float32))
        >>> opt = taifuse.optim.AdamW([w], lr=0.1, weight_decay=0.5)
        >>> (w * w).sum().backward()
        >>> opt.step()
        >>> w.numpy()  # (1 - 0.1 * 0.5) * w, then the Adam step
        array([ 0.85, -1.8 ], dtype=float32)
    """

    _DECOUPLED = True

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        maximize: bool = False,
        *,
        check_finite: bool = False,
        state_dtype: Any = np.float32,
    ) -> None:
        super().__init__(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            amsgrad,
            maximize,
            check_finite=check_finite,
            state_dtype=state_dtype,
        )
