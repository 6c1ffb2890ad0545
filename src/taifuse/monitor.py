"""Watching a training run: :class:`TrainingMonitor` takes each step's loss (and whatever else is
passed: lr, grad norm) and keeps throughput, memory and health figures beside it, on a progress
bar, in a CSV or JSONL log, in memory and in a PNG plot.

Example::

    >>> import math, taifuse
    >>> from taifuse.monitor import TrainingMonitor
    >>> with TrainingMonitor(total_steps=3, unit="tokens", disable=True) as mon:
    ...     for step in range(3):
    ...         loss = 2.0 / (step + 1)            # a training step's loss (a float or a Tensor)
    ...         _ = mon.step(loss, n=512, lr=1e-3)  # 512 tokens; returns the step's record
    >>> [row["loss"] for row in mon.history]
    [2.0, 1.0, 0.6666666666666666]
    >>> sorted(k for k in mon.history[0] if k.endswith("_per_s"))
    ['steps_per_s', 'tokens_per_s']
    >>> mon.history[-1]["lr"], mon.flags
    (0.001, [])
"""

from __future__ import annotations

import bisect
import contextlib
import csv
import json
import math
import numbers
import operator
import os
import sys
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from taifuse import pool as _pool

if TYPE_CHECKING:  # annotations only: typing.Self is Python 3.11+
    from typing_extensions import Self

__all__ = ["Flag", "TrainingMonitor", "process_memory"]

# The columns every record starts with, in this order; the memory columns only with track_memory.
_BASE_COLUMNS = ("step", "time_s", "step_time_s", "loss", "n", "steps_per_s")
_MEMORY_COLUMNS = ("pool_in_use_bytes", "pool_peak_bytes", "rss_bytes", "rss_peak_bytes")
_LOG_FORMATS = {".csv": "csv", ".jsonl": "jsonl"}


@dataclass(frozen=True)
class Flag:
    """Something about the run that needs a look, recorded in :attr:`TrainingMonitor.flags`.

    Attributes:
        step: the step it was seen at (as in the ``step`` column).
        kind: ``"nonfinite_loss"`` or ``"throughput_drop"``.
        value: the loss, or the windowed throughput that dropped.
        message: what was seen, in words (also the warning's text).
    """

    step: int
    kind: str
    value: float
    message: str


# ----------------------------------------------------------------------------- process memory

_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
# ru_maxrss is in KiB on Linux and the BSDs (as VmHWM in /proc/self/status), in bytes on macOS.
_MAXRSS_UNIT = 1 if sys.platform == "darwin" else 1024


def _peak_rss() -> int | None:
    try:
        import resource
    except ImportError:  # Windows
        return None
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * _MAXRSS_UNIT


def _open_statm() -> int | None:
    if not hasattr(os, "pread"):
        return None
    try:
        return os.open("/proc/self/statm", os.O_RDONLY)
    except OSError:  # not Linux
        return None


def _rss(statm_fd: int | None) -> tuple[int | None, int | None]:
    """``(current, peak)`` resident bytes; current from /proc/self/statm (None without it)."""
    # NOTE [ The peak RSS ]
    # Linux keeps a process's RSS in per-CPU batched counters: statm (and VmRSS) sum them exactly,
    # while the high-water mark behind ru_maxrss is taken from their approximate, unsummed value.
    # So ru_maxrss read beside statm came out a few hundred KiB *below* the current RSS (in every
    # row of train_mlp.py's log). /proc/self/status's VmHWM is max(that high-water mark, the exact
    # current RSS): the same figure here, at a getrusage call rather than formatting the whole
    # status file (a few microseconds a step more). Both restart from the current RSS when 5 is
    # written to /proc/self/clear_refs.
    current = None
    if statm_fd is not None:
        current = int(os.pread(statm_fd, 128, 0).split()[1]) * _PAGE_SIZE
    peak = _peak_rss()
    if peak is not None and current is not None:
        peak = max(peak, current)
    return current, peak


def process_memory() -> tuple[int | None, int | None]:
    """This process's resident set size in bytes: ``(current, peak)``.

    ``current`` is read from ``/proc/self/statm`` on Linux and is None elsewhere. ``peak`` is the
    kernel's high-water mark, ``resource.getrusage``'s ``ru_maxrss`` (KiB on Linux, bytes on macOS;
    converted here), raised to ``current`` where it is below it, as Linux's ``VmHWM`` is (Linux
    keeps the high-water mark from approximate counters); it is None where the ``resource`` module
    is missing (Windows). On Linux it restarts from the current RSS when 5 is written to
    ``/proc/self/clear_refs`` (as the ``memory`` bench suite does).

    Example::

        >>> from taifuse.monitor import process_memory
        >>> current, peak = process_memory()
        >>> peak is None or peak > 0
        True
        >>> current is None or peak >= current
        True
    """
    fd = _open_statm()
    try:
        return _rss(fd)
    finally:
        if fd is not None:
            os.close(fd)


