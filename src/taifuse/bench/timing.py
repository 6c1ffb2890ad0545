"""Timing primitives, all on ``time.perf_counter_ns``: first call, warm-up, loop calibration, ABBA pairs.

NOTE [ Timing device work ]
A call that launches GPU work returns before the work is done. A callable built from a variant with
``sync`` code (:class:`taifuse.bench.case.Variant`) carries that code as its ``sync`` attribute
(``torch.cuda.synchronize()``, Taichi's ``ti.sync()``), and every timer here runs it before the clock
starts and again before it stops: a timed loop of n calls is then n launches and the device's work
for all of them, as ``torch.utils.benchmark.Timer`` times it, and a sample never ends while its work
is still queued or starts while the previous sample's is. Host callables have no ``sync`` and are
timed as before.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

MIN_SAMPLE_NS = 1_000_000  # one timed sample runs at least ~1 ms, far above the timer's resolution
_WARMUP_MAX_CALLS = 50
_WARMUP_MAX_NS = 3_000_000_000


def _sync(fn: Callable[[], Any]) -> Callable[[], Any]:
    """The device synchronisation ``fn`` carries (NOTE [ Timing device work ]), or a no-op."""
    return getattr(fn, "sync", None) or _no_sync


def _no_sync() -> None:
    return None


def first_call(fn: Callable[[], Any]) -> tuple[int, Any]:
    """Time one call (in a fresh process: import, JIT compile or cache load included); return (ns, result)."""
    sync = _sync(fn)
    sync()
    start = time.perf_counter_ns()
    result = fn()
    sync()
    return time.perf_counter_ns() - start, result


def warm_up(fn: Callable[[], Any], *, settle: float = 1.5) -> int:
    """Call ``fn`` until compilation is over, i.e. until two calls in a row run within ``settle``
    times the fastest call seen so far; return how many calls that took (capped at 50 calls / 3 s)."""
    fastest = None
    calm = 0
    sync = _sync(fn)
    sync()
    started = time.perf_counter_ns()
    for calls in range(1, _WARMUP_MAX_CALLS + 1):
        t0 = time.perf_counter_ns()
        fn()
        sync()
        dt = time.perf_counter_ns() - t0
        fastest = dt if fastest is None else min(fastest, dt)
        calm = calm + 1 if dt <= settle * fastest else 0
        if calm >= 2 or time.perf_counter_ns() - started > _WARMUP_MAX_NS:
            return calls
    return _WARMUP_MAX_CALLS


def time_loops(fn: Callable[[], Any], loops: int) -> float:
    """Nanoseconds per call, averaged over ``loops`` back-to-back calls (and their device work:
    NOTE [ Timing device work ])."""
    sync = _sync(fn)
    sync()
    start = time.perf_counter_ns()
    for _ in range(loops):
        fn()
    sync()
    return (time.perf_counter_ns() - start) / loops


def calibrate(fn: Callable[[], Any], min_sample_ns: int = MIN_SAMPLE_NS, min_loops: int = 1) -> int:
    """The number of calls per sample that makes one sample last at least ``min_sample_ns``, and
    at least ``min_loops`` (a case's own floor: ``Case.min_loops``)."""
    loops = max(1, min_loops)
    while True:
        per_call = time_loops(fn, loops)
        if per_call * loops >= min_sample_ns:
            return loops
        # Aim 20% past the target so the next try lands on it despite noise.
        loops = max(loops * 2, int(1.2 * min_sample_ns / max(per_call, 1.0)) + 1)


def abba_block(
    fn_a: Callable[[], Any], loops_a: int, fn_b: Callable[[], Any], loops_b: int
) -> tuple[float, float]:
    """One A-B-B-A block: the mean per-call time of A's two runs and of B's two runs.

    The symmetric order cancels a drift (clock frequency, cache warmth) that is linear over the block.
    """
    a1 = time_loops(fn_a, loops_a)
    b1 = time_loops(fn_b, loops_b)
    b2 = time_loops(fn_b, loops_b)
    a2 = time_loops(fn_a, loops_a)
    return (a1 + a2) / 2.0, (b1 + b2) / 2.0


def timer_resolution_ns(trials: int = 2000) -> dict:
    """The clock's advertised resolution and the smallest non-zero step seen between two reads."""
    import time as _time

    info = _time.get_clock_info("perf_counter")
    steps = []
    for _ in range(trials):
        t0 = _time.perf_counter_ns()
        t1 = _time.perf_counter_ns()
        while t1 == t0:
            t1 = _time.perf_counter_ns()
        steps.append(t1 - t0)
    return {
        "clock": "time.perf_counter_ns",
        "implementation": info.implementation,
        "advertised_resolution_ns": info.resolution * 1e9,
        "smallest_step_ns": min(steps),
        "median_step_ns": sorted(steps)[len(steps) // 2],
    }
