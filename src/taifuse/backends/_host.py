"""Array helpers shared by the two host backends (NumPy reference and Numba): data is ``numpy.ndarray``."""

from __future__ import annotations

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
    return np.empty(shape, dtype=dtype)


def compute_dtype(dtype: np.dtype) -> np.dtype:
    """float16 is storage only: arithmetic runs in float32 (float64 stays float64)."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)