# ----------------------------------------------------------------------------- validation


def _int(value: Any) -> int | None:
    """``value`` as a Python int when it is an integer (a NumPy integer too), else None; bools and
    floats (``5.0`` included) are not integers here, as ``operator.index`` has it."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        return None
    return operator.index(value)


def _positive_int(name: str, value: Any, *, minimum: int = 1) -> int:
    as_int = _int(value)
    if as_int is None:
        raise TypeError(f"TrainingMonitor {name} should be an int, got {value!r}")
    if as_int < minimum:
        raise ValueError(f"TrainingMonitor {name} should be at least {minimum}, got {as_int}")
    return as_int


def _real(name: str, value: Any) -> float:
    """A float argument: a Python or NumPy real number, not a bool."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):  # np.bool_ is no Real
        raise TypeError(f"TrainingMonitor {name} should be a float, got {value!r}")
    return float(value)


def _flag_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"TrainingMonitor {name} should be a bool, got {value!r}")
    return value


def _number(name: str, value: Any) -> float | int:
    """A logged number as a Python float or int: Tensors and NumPy scalars via ``.item()``."""
    # NOTE: float() and int() also turn subclasses (np.float64) into the builtins, whose repr the
    # CSV writer uses: NumPy 2's repr of np.float64(0.1) is "np.float64(0.1)".
    if isinstance(value, float):
        return float(value)
    if isinstance(value, int):
        return int(value)
    item = getattr(value, "item", None)
    if callable(item):
        try:
            value = item()
        except ValueError as exc:  # a Tensor or array with more than one element
            raise ValueError(f"TrainingMonitor.step {name} should be a single number: {exc}") from None
        if isinstance(value, float):
            return float(value)
        if isinstance(value, int):
            return int(value)
    raise TypeError(
        f"TrainingMonitor.step {name} should be a number (or a one-element Tensor or array), "
        f"got {type(value).__name__}"
    )


# ----------------------------------------------------------------------------- the monitor


