"""The machine's ceilings, written once: the copy kernel and the GEMM that measure them, what a
``taifuse bench`` results.json calls them (named row ids), and :class:`Ceilings`, the rates with
their intervals.

``taifuse bench`` (bench/roofline.py) measures a copy ceiling per cache level in worker
processes, with :func:`time_copy` and :func:`time_gemm`, and reports them as roofline rows;
``taifuse.profiler`` measures copies at fixed working sets once per process
(:func:`measured`, cached) or reads a bench run's rows (:func:`read_results`). Both judge what
they time with ``taifuse._costs.traffic_bytes``. This module imports only NumPy and
``taifuse._costs``, so that the profiler's layer can use it (docs/architecture.md).

NOTE [ Traffic model ]
A ceiling bounds a row only when both count bytes the same way. The memory system moves every
byte a kernel reads, and every byte it writes twice: an ordinary store first reads the cache line
it writes into (write-allocate), then writes it back. So a row's traffic is
``bytes_moved + bytes_written`` (:func:`traffic_bytes`), where ``bytes_moved`` counts inputs and
output once; a copy of A bytes moves 3A, a GELU from x into out moves 3A too.
The ceiling's kernel must therefore be one whose stores are ordinary ones. ``np.copyto`` is not:
it calls glibc's memcpy, which picks ``rep movsb`` or non-temporal stores (no write-allocate) by
size and CPU, so what it moves depends on the machine; on the 2-core AMD EPYC it ran slower than a
ufunc doing the same read and write, and a GELU came out "1.11x of copy bound". The kernel here is
``np.add(src, 0.0, out=dst)`` (NumPy's SIMD loop, ordinary stores), one contiguous chunk per CPU,
each on its own thread (the ufunc releases the GIL), repeated inside the thread so thread start-up
does not count, as the multi-threaded kernels it judges use every core.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from taifuse._costs import traffic_bytes

GEMM_SHAPE = (4096, 1024, 768)  # (rows of x, inner, rows of w)
GEMM_FLOPS = 2 * GEMM_SHAPE[0] * GEMM_SHAPE[1] * GEMM_SHAPE[2]
GEMM_CODE = "np.matmul(x, w.T, out=out)"
COPY_CODE = (
    "np.add(src[chunk], 0.0, out=dst[chunk]) for one contiguous chunk per CPU, each on its own thread, "
    "repeated {reps}x inside the thread per sample"
)
TRAFFIC_MODEL = (
    "bytes read + 2 x bytes written (an ordinary store reads its cache line first: write-allocate)"
)
_MIB = 2**20
# A bench sample streams about this much working set: several ms at any level.
PASS_BYTES = 256 * _MIB

# ----------------------------------------------------------------------------- row ids

ROOFLINE = "roofline"  # the kind of a ceiling's row in a results.json
DRAM = "DRAM"
# The levels a copy ceiling can be measured at: every cache level a CPU reports (x86's CPUID and
# Arm's CLIDR both number at most seven), then DRAM.
LEVELS = (*(f"L{i}" for i in range(1, 8)), DRAM)
GEMM_ROW = "roofline/gemm"
GEMM_LABEL = "GEMM rate"
COPY_ROWS: Mapping[str, str] = {f"roofline/copy-{level}": level for level in LEVELS}
"""Row id of a copy ceiling -> its level (``"roofline/copy-L3"`` -> ``"L3"``)."""
_COPY_ROW_OF = {level: row_id for row_id, level in COPY_ROWS.items()}


def copy_row(level: str) -> str:
    """The row id of the copy ceiling at ``level`` (one of :data:`LEVELS`)."""
    try:
        return _COPY_ROW_OF[level]
    except KeyError:
        raise ValueError(f"level should be one of {LEVELS}, got {level!r}") from None


def copy_label(level: str) -> str:
    """The name of a level's copy ceiling in a report (``"L3 copy bandwidth"``)."""
    return f"{level} copy bandwidth"


# ----------------------------------------------------------------------------- kernels


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


