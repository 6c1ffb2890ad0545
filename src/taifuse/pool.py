"""A reuse pool for the buffers kernels write into: host (NumPy) buffers and device buffers.

Every result a kernel writes (functional ops, autograd intermediates and gradients, tensor
arithmetic, kernel scratch, optimizer scratch) is allocated through :func:`empty`, which takes a
free buffer of the request's size class (host; any dtype) or dtype and length (device) from its
memory space's :class:`BufferPool` or, on a miss, from that space's :class:`Allocator`. A buffer
goes back to the pool when nothing refers to it any more (NOTE [ Buffer ownership ]), so a
training step that repeats the same shapes stops allocating after its first step or two.

Host blocks are split and coalesced (NOTE [ Splitting host blocks ]): a request that finds no free
block of its size class takes the smallest larger free block of a small enough allocation and
leaves the rest free, and a returned block merges with its free neighbours, so the memory one
step freed in one size class serves the next step's requests of another.

The pool is the policy (size classes, free lists, splitting, the LRU and byte cap, statistics,
the returns queue) and knows no backend: each backend's table exports an ``ALLOCATOR`` that makes
blocks of its memory and leases them out as its arrays (:class:`Allocator`).

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

Knobs: ``TAIFUSE_POOL_MAX_MB`` caps the bytes of wholly free allocations a pool keeps (default
:data:`DEFAULT_MAX_MB`; least recently freed allocations are evicted first; ``0`` keeps none), and
``with get_pool().disabled():`` bypasses a pool (every allocation goes to the backend);
``TAIFUSE_POOL=0`` disables every pool from the start.

# NOTE [ Buffer ownership ]
# A pooled buffer has exactly one owner object per lease, and the buffer returns to the pool when
# (and only when) that owner is garbage: then nothing can read or write the memory any more, so
# handing it out again cannot alias anything. The owner must be an object that EVERY view of the
# buffer keeps alive. Each allocator's ``lease`` makes that owner:
#
# * Host (NumPy), ``_HostLease`` in ``backends/_host.py``: NumPy collapses view chains -- a view's
#   ``.base`` is the first array that owns its memory or whose base is not an ndarray -- so a
#   finalizer on a handed-out array that is itself a view of the pool's storage would fire while
#   views of it are alive. Instead each lease is an object that is not an ndarray, exporting the
#   memory through ``__array_interface__``; the handed-out array's base is that lease, and every
#   view, reshape, slice or dtype view of it keeps either the handed-out array or the lease alive.
#   The lease's ``__del__`` returns the block. Copies (a non-contiguous reshape, ``np.array``) own
#   their memory and keep nothing alive, as they should.
# * Taichi ndarrays, ``_DeviceLease`` in ``backends/taichi/_runtime.py``: a device array's
#   ``reshape`` views share its flat ``ti.Ndarray`` object, so each lease hands out a fresh one (a
#   Python ``ti.Ndarray`` over the block's device allocation, with no memory of its own), and its
#   ``__del__`` returns the block.
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
#
# NOTE [ Splitting host blocks ]
# Keyed by size class alone, a pool holds at its peak the sum over classes of the most blocks of
# each class in use at once: the GPT step under autocast peaked at 35.4 MiB of pool against 27.0
# MiB in use at any one moment, the difference being free blocks of other classes. So host memory
# is managed as PyTorch's caching allocator manages device memory (c10/cuda/CUDACachingAllocator.cpp):
#
# * An allocation (a *segment*, one ``new_block`` on a miss, of the request's size class) is a
#   doubly linked list of blocks in address order, each free or leased. A request of class ``c``
#   takes a free block of exactly ``c`` bytes if there is one (the most recently returned), else
#   the smallest larger one (best fit) and splits it: the front ``c`` bytes are leased, the rest
#   stays free (a rest under 256 bytes, the smallest class, is leased with the front). Every size
#   class is a multiple of 64 bytes, so every block starts 64-byte aligned relative to its
#   segment. Blocks of one segment never overlap, so a lease can never alias another; each lease
#   is its own owner object (NOTE [ Buffer ownership ]), whose array's base is the lease, not the
#   segment: NumPy's base-keeping holds the lease's block, never the segment's other blocks.
# * A returned block merges with a free neighbour on either side (the left block absorbs the
#   right, so a segment's first block, which ``_owned`` keeps, lives as long as the segment).
#   A segment wholly free again is one block; only such segments go on the LRU, count towards the
#   byte cap and are evicted (``new_block``'s storage then dies): free blocks of a segment that is
#   partly in use cannot be given back, and are reported as ``bytes_fragmented``.
# * The bound: a block of a segment of ``S`` bytes serves a request of ``c`` bytes only if
#   ``S <= SPLIT_RATIO * c`` (PyTorch's ``max_split_size`` serves the same end: small requests do
#   not fragment large blocks). Every leased block of a segment then holds at least
#   ``S / SPLIT_RATIO`` of it, so the free bytes of partly used segments are at most
#   ``(SPLIT_RATIO - 1) * bytes_in_use`` and the pool holds at most
#   ``SPLIT_RATIO * bytes_in_use + max_bytes`` whatever the request pattern. A free block smaller
#   than ``S / SPLIT_RATIO`` can serve nothing until it merges; it is not indexed.
# * Steady state: a segment is freed only by the byte cap, clear or shrink_to_fit, never because a
#   request split it. A smaller request that splits the free block a larger request of the same
#   step wanted makes that step allocate one more segment, which every later step finds free
#   (issue 28's conv step: grad_x's 8 MiB split the 16 MiB of the last output), so a loop that
#   repeats its requests allocates nothing after a step or two; tests/test_pool.py checks it.
# * Device (Taichi) blocks are not split: a ``ti.Ndarray`` over part of an allocation does not
#   exist, and their keys are exact (dtype, length).
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import math
import os
import threading
from collections import OrderedDict, deque
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol

import numpy as np

from taifuse import _profile_hook, _trace_hook

__all__ = [
    "DEFAULT_MAX_MB",
    "SMALL_HOST_BYTES",
    "SPLIT_RATIO",
    "Allocator",
    "BufferPool",
    "PoolStats",
    "empty",
    "get_pool",
    "host_empty",
    "host_pool",
    "size_class",
    "zeros",
]

DEFAULT_MAX_MB = 1024
_MIN_CLASS_BYTES = 256
# A host block of a segment of S bytes serves a request of c bytes only if S <= SPLIT_RATIO * c
# (NOTE [ Splitting host blocks ]).
SPLIT_RATIO = 8
# Empty free-list buckets are dropped when there are this many buckets (or twice as many as after
# the last pruning).
_PRUNE_BUCKETS = 256


# The protocol is written here, beside the policy that calls it and the NOTE its leases must keep,
# rather than in backends/_spec.py: the kernel tables' spec is read by every layer, this contract
# only by the pool. Allocators implement it structurally and never import this module.
class Allocator(Protocol):
    """One memory space, as the pool sees it: raw allocations and leases of its blocks.

    Every backend's table exports one as ``ALLOCATOR``: host memory (``backends/_host.py``, shared
    by the ``numpy`` and ``numba`` backends) or the device memory of the running Taichi runtime
    (``backends/taichi/_runtime.py``).

    Attributes:
        ON_HOST: True for host memory, whose requests share blocks by :func:`size_class`; False for
            device memory, whose blocks are keyed by exact element count (a device array's length
            is visible to kernels and copies).
    """

    ON_HOST: bool

    def key(self) -> tuple:
        """The identity of the memory space now, e.g. ``("host",)``; :func:`get_pool` keys pools by it.

        A key whose first element is known but whose rest changed (a re-initialised runtime) starts
        a new pool, and the old one is dropped: its blocks died with the old runtime.
        """

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> Any:
        """A new, unpooled array (the backend's own ``empty``): for size 0 and disabled pools."""

    def new_block(self, count: int, dtype: np.dtype) -> tuple[Any, int]:
        """A new flat allocation of ``count`` elements: ``(storage, address)``.

        The pool keeps ``storage`` reachable until it drops the block; ``address`` is for the
        allocator's own :meth:`lease` (0 when it has no use for one).
        """

    def lease(self, block: Any, returns: deque, shape: tuple[int, ...], dtype: np.dtype) -> Any:
        """The array handed out: ``shape`` and ``dtype`` over ``block.storage`` (and ``block.address``).

        Its owner appends ``block`` to ``returns`` when it is garbage, never before and without
        taking a lock (NOTE [ Buffer ownership ]).
        """

    def fill(self, array: Any, value: float) -> None:
        """Set every element of an array this allocator made to ``value``."""


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
        bytes_pooled: bytes of free buffers the pool holds, ready for reuse: wholly free
            allocations (kept under the cap) and ``bytes_fragmented``.
        bytes_in_use: bytes of buffers handed out and still referenced.
        peak_bytes: the most ``bytes_pooled + bytes_in_use`` has been since the pool was made (or
            :meth:`BufferPool.reset_stats`).
        evictions: free allocations dropped to keep their bytes under the byte cap;
            :meth:`BufferPool.clear` and :meth:`BufferPool.shrink_to_fit` are not counted here,
            they return what they freed.
        splits: reuses served by splitting a larger free block (host; counted in ``reuses``).
        bytes_fragmented: the part of ``bytes_pooled`` in allocations partly in use, which the pool
            cannot free until they are wholly free again; at most ``(SPLIT_RATIO - 1) *
            bytes_in_use`` (NOTE [ Splitting host blocks ]).
    """

    allocations: int
    reuses: int
    hit_rate: float
    bytes_pooled: int
    bytes_in_use: int
    peak_bytes: int
    evictions: int
    splits: int = 0
    bytes_fragmented: int = 0


class _Block:
    """A block of one pooled allocation (its segment), free or leased, and its accounting.

    ``storage`` is the segment's (shared by its blocks), ``address`` the block's own start,
    ``segment_nbytes`` the segment's size; ``prev``/``next`` are the neighbouring blocks of the
    segment in address order (NOTE [ Splitting host blocks ]; device blocks have none).
    """

    __slots__ = ("address", "dtype", "free", "key", "nbytes", "next", "prev", "segment_nbytes", "storage")

    def __init__(self, key: tuple, storage: Any, nbytes: int, dtype: np.dtype, address: int) -> None:
        self.key = key
        self.storage = storage
        self.nbytes = nbytes
        self.dtype = dtype
        self.address = address
        self.segment_nbytes = nbytes
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.free = False


# ----------------------------------------------------------------------------- the pool


class BufferPool:
    """Free buffers of one memory space, handed out by size class (host) or dtype and length (device).

    Host pools (the ``numpy`` and ``numba`` backends share one: both hold ``numpy.ndarray``)
    round requests up to :func:`size_class` and hand a free block to a request of any dtype in
    its class, or split a larger free block (NOTE [ Splitting host blocks ]). Device pools key
    blocks by dtype and exact element count (see :attr:`Allocator.ON_HOST`).

    Args:
        name: for messages and ``repr``.
        backend: a backend module (its ``ALLOCATOR`` is used) or an :class:`Allocator`; ``None``:
            host memory.
        max_bytes: cap on :attr:`PoolStats.bytes_pooled` (default from ``TAIFUSE_POOL_MAX_MB``).

    Thread-safe: acquisitions and the bookkeeping take one lock; returns never block.
    """

    def __init__(
        self,
        name: str,
        backend: ModuleType | Allocator | None = None,
        *,
        max_bytes: int | None = None,
    ) -> None:
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"BufferPool max_bytes should be non-negative, got {max_bytes}")
        self.name = name
        self.backend = backend  # as given: BufferPool(name, other.backend) pools the same memory
        self.allocator: Allocator = _host_allocator() if backend is None else _allocator_of(backend)
        self._on_host = bool(self.allocator.ON_HOST)
        self.max_bytes = _max_bytes_from_env() if max_bytes is None else int(max_bytes)
        self._lock = threading.Lock()
        self._returns: deque[_Block] = deque()
        # Free blocks by bucket (host: bytes; device: (dtype, length)), each bucket in the order
        # they were freed; host blocks too small to serve anything are in no bucket (NOTE
        # [ Splitting host blocks ]). ``_sizes``: the host buckets' sizes, sorted, for best fit.
        # A bucket that empties stays (most refill within a step) until ``_prune``.
        self._free: dict[Any, dict[int, _Block]] = {}
        self._sizes: list[int] = []
        self._prune_at = _PRUNE_BUCKETS
        # Wholly free segments (one block each), least recently freed first: what the cap evicts.
        self._lru: OrderedDict[int, _Block] = OrderedDict()
        self._bytes_whole = 0  # their bytes; bytes_pooled - _bytes_whole is bytes_fragmented
        # Every segment, by its first block (which lives as long as the segment), stays reachable
        # from here: see NOTE [ Buffer ownership ].
        self._owned: dict[int, _Block] = {}
        self._disabled = 1 if os.environ.get("TAIFUSE_POOL", "").strip() == "0" else 0
        # For tests and debugging: fill every buffer handed out (not zeroed) with this value, so
        # that a kernel reading memory it did not write shows up (NaN is a good choice).
        self.fill_on_reuse: float | None = None
        self._bytes_pooled = 0
        self._bytes_in_use = 0
        self._reset_counters()

    def _reset_counters(self) -> None:
        self._allocations = 0
        self._reuses = 0
        self._splits = 0
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

    @property
    def on_host(self) -> bool:
        """Whether the pool's buffers are host (NumPy) memory."""
        return self._on_host

    def bytes_in_use(self) -> int:
        """Bytes of the buffers handed out and not yet returned, as last counted: without
        accounting the buffers dropped since (unlike :meth:`stats`), so that it costs nothing on
        an ``acquire`` (the profiler reads it there)."""
        return self._bytes_in_use

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
                splits=self._splits,
                bytes_fragmented=self._bytes_pooled - self._bytes_whole,
            )

    def reset_stats(self) -> None:
        """Zero allocations, reuses, splits and evictions; restart the peak from the bytes held now."""
        with self._lock:
            self._drain()
            self._reset_counters()

    def clear(self) -> int:
        """Free every wholly free allocation; return the bytes freed.

        Free blocks of an allocation partly in use (``bytes_fragmented``) stay until it is wholly free.
        """
        return self.shrink_to_fit(0)

    def shrink_to_fit(self, max_bytes: int) -> int:
        """Free the least recently freed wholly free allocations until at most ``max_bytes`` of
        them stay pooled.

        Returns the bytes freed. Buffers in use, and the free blocks of allocations partly in use
        (``bytes_fragmented``), are untouched.
        """
        if max_bytes < 0:
            raise ValueError(f"shrink_to_fit: max_bytes should be non-negative, got {max_bytes}")
        with self._lock:
            self._drain()
            freed, _ = self._evict_until(max_bytes)
        return freed

    def acquire(self, shape: tuple[int, ...], dtype: Any, *, zero: bool = False) -> Any:
        """A buffer of ``shape`` and ``dtype``: an array of the pool's memory space (NumPy on the host).

        Its contents are undefined (stale data from an earlier user) unless ``zero`` is True.
        Empty shapes and a disabled pool go straight to the allocator's ``empty``.
        """
        tr = _trace_hook.ACTIVE  # NOTE [ Step compiler hooks ]
        if tr is not None:
            planned = tr.acquire(self, shape, dtype, zero)
            if planned is not None:
                return planned
        dtype = np.dtype(dtype)
        shape = tuple(map(int, shape))
        size = math.prod(shape)
        allocator = self.allocator
        if size == 0 or self._disabled:
            out = allocator.empty(shape, dtype)
            if zero and size:
                allocator.fill(out, 0)
            return out
        nbytes = size * dtype.itemsize
        # Host memory is bytes: a block serves any dtype of its size class (a float32 block the
        # forward freed, a float16 request under autocast); a device array's dtype is fixed.
        with self._lock:
            if self._returns:
                self._drain()
            if self._on_host:
                nbytes = size_class(nbytes)
                bucket = self._free.get(nbytes)
                # Indexed blocks hold at least 1 / SPLIT_RATIO of their segment: any one of exactly
                # nbytes serves; else split a larger one.
                block = self._pop(bucket) if bucket else self._split(nbytes)
                key: Any = None
            else:
                key = (dtype, size)
                block = self._take_device(key)
            if block is not None:
                self._reuses += 1
            else:
                block = self._new_block(key, dtype, nbytes)
                self._owned[id(block)] = block
                self._allocations += 1
            self._bytes_in_use += block.nbytes
            held = self._bytes_in_use + self._bytes_pooled
            self._peak = max(self._peak, held)
        out = allocator.lease(block, self._returns, shape, dtype)
        if zero:
            allocator.fill(out, 0)
        elif self.fill_on_reuse is not None:
            allocator.fill(out, self.fill_on_reuse)
        rec = _profile_hook.ACTIVE  # NOTE [ Profiler hooks ]
        return out if rec is None else rec.acquired(self, out, shape, dtype)

    # -- internals (called with the lock held unless said otherwise)

    def _drain(self) -> None:
        returns = self._returns
        on_host = self._on_host
        while returns:
            block = returns.popleft()
            nbytes = block.nbytes
            self._bytes_in_use -= nbytes
            self._bytes_pooled += nbytes
            block.free = True
            # Coalesce (NOTE [ Splitting host blocks ]): the left block absorbs the right.
            right = block.next
            if right is not None and right.free:
                self._unindex(right, right.nbytes)
                block.nbytes = nbytes = nbytes + right.nbytes
                block.next = right = right.next
                if right is not None:
                    right.prev = block
            left = block.prev
            if left is not None and left.free:
                self._unindex(left, left.nbytes)
                left.nbytes = nbytes = nbytes + left.nbytes
                left.next = right
                if right is not None:
                    right.prev = left
                block = left
            if block.prev is not None or right is not None:
                # Part of a segment still in use: not evictable, and it serves only requests of at
                # least 1 / SPLIT_RATIO of its segment.
                if nbytes * SPLIT_RATIO >= block.segment_nbytes:
                    self._index(block, nbytes)
                continue
            if nbytes > self.max_bytes:
                self._bytes_pooled -= nbytes
                self._drop(block)
                self._evictions += 1
                continue
            self._index(block, nbytes if on_host else block.key)
            self._lru[id(block)] = block
            self._bytes_whole += nbytes
            if self._bytes_whole > self.max_bytes:
                self._evictions += self._evict_until(self.max_bytes)[1]

    def _index(self, block: _Block, key: Any) -> None:
        """Put a free block in the bucket ``key`` (host: its bytes; device: its key)."""
        bucket = self._free.get(key)
        if bucket is None:
            if len(self._free) >= self._prune_at:
                self._prune()
            self._free[key] = {id(block): block}
            if self._on_host:
                bisect.insort(self._sizes, key)
        else:
            bucket[id(block)] = block

    def _unindex(self, block: _Block, key: Any) -> None:
        """Take a free block out of its bucket ``key`` and the LRU (it may be in neither)."""
        bucket = self._free.get(key)
        if bucket is not None:
            bucket.pop(id(block), None)
        if self._lru.pop(id(block), None) is not None:
            self._bytes_whole -= block.nbytes

    def _prune(self) -> None:
        """Drop the empty buckets."""
        self._free = {key: bucket for key, bucket in self._free.items() if bucket}
        if self._on_host:
            self._sizes = sorted(self._free)
        self._prune_at = max(_PRUNE_BUCKETS, 2 * len(self._free))

    def _pop(self, bucket: dict[int, _Block]) -> _Block:
        """The most recently freed block of a non-empty bucket, out of the bucket and the LRU."""
        ident, block = bucket.popitem()  # the most recently returned: warmest in cache
        if self._lru.pop(ident, None) is not None:
            self._bytes_whole -= block.nbytes
        block.free = False
        self._bytes_pooled -= block.nbytes
        return block

    def _take_device(self, key: tuple) -> _Block | None:
        bucket = self._free.get(key)
        return self._pop(bucket) if bucket else None

    def _split(self, nbytes: int) -> _Block | None:
        """The front ``nbytes`` (a size class) of the best-fitting larger free block, or None."""
        block = self._best_fit(nbytes)
        if block is None:
            return None
        self._unindex(block, block.nbytes)
        block.free = False
        rest = block.nbytes - nbytes
        if rest >= _MIN_CLASS_BYTES:
            # The front is leased, the rest stays free after it.
            tail = _Block(block.key, block.storage, rest, block.dtype, block.address + nbytes)
            tail.segment_nbytes = block.segment_nbytes
            tail.free = True
            tail.prev, tail.next = block, block.next
            if block.next is not None:
                block.next.prev = tail
            block.next = tail
            block.nbytes = nbytes
            if rest * SPLIT_RATIO >= tail.segment_nbytes:
                self._index(tail, rest)
            self._splits += 1
        self._bytes_pooled -= block.nbytes
        return block

    def _best_fit(self, nbytes: int) -> _Block | None:
        # The smallest free block above nbytes in a segment of at most SPLIT_RATIO * nbytes bytes;
        # blocks above that bound cannot be in such a segment.
        limit = SPLIT_RATIO * nbytes
        sizes = self._sizes
        for i in range(bisect.bisect_right(sizes, nbytes), len(sizes)):
            if sizes[i] > limit:
                break
            for block in reversed(self._free[sizes[i]].values()):  # empty buckets have none
                if block.segment_nbytes <= limit:
                    return block
        return None

    def _evict_until(self, max_bytes: int) -> tuple[int, int]:
        """Drop least recently freed whole segments until at most ``max_bytes`` of them stay:
        (bytes, segments) dropped."""
        freed = dropped = 0
        while self._lru and self._bytes_whole > max_bytes:
            block = next(iter(self._lru.values()))
            self._unindex(block, block.nbytes if self._on_host else block.key)
            self._bytes_pooled -= block.nbytes
            self._drop(block)
            freed += block.nbytes
            dropped += 1
        return freed, dropped

    def _drop(self, block: _Block) -> None:
        # A wholly free segment is one block, its first: the one _owned keeps.
        del self._owned[id(block)]
        block.storage = None  # the memory goes with the last reference

    def _new_block(self, key: Any, dtype: np.dtype, nbytes: int) -> _Block:
        # Host: nbytes is the whole size class, so any request of the class fits.
        storage, address = self.allocator.new_block(nbytes // dtype.itemsize, dtype)
        return _Block(key, storage, nbytes, dtype, address)


# ----------------------------------------------------------------------------- registry

_pools: dict[tuple, BufferPool] = {}
_registry_lock = threading.Lock()


def _allocator_of(backend: ModuleType | Allocator) -> Allocator:
    return getattr(backend, "ALLOCATOR", backend)


@functools.cache
def _host_allocator() -> Allocator:
    # The reference backend is always installed, and the numba backend exports the same allocator.
    from taifuse import backends

    return backends.get_module("numpy").ALLOCATOR


def get_pool(backend: ModuleType | Allocator | None = None) -> BufferPool:
    """The pool of ``backend`` (default: the active one): one per memory space.

    ``backend`` is a backend module or its ``ALLOCATOR`` (kernels inside a backend package pass
    the allocator, so they need not import their own package's table). The ``numpy`` and
    ``numba`` backends share the host pool. A Taichi re-initialisation (arch switch) starts a new
    pool; the old one's buffers died with the old runtime.
    """
    if backend is None:
        from taifuse import backends

        backend = backends.active()
    allocator = _allocator_of(backend)
    key = allocator.key()
    pool = _pools.get(key)
    if pool is not None:
        return pool
    with _registry_lock:
        pool = _pools.get(key)
        if pool is None:
            # A new key of a known memory space is a new runtime: the old pool's blocks are gone
            # (NOTE [ Re-initialising Taichi ] in backends/taichi/_runtime.py).
            for stale in [k for k in _pools if k[0] == key[0]]:
                del _pools[stale]
            pool = BufferPool(":".join(str(k) for k in key), allocator)
            _pools[key] = pool
    return pool


def host_pool() -> BufferPool:
    """The pool of host (NumPy) buffers, shared by the ``numpy`` and ``numba`` backends."""
    return get_pool(_host_allocator())


def empty(be: ModuleType | Allocator, shape: tuple[int, ...], dtype: Any) -> Any:
    """An uninitialised array of ``shape`` and ``dtype`` on backend ``be``, from its pool (a host
    request of at most 1 KiB from NumPy: NOTE [ Small host buffers ]).

    The one allocation path for results and scratch (see NOTE [ Buffer ownership ]): the caller
    must write every element before reading it. ``be`` is a backend module or its ``ALLOCATOR``.

    Example::

        >>> import numpy as np, taifuse
        >>> from taifuse import backends, pool
        >>> taifuse.set_backend("numpy")
        >>> pool.empty(backends.active(), (2, 3), np.float32).shape
        (2, 3)
    """
    try:
        small = _small_requests.get((be, shape, dtype))  # the common case, without a call
    except TypeError:  # an unhashable shape: _small_host_pool decides
        small = None
    if small is None:
        small = _small_host_pool(be, shape, dtype)
    # While taifuse.compile traces or replays a step, every buffer goes through the pool, where the
    # compiler plans it (NOTE [ Step compiler hooks ]): a bare np.empty would be a host-made array.
    if small and not small._disabled and _trace_hook.ACTIVE is None:
        out = np.empty(shape, dtype)
        if small.fill_on_reuse is not None:
            out.fill(small.fill_on_reuse)
        return out
    return get_pool(be).acquire(shape, dtype)


def host_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """:func:`empty` on the host memory, whichever backend is active (the host tensor math's results)."""
    return empty(_host_allocator(), shape, dtype)


def zeros(be: ModuleType | Allocator, shape: tuple[int, ...], dtype: Any) -> Any:
    """Like :func:`empty`, zero-filled: for kernels that accumulate into their output."""
    small = _small_host_pool(be, shape, dtype)
    if small and not small._disabled and _trace_hook.ACTIVE is None:  # as empty()
        return np.zeros(shape, dtype)
    return get_pool(be).acquire(shape, dtype, zero=True)


# NOTE [ Small host buffers ]
# A host request of at most SMALL_HOST_BYTES bytes is a plain ``np.empty``, outside the pool:
# NumPy serves data that small from its own cache of freed blocks (numpy/_core/src/multiarray/
# alloc.c caches up to 1024 bytes), so the pool would save no allocation, while its bookkeeping and
# lease (NOTE [ Buffer ownership ]) took about as long as the rest of a small op together (the
# ``step`` bench suite's per-op rows: ``F.relu`` on an (8, 16) tensor). As PyTorch's CPU allocator,
# which caches nothing. Such buffers are not in the pool's statistics (a step's bytes in use miss at
# most 1 KiB per live tiny buffer), and ``fill_on_reuse`` fills them too. ``BufferPool.acquire``
# itself pools every size (tests/test_pool.py drives it directly), and while taifuse.compile traces
# or replays a step every request goes to the pool, where the compiler plans its buffers (NOTE [ Step
# compiler hooks ]). Device pools take every request:
# a device allocation is expensive whatever its size.
SMALL_HOST_BYTES = 1024

# (backend or allocator, shape, dtype) -> the host pool, for the small requests (NOTE [ Small host
# buffers ]); False for the requests that go to the pool. Ops repeat a few signatures.
_small_requests: dict[tuple, Any] = {}


def _small_host_pool(be: ModuleType | Allocator, shape: Any, dtype: Any) -> BufferPool | bool:
    """The host pool when a request of ``shape`` and ``dtype`` on ``be`` is small (NOTE [ Small
    host buffers ]; the caller checks that the pool is not disabled), else False."""
    try:
        known = _small_requests.get((be, shape, dtype))
    except TypeError:  # an unhashable shape (a list): decided without the cache
        known = None
        shape = tuple(shape)
    if known is None:
        target = get_pool(be)
        nbytes = math.prod(int(n) for n in shape) * np.dtype(dtype).itemsize
        known = target if target.allocator.ON_HOST and 0 < nbytes <= SMALL_HOST_BYTES else False
        if len(_small_requests) < 4096:
            _small_requests[(be, shape, dtype)] = known
    return known
