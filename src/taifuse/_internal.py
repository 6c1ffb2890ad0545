"""The package's internal API to a Tensor's fields: the bottom of the Tensor layer.

A :class:`taifuse.tensor.Tensor` is an array of one backend plus its place in the autograd graph.
Those fields are private (``_data``, ``_be``, ``_ctx``, ...); code elsewhere in the package that
needs them (the engine, the Functions, the optimizers, checkpointing, gradient clipping and
scaling) goes through the functions here, so that a field can change in one module and the
architecture test can check that no module reads another's private names
(tests/test_architecture.py, "private reach"). They do no checking: they are for the package's
own code, which keeps a Tensor's invariants (NOTE [ Tensor storage ] in _tensor_math.py); users
have the Tensor's public API.

``TensorCore`` declares the fields; ``Tensor`` is its one subclass that :func:`wrap` makes (it is
registered by taifuse/tensor.py, which sits above this module: that is how ``wrap`` makes one
without importing it).
"""

from __future__ import annotations

import bisect
import operator
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import numpy as np

from taifuse import backends


class TensorCore:
    """A Tensor's fields: its array, the backend it lives on, the node that made it and its
    gradient. Subclassed by :class:`taifuse.tensor.Tensor`, which is the public face."""

    _data: Any  # an array of backend _be (a strided view on the host: NOTE [ Views ])
    _be: ModuleType
    _ctx: Any  # the Function that made it (taifuse/_engine.py); None for a leaf
    _requires_grad: bool
    _grad: TensorCore | None
    # Where autograd may put this leaf's first gradient, a GradSlot (NOTE [ Gradient slots ]).
    _grad_slot: Any = None
    # Callables run once this leaf's gradient of a backward pass is complete (NOTE [ Gradient
    # hooks ] in _engine.py); None while it has none.
    _post_accumulate_hooks: Any = None
    # Its version counter, a one-element list that in-place ops bump and that its views share
    # (NOTE [ Version counters ] in _engine.py).
    _version_counter: list[int]
    # The tensor whose memory this one views (PyTorch's ``_base``; never itself a view), or None.
    _base: TensorCore | None = None
    # A view made under no_grad of a tensor that requires grad (or of such a view): in-place
    # changes to it with grad mode on are refused, as PyTorch refuses them.
    _no_grad_view: bool = False


_tensor_class: type[TensorCore] = TensorCore


def register_tensor_class(cls: type[TensorCore]) -> None:
    """Make ``cls`` what :func:`wrap` returns (taifuse/tensor.py registers ``Tensor``)."""
    global _tensor_class
    _tensor_class = cls


def is_tensor(value: Any) -> bool:
    return isinstance(value, TensorCore)


def wrap(array: Any, be: ModuleType, node: Any = None) -> Any:
    """A new Tensor on ``array`` (no copy) of backend ``be``: outside the graph, or made by
    ``node`` (then it requires grad, as after :func:`attach`)."""
    t = _tensor_class.__new__(_tensor_class)
    t._data, t._be, t._ctx, t._requires_grad, t._grad = array, be, node, node is not None, None
    t._version_counter = [0]
    return t


def share_version(t: TensorCore, of: TensorCore, recorded: bool) -> None:
    """Make ``t`` (a new Tensor on ``of``'s memory) a view of ``of`` (NOTE [ Views ]); ``recorded``:
    the op that made it is in the graph."""
    t._version_counter = of._version_counter
    t._base = of if of._base is None else of._base
    if of._no_grad_view or (not recorded and of._requires_grad):
        t._no_grad_view = True


# In-place changes, in order (NOTE [ Version counters ] in _engine.py): INPLACE_EPOCH[0] counts
# them, and _changes holds the last ones as (epoch, memory extent) for the engine's check.
INPLACE_EPOCH = [0]
_changes: list[tuple[int, tuple]] = []
_MAX_CHANGES = 4096