class ThreadedCopy:
    """The ceiling's kernel over one pair of float32 arrays (NOTE [ Traffic model ]).

    ``dst[:] = src + 0.0`` with ``np.add``, split into one contiguous chunk per thread, each chunk
    on its own thread. ``copy(reps)`` runs ``reps`` passes in every thread before joining.

    Example::

        >>> src = np.arange(8, dtype=np.float32); dst = np.empty_like(src)
        >>> copy = ThreadedCopy(src, dst, workers=2)
        >>> copy(); bool((dst == src).all())
        True
    """

    def __init__(self, src: np.ndarray, dst: np.ndarray, workers: int | None = None) -> None:
        if src.shape != dst.shape or src.dtype != dst.dtype or src.ndim != 1:
            raise ValueError(f"ThreadedCopy needs two 1-D arrays alike, got {src.shape} and {dst.shape}")
        # Imported here: the profiler imports this module, and measures only when a table needs it.
        from concurrent.futures import ThreadPoolExecutor

        self.workers = workers or usable_cpus()
        bounds = np.linspace(0, src.size, self.workers + 1).astype(np.int64)
        self.chunks = [(src[lo:hi], dst[lo:hi]) for lo, hi in itertools.pairwise(bounds)]
        self.pool = ThreadPoolExecutor(max_workers=self.workers)

    @staticmethod
    def _passes(src: np.ndarray, dst: np.ndarray, reps: int) -> None:
        for _ in range(reps):
            np.add(src, 0.0, out=dst)

    def __call__(self, reps: int = 1) -> None:
        for future in [self.pool.submit(self._passes, s, d, reps) for s, d in self.chunks]:
            future.result()


def _call_once(fn: Callable[[], Any]) -> None:
    fn()


def time_copy(
    working_set_bytes: int,
    samples: int,
    *,
    pass_bytes: int = PASS_BYTES,
    warm_up: Callable[[Callable[[], Any]], Any] = _call_once,
) -> dict:
    """Time ``samples`` passes of :class:`ThreadedCopy` over ``working_set_bytes`` (source +
    destination), each sample repeating the copy until about ``pass_bytes`` of working set went
    through; nanoseconds per copy, with what one copy moves (NOTE [ Traffic model ]).

    ``warm_up(copy)`` runs first (the first pass also faults in the destination's pages): one call
    by default, ``taifuse.bench.timing.warm_up`` in the bench.
    """
    n = working_set_bytes // 8  # float32 elements per array
    src = np.full(n, 1.5, dtype=np.float32)  # the values do not matter; the pages must exist
    dst = np.empty_like(src)
    copy = ThreadedCopy(src, dst)
    reps = max(1, pass_bytes // working_set_bytes)
    try:
        warm_up(copy)
        ns = []
        for _ in range(samples):
            start = time.perf_counter_ns()
            copy(reps)
            ns.append((time.perf_counter_ns() - start) / reps)
    finally:
        copy.pool.shutdown()
    array_bytes = 4 * n
    return {
        "ns": ns,
        "array_bytes": array_bytes,
        "bytes_moved": 2 * array_bytes,
        "bytes_written": array_bytes,
        "threads": copy.workers,
        "reps": reps,
        "code": COPY_CODE.format(reps=reps),
    }


def time_gemm(
    samples: int, seed: int = 0, *, warm_up: Callable[[Callable[[], Any]], Any] = _call_once
) -> list[float]:
    """Nanoseconds of ``samples`` calls of the GEMM ceiling's product (:data:`GEMM_CODE` on
    :data:`GEMM_SHAPE`, float32, NumPy's BLAS), after ``warm_up(gemm)``."""
    m, k, n = GEMM_SHAPE
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k), dtype=np.float32)
    w = rng.standard_normal((n, k), dtype=np.float32)
    out = np.empty((m, n), dtype=np.float32)

    def gemm() -> None:
        np.matmul(x, w.T, out=out)

    warm_up(gemm)
    ns = []
    for _ in range(samples):
        start = time.perf_counter_ns()
        gemm()
        ns.append(time.perf_counter_ns() - start)
    return ns


def copy_gbps(copy: dict) -> float:
    """GB/s of traffic of a :func:`time_copy` result's fastest sample (other work on the machine
    only ever slows a pass)."""
    return traffic_bytes(copy["bytes_moved"], copy["bytes_written"]) / min(copy["ns"])


# Working sets (source + destination bytes) of the profiler's measured copy ceilings: one per size
# class, so that an op is judged against a copy of about its own size (NOTE [ One ceiling per cache
# level ] in taifuse/bench/roofline.py: a step's small ops stream from cache, several times faster
# than DRAM, and where the caches end differs between machines).
COPY_WORKING_SETS = tuple(2**p for p in range(18, 29, 2))  # 256 KiB .. 256 MiB
_MEASURED_PASS_BYTES = 64 * _MIB  # a second or two for all of them


