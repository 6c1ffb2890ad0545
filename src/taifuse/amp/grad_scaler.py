"""Dynamic loss scaling for float16 training, as ``torch.amp.GradScaler``.

# NOTE [ GradScaler's unscale pass ]
# ``unscale_`` multiplies every gradient the optimizer will use by 1/scale and checks it for NaN
# and infinity in the same pass: one ``unscale_check`` call per backend over the optimizer's flat
# gradient buffers (NOTE [ Flat buffers ] in taifuse/optim/optimizer.py), so one read and one write
# of each gradient and, on a device backend, one 4-byte read-back per step (PyTorch's
# ``_amp_foreach_non_finite_check_and_unscale_`` followed by ``.item()`` in ``step``). The arrays
# are the ``.grad`` storage itself (``_Bucket.grads_in_place``), so ``p.grad`` sees the unscaled
# values, and ``clip_grad_norm_`` between ``unscale_`` and ``step`` clips what the step will use.
# The scale is a float32 held on the host (PyTorch's is a float32 tensor): reading it costs nothing,
# and ``scale(loss)`` multiplies by it on the loss's backend.

# NOTE [ A scale of zero ]
# Each non-finite step halves the scale (backoff_factor 0.5); from 2**16, the 166th in a row rounds
# it to 0.0 in float32, and it stays 0 (0 times any factor). PyTorch's GradScaler goes on from
# there, and so does this one, step for step: 1/scale is inf, the scaled loss is loss * 0 (NaN for
# an infinite loss, so the gradients are NaN and the step is skipped, parameters unchanged). The
# check is of the gradients before they are multiplied by inf, as PyTorch's: should the loss turn
# finite while the scale is 0, the gradients are 0, pass the check, and come out of unscale_ as
# NaN (0 * inf), which the step then writes into the parameters, as PyTorch's does.
"""

from __future__ import annotations

import enum
import math
import numbers
from collections import abc, defaultdict
from types import ModuleType
from typing import Any

import numpy as np

from taifuse._internal import backend, grad_data
from taifuse.optim.optimizer import Optimizer
from taifuse.tensor import Tensor

__all__ = ["GradScaler", "OptState"]


class OptState(enum.Enum):
    """Where an optimizer is in the current iteration: ``unscale_`` and ``step`` move it on,
    ``update`` starts the next iteration."""

    READY = 0
    UNSCALED = 1
    STEPPED = 2


def _fresh_state() -> dict[str, Any]:
    return {"stage": OptState.READY, "found_inf_per_device": {}}


# ----------------------------------------------------------------------------- validation


