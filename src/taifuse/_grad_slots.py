"""Gradient slots and storage binding: how an optimizer's flat buffers become a Tensor's storage
and the place of its gradients (NOTE [ Gradient slots ], NOTE [ Buffer hooks ]).

The engine (taifuse/_engine.py) lends a leaf's slot for its first gradient; the optimizers
(taifuse/optim/optimizer.py) make the slots and bind parameters to their flat buffer. The public
names are re-exported by taifuse.tensor.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from taifuse._internal import TensorCore, data, set_data, set_grad_slot_field

__all__ = ["GradSlot", "bind_storage", "set_grad_slot", "storage_is"]


# NOTE [ Gradient slots ]
# An optimizer keeps a bucket's gradients side by side in one flat buffer, so that a step is one
# kernel launch (NOTE [ Flat buffers ] in taifuse/optim/optimizer.py), and gives each of its leaves
# a GradSlot: the leaf's place in that buffer. Autograd writes a leaf's first gradient straight
# into the slot, so that the step needs no copy. But PyTorch's ``.grad`` is a tensor of its own:
# once ``zero_grad()`` (or anyone) drops it, the next backward makes a new one, and a gradient the
# user kept (``g = w.grad``, ``w.grad.numpy()``, any view of either) never changes again. So a slot
# is *lent*: every gradient made in it is an array whose base is a fresh lease object, which every
# view of that memory keeps alive (the memory is exported through ``__array_interface__``, as the
# pool does: NOTE [ Buffer ownership ] in taifuse/pool.py), and the slot keeps only a weak
# reference to the lease. While the lease lives, something may still read the old gradient: the
# slot is not lent again, the next backward makes a gradient of its own as PyTorch would, and the
# optimizer moves its bucket to a fresh flat buffer before it copies anything in. Once the lease is
# gone (the usual loop: ``zero_grad()`` dropped the only reference), the slot is lent again, free.


class _SlotLease:
    """Owns one lent gradient's memory: every NumPy view of it keeps this object alive."""

    def __init__(self, buffer: np.ndarray, interface: dict) -> None:
        self.__array_interface__ = interface
        self._buffer = buffer  # keeps the optimizer's flat buffer alive as long as the gradient


class GradSlot:
    """A leaf's place in an optimizer's flat gradient buffer (NOTE [ Gradient slots ]).

    ``array`` is the place itself (a host view into the flat buffer, the leaf's shape). Autograd
    asks :meth:`lend` for the memory of a leaf's first gradient; the optimizer asks :meth:`holds`
    whether a ``.grad`` already lies in the slot and :meth:`in_use` whether it may write there.
    """

    __slots__ = ("_interface", "_lease", "array")

    def __init__(self, array: np.ndarray) -> None:
        self.array = array
        self._interface = dict(array.__array_interface__)
        self._lease: weakref.ref | None = None

    def in_use(self) -> bool:
        """Whether a gradient lent from this slot may still be read by someone."""
        return self._lease is not None and self._lease() is not None

    def lend(self) -> np.ndarray | None:
        """The slot's memory as an array for a new gradient, or None while the last one lives on."""
        if self.in_use():
            return None
        lease = _SlotLease(self.array, self._interface)
        self._lease = weakref.ref(lease)
        return np.asarray(lease)

    def holds(self, data: Any) -> bool:
        """Whether ``data`` is the array of the gradient currently lent from this slot."""
        lease = None if self._lease is None else self._lease()
        return lease is not None and isinstance(data, np.ndarray) and data.base is lease


# NOTE [ Buffer hooks ]
# The optimizers keep parameters and gradients in flat buffers (NOTE [ Flat buffers ] in
# taifuse/optim/optimizer.py). These three functions are the only way code outside the Tensor layer
# places a tensor's storage or gradient there, so that a Tensor's invariants (C-contiguous data of
# its shape and dtype on its backend; gradients lent, not shared) are kept here.


def bind_storage(t: TensorCore, view: np.ndarray) -> None:
    """Make host array ``view`` (``t``'s shape and dtype, C-contiguous) the storage of ``t``, with
    ``t``'s values copied in: an optimizer moves a parameter into its flat buffer this way."""
    current = data(t)
    if not isinstance(current, np.ndarray) or not isinstance(view, np.ndarray):
        raise TypeError(f"bind_storage: only host (NumPy) storage can be rebound, not {t.backend!r} arrays")
    if view.shape != t.shape or view.dtype != t.dtype or not view.flags.c_contiguous:
        raise ValueError(
            f"bind_storage: a tensor of shape {t.shape} and dtype {t.dtype} needs C-contiguous storage of "
            f"that shape and dtype, got {view.shape} {view.dtype}"
        )
    if current is not view:
        np.copyto(view, current)
        set_data(t, view)


def storage_is(t: TensorCore, view: Any) -> bool:
    """Whether ``view`` is still ``t``'s storage (code that replaced it, such as a module's
    ``load_state_dict``, makes this False)."""
    return data(t) is view


def set_grad_slot(t: TensorCore, slot: GradSlot | None) -> None:
    """Give leaf ``t`` a slot for its gradients (None: none), see NOTE [ Gradient slots ]."""
    if slot is not None and (slot.array.shape != t.shape or slot.array.dtype != t.dtype):
        raise ValueError(
            f"set_grad_slot: a slot of shape {slot.array.shape} and dtype {slot.array.dtype} for a tensor of "
            f"shape {t.shape} and dtype {t.dtype}"
        )
    set_grad_slot_field(t, slot)