@functools.lru_cache(maxsize=1)
def measured(samples: int = 5) -> tuple[tuple[tuple[int, float], ...], float]:
    """``(copy, gemm_gflops)`` of this machine, measured once per process and cached: copy GB/s of
    traffic at each of :data:`COPY_WORKING_SETS` as ``((working set, GB/s), ...)``, and the GEMM
    rate, each the fastest of ``samples`` passes."""
    copy = tuple(
        (size, copy_gbps(time_copy(size, samples, pass_bytes=_MEASURED_PASS_BYTES)))
        for size in COPY_WORKING_SETS
    )
    return copy, GEMM_FLOPS / min(time_gemm(samples))


# ----------------------------------------------------------------------------- ceilings


@dataclass(frozen=True)
class Rate:
    """A ceiling: its value with the interval, the row that reports it and, for a copy, its working
    set (bytes, source + destination) where known."""

    value: float
    low: float
    high: float
    row_id: str
    label: str
    working_set: int | None = None


@dataclass(frozen=True)
class Ceilings:
    """A run's ceilings: copy bandwidth by level (GB/s of traffic) and the GEMM rate (GFLOP/s)."""

    copy: dict[str, Rate] = field(default_factory=dict)
    gemm: Rate | None = None

    @classmethod
    def from_rows(cls, rows: list[dict]) -> Ceilings:
        """The ceilings reported by the roofline rows of a run (``taifuse.bench.roofline.rows``);
        other rows, and roofline rows without a value, are passed over. A row without an interval
        or a label (a hand-written file) gets its value as both bounds and the usual label."""
        copy, gemm = {}, None
        for r in rows:
            row_id = r.get("id")
            if r.get("kind") != ROOFLINE or r.get("value") is None or not isinstance(row_id, str):
                continue
            value = float(r["value"])
            low, high = (value if r.get(b) is None else float(r[b]) for b in ("low", "high"))
            if row_id == GEMM_ROW:
                gemm = Rate(value, low, high, row_id, r.get("label") or GEMM_LABEL)
            elif row_id in COPY_ROWS:
                level = COPY_ROWS[row_id]
                ws = int(r["bytes_moved"]) if r.get("bytes_moved") else None
                copy[level] = Rate(value, low, high, row_id, r.get("label") or copy_label(level), ws)
        return cls(copy, gemm)

    @classmethod
    def coerce(cls, ceilings: Ceilings | Mapping) -> Ceilings:
        """A :class:`Ceilings` from itself or from a plain ``{"copy_gbps", "gemm_gflops"}`` mapping,
        whose ``copy_gbps`` is ``{level: GB/s}`` or one number (taken as the DRAM ceiling)."""
        if isinstance(ceilings, Ceilings):
            return ceilings
        copy = ceilings.get("copy_gbps")
        by_level = copy if isinstance(copy, Mapping) else ({DRAM: copy} if copy is not None else {})
        rates = {
            level: Rate(v, v, v, copy_row(level), copy_label(level))
            for level, v in by_level.items()
            if v is not None and math.isfinite(v)
        }
        g = ceilings.get("gemm_gflops")
        gemm = Rate(g, g, g, GEMM_ROW, GEMM_LABEL) if g is not None and math.isfinite(g) else None
        return cls(rates, gemm)

    def by_working_set(self) -> tuple[tuple[int, float], ...]:
        """``((working set, GB/s), ...)`` of the copy ceilings whose working set is known."""
        return tuple((r.working_set, r.value) for r in self.copy.values() if r.working_set)

    def as_dict(self) -> dict:
        """For ``results.json``'s ``method``: the values and how bytes were counted."""
        return {
            "copy_gbps": {level: rate.value for level, rate in self.copy.items()},
            "gemm_gflops": self.gemm.value if self.gemm else None,
            "traffic_model": TRAFFIC_MODEL,
        }


def read_results(path: str | os.PathLike) -> Ceilings:
    """The ceilings of a ``taifuse bench`` results.json (its roofline rows), measuring nothing.

    Raises ValueError naming ``path`` when it cannot be read, is not JSON, or holds no GEMM row and
    no copy row with its working set.
    """
    where = repr(os.fspath(path))
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as exc:
        raise ValueError(f"ceilings: cannot read {where}: {exc.strerror or exc}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"ceilings: {where} is not JSON (a taifuse bench results.json): {exc}") from None
    rows = data.get("rows", []) if isinstance(data, dict) else []
    ceilings = Ceilings.from_rows([r for r in rows if isinstance(r, dict)] if isinstance(rows, list) else [])
    if ceilings.gemm is None or not ceilings.by_working_set():
        raise ValueError(f"ceilings: {where} holds no roofline rows (a taifuse bench results.json)")
    return ceilings
