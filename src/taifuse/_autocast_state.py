"""Autocast's state and cast policy, at the bottom of the layers (it imports nothing of taifuse).

The Tensor ops (``taifuse._tensor_functions.autocast_args``, NOTE [ Autocast ] there), the autograd ops and
``taifuse.checkpoint`` read autocast's state here; ``taifuse.amp.autocast`` is the public face
(the ``autocast`` context manager and decorator) and re-exports the public functions. The state
is thread-local, as PyTorch's: whether autocast is on, its dtype, the nesting depth and the cache
of weight casts. The casts themselves are autograd ops of the Tensor layer; this module says
which dtype each argument goes to and keeps the cache.

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

import contextlib
import functools
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

__all__ = [
    "active_state",
    "autocast_kwargs",
    "cached_cast",
    "cast_target",
    "casts",
    "clear_autocast_cache",
    "enter",
    "get_autocast_dtype",
    "is_autocast_enabled",
    "leave",
    "region",
    "state",
]

_FLOAT16 = np.dtype(np.float16)
_FLOAT32 = np.dtype(np.float32)
_FLOAT64 = np.dtype(np.float64)


class _Local(threading.local):
    # Class attributes: a thread that never used autocast reads None without a lookup miss.
    state: State | None = None  # this thread's state, made on first use
    # The state while autocast is on in this thread, else None: what the ops' hooks read, one
    # attribute (``current.active``), so that autocast costs an op nothing while it is off.
    active: State | None = None


current = _Local()


class State:
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


def state() -> State:
    """This thread's state, made on first use."""
    mine = current.state
    if mine is None:
        mine = current.state = State()
    return mine


def active_state() -> State | None:
    """This thread's state when autocast is on, else ``None`` (what the ops' hooks ask)."""
    return current.active


def is_autocast_enabled() -> bool:
    """Whether ops on this thread run under autocast now (``torch.is_autocast_enabled``)."""
    return active_state() is not None


def get_autocast_dtype() -> np.dtype:
    """The dtype autocast casts to on this thread (``torch.get_autocast_dtype``): float16."""
    return state().dtype


def autocast_kwargs() -> dict[str, Any]:
    """This thread's autocast settings as ``autocast``'s keyword arguments, for a region that
    must compute as this one does later (a checkpoint's recomputation, as PyTorch's)."""
    here = state()
    return {"dtype": here.dtype, "enabled": here.enabled, "cache_enabled": here.cache_enabled}


def clear_autocast_cache() -> None:
    """Drop this thread's cached weight casts (``torch.clear_autocast_cache``); leaving the
    outermost ``autocast`` region does it."""
    state().cache.clear()


# ----------------------------------------------------------------------------- regions


def enter(dtype: np.dtype, enabled: bool, cache_enabled: bool) -> tuple[bool, np.dtype, bool]:
    """Start a region with these (checked) settings on this thread; returns what ``leave`` restores."""
    here = state()
    previous = (here.enabled, here.dtype, here.cache_enabled)
    here.enabled, here.dtype, here.cache_enabled = enabled, dtype, cache_enabled
    here.nesting += 1
    current.active = here if enabled else None
    return previous


def leave(previous: tuple[bool, np.dtype, bool]) -> None:
    """End the innermost region: the outermost one's exit clears the cache (NOTE [ Autocast cache ])."""
    here = state()
    here.nesting -= 1
    if here.nesting == 0:
        here.cache.clear()
    here.enabled, here.dtype, here.cache_enabled = previous
    current.active = here if here.enabled else None


@contextlib.contextmanager
def region(dtype: np.dtype, enabled: bool, cache_enabled: bool) -> Iterator[None]:
    """A region with settings taken from ``autocast_kwargs`` (so already checked): what a
    checkpoint's recomputation runs under."""
    previous = enter(dtype, enabled, cache_enabled)
    try:
        yield
    finally:
        leave(previous)


# ----------------------------------------------------------------------------- cast policy


def cast_target(current: State, policy: str, float_dtypes: Iterable[np.dtype]) -> np.dtype:
    """The dtype an op's floating arguments go to under ``policy`` (NOTE [ Autocast ] in
    _tensor_functions.py): ``"lower"`` the autocast dtype, ``"float32"`` float32, else (``"widest"``) the
    widest of ``float_dtypes``."""
    if policy == "lower":
        return current.dtype
    if policy == "float32":
        return _FLOAT32
    return functools.reduce(np.promote_types, float_dtypes, _FLOAT16)


def casts(dtype: np.dtype, target: np.dtype) -> bool:
    """Whether an argument of ``dtype`` is cast to ``target``: floating ones are, never float64."""
    return dtype.kind == "f" and dtype != target and dtype != _FLOAT64


def cached_cast(
    current: State, tensor: Any, dtype: np.dtype, grad_enabled: bool, cast: Callable[[Any, np.dtype], Any]
) -> Any:
    """``cast(tensor, dtype)``, through this thread's cache when ``tensor`` is a parameter (a
    float32 leaf that requires grad) cast to the autocast dtype (NOTE [ Autocast cache ])."""
    cacheable = (
        current.cache_enabled
        and dtype == current.dtype
        and tensor.dtype == _FLOAT32
        and tensor.is_leaf
        and tensor.requires_grad
    )
    if not cacheable:
        return cast(tensor, dtype)
    key = (id(tensor), grad_enabled)
    hit = current.cache.get(key)
    if hit is not None and hit[0] is tensor:
        return hit[1]
    result = cast(tensor, dtype)
    current.cache[key] = (tensor, result)
    return result
