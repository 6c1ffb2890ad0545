"""A reuse pool for the buffers kernels write into: host NumPy buffers, Taichi ndarrays and fields.

Every result a kernel writes (functional ops, autograd intermediates and gradients, tensor
arithmetic on the host, optimizer scratch) is allocated through :func:`empty`, which takes a
buffer of the right dtype and size class from the active backend's :class:`BufferPool` or, on a
miss, from the backend's own ``empty``. A buffer goes back to the pool when nothing refers to it
any more (NOTE [ Buffer ownership ]), so a training step that repeats the same shapes stops
allocating after its first step.

Example::

    >>> import numpy as np, taifuse
    >>> from taifuse import pool
    >>> taifuse.set_backend("numpy")
    >>> p = pool.BufferPool("example")
    >>> a = p.acquire((256,), np.float32)     # a miss: allocated
    >>> del a                                 # nothing refers to it: back to the pool
    >>> b = p.acquire((16, 16), np.float32)   # same dtype and size class: reused
    >>> s = p.stats()
    >>> (s.allocations, s.reuses, s.hit_rate)
    (1, 1, 0.5)

Knobs: ``TAIFUSE_POOL_MAX_MB`` caps the bytes of free buffers a pool keeps (default
:data:`DEFAULT_MAX_MB`; least recently returned buffers are evicted first; ``0`` keeps none), and
``with get_pool().disabled():`` bypasses a pool (every allocation goes to the backend);
``TAIFUSE_POOL=0`` disables every pool from the start.

# NOTE [ Buffer ownership ]
# A pooled buffer has exactly one owner object per lease, and the buffer returns to the pool when
# (and only when) that owner is garbage: then nothing can read or write the memory any more, so
# handing it out again cannot alias anything. The owner must be an object that EVERY view of the
# buffer keeps alive:
#
# * Host (NumPy): NumPy collapses view chains -- a view's ``.base`` is the first array that owns
#   its memory or whose base is not an ndarray -- so a finalizer on a handed-out array that is
#   itself a view of the pool's storage would fire while views of it are alive. Instead each lease
#   is a :class:`_HostLease` (not an ndarray) exporting the memory through
#   ``__array_interface__``; the handed-out array's base is that lease, and every view, reshape,
#   slice or dtype view of it keeps either the handed-out array or the lease alive. The lease's
#   ``__del__`` returns the storage. Copies (a non-contiguous reshape, ``np.array``) own their
#   memory and keep nothing alive, as they should.
# * Taichi ndarrays: a DeviceArray's ``reshape`` views share its ``_storage`` object, so each lease
#   hands out a fresh ``_storage`` (:func:`_device_lease`: a Python ``ti.Ndarray`` over the same
#   device allocation, with no memory of its own) and its ``__del__`` returns the allocation.
# * Taichi fields are the exception: a template kernel's cache keeps every field it was given
#   alive, so "nothing refers to it" never happens. A field is leased through a
#   :class:`FieldLease` handle, which owns it: the field returns when the lease is released (``with``
#   block, :meth:`FieldLease.release`) or the handle is garbage. Using the field after that is a bug.
#
# The pool itself keeps every block it allocated reachable until it frees it, leased or not. A lease
# that dies inside a garbage cycle (Taichi's compiler keeps the arguments of the call that compiled a
# kernel in one) would otherwise take its block and storage into the cycle's garbage, and the
# collector calls every finalizer in that garbage -- the storage's too, which frees the device
# memory -- even though the lease's ``__del__`` hands the block back to the pool.
#
# Returns never take the pool's lock: ``__del__`` may run inside the garbage collector on any
# thread, even on one that holds the lock. A returning owner appends its block to a deque (atomic
# in CPython); the pool drains that deque under its lock before it hands anything out or reports.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
from collections import OrderedDict, deque
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

__all__ = [
    "DEFAULT_MAX_FIELDS",
    "DEFAULT_MAX_MB",
    "BufferPool",
    "FieldLease",
    "PoolStats",
    "empty",
    "get_pool",
    "host_pool",
    "size_class",
    "zeros",
]

DEFAULT_MAX_MB = 1024
# Taichi crashes at its 512th live SNode tree (FACTS.md); every pooled field is one tree.
DEFAULT_MAX_FIELDS = 256
_MIN_CLASS_BYTES = 256


def size_class(nbytes: int) -> int:
    """The bytes actually allocated for a request of ``nbytes`` (host buffers).

    At least 256 bytes; above that, ``nbytes`` rounded up to a multiple of a quarter of the
    largest power of two below it (1024 -> 1024, 1025 -> 1280, 3000 -> 3072), so a pooled buffer
    wastes at most a quarter of the request and requests of nearby sizes share a class.
    """
    cls = _class_cache.get(nbytes)
    if cls is None:
        if nbytes <= _MIN_CLASS_BYTES:
            cls = _MIN_CLASS_BYTES
        else:
            step = 1 << max((nbytes - 1).bit_length() - 3, 0)
            cls = -(-nbytes // step) * step
        if len(_class_cache) < 4096:
            _class_cache[nbytes] = cls
    return cls


_class_cache: dict[int, int] = {}


def _max_bytes_from_env() -> int:
    raw = os.environ.get("TAIFUSE_POOL_MAX_MB", "")
    if raw.strip() == "":
        return DEFAULT_MAX_MB * 2**20
    try:
        mb = float(raw)
    except ValueError:
        raise ValueError(f"TAIFUSE_POOL_MAX_MB should be a number of MiB, got {raw!r}") from None
    if not math.isfinite(mb) or mb < 0:
        raise ValueError(f"TAIFUSE_POOL_MAX_MB should be a non-negative number of MiB, got {raw!r}")
    return int(mb * 2**20)


@dataclass(frozen=True)
class PoolStats:
    """A snapshot of a pool's counters.

    Attributes:
        allocations: buffers the pool allocated from the backend (misses).
        reuses: requests served with a pooled buffer (hits).
        hit_rate: ``reuses / (allocations + reuses)``; 0.0 before any request.
        bytes_pooled: bytes of free buffers the pool holds, ready for reuse (kept under the cap).
        bytes_in_use: bytes of buffers handed out and still referenced.
        peak_bytes: the most ``bytes_pooled + bytes_in_use`` has been since the pool was made (or
            :meth:`BufferPool.reset_stats`).
        evictions: free buffers dropped to keep ``bytes_pooled`` under the byte cap (or the
            field count under its limit); :meth:`BufferPool.clear` and
            :meth:`BufferPool.shrink_to_fit` are not counted here, they return what they freed.
    """

    allocations: int
    reuses: int
    hit_rate: float
    bytes_pooled: int
    bytes_in_use: int
    peak_bytes: int
    evictions: int


class _Block:
    """One pooled allocation: the backend storage and its accounting."""

    __slots__ = ("address", "dtype", "key", "nbytes", "storage")

    def __init__(self, key: tuple, storage: Any, nbytes: int, dtype: np.dtype, address: int = 0) -> None:
        self.key = key
        self.storage = storage
        self.nbytes = nbytes
        self.dtype = dtype
        self.address = address


# ----------------------------------------------------------------------------- host leases


class _HostLease:
    """Owner of one lease of a host block (see NOTE [ Buffer ownership ])."""

    __slots__ = ("__array_interface__", "__weakref__", "_block", "_returns")

    def __del__(self) -> None:
        # Never take a lock here (see the NOTE); deque.append is atomic.
        self._returns.append(self._block)


def _host_view(block: _Block, returns: deque, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
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


# ----------------------------------------------------------------------------- device leases

_device_lease_class: type | None = None


def _device_lease(block: _Block, returns: deque) -> Any:
    """A per-lease ``ti.Ndarray`` over ``block``'s device allocation (see NOTE [ Buffer ownership ])."""
    global _device_lease_class
    if _device_lease_class is None:
        from taichi.lang._ndarray import ScalarNdarray

        class _DeviceLease(ScalarNdarray):
            # Built without __init__ (no allocation of its own); it borrows the pooled storage's
            # attributes, including the C++ handle ``arr``, so kernels see the same memory.
            # Held by the class: at interpreter exit this module's globals (sys) may be None already.
            _is_finalizing = staticmethod(sys.is_finalizing)

            def __del__(self) -> None:
                if self._is_finalizing():
                    return
                self._returns.append(self._block)

        _device_lease_class = _DeviceLease
    lease = _device_lease_class.__new__(_device_lease_class)
    lease.__dict__.update(block.storage.__dict__)
    lease._block = block
    lease._returns = returns
    return lease


