"""``taifuse.amp.autocast``: PyTorch's autocast for float16, the context manager and decorator.

Autocast's state (thread-local, as PyTorch's), its cast cache (NOTE [ Autocast cache ]) and its
cast policy live in ``taifuse._autocast_state``, at the bottom of the layers, so that the Tensor
layer reads them without importing this package; this module re-exports its public functions. The
casts themselves are autograd ops of the Tensor layer (``taifuse._tensor_functions.autocast_args``, NOTE
[ Autocast ] there).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from taifuse import _autocast_state
from taifuse._autocast_state import clear_autocast_cache, get_autocast_dtype, is_autocast_enabled

if TYPE_CHECKING:  # annotations only: typing.Self is Python 3.11+
    from typing_extensions import Self

__all__ = ["autocast", "clear_autocast_cache", "get_autocast_dtype", "is_autocast_enabled"]

_FLOAT16 = np.dtype(np.float16)

_F = TypeVar("_F", bound=Callable[..., Any])


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
        self._prev.append(_autocast_state.enter(self.fast_dtype, self._enabled, self._cache_enabled))
        return self

    def __exit__(self, *exc: object) -> None:
        _autocast_state.leave(self._prev.pop())

    def __call__(self, fn: _F) -> _F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            # A fresh region per call, so a recursive or concurrent call nests correctly.
            with autocast(self.fast_dtype, self._enabled, self._cache_enabled):
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]