def _real(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise ValueError(f"GradScaler {name} should be a finite number, got {value!r}")
    return float(value)


def _check_scale(name: str, value: Any) -> float:
    value = _real(name, value)
    # The scale is a float32: a value that rounds to 0 or to infinity there cannot be one.
    with np.errstate(over="ignore", under="ignore"):
        as_f32 = np.float32(value)
    if not (value > 0 and as_f32 > 0 and np.isfinite(as_f32)):
        raise ValueError(f"GradScaler {name} should be > 0 and within float32's range, got {value}")
    return value


def _check_loaded_scale(value: Any) -> float:
    # A loaded scale may be 0: the scale a long run of overflows backs off to (NOTE [ A scale of
    # zero ]), which a state dict saved then holds, from this scaler or from PyTorch's.
    value = _real("scale", value)
    if value == 0.0:
        return value
    return _check_scale("scale", value)


def _check_growth_factor(value: Any) -> float:
    value = _real("growth_factor", value)
    if not value > 1.0:
        raise ValueError(f"GradScaler growth_factor should be > 1.0, got {value}")
    return value


def _check_backoff_factor(value: Any) -> float:
    value = _real("backoff_factor", value)
    if not 0.0 < value < 1.0:
        raise ValueError(f"GradScaler backoff_factor should be in (0, 1), got {value}")
    return value


def _check_count(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < low:
        raise ValueError(f"GradScaler {name} should be an int >= {low}, got {value!r}")
    return int(value)


# ----------------------------------------------------------------------------- the scale's update


def update_scale(
    scale: np.float32,
    growth_tracker: int,
    found_inf: bool,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
) -> tuple[np.float32, int]:
    """The next (scale, growth tracker), as PyTorch's ``_amp_update_scale_``.

    A non-finite gradient multiplies the scale by ``backoff_factor`` and resets the tracker; a
    finite step counts one more, and the ``growth_interval``-th in a row multiplies the scale by
    ``growth_factor`` (unless that overflows float32) and resets the count. The products are
    taken in float64 and rounded to float32 once, as PyTorch's CPU kernel does.
    """
    with np.errstate(over="ignore"):
        if found_inf:
            return np.float32(float(scale) * backoff_factor), 0
        successful = growth_tracker + 1
        if successful == growth_interval:
            grown = np.float32(float(scale) * growth_factor)
            return (grown if np.isfinite(grown) else scale), 0
        return scale, successful


# ----------------------------------------------------------------------------- GradScaler


class GradScaler:
    r"""Scales the loss so that float16 gradients neither underflow nor, for long, overflow.

    As ``torch.amp.GradScaler``: :meth:`scale` multiplies the loss by the scale before
    ``backward()``; :meth:`step` divides the optimizer's gradients by it (:meth:`unscale_`), checks
    them for NaN and infinity in the same pass, and runs ``optimizer.step()`` only if none was
    found (a skipped step changes no parameter, optimizer state or step count); :meth:`update`
    then adjusts the scale:

    .. math::
        s \leftarrow \begin{cases} s \cdot \text{backoff\_factor} & \text{a gradient was not finite} \\
        s \cdot \text{growth\_factor} & \text{growth\_interval finite steps in a row} \\
        s & \text{otherwise} \end{cases}

    Call :meth:`unscale_` yourself to work on the true gradients before the step (clipping with
    ``taifuse.optim.clip_grad_norm_``); once per optimizer per iteration. The scale is a float32.
    With ``enabled=False`` every method passes through: :meth:`scale` returns its argument,
    :meth:`step` calls ``optimizer.step()``, :meth:`get_scale` returns 1.0.

    Float16 gradients are refused, as PyTorch refuses them: keep the parameters (and so their
    gradients) in float32 and compute in float16 under ``autocast``.

    Args:
        init_scale: the first scale, > 0.
        growth_factor: what the scale is multiplied by after ``growth_interval`` finite steps, > 1.
        backoff_factor: what the scale is multiplied by after a non-finite step, in (0, 1).
        growth_interval: how many finite steps in a row grow the scale, an int >= 1.
        enabled: False makes every method a pass-through.

    Differences from PyTorch: no ``device`` argument (the scale lives on the host and multiplies
    the loss on its own backend); bad arguments raise ``ValueError`` where PyTorch asserts, and
    calls out of order (``unscale_`` before ``scale``) raise ``RuntimeError``.

    Example::

        >>> import numpy as np, taifuse
        >>> import taifuse.functional as F
        >>> from taifuse import nn, optim
        >>> from taifuse.amp import GradScaler
        >>> taifuse.set_backend("numpy")
        >>> model = nn.Linear(3, 1)
        >>> opt = optim.SGD(model.parameters(), lr=0.1)
        >>> scaler = GradScaler(init_scale=2.0**10, growth_interval=2)
        >>> x, y = taifuse.tensor(np.ones((4, 3), np.float32)), taifuse.tensor(np.zeros((4, 1), np.float32))
        >>> for _ in range(2):
        ...     opt.zero_grad()
        ...     scaler.scale(F.mse_loss(model(x), y)).backward()
        ...     scaler.unscale_(opt)
        ...     _ = optim.clip_grad_norm_(model.parameters(), max_norm=1.0)
        ...     scaler.step(opt)
        ...     scaler.update()
        >>> scaler.get_scale()
        2048.0
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ) -> None:
        self._enabled = bool(enabled)
        self._init_scale = _check_scale("init_scale", init_scale)
        self._growth_factor = _check_growth_factor(growth_factor)
        self._backoff_factor = _check_backoff_factor(backoff_factor)
        self._growth_interval = _check_count("growth_interval", growth_interval, 1)
        self._init_growth_tracker = 0
        # Made by the first scale(), as PyTorch's, so that a loaded state dict sets where they start.
        self._scale: np.float32 | None = None
        self._growth_tracker: int | None = None
        self._per_optimizer_states: defaultdict[int, dict[str, Any]] = defaultdict(_fresh_state)

    def _check_started(self, funcname: str) -> None:
        if self._scale is None or self._growth_tracker is None:
            raise RuntimeError(
                f"GradScaler: attempted {funcname} before the scale was made. This may indicate your "
                "script did not use scaler.scale(loss or outputs) earlier in the iteration."
            )

    # -- scaling the loss

    def scale(self, outputs: Any) -> Any:
        """``outputs`` (a Tensor, or lists and tuples of them, nested) multiplied by the scale.

        Lists and tuples come back as lists and tuples; another iterable as a lazy ``map``. The
        product is taken on each Tensor's backend with the float32 scale, and its dtype follows
        PyTorch's promotion against the scale (a float32 0-d tensor): a 0-d float16 loss comes
        back float32 (so a large loss times the scale stays finite), a float16 tensor of one or
        more dims stays float16 (rounded once from the float32 product), float32 and float64 stay.
        """
        if not self._enabled:
            return outputs
        if self._scale is None:
            self._scale = np.float32(self._init_scale)
            self._growth_tracker = self._init_growth_tracker
        factor = float(self._scale)

        def apply(value: Any) -> Any:
            if isinstance(value, Tensor):
                if value.dtype != np.float16:
                    return value * factor
                product = value.float() * factor  # exact operands, one rounding: PyTorch's opmath
                return product if value.ndim == 0 else product.half()
            if isinstance(value, abc.Iterable) and not isinstance(value, (np.ndarray, str, bytes)):
                mapped = map(apply, value)
                return type(value)(mapped) if isinstance(value, (list, tuple)) else mapped
            raise ValueError(
                f"outputs must be a Tensor or an iterable of Tensors, got {type(value).__name__}"
            )

        return apply(outputs)

    # -- unscaling and stepping

    def unscale_(self, optimizer: Any) -> None:
        """Divide ``optimizer``'s gradients by the scale, in place, checking them for NaN and infinity.

        Optional: :meth:`step` unscales if this was not called. Once per optimizer between two
        :meth:`update` calls; a second call, or one after :meth:`step`, raises ``RuntimeError``.
        The gradients are checked and scaled in one fused pass (NOTE [ GradScaler's unscale pass ]).
        """
        if not self._enabled:
            return
        self._check_started("unscale_")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update()."
            )
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        # The reciprocal in float64, rounded to float32 once, as PyTorch (float32 division may be
        # inexact). A scale that backed off to 0 (about 166 non-finite steps in a row from 2**16)
        # gives inf, as PyTorch's reciprocal does: a gradient times inf is inf or NaN, so the
        # step is skipped while the overflows last (NOTE [ A scale of zero ]).
        with np.errstate(divide="ignore"):
            inv_scale = np.float32(np.float64(1.0) / np.float64(self._scale))
        state["found_inf_per_device"] = self._unscale_grads(optimizer, inv_scale)
        state["stage"] = OptState.UNSCALED

    def _unscale_grads(self, optimizer: Any, inv_scale: np.float32) -> dict[str, bool]:
        """One ``unscale_check`` per backend; {backend name: found_inf}, only for backends with gradients."""
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None and p.grad.dtype == np.float16:
                    raise ValueError("Attempting to unscale FP16 gradients.")
        found: dict[str, bool] = {}
        for be, arrays in _grad_arrays(optimizer).values():
            found[be.NAME] = bool(be.unscale_check(arrays, inv_scale))
        return found

    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """:meth:`unscale_` (unless done this iteration), then ``optimizer.step(*args, **kwargs)``
        if every gradient was finite; returns what that step returns, or None when skipped.

        A closure (``closure=`` keyword) is refused, as PyTorch refuses it.
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        self._check_started("step")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        if not state["found_inf_per_device"]:
            raise RuntimeError("No inf checks were recorded for this optimizer (it has no gradients).")
        retval = None
        if not any(state["found_inf_per_device"].values()):
            retval = optimizer.step(*args, **kwargs)
        state["stage"] = OptState.STEPPED
        return retval

    def update(self, new_scale: float | Tensor | None = None) -> None:
        """Adjust the scale for the next iteration from this iteration's checks (see the class),
        or set it to ``new_scale`` (a number or a one-element Tensor; the growth tracker stays)."""
        if not self._enabled:
            return
        self._check_started("update")
        if new_scale is not None:
            if isinstance(new_scale, Tensor):
                if new_scale.size != 1 or new_scale.requires_grad:
                    raise ValueError(
                        "GradScaler.update new_scale should be a number or a one-element Tensor with "
                        f"requires_grad=False, got a Tensor of shape {new_scale.shape}"
                    )
                new_scale = new_scale.item()
            self._scale = np.float32(_check_scale("new_scale", new_scale))
        else:
            found_infs = [
                found
                for state in self._per_optimizer_states.values()
                for found in state["found_inf_per_device"].values()
            ]
            if not found_infs:
                raise RuntimeError("No inf checks were recorded prior to update.")
            self._scale, self._growth_tracker = update_scale(
                self._scale,
                self._growth_tracker,
                any(found_infs),
                self._growth_factor,
                self._backoff_factor,
                self._growth_interval,
            )
        self._per_optimizer_states = defaultdict(_fresh_state)

    # -- settings and state

    def get_scale(self) -> float:
        """The current scale (``init_scale`` before the first :meth:`scale`), or 1.0 when disabled."""
        if not self._enabled:
            return 1.0
        return self._init_scale if self._scale is None else float(self._scale)

    def get_growth_factor(self) -> float:
        """The factor the scale grows by."""
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        """Set the factor the scale grows by (> 1)."""
        self._growth_factor = _check_growth_factor(new_factor)

    def get_backoff_factor(self) -> float:
        """The factor the scale backs off by."""
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the factor the scale backs off by (in (0, 1))."""
        self._backoff_factor = _check_backoff_factor(new_factor)

    def get_growth_interval(self) -> int:
        """How many finite steps in a row grow the scale."""
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        """Set how many finite steps in a row grow the scale (an int >= 1)."""
        self._growth_interval = _check_count("growth_interval", new_interval, 1)

    def _get_growth_tracker(self) -> int:
        if not self._enabled:
            return 0
        return self._init_growth_tracker if self._growth_tracker is None else self._growth_tracker

    def is_enabled(self) -> bool:
        """Whether this scaler scales (``enabled`` at construction)."""
        return self._enabled

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state in PyTorch's keys: ``scale``, ``growth_factor``, ``backoff_factor``,
        ``growth_interval``, ``_growth_tracker``; an empty dict when disabled. Take it after :meth:`update`."""
        if not self._enabled:
            return {}
        return {
            "scale": self.get_scale(),
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": self._get_growth_tracker(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a state from :meth:`state_dict` (or from ``torch.amp.GradScaler``'s); a no-op when
        disabled. Every entry is checked before anything changes."""
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError(
                "The source state dict is empty, possibly because it was saved from a disabled instance of GradScaler."
            )
        keys = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
        missing = [k for k in keys if k not in state_dict]
        if missing:
            raise ValueError(f"GradScaler state dict lacks {missing}")
        scale = _check_loaded_scale(_number(state_dict["scale"]))
        growth_factor = _check_growth_factor(_number(state_dict["growth_factor"]))
        backoff_factor = _check_backoff_factor(_number(state_dict["backoff_factor"]))
        growth_interval = _check_count("growth_interval", _number(state_dict["growth_interval"]), 1)
        tracker = _check_count("_growth_tracker", _number(state_dict["_growth_tracker"]), 0)
        self._init_scale = scale
        self._growth_factor, self._backoff_factor = growth_factor, backoff_factor
        self._growth_interval = growth_interval
        self._init_growth_tracker = tracker
        if self._scale is not None:
            self._scale = np.float32(scale)
        if self._growth_tracker is not None:
            self._growth_tracker = tracker


def _number(value: Any) -> Any:
    """A loaded entry as a Python number when it is a one-element tensor (taifuse's or torch's)."""
    if isinstance(value, Tensor) or hasattr(value, "item") and not isinstance(value, numbers.Number):
        return value.item()
    return value


def _grad_arrays(optimizer: Any) -> dict[int, tuple[ModuleType, list[Any]]]:
    """Every gradient ``optimizer`` will use, as flat arrays that are the ``.grad`` storage, by backend.

    A taifuse optimizer gives its flat buffers (NOTE [ GradScaler's unscale pass ]); any other
    object with ``param_groups`` gives each ``.grad`` by itself.
    """
    out: dict[int, tuple[ModuleType, list[Any]]] = {}
    if isinstance(optimizer, Optimizer):
        for be, parts in optimizer.grad_buffers():
            out.setdefault(id(be), (be, []))[1].extend(parts)
        return out
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                out.setdefault(id(backend(p.grad)), (backend(p.grad), []))[1].append(grad_data(p).reshape(-1))
    return out
