"""Array helpers shared by the two host backends (NumPy reference and Numba): data is ``numpy.ndarray``.

:data:`ALLOCATOR` is the host memory's allocator for ``taifuse.pool`` (the protocol is
``pool.Allocator``): both backends' tables export it, so they share one pool.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np

FLOAT_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


# NOTE [ float16 products in blocks ]
# BLAS has no float16 product, and NumPy's own float16 matmul is a scalar loop. So a float16
# product on the host backends (numba's linear_act and its backward; batched ``@`` in
# ``_tensor_math``; attention in ``numba/attention.py``) runs float32 BLAS on blocks converted in
# float32 scratch from the host pool, never on a float32 copy of a whole operand: rows of x (and
# of grad_out) in chunks whose float32 form takes about ``F16_BLOCK_BYTES``, the weight whole when
# its float32 form fits in that too, else in row blocks converted again for each chunk (batched
# ``@`` groups as many small products per BLAS call as fit the budget). Results and gradients are
# summed in float32 (grad_x over the weight's blocks, grad_w over the chunks, grad_b in float64)
# and rounded into the float16 outputs once. A weight gradient larger than the budget is summed
# one block of its rows at a time over all the chunks, so x is converted once per block. Cost:
# the conversions are elementwise passes over blocks that sit in cache, beside products of O(K)
# flops per element (measured figures in docs/amp.md). The budget is sized for cache, not for
# whole tensors: at 4 MiB the example GPT's operands (2048 x 512 at most) were one block each, so
# its autocast step held a float32 copy of every operand it multiplied. 1 MiB took 9.9 MiB off
# that step's peak at the same step time within noise; a large product pays for the shorter BLAS
# panels (4096 x 1024 x 1024 forward and backward: 1.08-1.13x on one thread, more on two threads
# of a loaded machine). Figures and method: docs/amp.md 'Activation memory'. One budget serves
# every host product (the numba kernels and ``_tensor_math``'s batched ``@``, which the numpy
# backend runs without Numba); both read it at call time.
F16_BLOCK_BYTES = 1024 * 1024
# The fewest rows per chunk, so that a very wide weight (a vocabulary head) still gives BLAS
# products of useful height; its scratch then exceeds the budget, still a fraction of the whole.
F16_MIN_ROWS = 64


def f16_rows(rows: int, width: int) -> int:
    """Rows per float16 chunk of a product whose widest float32 row has ``width`` elements."""
    # max(width, 1): a product with no input features (K = 0) has rows of zero width.
    return max(1, min(rows, max(F16_MIN_ROWS, F16_BLOCK_BYTES // (4 * max(width, 1)))))


def f16_weight_rows(rows: int, cols: int) -> int:
    """Rows of a ``(rows, cols)`` float16 weight per float32 block (all of them if it fits)."""
    return max(1, min(rows, F16_BLOCK_BYTES // (4 * max(cols, 1))))


# NOTE [ Hardware float16 conversions ]
# NumPy's float16 casts run in software, 20-40x slower than the F16C conversions the numba backend
# compiles (the note above ``_convert`` in backends/numba/_jit.py); the two round identically. The
# numba backend hands its conversion in here when it is loaded (``set_f16_converter``), and the
# host array code (``taifuse._tensor_math``) converts through ``convert_f16``: the hardware's
# where Numba is loaded, NumPy's otherwise, so that the numpy backend alone never loads Numba.
_f16_converter: Any = None


def set_f16_converter(convert: Any) -> None:
    """Make ``convert(dst, src)`` (``dst[...] = src`` of one shape) the host's float16 conversion."""
    global _f16_converter
    _f16_converter = convert


def fast_f16() -> bool:
    """Whether float16 conversions run in hardware (NOTE [ Hardware float16 conversions ])."""
    return _f16_converter is not None


def convert_f16(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[...] = src``, float16 through the hardware conversions when the numba backend is loaded."""
    if _f16_converter is None:
        np.copyto(dst, src)
    else:
        _f16_converter(dst, src)


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
