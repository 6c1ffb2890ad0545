"""Helpers around a training loop: :func:`find_batch_size`, a measured choice of batch size.

Example (a step that takes the same millisecond at every batch size, so samples/s doubles with
each doubling and the search runs to ``max_batch``)::

    >>> import time
    >>> from taifuse.utils import find_batch_size
    >>> found = find_batch_size(lambda n: time.sleep(1e-3), start=8, max_batch=32, printer=None)
    >>> [t.batch_size for t in found.table]
    [8, 16, 32]
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["BatchSizeSearch", "BatchSizeTrial", "find_batch_size"]


@dataclass(frozen=True)
class BatchSizeTrial:
    """One batch size measured: its throughput and the peak memory of its steps.

    ``pool_peak_bytes`` is the active backend's buffer pool's peak (device memory on the Taichi
    backend), ``rss_peak_bytes`` the process's resident high-water mark while it ran (None where
    the system does not report it), ``stopped`` why the search stopped here (None: it went on).
    """

    batch_size: int
    steps_per_s: float
    samples_per_s: float
    pool_peak_bytes: int
    rss_peak_bytes: int | None
    stopped: str | None = None


@dataclass
class BatchSizeSearch:
    """What :func:`find_batch_size` found: the chosen ``batch_size``, the trials in the order
    they ran, and why the search ended."""

    batch_size: int
    table: list[BatchSizeTrial] = field(default_factory=list)
    reason: str = ""

    def format(self) -> str:
        """The table as text, the chosen row marked."""
        lines = [
            f"{'batch':>7} {'steps/s':>9} {'samples/s':>11} {'pool peak MiB':>14} {'RSS peak MiB':>13}  note"
        ]
        for t in self.table:
            rss = "-" if t.rss_peak_bytes is None else f"{t.rss_peak_bytes / 2**20:.1f}"
            rate = "-" if math.isnan(t.steps_per_s) else f"{t.steps_per_s:.2f}"
            samples = "-" if math.isnan(t.samples_per_s) else f"{t.samples_per_s:,.0f}"
            note = ("chosen; " if t.batch_size == self.batch_size else "") + (t.stopped or "")
            lines.append(
                f"{t.batch_size:>7} {rate:>9} {samples:>11} {t.pool_peak_bytes / 2**20:>14.1f} {rss:>13}  {note}"
            )
        lines.append(f"chosen batch size {self.batch_size} ({self.reason})")
        return "\n".join(lines)

    def plot(self, path: str) -> None:
        """Draw samples/s and peak memory against the batch size to a PNG (needs matplotlib)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        rows = [t for t in self.table if not math.isnan(t.samples_per_s)]
        sizes = [t.batch_size for t in rows]
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(sizes, [t.samples_per_s for t in rows], "o-", label="samples/s")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel("samples/s")
        ax.axvline(self.batch_size, color="gray", linestyle=":", label=f"chosen {self.batch_size}")
        mem = ax.twinx()
        mem.plot(sizes, [t.pool_peak_bytes / 2**20 for t in rows], "s--", color="C1", label="pool peak MiB")
        if all(t.rss_peak_bytes is not None for t in rows):
            mem.plot(sizes, [t.rss_peak_bytes / 2**20 for t in rows], "^--", color="C2", label="RSS peak MiB")
        mem.set_ylabel("MiB")
        fig.legend(loc="upper left")
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)


def _is_out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, MemoryError) or "out of memory" in str(exc).lower()