class TrainingMonitor:
    """Per-step loss, throughput, memory and health of a training loop.

    Call :meth:`step` once per optimizer step with the loss and the number of samples (or tokens)
    the step consumed; anything else passed as a keyword (``lr=``, ``grad_norm=``) is logged as a
    column of its own. Each step the monitor records:

    * ``step`` (counting from ``initial_step + 1``), ``time_s`` (seconds since the clock started),
      ``step_time_s`` (seconds since the previous step, measured by the monitor itself, less the
      time spent inside :meth:`paused`), ``loss`` and ``n``;
    * ``steps_per_s`` and ``<unit>_per_s`` (``samples_per_s``, ``tokens_per_s``): over the last
      ``window`` steps (total ``n`` over total time); ``<unit>_per_s`` is None when ``n`` is not given;
    * with ``track_memory``: ``pool_in_use_bytes`` and ``pool_peak_bytes``, the active backend's
      buffer pool's :class:`~taifuse.pool.PoolStats` ``bytes_in_use`` and ``peak_bytes`` (the most
      the pool has held, free buffers included); ``rss_bytes`` and ``rss_peak_bytes``, the
      process's resident memory (:func:`process_memory`: the current figure where the platform
      gives one, Linux, else None) and its peak (never below the current figure);
    * the keyword extras, in the order the first step passed them.

    The records go to :attr:`history` (a list of dicts), to the log file when ``log_path`` is
    given, and to a tqdm progress bar's postfix when tqdm is installed (the ``test`` and ``bench``
    extras have it); without tqdm, or with ``use_tqdm=False``, a plain line every ``print_every``
    steps. :meth:`plot` draws loss, throughput and memory against the step into one PNG.

    Flags (:attr:`flags`, each also a ``RuntimeWarning``):

    * ``nonfinite_loss``: the loss is NaN or infinite. With ``raise_on_nonfinite=True`` the step is
      recorded and then :class:`FloatingPointError` is raised.
    * ``throughput_drop``: the windowed throughput (``<unit>_per_s``, or ``steps_per_s`` without
      ``n``) fell below ``drop_fraction`` times the median of its earlier values. Checked once the
      window holds no warm-up step (step > ``warmup + window``, counting this monitor's steps) and
      at least ``window`` earlier values are there for the median (they include slow ones: the
      median is of every checked step). It is flagged once it has lasted ``drop_patience_s``
      seconds of step time (the steps' ``step_time_s`` summed from the first one below the
      threshold, so a scheduling hiccup in a window of short steps is not a drop), and flagged
      again only after the throughput has come back above the threshold. The median is kept in
      bins 0.27% wide (within 0.27% of the exact median; exact when the middle values are equal),
      so the check costs the same and holds a bounded amount of memory however long the run.

    The integer arguments take Python or NumPy integers (not bools, not floats such as ``5.0``); the
    float ones, Python or NumPy real numbers.

    Args:
        total_steps: the steps the run will take (the bar's total), or None when unknown.
        unit: what ``n`` counts; names the throughput column ``<unit>_per_s``.
        log_path: a ``.csv`` file (a header from the first step's columns, then one row per step;
            None is an empty cell) or a ``.jsonl`` file (one JSON object per step; None is null and
            non-finite floats are written ``NaN``/``Infinity``, as Python's ``json`` reads them).
            Created (truncated) when the monitor is made.
        window: the steps the rates are computed over.
        warmup: steps before the throughput-drop check may start (compilation, first allocations).
        drop_fraction: the throughput-drop threshold, in (0, 1).
        drop_patience_s: seconds a drop must last before it is flagged (0: at its first step).
        desc: the bar's label (and the plain lines' prefix).
        disable: no bar and no plain lines; the log, history and flags still work.
        use_tqdm: None: a tqdm bar when tqdm is installed; False: plain lines; True: tqdm required.
        print_every: steps between plain lines (default: a tenth of ``total_steps``, or 100).
        flush_every: steps between flushes of the log file.
        raise_on_nonfinite: raise ``FloatingPointError`` after recording a non-finite loss.
        track_memory: record the pool and RSS columns.
        keep_history: keep every record in :attr:`history` (about 0.75 KB a step with two extras,
            measured: a million steps hold 0.7 GB); False keeps none (the log file has them, and
            :meth:`plot` cannot draw), and the monitor's memory then does not grow with the steps.
        initial_step: steps already done (a resumed run): the first step is numbered one more.
        clock: a function returning seconds (default ``time.perf_counter``); tests pass their own.
        file: where the bar and the plain lines go (default ``sys.stderr``).

    Use it as a context manager, or call :meth:`close` at the end (it flushes and closes the log
    file and the bar). The clock starts when the monitor is made and restarts on entering the
    ``with`` block if no step was taken yet.

    Example::

        >>> import numpy as np, taifuse
        >>> import taifuse.functional as F
        >>> from taifuse import nn, optim
        >>> from taifuse.monitor import TrainingMonitor
        >>> taifuse.manual_seed(0)
        >>> model = nn.Linear(4, 1)
        >>> opt = optim.SGD(model.parameters(), lr=0.05)
        >>> x, y = np.ones((8, 4), np.float32), np.zeros((8, 1), np.float32)
        >>> with TrainingMonitor(total_steps=5, disable=True) as monitor:
        ...     for _ in range(5):
        ...         loss = F.mse_loss(model(taifuse.tensor(x)), taifuse.tensor(y))
        ...         opt.zero_grad()
        ...         loss.backward()
        ...         opt.step()
        ...         _ = monitor.step(loss, n=len(x), lr=opt.param_groups[0]["lr"])
        >>> len(monitor.history), monitor.history[-1]["step"], monitor.history[-1]["n"]
        (5, 5, 8)
        >>> monitor.history[-1]["loss"] < monitor.history[0]["loss"]
        True
        >>> monitor.history[-1]["pool_peak_bytes"] >= monitor.history[-1]["pool_in_use_bytes"] >= 0
        True
    """

    def __init__(
        self,
        total_steps: int | None = None,
        *,
        unit: str = "samples",
        log_path: str | os.PathLike | None = None,
        window: int = 20,
        warmup: int = 10,
        drop_fraction: float = 0.5,
        drop_patience_s: float = 1.0,
        desc: str | None = "train",
        disable: bool = False,
        use_tqdm: bool | None = None,
        print_every: int | None = None,
        flush_every: int = 1,
        raise_on_nonfinite: bool = False,
        track_memory: bool = True,
        keep_history: bool = True,
        initial_step: int = 0,
        clock: Callable[[], float] = time.perf_counter,
        file: Any = None,
    ) -> None:
        if total_steps is not None:
            total_steps = _positive_int("total_steps", total_steps)
        if not isinstance(unit, str):
            raise TypeError(f"TrainingMonitor unit should be a str, got {unit!r}")
        if not unit.isidentifier():
            raise ValueError(
                f"TrainingMonitor unit should be a word such as 'samples' or 'tokens', got {unit!r}"
            )
        fmt = None
        if log_path is not None:
            if not isinstance(log_path, (str, os.PathLike)):
                raise TypeError(f"TrainingMonitor log_path should be a path or None, got {log_path!r}")
            log_path = Path(log_path)
            fmt = _LOG_FORMATS.get(log_path.suffix.lower())
            if fmt is None:
                raise ValueError(
                    f"TrainingMonitor log_path should end in .csv or .jsonl, got {str(log_path)!r}"
                )
        window = _positive_int("window", window)
        warmup = _positive_int("warmup", warmup, minimum=0)
        drop_fraction = _real("drop_fraction", drop_fraction)
        if not 0.0 < drop_fraction < 1.0:
            raise ValueError(f"TrainingMonitor drop_fraction should be in (0, 1), got {drop_fraction}")
        drop_patience_s = _real("drop_patience_s", drop_patience_s)
        if not (math.isfinite(drop_patience_s) and drop_patience_s >= 0):
            raise ValueError(
                f"TrainingMonitor drop_patience_s should be a finite number >= 0, got {drop_patience_s}"
            )
        if desc is not None and not isinstance(desc, str):
            raise TypeError(f"TrainingMonitor desc should be a str or None, got {desc!r}")
        _flag_bool("disable", disable)
        if use_tqdm is not None:
            _flag_bool("use_tqdm", use_tqdm)
        if print_every is not None:
            print_every = _positive_int("print_every", print_every)
        flush_every = _positive_int("flush_every", flush_every)
        _flag_bool("raise_on_nonfinite", raise_on_nonfinite)
        _flag_bool("track_memory", track_memory)
        _flag_bool("keep_history", keep_history)
        initial_step = _positive_int("initial_step", initial_step, minimum=0)
        if not callable(clock):
            raise TypeError(f"TrainingMonitor clock should be a function returning seconds, got {clock!r}")
        tqdm_cls = None
        if not disable and use_tqdm is not False:
            try:
                from tqdm import tqdm as tqdm_cls
            except ImportError:  # optional: the `test` and `bench` extras
                if use_tqdm:
                    raise ImportError(
                        "TrainingMonitor(use_tqdm=True) needs tqdm: pip install tqdm "
                        "(or 'taifuse[bench]'); leave use_tqdm=None to fall back to plain lines"
                    ) from None

        self.total_steps = total_steps
        self.unit = unit
        self.rate_column = f"{unit}_per_s"
        self.log_path = log_path
        self.window = window
        self.warmup = warmup
        self.drop_fraction = drop_fraction
        self.drop_patience_s = drop_patience_s
        self.desc = desc
        self.disable = disable
        self.print_every = print_every or (max(1, total_steps // 10) if total_steps else 100)
        self.flush_every = flush_every
        self.raise_on_nonfinite = raise_on_nonfinite
        self.track_memory = track_memory
        self.keep_history = keep_history
        self.initial_step = initial_step
        self._clock = clock
        self._out = file
        self.history: list[dict[str, Any]] = []
        """One dict per step, the columns described above."""
        self.flags: list[Flag] = []
        """What was flagged, in order (see the class docstring)."""

        self._columns: tuple[str, ...] | None = None  # fixed by the first step
        self._count = 0  # steps recorded
        self._last_record: dict[str, Any] | None = None
        # summary()'s totals: [steps, seconds, n, steps without n] over all steps and after warmup
        self._totals = [0, 0.0, 0, 0]
        self._timed = [0, 0.0, 0, 0]
        self._pool_peak = 0
        self._rss_peak: int | None = None  # the most rss_peak_bytes has read (a reset lowers the kernel's)
        self._extras: tuple[str, ...] = ()
        self._recent: deque[tuple[float, int | None]] = deque()  # (seconds, n) of the last `window` steps
        self._recent_time = 0.0
        self._recent_n = 0
        self._recent_missing_n = 0  # steps in the window without n
        self._checked_rates = _RunningMedian()  # the throughput check's earlier values
        self._in_drop = False
        self._below_s = 0.0  # step time since the rate went below the threshold (not yet flagged)
        self._rate_in_units = False
        self._postfix_time = -math.inf  # time_s of the bar's last postfix update
        self._paused = 0.0  # seconds inside paused() since the last step
        self._pause_depth = 0  # paused() blocks open: only the outermost one is timed
        self._closed = False
        self._statm = None
        if track_memory:
            _pool.get_pool()  # starts the active backend now rather than inside the first step's time
            self._statm = _open_statm()
        self._start = self._last = clock()
        self._writer: Any = None
        self._log = None
        if log_path is not None:
            self._log = open(log_path, "w", newline="" if fmt == "csv" else None, encoding="utf-8")  # noqa: SIM115
        self._format = fmt
        self._bar = None
        if tqdm_cls is not None:
            self._bar = tqdm_cls(
                total=total_steps,
                initial=initial_step,
                desc=desc,
                unit="step",
                dynamic_ncols=True,
                file=file,
            )

    # -- the loop's side

    def step(self, loss: Any, n: int | None = None, **extra: Any) -> dict[str, Any]:
        """Record one step: its ``loss``, the ``n`` samples (or tokens) it consumed and ``extra`` columns.

        ``loss`` and the extras are numbers (a one-element Tensor or NumPy value is read with
        ``.item()``; an extra may also be a str or None). The extras' names are fixed by the first
        step (as the CSV header): a later step may leave one out (None is logged) but not add one.
        Returns the record (also appended to :attr:`history`).
        """
        if self._closed:
            raise RuntimeError("TrainingMonitor.step after close()")
        now = self._clock()
        loss = float(_number("loss", loss))
        if n is not None:
            as_int = _int(n)
            if as_int is None:
                raise TypeError(f"TrainingMonitor.step n should be an int or None, got {n!r}")
            n = as_int
            if n < 0:
                raise ValueError(f"TrainingMonitor.step n should be non-negative, got {n}")
        values = {}
        for key, value in extra.items():
            if value is not None and not isinstance(value, str):
                value = _number(key, value)
            values[key] = value
        if self._columns is None:
            reserved = set(_BASE_COLUMNS) | set(_MEMORY_COLUMNS) | {self.rate_column}
            clash = sorted(reserved.intersection(values))
            if clash:
                raise ValueError(f"TrainingMonitor.step extra column(s) {clash} clash with the monitor's own")
            self._extras = tuple(values)
            self._rate_in_units = n is not None  # which rate the drop check follows: fixed by step 1
        else:
            unknown = [k for k in values if k not in self._extras]
            if unknown:
                raise ValueError(
                    f"TrainingMonitor.step got extra column(s) {unknown} that the first step did not have; "
                    f"the columns are fixed by the first step: {list(self._extras)}"
                )

        dt = max(now - self._last - self._paused, 0.0)
        self._last, self._paused = now, 0.0
        steps_per_s, unit_per_s = self._update_rates(dt, n)
        record: dict[str, Any] = {
            "step": self.initial_step + self._count + 1,
            "time_s": now - self._start,
            "step_time_s": dt,
            "loss": loss,
            "n": n,
            "steps_per_s": steps_per_s,
            self.rate_column: unit_per_s,
        }
        if self.track_memory:
            stats = _pool.get_pool().stats()
            record["pool_in_use_bytes"] = stats.bytes_in_use
            record["pool_peak_bytes"] = stats.peak_bytes
            record["rss_bytes"], record["rss_peak_bytes"] = _rss(self._statm)
        for key in self._extras:
            record[key] = values.get(key)
        if self._columns is None:
            self._columns = tuple(record)
        self._count += 1
        self._last_record = record
        for totals in (self._totals, self._timed) if self._count > self.warmup else (self._totals,):
            totals[0] += 1
            totals[1] += dt
            totals[2] += n or 0
            totals[3] += n is None
        if self.track_memory:
            self._pool_peak = max(self._pool_peak, record["pool_peak_bytes"])
            if record["rss_peak_bytes"] is not None:
                self._rss_peak = max(self._rss_peak or 0, record["rss_peak_bytes"])
        if self.keep_history:
            self.history.append(record)
        self._write(record)
        self._show(record)

        if not math.isfinite(loss):
            message = f"step {record['step']}: the loss is {loss}"
            self._flag(record["step"], "nonfinite_loss", loss, message, stacklevel=3)
        self._check_throughput(record["step"], dt, unit_per_s if self._rate_in_units else steps_per_s)
        if self.raise_on_nonfinite and not math.isfinite(loss):
            raise FloatingPointError(f"step {record['step']}: the loss is {loss}")
        return record

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Time inside the block (an evaluation, a checkpoint save) is left out of the next step's time.

        Blocks may nest (a checkpoint save inside an evaluation): the outermost one's time is left
        out, once."""
        outermost = self._pause_depth == 0
        self._pause_depth += 1
        t0 = self._clock() if outermost else 0.0
        try:
            yield
        finally:
            self._pause_depth -= 1
            if outermost:
                self._paused += self._clock() - t0

    def write(self, line: str) -> None:
        """Print ``line`` to stdout without breaking the progress bar (``tqdm.write`` when there is one)."""
        if self._bar is not None:
            self._bar.write(line, file=sys.stdout)
        else:
            print(line, flush=True)

    # -- rates and flags

    def _update_rates(self, dt: float, n: int | None) -> tuple[float | None, float | None]:
        recent = self._recent
        recent.append((dt, n))
        self._recent_time += dt
        if n is None:
            self._recent_missing_n += 1
        else:
            self._recent_n += n
        if len(recent) > self.window:
            old_dt, old_n = recent.popleft()
            self._recent_time -= old_dt
            if old_n is None:
                self._recent_missing_n -= 1
            else:
                self._recent_n -= old_n
        if self._recent_time <= 0.0:
            return None, None
        steps_per_s = len(recent) / self._recent_time
        unit_per_s = None if self._recent_missing_n else self._recent_n / self._recent_time
        return steps_per_s, unit_per_s

    def _check_throughput(self, step: int, dt: float, rate: float | None) -> None:
        if rate is None or self._count <= self.warmup + self.window:
            return
        earlier = self._checked_rates
        if earlier.count >= self.window:
            median = earlier.median()
            threshold = self.drop_fraction * median
            if rate >= threshold:
                self._in_drop, self._below_s = False, 0.0
            elif not self._in_drop and self._below_s + dt >= self.drop_patience_s:
                self._in_drop = True
                unit = self.unit if self._rate_in_units else "steps"
                self._flag(
                    step,
                    "throughput_drop",
                    rate,
                    f"step {step}: throughput {rate:.4g} {unit}/s over the last {self.window} steps is below "
                    f"{self.drop_fraction:g} x its running median {median:.4g} "
                    f"(for {self._below_s + dt:.3g} s of steps)",
                    stacklevel=4,
                )
            elif not self._in_drop:
                self._below_s += dt
        earlier.add(rate)

    def _flag(self, step: int, kind: str, value: float, message: str, stacklevel: int) -> None:
        # stacklevel: the frames between here and the caller of step(), whose line the warning names.
        self.flags.append(Flag(step, kind, value, message))
        warnings.warn(message, RuntimeWarning, stacklevel=stacklevel)

    # -- output

    def _write(self, record: dict[str, Any]) -> None:
        if self._log is None:
            return
        if self._format == "csv":
            if self._writer is None:
                self._writer = csv.DictWriter(self._log, fieldnames=self._columns, lineterminator="\n")
                self._writer.writeheader()
            self._writer.writerow(record)
        else:
            self._log.write(json.dumps(record) + "\n")
        if self._count % self.flush_every == 0:
            self._log.flush()

    def _postfix(self, record: dict[str, Any]) -> dict[str, str]:
        shown = {"loss": f"{record['loss']:.4g}"}
        rate = record[self.rate_column]
        if rate is not None:
            shown[f"{self.unit}/s"] = f"{rate:,.0f}"
        elif record["steps_per_s"] is not None:
            shown["steps/s"] = f"{record['steps_per_s']:.3g}"
        if self.track_memory:
            shown["pool"] = _mib(record["pool_in_use_bytes"])
            rss = record["rss_bytes"] if record["rss_bytes"] is not None else record["rss_peak_bytes"]
            if rss is not None:
                shown["rss"] = _mib(rss)
        for key in self._extras:
            value = record[key]
            if value is not None:
                shown[key] = f"{value:.3g}" if isinstance(value, float) else str(value)
        return shown

    def _show(self, record: dict[str, Any]) -> None:
        if self._bar is not None:
            # Formatting the postfix costs more than the rest of a step's bookkeeping: at most once
            # per tqdm refresh interval (its mininterval, 0.1 s by default), and at close().
            if record["time_s"] - self._postfix_time >= self._bar.mininterval:
                self._postfix_time = record["time_s"]
                self._bar.set_postfix(self._postfix(record), refresh=False)
            self._bar.update(1)
        elif not self.disable:
            count = self._count
            if count % self.print_every == 0 or count == 1 or record["step"] == self.total_steps:
                total = f"/{self.total_steps}" if self.total_steps else ""
                fields = "  ".join(f"{k} {v}" for k, v in self._postfix(record).items())
                prefix = f"{self.desc} " if self.desc else ""
                print(
                    f"{prefix}step {record['step']}{total}  {fields}",
                    file=self._out or sys.stderr,
                    flush=True,
                )

    # -- summary, plot, close

    def plot(self, path: str | os.PathLike) -> Path:
        """Draw the loss, the throughput and the memory against the step into one PNG at ``path``.

        Needs matplotlib (the ``plot`` extra: ``pip install 'taifuse[plot]'``), imported here and
        used without pyplot (no global backend is set). Flagged steps are marked with vertical
        lines. Returns the path written.
        """
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"TrainingMonitor.plot path should be a path, got {path!r}")
        if not self.history:
            why = "keep_history=False keeps no records" if self._count else "no step recorded yet"
            raise ValueError(f"TrainingMonitor.plot: {why}, nothing to plot")
        try:
            import matplotlib.backends.backend_agg
            import matplotlib.figure  # noqa: F401
        except ImportError:
            raise ImportError(
                "TrainingMonitor.plot needs matplotlib, the 'plot' extra: pip install 'taifuse[plot]'"
            ) from None
        path = Path(path)
        self._figure().savefig(path, format="png", dpi=100)
        return path

    def _figure(self) -> Any:
        """:meth:`plot`'s matplotlib Figure, not yet saved."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        rows = self.history
        steps = [r["step"] for r in rows]
        panels = 3 if self.track_memory else 2
        fig = Figure(figsize=(8, 2.6 * panels), layout="constrained")
        FigureCanvasAgg(fig)
        axes = fig.subplots(panels, 1, sharex=True)

        ax = axes[0]
        losses = [r["loss"] if math.isfinite(r["loss"]) else math.nan for r in rows]
        ax.plot(steps, losses, lw=0.8, alpha=0.5, label="loss")
        ax.plot(steps, _trailing_mean(losses, self.window), lw=1.5, label=f"mean of the last {self.window}")
        ax.set_ylabel("loss")
        ax.legend(loc="best", fontsize="small")
        ax.set_title(f"{self.desc}: loss, throughput, memory" if self.desc else "loss, throughput, memory")

        ax = axes[1]
        unit_rates = [r[self.rate_column] for r in rows]
        if any(v is not None for v in unit_rates):
            ax.plot(steps, [math.nan if v is None else v for v in unit_rates], lw=1, label=f"{self.unit}/s")
            ax.set_ylabel(f"{self.unit}/s (last {self.window} steps)")
        else:
            ax.plot(steps, [math.nan if r["steps_per_s"] is None else r["steps_per_s"] for r in rows], lw=1)
            ax.set_ylabel(f"steps/s (last {self.window} steps)")
        ax.set_ylim(bottom=0)

        if self.track_memory:
            # The pool on the left axis, the process's RSS (usually far larger) on the right.
            ax = axes[2]
            rss_ax = ax.twinx()
            tops = {ax: 0.0, rss_ax: 0.0}
            for target, column, label, color, style in (
                (ax, "pool_in_use_bytes", "pool in use", "tab:blue", "-"),
                (ax, "pool_peak_bytes", "pool peak", "tab:orange", "-"),
                (rss_ax, "rss_bytes", "process RSS (right)", "tab:green", "-"),
                (rss_ax, "rss_peak_bytes", "process RSS peak (right)", "tab:green", ":"),
            ):
                values = [r[column] for r in rows]
                if any(v is not None for v in values):
                    mib = [math.nan if v is None else v / 2**20 for v in values]
                    target.plot(steps, mib, lw=1, ls=style, label=label, color=color)
                    tops[target] = max(tops[target], max(v for v in mib if not math.isnan(v)))
            ax.set_ylabel("pool MiB")
            rss_ax.set_ylabel("RSS MiB")
            # From 0 to above the highest line, so no line lies on an axis's edge (a flat RSS
            # autoscaled to its own few KiB of range sat on the top edge, hidden by the frame); the
            # two axes' headrooms differ so that the pool's peak and the RSS, each the highest on its
            # axis, are not drawn over each other.
            for target, headroom in ((ax, _POOL_HEADROOM), (rss_ax, _RSS_HEADROOM)):
                target.set_ylim(0, headroom * tops[target] if tops[target] > 0 else 1.0)
            lines = ax.get_lines() + rss_ax.get_lines()
            ax.legend(lines, [line.get_label() for line in lines], loc="lower right", fontsize="small")

        for flag in self.flags:
            panel = axes[0] if flag.kind == "nonfinite_loss" else axes[1]
            panel.axvline(flag.step, color="tab:red", lw=0.8, ls="--")
        axes[-1].set_xlabel("step")
        for ax in axes:
            ax.grid(True, alpha=0.3)
        return fig

    def summary(self) -> dict[str, Any]:
        """Totals of the run so far: ``steps``, ``wall_s`` (the last step's ``time_s``), mean
        ``steps_per_s`` and ``<unit>_per_s`` over the steps after ``warmup`` (over all of them while
        there are no more; None without time, or when a step had no ``n``), ``flags`` (their
        number) and, with ``track_memory``, ``pool_peak_bytes`` and ``rss_peak_bytes`` (the most
        each column read over the steps)."""
        steps, seconds, n, missing = self._timed if self._timed[0] else self._totals
        last = self._last_record
        out: dict[str, Any] = {
            "steps": self._count,
            "wall_s": last["time_s"] if last else 0.0,
            "steps_per_s": steps / seconds if seconds > 0 else None,
            self.rate_column: n / seconds if seconds > 0 and not missing else None,
            "flags": len(self.flags),
        }
        if self.track_memory:
            out["pool_peak_bytes"] = self._pool_peak
            out["rss_peak_bytes"] = self._rss_peak
        return out

    def close(self) -> None:
        """Flush and close the log file, close the bar. Calling it again does nothing."""
        if self._closed:
            return
        self._closed = True
        if self._log is not None:
            self._log.close()
        if self._bar is not None:
            if self._last_record is not None:
                self._bar.set_postfix(self._postfix(self._last_record), refresh=False)
            self._bar.close()
        if self._statm is not None:
            os.close(self._statm)
            self._statm = None

    def __enter__(self) -> Self:
        if not self._count:
            self._start = self._last = self._clock()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # A monitor dropped without close(): release the statm descriptor (files close themselves).
        statm = getattr(self, "_statm", None)
        if statm is not None:
            with contextlib.suppress(OSError):
                os.close(statm)

    def __repr__(self) -> str:
        return (
            f"TrainingMonitor(total_steps={self.total_steps}, unit={self.unit!r}, "
            f"log_path={str(self.log_path) if self.log_path else None!r}, steps={self._count})"
        )


# The memory panel's axes reach this far above their highest line (see plot()).
_POOL_HEADROOM, _RSS_HEADROOM = 1.1, 1.3

# The running median's bins: 256 to a factor of 2 (each 0.27% wide).
_LOG_BIN = math.log(2.0) / 256
_ZERO_KEY = -(1 << 62)  # the bin of 0 (a window of steps with n=0), below every other


class _RunningMedian:
    """The median of every value added (each >= 0), in memory that does not grow with their number.

    The values go into bins 0.27% wide in ratio (256 to a factor of 2), each keeping its count and
    its values' sum; the median is the mean of the bin that holds the middle rank (for an even count,
    the mean of the two middle ranks' bins). It is exact when that bin's values are equal and within
    0.27% of the exact median otherwise. The bins are as many as the values' range needs: a factor of
    10**6 between the slowest and the fastest rate is 5,102 bins, whatever the number of steps.
    ``add`` and ``median`` take O(1) steps amortized (the middle rank moves by at most one value
    per ``add``), plus a list insert of the sorted bin keys when a value opens a new bin.
    """

    __slots__ = ("_at", "_below", "_bins", "_keys", "count")

    def __init__(self) -> None:
        self.count = 0
        self._keys: list[int] = []  # the bins' keys, sorted
        self._bins: dict[int, list] = {}  # key -> [count, sum]
        self._at = 0  # index in _keys of the bin the last median was read from
        self._below = 0  # the values in the bins before it

    def add(self, value: float) -> None:
        key = math.floor(math.log(value) / _LOG_BIN) if value > 0.0 else _ZERO_KEY
        entry = self._bins.get(key)
        if entry is None:
            entry = self._bins[key] = [0, 0.0]
            i = bisect.bisect_left(self._keys, key)
            self._keys.insert(i, key)
            if self.count and i <= self._at:  # a bin before the current one: the index moves on
                self._at += 1
        entry[0] += 1
        entry[1] += value
        if self.count and key < self._keys[self._at]:
            self._below += 1
        self.count += 1

    def _rank(self, rank: int) -> float:
        """The mean of the bin holding the ``rank``-th smallest value (from 0)."""
        keys, bins = self._keys, self._bins
        while rank < self._below:
            self._at -= 1
            self._below -= bins[keys[self._at]][0]
        while rank >= self._below + bins[keys[self._at]][0]:
            self._below += bins[keys[self._at]][0]
            self._at += 1
        count, total = bins[keys[self._at]]
        return total / count

    def median(self) -> float:
        if not self.count:
            raise ValueError("the median of no values")
        mid = self.count // 2
        if self.count % 2:
            return self._rank(mid)
        return 0.5 * (self._rank(mid - 1) + self._rank(mid))


def _trailing_mean(values: list[float], window: int) -> list[float]:
    """The mean of each value and the ``window - 1`` before it, NaNs left out (NaN when all are)."""
    out, recent, total, count = [], deque(), 0.0, 0
    for v in values:
        recent.append(v)
        if not math.isnan(v):
            total += v
            count += 1
        if len(recent) > window:
            old = recent.popleft()
            if not math.isnan(old):
                total -= old
                count -= 1
        out.append(total / count if count else math.nan)
    return out


def _mib(nbytes: int | None) -> str:
    """Bytes for the bar: in KiB below 1 MiB, MiB below 1 GiB, else GiB."""
    if nbytes is None:
        return "?"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
        if nbytes >= size:
            return f"{nbytes / size:.1f}{unit}"
    return f"{nbytes / 2**10:.1f}KiB"
