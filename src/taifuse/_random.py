"""Host-side random state: ``manual_seed`` and the per-call seeds that kernels hash.

# NOTE [ Counter-based dropout ]
# Kernels never hold RNG state. Each random op draws one 32-bit ``seed`` here, on the host, and
# the kernel derives element i's random number from ``hash32(i ^ dropout_key(seed))`` (see
# ``reference.dropout``). So every backend draws the same mask for the same seed, a backward
# pass can regenerate the mask from the seed instead of storing it, and checkpointing only has to
# save and restore the generator state below to replay a forward exactly.
"""

from __future__ import annotations

import threading

import numpy as np

_lock = threading.Lock()
# Made on first draw: an unseeded PCG64 draws OS entropy through ``secrets``, whose import
# (hashlib, hmac) would otherwise cost every ``import taifuse`` ~10 ms.
_generator: np.random.Generator | None = None


def _get() -> np.random.Generator:
    global _generator
    if _generator is None:
        _generator = np.random.Generator(np.random.PCG64())
    return _generator


def manual_seed(seed: int) -> None:
    """Seed taifuse's random ops (dropout) for reproducible results.

    Args:
        seed: a non-negative integer.

    Example::

        >>> import taifuse
        >>> taifuse.manual_seed(0)
    """
    global _generator
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"seed should be an int, got {type(seed).__name__}")
    if seed < 0:
        raise ValueError(f"seed should be non-negative, got {seed}")
    with _lock:
        _generator = np.random.Generator(np.random.PCG64(int(seed)))


def next_seed() -> int:
    """Draw the 32-bit seed for one random kernel launch."""
    with _lock:
        return int(_get().integers(0, 2**32, dtype=np.uint64))


def get_rng_state() -> dict:
    """The generator state, for checkpointing to replay random ops."""
    with _lock:
        return _get().bit_generator.state


def set_rng_state(state: dict) -> None:
    with _lock:
        _get().bit_generator.state = state