def _reset_rss_peak() -> None:
    try:  # Linux: restart the high-water mark from the current RSS
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def find_batch_size(
    step: Callable[[int], Any],
    start: int = 8,
    max_batch: int = 4096,
    memory_limit: int | None = None,
    *,
    min_gain: float = 0.05,
    repeats: int = 3,
    min_time: float = 0.2,
    printer: Callable[[str], Any] | None = print,
) -> BatchSizeSearch:
    """Measure ``step(batch_size)`` at ``start``, ``2 * start``, ... and choose the batch size past
    which samples per second stop growing.

    Each size runs once untimed (the kernels compile, the pool fills), then at least ``repeats``
    times and ``min_time`` seconds, each step timed: steps/s is one over the median step time (a
    burst of other work on the machine moves it less than a mean), samples/s = batch_size x steps/s. The peak
    memory of those steps is the active backend pool's peak (``taifuse.pool``; the pool is cleared
    before each size) and the process's resident high-water mark (``taifuse.monitor.process_memory``).

    The search stops at the first of: a size whose pool peak is above ``memory_limit`` bytes (the
    memory the model's tensors take: device memory on the Taichi backend; the process's resident
    size, which counts the interpreter and its libraries too, is reported beside it); a step that runs out of memory (``MemoryError``, or an error whose
    message says "out of memory"; any other error is raised); a size whose samples/s is not at
    least ``1 + min_gain`` times the best so far (throughput stopped growing); ``max_batch``.
    The chosen size is the last one that was not stopped: over the limit, out of memory, or within
    ``min_gain`` of the one before, a larger size buys nothing for its memory.

    Returns a :class:`BatchSizeSearch` (``.batch_size``, ``.table``, ``.format()``,
    ``.plot(path)``); the table is also given to ``printer`` (None: not printed). Raises
    ``RuntimeError`` when even ``start`` does not fit.
    """
    from taifuse import pool
    from taifuse.monitor import process_memory

    for name, value in (("start", start), ("max_batch", max_batch), ("repeats", repeats)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"find_batch_size: {name} should be a positive int, got {value!r}")
    if start > max_batch:
        raise ValueError(f"find_batch_size: start ({start}) should be at most max_batch ({max_batch})")
    if memory_limit is not None and (
        isinstance(memory_limit, bool) or not isinstance(memory_limit, int) or memory_limit <= 0
    ):
        raise ValueError(
            f"find_batch_size: memory_limit should be a positive number of bytes, got {memory_limit!r}"
        )
    if not callable(step):
        raise TypeError(f"find_batch_size: step should be callable, got {type(step).__name__}")

    search = BatchSizeSearch(batch_size=0)
    best: BatchSizeTrial | None = None
    size = start
    while True:
        the_pool = pool.get_pool()
        the_pool.clear()
        the_pool.reset_stats()
        _reset_rss_peak()
        try:
            step(size)
            times: list[float] = []
            elapsed = 0.0  # a running total: sum(times) each step was quadratic for a fast step
            while len(times) < repeats or elapsed < min_time:
                t0 = time.perf_counter()
                step(size)
                times.append(time.perf_counter() - t0)
                elapsed += times[-1]
            median = statistics.median(times)
        except Exception as exc:
            if not _is_out_of_memory(exc):
                raise
            nan = float("nan")
            trial = BatchSizeTrial(
                size, nan, nan, the_pool.stats().peak_bytes, process_memory()[1], "out of memory"
            )
            search.table.append(trial)
            search.reason = f"{size} ran out of memory ({type(exc).__name__})"
            break
        rss_peak = process_memory()[1]
        pool_peak = the_pool.stats().peak_bytes
        trial = BatchSizeTrial(size, 1 / median, size / median, pool_peak, rss_peak)
        peak = pool_peak
        if memory_limit is not None and peak > memory_limit:
            search.table.append(_stopped(trial, "over the memory limit"))
            search.reason = f"{size}'s pool peaked at {peak / 2**20:.2f} MiB, over the limit {memory_limit / 2**20:.2f} MiB"
            break
        if best is not None and trial.samples_per_s < (1 + min_gain) * best.samples_per_s:
            # Not chosen even when a little faster: within min_gain it buys nothing for its memory.
            search.table.append(_stopped(trial, "throughput stopped growing"))
            search.reason = f"samples/s grew less than {min_gain:.0%} from {size // 2} to {size}"
            break
        search.table.append(trial)
        best = trial
        if size * 2 > max_batch:
            search.reason = f"max_batch {max_batch} reached"
            break
        size *= 2
    if best is None:
        raise RuntimeError(
            f"find_batch_size: even the start batch size {start} does not fit ({search.reason})"
        )
    search.batch_size = best.batch_size
    if printer is not None:
        printer(search.format())
    return search


def _stopped(trial: BatchSizeTrial, why: str) -> BatchSizeTrial:
    return BatchSizeTrial(
        trial.batch_size,
        trial.steps_per_s,
        trial.samples_per_s,
        trial.pool_peak_bytes,
        trial.rss_peak_bytes,
        why,
    )