# ----------------------------------------------------------------------------- field leases


class FieldLease:
    """A Taichi field leased from a pool; it owns the field (see NOTE [ Buffer ownership ]).

    Use it as a context manager, or call :meth:`release`; a lease that is garbage-collected
    releases itself. ``lease.field`` is the ``ti.field`` (contents are whatever the last user left
    unless it came from ``field(..., zero=True)``).
    """

    __slots__ = ("__weakref__", "_block", "_returns", "field")
    _is_finalizing = staticmethod(sys.is_finalizing)  # as _DeviceLease's: globals may be gone at exit

    def __init__(self, block: _Block, returns: deque) -> None:
        self._block: _Block | None = block
        self._returns = returns
        self.field = block.storage[0]

    def release(self) -> None:
        """Give the field back to its pool; the lease (and ``self.field``) must not be used after."""
        block, self._block = self._block, None
        if block is not None:
            self.field = None
            self._returns.append(block)

    def __enter__(self) -> Any:
        return self.field

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        if not self._is_finalizing():
            self.release()


# ----------------------------------------------------------------------------- the pool


class BufferPool:
    """Free buffers of one backend/device, handed out by dtype and size class.

    Host pools (the ``numpy`` and ``numba`` backends share one: both hold ``numpy.ndarray``)
    round requests up to :func:`size_class`. Taichi pools key ndarrays by exact element count
    (a ``ti.Ndarray``'s length is visible to kernels and copies) and fields by exact shape.

    Args:
        name: for messages and ``repr``.
        backend: the backend module whose ``empty`` allocates on a miss (``None``: NumPy's).
        max_bytes: cap on :attr:`PoolStats.bytes_pooled` (default from ``TAIFUSE_POOL_MAX_MB``).
        max_fields: most Taichi fields alive at once (leased or free).

    Thread-safe: acquisitions and the bookkeeping take one lock; returns never block.
    """

    def __init__(
        self,
        name: str,
        backend: ModuleType | None = None,
        *,
        max_bytes: int | None = None,
        max_fields: int = DEFAULT_MAX_FIELDS,
    ) -> None:
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"BufferPool max_bytes should be non-negative, got {max_bytes}")
        self.name = name
        self.backend = backend
        self._device = backend is not None and not backend.is_array(np.empty(0))
        self.max_bytes = _max_bytes_from_env() if max_bytes is None else int(max_bytes)
        self.max_fields = int(max_fields)
        self._lock = threading.Lock()
        self._returns: deque[_Block] = deque()
        self._free: dict[tuple, list[_Block]] = {}
        self._lru: OrderedDict[int, _Block] = OrderedDict()  # free blocks, least recently returned first
        # Every block, leased or free, stays reachable from here: see NOTE [ Buffer ownership ].
        self._owned: dict[int, _Block] = {}
        self._disabled = 1 if os.environ.get("TAIFUSE_POOL", "").strip() == "0" else 0
        self._fields_alive = 0
        # For tests and debugging: fill every buffer handed out (not zeroed) with this value, so
        # that a kernel reading memory it did not write shows up (NaN is a good choice).
        self.fill_on_reuse: float | None = None
        self._bytes_pooled = 0
        self._bytes_in_use = 0
        self._reset_counters()

    def _reset_counters(self) -> None:
        self._allocations = 0
        self._reuses = 0
        self._evictions = 0
        self._peak = self._bytes_pooled + self._bytes_in_use

    def __repr__(self) -> str:
        return f"BufferPool({self.name!r}, max_bytes={self.max_bytes})"

    # -- the public surface

    @property
    def enabled(self) -> bool:
        """False inside :meth:`disabled`."""
        return self._disabled == 0

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """Within the block (on every thread), allocations bypass this pool and go to the backend.

        Buffers leased before still return to the pool when they are dropped.
        """
        with self._lock:
            self._disabled += 1
        try:
            yield
        finally:
            with self._lock:
                self._disabled -= 1

    def stats(self) -> PoolStats:
        """The counters now (buffers dropped since the last call are accounted first)."""
        with self._lock:
            self._drain()
            requests = self._allocations + self._reuses
            return PoolStats(
                allocations=self._allocations,
                reuses=self._reuses,
                hit_rate=self._reuses / requests if requests else 0.0,
                bytes_pooled=self._bytes_pooled,
                bytes_in_use=self._bytes_in_use,
                peak_bytes=self._peak,
                evictions=self._evictions,
            )

    def reset_stats(self) -> None:
        """Zero allocations, reuses and evictions; restart the peak from the bytes held now."""
        with self._lock:
            self._drain()
            self._reset_counters()

    def clear(self) -> int:
        """Free every pooled (not in-use) buffer; return the bytes freed."""
        return self.shrink_to_fit(0)

    def shrink_to_fit(self, max_bytes: int) -> int:
        """Free the least recently returned free buffers until at most ``max_bytes`` stay pooled.

        Returns the bytes freed. Buffers in use are untouched.
        """
        if max_bytes < 0:
            raise ValueError(f"shrink_to_fit: max_bytes should be non-negative, got {max_bytes}")
        with self._lock:
            self._drain()
            freed, _ = self._evict_until(lambda: self._bytes_pooled <= max_bytes)
        return freed

    def acquire(self, shape: tuple[int, ...], dtype: Any, *, zero: bool = False) -> Any:
        """A buffer of ``shape`` and ``dtype``: a NumPy array, or a Taichi ``DeviceArray``.

        Its contents are undefined (stale data from an earlier user) unless ``zero`` is True.
        Empty shapes and a disabled pool go straight to the backend.
        """
        dtype = np.dtype(dtype)
        shape = tuple(map(int, shape))
        size = math.prod(shape)
        if size == 0 or self._disabled:
            out = self._raw_empty(shape, dtype)
            if zero and size:
                self._zero(out)
            return out
        nbytes = size * dtype.itemsize
        key = (dtype, size) if self._device else (dtype, size_class(nbytes))
        with self._lock:
            if self._returns:
                self._drain()
            block = self._take(key)
            if block is not None:
                self._reuses += 1
            else:
                block = self._new_block(key, dtype, size, nbytes)
                self._owned[id(block)] = block
                self._allocations += 1
            self._bytes_in_use += block.nbytes
            held = self._bytes_in_use + self._bytes_pooled
            self._peak = max(self._peak, held)
        out = self._lease(block, shape, dtype)
        if zero:
            self._zero(out)
        elif self.fill_on_reuse is not None:
            self._fill(out, self.fill_on_reuse)
        return out

    def field(self, shape: tuple[int, ...], dtype: Any, *, zero: bool = False) -> FieldLease:
        """Lease a Taichi field of ``shape`` and ``dtype`` (reused, never one per call).

        A new field lives in its own SNode tree (``ti.FieldsBuilder``), freed with
        ``SNodeTree.destroy()`` when evicted or cleared. At most ``max_fields`` fields exist at
        once: free ones are evicted first, and a request beyond that with every field leased
        raises ``RuntimeError`` (Taichi would crash at its 512th tree).
        """
        if not self._device or self.backend is None or self.backend.NAME != "taichi":
            raise TypeError(f"{self!r}: fields exist only on the taichi backend")
        dtype = np.dtype(dtype)
        shape = tuple(int(s) for s in shape)
        if not shape or any(s <= 0 for s in shape):
            raise ValueError(f"field: shape should be non-empty with positive sizes, got {shape}")
        nbytes = math.prod(shape) * dtype.itemsize
        key = ("field", dtype, shape)
        with self._lock:
            self._drain()
            block = self._take(key)
            if block is not None:
                self._reuses += 1
            else:
                if self._fields_alive >= self.max_fields:
                    self._evict_until(
                        lambda: self._fields_alive < self.max_fields, fields_only=True, count=True
                    )
                if self._fields_alive >= self.max_fields:
                    raise RuntimeError(
                        f"field: all {self.max_fields} pooled fields are leased; release some first "
                        "(Taichi crashes at its 512th field tree)"
                    )
                block = _Block(key, _new_field(shape, dtype), nbytes, dtype)
                self._owned[id(block)] = block
                self._fields_alive += 1
                self._allocations += 1
            self._bytes_in_use += block.nbytes
            self._peak = max(self._peak, self._bytes_in_use + self._bytes_pooled)
        lease = FieldLease(block, self._returns)
        if zero:
            lease.field.fill(0)
        return lease

    # -- internals (called with the lock held unless said otherwise)

    def _drain(self) -> None:
        returns = self._returns
        while returns:
            block = returns.popleft()
            self._bytes_in_use -= block.nbytes
            if block.nbytes > self.max_bytes:
                self._drop(block)
                self._evictions += 1
                continue
            self._free.setdefault(block.key, []).append(block)
            self._lru[id(block)] = block
            self._bytes_pooled += block.nbytes
            if self._bytes_pooled > self.max_bytes:
                self._evict_until(lambda: self._bytes_pooled <= self.max_bytes, count=True)

    def _take(self, key: tuple) -> _Block | None:
        stack = self._free.get(key)
        if not stack:
            return None
        block = stack.pop()  # the most recently returned: warmest in cache
        del self._lru[id(block)]
        self._bytes_pooled -= block.nbytes
        return block

    def _evict_until(self, done, *, fields_only: bool = False, count: bool = False) -> tuple[int, int]:
        freed = dropped = 0
        candidates = [b for b in self._lru.values() if b.key[0] == "field"] if fields_only else None
        while not done():
            if candidates is not None:
                if not candidates:
                    break
                block = candidates.pop(0)
            elif self._lru:
                block = next(iter(self._lru.values()))
            else:
                break
            del self._lru[id(block)]
            self._free[block.key].remove(block)
            self._bytes_pooled -= block.nbytes
            self._drop(block)
            freed += block.nbytes
            dropped += 1
        if count:
            self._evictions += dropped
        return freed, dropped

    def _drop(self, block: _Block) -> None:
        del self._owned[id(block)]
        if block.key[0] == "field":
            self._fields_alive -= 1
            if _taichi_generation() == block.storage[2]:
                block.storage[1].destroy()
        block.storage = None  # host/ndarray memory goes with the last reference

    def _raw_empty(self, shape: tuple[int, ...], dtype: np.dtype) -> Any:
        if self.backend is None:
            return np.empty(shape, dtype)
        return self.backend.empty(shape, dtype)

    def _new_block(self, key: tuple, dtype: np.dtype, size: int, nbytes: int) -> _Block:
        if self._device:
            storage = self.backend.empty((size,), dtype)._storage  # type: ignore[union-attr]
            return _Block(key, storage, nbytes, dtype)
        class_bytes = key[1]
        storage = self._raw_empty((class_bytes // dtype.itemsize,), dtype)
        return _Block(key, storage, class_bytes, dtype, storage.__array_interface__["data"][0])

    def _lease(self, block: _Block, shape: tuple[int, ...], dtype: np.dtype) -> Any:
        if not self._device:
            return _host_view(block, self._returns, shape, dtype)
        be = self.backend
        return be.DeviceArray(_device_lease(block, self._returns), shape, dtype, block.storage._generation)  # type: ignore[union-attr]

    def _zero(self, out: Any) -> None:
        self._fill(out, 0)

    def _fill(self, out: Any, value: float) -> None:
        if isinstance(out, np.ndarray):
            out.fill(value)
        elif out.size:
            out._ndarray().fill(value)


def _taichi_generation() -> int:
    from taifuse.backends import taichi_gpu

    return taichi_gpu._state["generation"]


def _new_field(shape: tuple[int, ...], dtype: np.dtype) -> tuple:
    """A field in its own SNode tree: (field, tree, runtime generation)."""
    from taifuse.backends import taichi_gpu

    ti = taichi_gpu._import_taichi()
    taichi_gpu._require_init()
    builder = ti.FieldsBuilder()
    f = ti.field(taichi_gpu._ti_dtype(dtype))
    builder.dense(ti.axes(*range(len(shape))), shape).place(f)
    tree = builder.finalize()
    return (f, tree, _taichi_generation())


# ----------------------------------------------------------------------------- registry

_pools: dict[tuple, BufferPool] = {}
_registry_lock = threading.Lock()


_HOST_KEY = ("host",)
_HOST_BACKENDS = ("numpy", "numba")


def _pool_key(be: ModuleType) -> tuple:
    if be.NAME in _HOST_BACKENDS or be.is_array(np.empty(0)):
        return _HOST_KEY  # numpy and numba hold the same kind of memory
    state = getattr(be, "_state", None)
    if state is not None:  # taichi: see NOTE [ Re-initialising Taichi ] in taichi_gpu.py
        return (be.NAME, state["actual"], state["generation"])
    return (be.NAME,)


def get_pool(backend: ModuleType | None = None) -> BufferPool:
    """The pool of ``backend`` (default: the active one): one per backend/device.

    The ``numpy`` and ``numba`` backends share the host pool. A Taichi re-initialisation (arch
    switch) starts a new pool; the old one's buffers died with the old runtime.
    """
    if backend is None:
        from taifuse import backends

        backend = backends.active()
    key = _HOST_KEY if backend.NAME in _HOST_BACKENDS else _pool_key(backend)
    pool = _pools.get(key)
    if pool is not None:
        return pool
    with _registry_lock:
        pool = _pools.get(key)
        if pool is None:
            for stale in [k for k in _pools if k[0] == key[0] and k != key and key[0] != "host"]:
                del _pools[stale]  # see NOTE [ Re-initialising Taichi ] in taichi_gpu.py
            pool = BufferPool(":".join(str(k) for k in key), None if key == _HOST_KEY else backend)
            _pools[key] = pool
    return pool


def host_pool() -> BufferPool:
    """The pool of host (NumPy) buffers, shared by the ``numpy`` and ``numba`` backends."""
    pool = _pools.get(_HOST_KEY)
    if pool is None:
        with _registry_lock:
            pool = _pools.setdefault(_HOST_KEY, BufferPool("host"))
    return pool


def empty(be: ModuleType, shape: tuple[int, ...], dtype: Any) -> Any:
    """An uninitialised array of ``shape`` and ``dtype`` on backend ``be``, from its pool.

    The one allocation path for everything above the kernels (see NOTE [ Buffer ownership ]):
    the caller must write every element before reading it.

    Example::

        >>> import numpy as np, taifuse
        >>> from taifuse import backends, pool
        >>> taifuse.set_backend("numpy")
        >>> pool.empty(backends.active(), (2, 3), np.float32).shape
        (2, 3)
    """
    return get_pool(be).acquire(shape, dtype)


def zeros(be: ModuleType, shape: tuple[int, ...], dtype: Any) -> Any:
    """Like :func:`empty`, zero-filled: for kernels that accumulate into their output."""
    return get_pool(be).acquire(shape, dtype, zero=True)