def bump_version(t: TensorCore, changed: Any = None) -> None:
    """Count an in-place change of ``t``'s memory (of ``changed``, a view of it, when only that
    part changed): its version (shared with its views) and the log of changed memory the engine
    checks a node's saved arrays against (NOTE [ Version counters ] in _engine.py)."""
    t._version_counter[0] += 1
    INPLACE_EPOCH[0] += 1
    if len(_changes) >= _MAX_CHANGES:
        del _changes[: _MAX_CHANGES // 2]
    _changes.append((INPLACE_EPOCH[0], memory_extent(t._data if changed is None else changed)))


def changes_since(epoch: int) -> list[tuple]:
    """The memory extents changed in place after ``epoch`` (of those the log still holds: the
    last few thousand changes)."""
    first = bisect.bisect_right(_changes, epoch, key=operator.itemgetter(0))
    return [extent for _, extent in _changes[first:]]


def memory_extent(array: Any) -> tuple:
    """Where ``array``'s elements lie: (address of the first byte, past the last byte) of a host
    array, ("device", id of the storage) of a device array (a device view shares its storage)."""
    if isinstance(array, np.ndarray):
        lo = hi = array.__array_interface__["data"][0]
        if array.size == 0:
            return (lo, lo)
        for n, step in zip(array.shape, array.strides):
            if step < 0:
                lo += step * (n - 1)
            else:
                hi += step * (n - 1)
        return (lo, hi + array.itemsize)
    return ("device", id(getattr(array, "storage", array)))


def extents_overlap(a: tuple, b: tuple) -> bool:
    if a[0] == "device" or b[0] == "device":
        return a == b
    return a[0] < b[1] and b[0] < a[1] and a[0] < a[1] and b[0] < b[1]


# The readers are attribute getters (C code, no Python frame: the engine calls them per op and
# argument, and a Python function each was about 1% of a small MLP step's time).
data: Callable[[TensorCore], Any] = operator.attrgetter("_data")  # t's array itself, not a copy
backend: Callable[[TensorCore], ModuleType] = operator.attrgetter("_be")  # the backend module it lives on
node: Callable[[TensorCore], Any] = operator.attrgetter("_ctx")  # its creator (grad_fn); None: a leaf
requires_grad: Callable[[TensorCore], bool] = operator.attrgetter("_requires_grad")  # t.requires_grad
grad_slot: Callable[[TensorCore], Any] = operator.attrgetter("_grad_slot")  # its GradSlot, or None
post_accumulate_hooks: Callable[[TensorCore], Any] = operator.attrgetter("_post_accumulate_hooks")
version_counter: Callable[[TensorCore], list[int]] = operator.attrgetter("_version_counter")
base: Callable[[TensorCore], Any] = operator.attrgetter("_base")  # the tensor it views, or None


def attach(t: TensorCore, node: Any) -> None:
    """Make ``node`` the creator of ``t`` in the graph (``t`` then requires grad)."""
    t._ctx, t._requires_grad = node, True


def set_data(t: TensorCore, array: Any) -> None:
    """Replace ``t``'s array by ``array`` (of ``t``'s shape, dtype and backend: not checked)."""
    t._data = array


def grad_data(t: TensorCore) -> Any:
    """The array of ``t.grad`` (None when ``t`` has no gradient)."""
    return None if t._grad is None else t._grad._data


def set_grad(t: TensorCore, grad: TensorCore | None) -> None:
    """Set ``t.grad`` without the public setter's checks (the engine's gradients are right)."""
    t._grad = grad


def set_grad_slot_field(t: TensorCore, slot: Any) -> None:
    t._grad_slot = slot


def set_post_accumulate_hooks(t: TensorCore, hooks: Any) -> None:
    """Replace ``t``'s post-accumulate gradient hooks (a dict, or None for none)."""
    t._post_accumulate_hooks = hooks


def common_backend(tensors: Sequence[TensorCore], op: str) -> ModuleType:
    """The backend the Tensor arguments share (the active one when there are none)."""
    if not tensors:
        return backends.active()
    be = tensors[0]._be
    for t in tensors[1:]:
        if t._be is not be:
            raise TypeError(
                f"{op}: tensors live on different backends ({be.NAME!r} and {t._be.NAME!r}); "
                "create them under the same backend"
            )
    return be
