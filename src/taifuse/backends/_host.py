"""Array helpers shared by the two host backends (NumPy reference and Numba): data is ``numpy.ndarray``.

:data:`ALLOCATOR` is the host memory's allocator for ``taifuse.pool`` (the protocol is
``pool.Allocator``): both backends' tables export it, so they share one pool.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np

FLOAT_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


def check_dtype(dtype: np.dtype, argname: str) -> None:
    if np.dtype(dtype) not in FLOAT_DTYPES:
        raise TypeError(f"{argname} should be float16, float32 or float64, got {np.dtype(dtype)}")


def is_array(obj: object) -> bool:
    return isinstance(obj, np.ndarray)


def from_numpy(a: np.ndarray) -> np.ndarray:
    # NOTE: not np.ascontiguousarray, which turns a 0-d array into shape (1,).
    return np.asarray(a, order="C")


def to_numpy(a: np.ndarray) -> np.ndarray:
    return a


def empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A new, unpooled array: what the pool allocates on a miss (results come from ``taifuse.pool``)."""
    return np.empty(shape, dtype=dtype)


def compute_dtype(dtype: np.dtype) -> np.dtype:
    """float16 is storage only: arithmetic runs in float32 (float64 stays float64)."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


# ----------------------------------------------------------------------------- the pool's allocator


class _HostLease:
    """Owner of one lease of a host block (NOTE [ Buffer ownership ] in taifuse/pool.py)."""

    __slots__ = ("__array_interface__", "__weakref__", "_block", "_returns")

    def __del__(self) -> None:
        # Never take a lock here (see the NOTE); deque.append is atomic.
        self._returns.append(self._block)


class HostAllocator:
    """Host (NumPy) memory for ``taifuse.pool``: blocks are flat arrays, leases NumPy arrays over them."""

    ON_HOST = True
    _KEY = ("host",)

    def key(self) -> tuple:
        return self._KEY  # one memory space for the whole process

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        return empty(shape, dtype)

    def new_block(self, count: int, dtype: np.dtype) -> tuple[np.ndarray, int]:
        storage = empty((count,), dtype)
        return storage, storage.__array_interface__["data"][0]

    def lease(self, block: Any, returns: deque, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        # The handed-out array's base is the lease, not the block's storage: every view keeps the
        # lease alive (NOTE [ Buffer ownership ]).
        lease = _HostLease()
        lease._block = block
        lease._returns = returns
        lease.__array_interface__ = {
            "data": (block.address, False),
            "shape": shape,
            "typestr": dtype.str,
            "version": 3,
        }
        return np.asarray(lease)

    def fill(self, array: np.ndarray, value: float) -> None:
        array.fill(value)


ALLOCATOR = HostAllocator()
