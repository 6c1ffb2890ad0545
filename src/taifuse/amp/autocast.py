"""``taifuse.amp.autocast``: PyTorch's autocast for float16, its state and its cast cache.

This module holds the state only (thread-local, as PyTorch's): whether autocast is on, its dtype,
the nesting depth and the cache of weight casts. The casts themselves are autograd ops of the
Tensor layer (``taifuse.tensor.autocast_args``, NOTE [ Autocast ] there), which reads this state;
this module imports nothing of taifuse, so that the Tensor layer may read it.

NOTE [ Autocast cache ]
As PyTorch's (``cached_cast`` in aten/src/ATen/autocast_mode.cpp): a cast to the autocast dtype of
a float32 leaf tensor that requires grad (a parameter) is kept in a per-thread cache keyed on that
tensor, so a weight used by several ops in one forward is cast once and its one cast node adds up
their gradients. The cache lives as long as the outermost autocast region (any ``autocast``,
enabled or not, counts for the nesting) and is cleared when it exits, so the next step casts the
updated weights afresh. Unlike PyTorch, the key includes the grad mode: a cast made under
``no_grad`` has no graph, and reusing it with grad enabled would cut the weight out of the
backward without an error; here each mode gets its own cast.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

if TYPE_CHECKING:  # annotations only: typing.Self is Python 3.11+
    from typing_extensions import Self

__all__ = ["autocast", "clear_autocast_cache", "get_autocast_dtype", "is_autocast_enabled"]

_FLOAT16 = np.dtype(np.float16)

_local = threading.local()

_F = TypeVar("_F", bound=Callable[..., Any])


class _State:
    """One thread's autocast state (PyTorch keeps the same fields per thread)."""

    __slots__ = ("cache", "cache_enabled", "dtype", "enabled", "nesting")

    def __init__(self) -> None:
        self.enabled = False
        self.dtype = _FLOAT16
        self.cache_enabled = True
        self.nesting = 0
        # (id(tensor), grad mode) -> (tensor, its cast): NOTE [ Autocast cache ]. The tensor is held
        # so that its id is not reused while the entry lives.
        self.cache: dict[tuple[int, bool], tuple[Any, Any]] = {}


def _state() -> _State:
    state = getattr(_local, "state", None)
    if state is None:
        state = _local.state = _State()
    return state


def active_state() -> _State | None:
    """This thread's state when autocast is on, else ``None`` (what the ops' hooks ask)."""
    state = getattr(_local, "state", None)
    return state if state is not None and state.enabled else None


def is_autocast_enabled() -> bool:
    """Whether ops on this thread run under autocast now (``torch.is_autocast_enabled``)."""
    return active_state() is not None


def get_autocast_dtype() -> np.dtype:
    """The dtype autocast casts to on this thread (``torch.get_autocast_dtype``): float16."""
    return _state().dtype


def autocast_kwargs() -> dict[str, Any]:
    """This thread's autocast settings as ``autocast``'s keyword arguments, for a region that
    must compute as this one does later (a checkpoint's recomputation, as PyTorch's)."""
    state = _state()
    return {"dtype": state.dtype, "enabled": state.enabled, "cache_enabled": state.cache_enabled}


def clear_autocast_cache() -> None:
    """Drop this thread's cached weight casts (``torch.clear_autocast_cache``); leaving the
    outermost ``autocast`` region does it."""
    _state().cache.clear()


def _check_dtype(dtype: Any) -> np.dtype:
    if isinstance(dtype, str) and dtype.lower() in ("bfloat16", "bf16"):
        raise ValueError(
            "autocast: dtype should be float16, got bfloat16: bfloat16 is not a compute dtype in "
            "taifuse (NumPy and Taichi have none; it is a storage format for optimizer state only)"
        )
    try:
        resolved = np.dtype(dtype)
    except TypeError:
        raise ValueError(f"autocast: dtype should be float16, got {dtype!r}") from None
    if resolved != _FLOAT16:
        raise ValueError(f"autocast: dtype should be float16 (the only autocast dtype here), got {resolved}")
    return resolved


class autocast:
    """Run the ops inside in mixed precision, as ``torch.autocast`` does with ``dtype=torch.float16``.

    A context manager or a decorator. Inside, on this thread, ops on Tensors pick their dtype:

    * ``F.linear`` (and ``nn.Linear``), batched ``@`` and ``F.scaled_dot_product_attention`` cast
      float32 arguments to float16 and return float16;
    * ``F.softmax``, ``F.log_softmax``, ``F.layer_norm``, ``F.rms_norm``, ``F.cross_entropy``,
      ``F.mse_loss`` and ``Tensor.sum``/``Tensor.mean`` cast float16 arguments to float32 and
      return float32;
    * ``+ - * /``, ``taifuse.cat``/``stack``, ``F.add_relu``, ``F.mul_relu`` and ``F.affine`` run
      in the widest dtype of their arguments; every other op runs in its input's dtype.

    float64 arguments are never cast. The casts are autograd ops: gradients reach float32
    parameters in float32. Casts of parameters (float32 leaves that require grad) are cached until
    the outermost region exits (NOTE [ Autocast cache ]), so run ``backward`` after the region,
    as in PyTorch. Regions nest and an inner ``autocast(enabled=False)`` turns autocast off (ops
    then run in their inputs' dtypes, as in PyTorch, so float16 results from the outer region stay
    float16 there). NumPy arrays given to ``taifuse.functional`` ops are computed as given: autocast
    acts on the Tensor (autograd) path.

    Args:
        dtype: the low-precision dtype, ``np.float16`` (the only one: bfloat16 is not a compute
            dtype in taifuse, so it and anything else raise ``ValueError``).
        enabled: ``False`` makes the region (or decorated function) run without autocast.
        cache_enabled: ``False`` casts parameters at every use instead of once per region.

    Example::

        >>> import numpy as np, taifuse, taifuse.functional as F
        >>> from taifuse.amp import autocast
        >>> x = taifuse.tensor(np.ones((2, 3), np.float32))
        >>> w = taifuse.tensor(np.ones((4, 3), np.float32), requires_grad=True)
        >>> with autocast():
        ...     y = F.linear(x, w)
        ...     p = F.softmax(y)
        >>> y.dtype, p.dtype
        (dtype('float16'), dtype('float32'))
        >>> p.sum().backward()
        >>> w.grad.dtype
        dtype('float32')
    """

    def __init__(self, dtype: Any = np.float16, enabled: bool = True, cache_enabled: bool = True) -> None:
        for name, value in (("enabled", enabled), ("cache_enabled", cache_enabled)):
            if not isinstance(value, (bool, np.bool_)):
                raise TypeError(f"autocast: {name} should be a bool, got {value!r}")
        self.fast_dtype = _check_dtype(dtype)
        self._enabled = bool(enabled)
        self._cache_enabled = bool(cache_enabled)
        self._prev: list[tuple[bool, np.dtype, bool]] = []

    def __enter__(self) -> Self:
        state = _state()
        self._prev.append((state.enabled, state.dtype, state.cache_enabled))
        state.enabled, state.dtype, state.cache_enabled = self._enabled, self.fast_dtype, self._cache_enabled
        state.nesting += 1
        return self

    def __exit__(self, *exc: object) -> None:
        state = _state()
        state.nesting -= 1
        if state.nesting == 0:
            state.cache.clear()
        state.enabled, state.dtype, state.cache_enabled = self._prev.pop()

    def __call__(self, fn: _F) -> _F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            # A fresh region per call, so a recursive or concurrent call nests correctly.
            with autocast(self.fast_dtype, self._enabled, self._cache_enabled):
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]
