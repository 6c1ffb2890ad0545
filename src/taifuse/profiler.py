"""Where a step's time goes, op by op, against what the machine can do: ``torch.profiler``'s shape.

:class:`profile` records every op call while it is active (forward and backward of every autograd
op, ops on NumPy arrays, the optimizers' fused updates, the pool's buffer acquisitions) and every
``nn.Module`` call as an enclosing range named by the module's path (``model.blocks.0.attn``), as
:func:`record_function` does for user code. Each op event carries its backend and arch, input
shapes and dtypes, wall time (synchronized before and after on a device backend when
``sync=True``), and what it must move and compute from the formulas ``taifuse bench`` uses
(``taifuse._costs``). :meth:`profile.key_averages` groups the events by name (and optionally by
input shapes) and prints a table with the achieved GB/s and GFLOP/s, the fraction of the machine's
ceiling and the bound (memory, compute, or per-call overhead); :meth:`profile.export_chrome_trace`
writes Trace Event JSON for Perfetto or chrome://tracing, with the pool's bytes in use as a counter
track. See docs/profiling.md.

Example::

    >>> import numpy as np, taifuse, taifuse.functional as F
    >>> from taifuse import nn
    >>> from taifuse.profiler import profile, record_function
    >>> taifuse.set_backend("numpy")
    >>> model = nn.Sequential(nn.Linear(8, 4), nn.GELU())
    >>> x = taifuse.tensor(np.ones((2, 8), np.float32))
    >>> with profile() as prof:
    ...     with record_function("step"):
    ...         model(x).sum().backward()
    >>> [e.name for e in prof.events() if e.kind == "range"]
    ['step', 'model', 'model.0', 'model.1']
    >>> "linear" in [row.name for row in prof.key_averages()]
    True
"""

from __future__ import annotations

import contextlib
import enum
import functools
import inspect
import json
import math
import os
import re
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from taifuse import _ceilings, _costs, _profile_hook, backends
from taifuse._costs import Cost, traffic_bytes

if TYPE_CHECKING:  # annotations only: typing.Self is Python 3.11+
    from typing_extensions import Self

__all__ = [
    "SORT_KEYS",
    "Ceilings",
    "EventAverage",
    "EventList",
    "ProfilerAction",
    "ProfilerEvent",
    "measure_ceilings",
    "profile",
    "record_function",
    "schedule",
]

# ----------------------------------------------------------------------------- events


@dataclass(slots=True)
class ProfilerEvent:
    """One recorded call.

    Attributes:
        name: the op (``"linear"``, ``"linear_backward"``, ``"AdamW.step"``, ``"pool.acquire"``)
            or the range (``"model.blocks.0.attn"``, a :func:`record_function` name).
        kind: ``"op"`` (an op's forward), ``"backward"``, ``"optimizer"``, ``"range"`` or ``"pool"``.
        backend, arch: where it ran (arch is the Taichi arch, or the backend's name).
        start_ns, duration_ns: wall time from the profile's start (``time.perf_counter``, in ns).
        self_ns: ``duration_ns`` less the time of the events directly inside it.
        shapes, dtypes: of the array arguments (empty with ``record_shapes=False``).
        cost: bytes it must move and flops it must do (``taifuse._costs.Cost``), None for ranges.
        depth: nesting depth (0: outermost).
        pool_bytes_in_use: for a pool event, the pool's bytes in use after the acquisition.
    """

    name: str
    kind: str
    backend: str
    arch: str
    start_ns: int
    duration_ns: int = 0
    self_ns: int = 0
    shapes: tuple = ()
    dtypes: tuple = ()
    cost: Cost | None = None
    depth: int = 0
    pool_bytes_in_use: int | None = None

    @property
    def end_ns(self) -> int:
        return self.start_ns + self.duration_ns


# ----------------------------------------------------------------------------- ceilings


@dataclass(frozen=True)
class Ceilings:
    """What the machine can do, as the profiler judges an op: copy bandwidth by working set
    (``((bytes, GB/s of traffic), ...)``, NOTE [ Traffic model ] in taifuse/_ceilings.py), the GEMM
    rate (GFLOP/s) and the cost of one op call that does no work (ns), with where they came from.
    The copy and GEMM figures are ``taifuse._ceilings``'s, which ``taifuse bench`` measures with too."""

    copy: tuple[tuple[int, float], ...]
    gemm_gflops: float
    call_overhead_ns: float
    source: str

    def bandwidth(self, working_set: float) -> tuple[float, int]:
        """(GB/s, its working set): the copy of the smallest working set that holds
        ``working_set`` bytes, else the largest measured."""
        ordered = sorted(self.copy)
        for size, gbps in ordered:
            if working_set <= size:
                return gbps, size
        return ordered[-1][1], ordered[-1][0]


def _call_overhead_ns() -> float:
    # One op that does no work, as a user calls it: a 1-element relu on the active backend.
    from taifuse import functional as F

    x = np.zeros(1, np.float32)
    F.relu(x)
    samples = []
    for _ in range(5):
        start = time.perf_counter_ns()
        for _ in range(50):
            F.relu(x)
        samples.append((time.perf_counter_ns() - start) / 50)
    return min(samples)


@functools.lru_cache(maxsize=1)
def measure_ceilings() -> Ceilings:
    """The ceilings of this machine, measured once per process (a second or two) and cached.

    Copy bandwidth at each of ``taifuse._ceilings.COPY_WORKING_SETS`` (256 KiB to 256 MiB,
    ``taifuse bench``'s copy kernel: one chunk per CPU on its own thread), the GEMM rate on
    ``taifuse bench``'s shape (4096x1024 @ 1024x768 float32, NumPy's BLAS), each the fastest of
    five passes (``taifuse._ceilings.measured``), and the per-call cost of a 1-element op on the
    active backend. A ``taifuse bench`` results file (``profile(ceilings=path)``) gives figures
    measured with intervals instead.
    """
    copy, gemm = _ceilings.measured()
    return Ceilings(
        copy=copy,
        gemm_gflops=gemm,
        call_overhead_ns=_call_overhead_ns(),
        source="measured in this process, fastest of 5 passes",
    )


def ceilings_from_results(path: str | os.PathLike) -> Ceilings:
    """The ceilings of a ``taifuse bench`` ``results.json``: its roofline rows (copy bandwidth per
    cache level at that level's working set, the GEMM rate); the per-call cost is measured here
    (bench results do not hold it).

    Raises ValueError naming ``path`` when the file has no roofline rows.
    """
    copy, gemm = roofline_from_results(path)
    return Ceilings(copy, gemm, _call_overhead_ns(), f"taifuse bench results {os.fspath(path)}")


def roofline_from_results(path: str | os.PathLike) -> tuple[tuple[tuple[int, float], ...], float]:
    """``(copy, gemm_gflops)`` of a ``taifuse bench`` results.json's roofline rows, measuring
    nothing (``taifuse profile --ceilings`` checks its file with it before the script runs).

    Raises ValueError naming ``path`` when it cannot be read, is not JSON, or holds no roofline rows.
    """
    ceilings = _ceilings.read_results(path)
    return ceilings.by_working_set(), ceilings.gemm.value


# ----------------------------------------------------------------------------- op names and costs

_CAMEL = re.compile(r"(?<!^)(?=[A-Z][a-z])")


@functools.cache
def _op_name(cls: type) -> str:
    """``_LayerNorm`` -> ``layer_norm``, ``_MatMul`` -> ``matmul``; a custom op's node class
    carries its name (``mylib::swiglu``: taifuse.library)."""
    custom = getattr(cls, "op_name", None)
    if isinstance(custom, str):
        return custom
    name = cls.__name__.lstrip("_")
    return "matmul" if name == "MatMul" else _CAMEL.sub("_", name).lower()


def _nbytes(shape: tuple, dtype: Any) -> int:
    return math.prod(shape) * np.dtype(dtype).itemsize


_SCALARS = frozenset((bool, int, float, str, type(None)))


_ARRAY_TYPES: set[type] = {np.ndarray}  # and the backends' array types, as they are seen


def _raw_signature(args: tuple) -> tuple:
    # What a hook keeps of a call, cheaply: (shape, dtype) per array, the value of a small scalar
    # (an activation name, is_causal), None for anything else. _split makes the signature of it.
    return tuple(
        (v.shape, v.dtype) if type(v) in _ARRAY_TYPES else v if type(v) in _SCALARS else _other(v)
        for v in args
    )


def _other(v: Any) -> Any:
    if hasattr(v, "dtype") and hasattr(v, "shape") and not isinstance(v, np.generic):
        _ARRAY_TYPES.add(type(v))  # a backend's array type (Taichi's DeviceArray), seen once
        return (v.shape, v.dtype)
    return None


def _raw_bytes(raw: tuple) -> int:
    """Bytes of the arrays in a raw signature (a result, or a tuple of gradients)."""
    return sum(_nbytes(tuple(item[0]), item[1]) for item in raw if type(item) is tuple)


def _split(raw: tuple) -> tuple:
    """(shapes, dtypes, scalars) of a call from :func:`_raw_signature`."""
    shapes, dtypes, scalars = [], [], []
    for item in raw:
        if type(item) is tuple:
            shapes.append(tuple(item[0]))
            dtypes.append(item[1])
            scalars.append(None)
        else:
            shapes.append(None)
            dtypes.append(None)
            scalars.append(item)
    return tuple(shapes), tuple(dtypes), tuple(scalars)


_ARRAY_PARAMS: dict[str, list[str]] = {}


def _bind(fn: Callable, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Positional arguments of an array-path call, keywords folded in (so costs read positions)."""
    if not kwargs:
        return args, kwargs
    params = _ARRAY_PARAMS.get(fn.__name__)
    if params is None:
        params = _ARRAY_PARAMS[fn.__name__] = list(inspect.signature(fn).parameters)
    full = list(args) + [None] * (len(params) - len(args))
    for key, value in kwargs.items():
        full[params.index(key)] = value
    return tuple(full), {}


def _linear_cost(sig: tuple, phase: str, needs_grad: tuple) -> Cost | None:
    shapes, dtypes, scalars = sig
    if len(shapes) < 2 or shapes[0] is None or shapes[1] is None:
        return None
    x, w = shapes[0], shapes[1]
    bias = len(shapes) > 2 and shapes[2] is not None
    activation = scalars[3] if len(scalars) > 3 else None
    return _costs.linear(
        math.prod(x[:-1]),
        w[1],
        w[0],
        bias=bias,
        itemsize=np.dtype(dtypes[0]).itemsize,
        backward=phase == "backward",
        activation=activation is not None,
        input_grad=bool(needs_grad[0]) if needs_grad else True,
    )


def _attention_cost(sig: tuple, phase: str, causal_at: int) -> Cost | None:
    shapes, dtypes, scalars = sig
    q, k = shapes[0], shapes[1]
    if q is None or k is None:
        return None
    causal = bool(scalars[causal_at]) if len(scalars) > causal_at else False
    heads = max(math.prod(q[:-2]), math.prod(k[:-2]))
    return _costs.attention(
        1, heads, q[-2], k[-2], q[-1], causal, phase=phase, itemsize=np.dtype(dtypes[0]).itemsize
    )


def _matmul_cost(sig: tuple, phase: str) -> Cost | None:
    shapes, dtypes, _ = sig
    a, b = shapes[0], shapes[1]
    if a is None or b is None or len(a) < 2 or len(b) < 1:
        return None
    b2 = b if len(b) >= 2 else (b[0], 1)
    batch = max(math.prod(a[:-2]), math.prod(b2[:-2]))
    return _costs.matmul(
        batch, a[-2], a[-1], b2[-1], itemsize=np.dtype(dtypes[0]).itemsize, backward=phase == "backward"
    )


def _conv_shape(x: tuple, w: tuple, out_bytes: int, itemsize: int) -> _costs.ConvShape:
    n, oc = x[0], w[0]
    pixels = out_bytes // itemsize // max(n * oc, 1)  # OH * OW, from the output (or its gradient)
    return _costs.ConvShape(n, x[1], x[2], x[3], oc, math.prod(w[1:]), pixels)


def _conv_cost(
    name: str, sig: tuple, phase: str, out_bytes: int, needs_grad: tuple, grad_bytes: int
) -> Cost | None:
    """conv2d (the array path's or the Function's signature) and the fused conv2d_batch_norm."""
    shapes, dtypes, scalars = sig
    if len(shapes) < 2 or shapes[0] is None or shapes[1] is None or len(shapes[0]) != 4:
        return None
    itemsize = np.dtype(dtypes[0]).itemsize
    backward = phase == "backward"
    shape = _conv_shape(shapes[0], shapes[1], grad_bytes if backward else out_bytes, itemsize)
    bias = len(shapes) > 2 and shapes[2] is not None
    input_grad = bool(needs_grad[0]) if needs_grad else True
    if name == "conv2d":
        # activation: the Function's 5th argument, the array path's 8th.
        activation = scalars[4] if len(scalars) == 5 else (scalars[7] if len(scalars) > 7 else None)
        return _costs.conv2d(
            shape, bias=bias, itemsize=itemsize, backward=backward, activation=activation is not None,
            input_grad=input_grad,
        )  # fmt: skip
    # conv2d_batch_norm: the Function (x, w, b, bn_w, bn_b, running_mean, running_var, ...) is the
    # training block; the array path (x, w, b, running_mean, running_var, bn_w, bn_b, ...) says
    # whether it trains (argument 11), and in evaluation costs as its two kernels.
    array_path = len(scalars) > 11 and isinstance(scalars[11], (bool, int))
    training = bool(scalars[11]) if array_path else True
    running_at = 3 if array_path else 5
    running = len(shapes) > running_at and shapes[running_at] is not None
    param = next((d for d in dtypes[3:7] if d is not None), dtypes[0])
    if not training:
        conv = _costs.conv2d(shape, bias=bias, itemsize=itemsize)
        bn = _costs.batch_norm(
            shape.n * shape.oc * shape.pixels, shape.oc, itemsize=itemsize,
            param_itemsize=np.dtype(param).itemsize, training=False,
        )  # fmt: skip
        return Cost(conv.bytes_moved + bn.bytes_moved, conv.bytes_written + bn.bytes_written, conv.flops)
    return _costs.conv2d_batch_norm(
        shape, bias=bias, itemsize=itemsize, param_itemsize=np.dtype(param).itemsize, backward=backward,
        input_grad=input_grad, running=running,
    )  # fmt: skip


def _batch_norm_cost(sig: tuple, phase: str) -> Cost | None:
    # batch_norm's Function (x, weight, bias, running_mean, running_var, training, ...) and array
    # path (input, running_mean, running_var, weight, bias, training, ...) agree on x and training.
    shapes, dtypes, scalars = sig
    if not shapes or shapes[0] is None or len(shapes[0]) < 2:
        return None
    param = next((d for d in dtypes[1:5] if d is not None), dtypes[0])
    return _costs.batch_norm(
        math.prod(shapes[0]), shapes[0][1], itemsize=np.dtype(dtypes[0]).itemsize,
        param_itemsize=np.dtype(param).itemsize, training=bool(scalars[5]) if len(scalars) > 5 else True,
        backward=phase == "backward", running=any(s is not None for s in shapes[1:5]),
    )  # fmt: skip


def _pool_cost(name: str, sig: tuple, phase: str, out_bytes: int, grad_bytes: int) -> Cost | None:
    shapes, dtypes, _ = sig
    if not shapes or shapes[0] is None:
        return None
    x_bytes = _nbytes(shapes[0], dtypes[0])
    if phase == "forward":
        return _costs.pool2d(x_bytes, out_bytes)
    # max pooling's Function keeps its indices (its 4th argument) and routes the gradient by them.
    index_bytes = (
        _nbytes(shapes[3], dtypes[3]) if name == "max_pool2d" and len(shapes) > 3 and shapes[3] else 0
    )
    return _costs.pool2d(out_bytes, grad_bytes, index_bytes=index_bytes, backward=True)


_POOLS = frozenset(("max_pool2d", "avg_pool2d", "adaptive_avg_pool2d"))
# Ops whose cost function counts their backward too (the others: NOTE in _cost_of).
_OWN_BACKWARD = (
    frozenset(("linear", "attention", "matmul", "conv2d", "conv2d_batch_norm", "batch_norm")) | _POOLS
)


def _op_cost(
    name: str, sig: tuple, phase: str, out_bytes: int, needs_grad: tuple = (), grad_bytes: int = 0
) -> Cost:
    """What the op must move and compute; ops without a formula of their own count their array
    arguments read and their results written (the elementwise model), their arithmetic not counted.
    In a backward, ``out_bytes`` are the gradients written and ``grad_bytes`` the output's gradient."""
    cost = None
    if name == "linear":
        cost = _linear_cost(sig, phase, needs_grad)
    elif name in ("attention", "scaled_dot_product_attention"):
        cost = _attention_cost(sig, phase, causal_at=5)
    elif name == "matmul":
        cost = _matmul_cost(sig, phase)
    elif name in ("conv2d", "conv2d_batch_norm"):
        cost = _conv_cost(name, sig, phase, out_bytes, needs_grad, grad_bytes)
    elif name == "batch_norm":
        cost = _batch_norm_cost(sig, phase)
    elif name in _POOLS:
        cost = _pool_cost(name, sig, phase, out_bytes, grad_bytes)
    if cost is not None:
        return cost
    shapes, dtypes, _ = sig
    read = sum(_nbytes(s, d) for s, d in zip(shapes, dtypes) if s is not None)
    return _costs.elementwise(read, out_bytes)


def _cost_of(
    name: str, phase: str, sig: tuple, out_bytes: int, needs_grad: tuple, grad_bytes: int, added: bool = False
) -> Cost:
    """An op event's cost from what its hook kept (``_pending``); a backward without a formula
    of its own reads the output's gradient and the forward's inputs and writes the gradients,
    a view's backward reads the output's gradient only (NOTE [ Views move no bytes ])."""
    if phase == "forward":
        return _op_cost(name, sig, "forward", out_bytes)
    op = name.removesuffix("_backward")
    if not out_bytes:  # every gradient passed through, or is a view of it: no kernel ran
        return Cost(0, 0, 0)
    if op in _OWN_BACKWARD:
        return _op_cost(op, sig, "backward", out_bytes, needs_grad, grad_bytes)
    if op in _VIEWS:  # a scatter of the gradient into zeros, or ``added`` into the sum so far
        return _costs.elementwise(grad_bytes + (out_bytes if added else 0), out_bytes)
    base = _op_cost(op, sig, "backward", 0, needs_grad)
    return _costs.elementwise(base.bytes_moved + grad_bytes, out_bytes)


# NOTE [ Views move no bytes ]
# On the host a view op (reshape, transpose, expand, basic indexing and split: a Function with
# ``view``) returns a NumPy view of its input, and the backward of a reshape or transpose returns a
# view of the gradient (a sum's backward, a broadcast of it): no kernel runs, so nothing is read
# or written. Counting their inputs and outputs as moved gave rows at several times the copy
# ceiling (transpose 587%, strided 424% in a profile of a GPT step). The hooks record such an op
# as moving nothing (a cost of 0 bytes: the row's time is per-op overhead), checked with
# ``np.may_share_memory`` (bounds only, about 0.25 us) on view ops' outputs and on gradients. A
# split's backward (``strided_backward``) does run a kernel, and moves less than the elementwise
# model says: it reads the output's gradient, not the forward's input, and either writes a zeroed
# gradient of the input's shape with the slice scattered in, or, where the engine hands it the
# gradient summed so far (NOTE [ Gradients summed in place ] in _engine.py), reads and writes its
# slice of that sum (``added``). On a device the view ops copy, and are counted as copies.
_VIEWS = frozenset(("reshape", "transpose", "strided", "expand"))


@functools.cache
def _step_name(cls: type) -> str:
    return f"{cls.__name__}.step"


# ----------------------------------------------------------------------------- schedule


class ProfilerAction(enum.Enum):
    """What a :func:`schedule` asks of the profiler at a step, as ``torch.profiler.ProfilerAction``:
    ``NONE`` (not recording), ``WARMUP`` (recording, then dropped), ``RECORD`` and
    ``RECORD_AND_SAVE`` (the last step of an active cycle: ``on_trace_ready`` is called after it)."""

    NONE = 0
    WARMUP = 1
    RECORD = 2
    RECORD_AND_SAVE = 3


def schedule(
    *, wait: int, warmup: int, active: int, repeat: int = 0, skip_first: int = 0
) -> Callable[[int], ProfilerAction]:
    """The step -> :class:`ProfilerAction` function of ``torch.profiler.schedule``: skip the first
    ``skip_first`` steps, then cycles of ``wait`` steps not recorded, ``warmup`` steps recorded
    and dropped, and ``active`` steps recorded (the last of them ``RECORD_AND_SAVE``); ``repeat``
    cycles, or without end when 0.

    Example::

        >>> from taifuse.profiler import schedule
        >>> s = schedule(wait=1, warmup=1, active=2, repeat=1)
        >>> [s(step).name for step in range(5)]
        ['NONE', 'WARMUP', 'RECORD', 'RECORD_AND_SAVE', 'NONE']
    """
    for name, value, least in (
        ("wait", wait, 0), ("warmup", warmup, 0), ("active", active, 1), ("repeat", repeat, 0),
        ("skip_first", skip_first, 0),
    ):  # fmt: skip
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
            raise TypeError(f"schedule: {name} should be an int, got {type(value).__name__}")
        if value < least:
            raise ValueError(f"schedule: {name} should be at least {least}, got {value}")
    wait, warmup, active, repeat, skip_first = map(int, (wait, warmup, active, repeat, skip_first))
    cycle = wait + warmup + active

    def schedule_fn(step: int) -> ProfilerAction:
        if step < 0:
            raise ValueError(f"schedule: step should be non-negative, got {step}")
        if step < skip_first:
            return ProfilerAction.NONE
        step -= skip_first
        if repeat > 0 and step >= repeat * cycle:
            return ProfilerAction.NONE
        at = step % cycle
        if at < wait:
            return ProfilerAction.NONE
        if at < wait + warmup:
            return ProfilerAction.WARMUP
        return ProfilerAction.RECORD if at < cycle - 1 else ProfilerAction.RECORD_AND_SAVE

    return schedule_fn


_RECORDING = (ProfilerAction.RECORD, ProfilerAction.RECORD_AND_SAVE)
_RECORD = ProfilerAction.RECORD  # NOTE: an Enum member read costs about 0.2 us; profile() reads this


# ----------------------------------------------------------------------------- the profiler


class _SyncOf(dict):
    """Backend module -> its ``sync`` (a device wait) when the profile synchronizes, else None."""

    def __init__(self, enabled: bool) -> None:
        super().__init__()
        self.enabled = enabled

    def __missing__(self, be: Any) -> Callable | None:
        sync = self[be] = getattr(be, "sync", None) if self.enabled else None
        return sync


_SYNCS = {True: _SyncOf(True), False: _SyncOf(False)}  # by profile(sync=...)


def _self_times(events: list[ProfilerEvent]) -> None:
    """Each timed event's ``self_ns``: its duration less those of the events directly inside it,
    found from the nesting (start, end, depth) when the results are read (NOTE [ Raw records ])."""
    timed = sorted((e for e in events if e.kind != "pool"), key=lambda e: (e.start_ns, e.depth))
    stack: list[ProfilerEvent] = []
    for ev in timed:
        ev.self_ns = ev.duration_ns
        while stack and (stack[-1].depth >= ev.depth or ev.start_ns > stack[-1].end_ns):
            stack.pop()
        if stack and stack[-1].depth == ev.depth - 1:
            stack[-1].self_ns -= ev.duration_ns
        stack.append(ev)


class _Recorder:
    """What the hook sites call while a profile runs (NOTE [ Profiler hooks ]): the value of
    ``_profile_hook.ACTIVE``. One per process (profiles do not nest), bound to the running
    profile by :meth:`profile.start` and unbound by :meth:`profile.stop`."""

    __slots__ = (
        "_mine",
        "acquired",
        "array_op",
        "backward",
        "bind",
        "close_ranges",
        "enter_range",
        "exit_range",
        "forward",
        "module",
        "open_ranges",
        "profile",
        "range",
        "step",
    )


@functools.cache
def _recorder() -> _Recorder:
    """The process's recorder: closures over one set of state that ``bind`` points at a profile.

    NOTE: they run once per op, range or acquisition of a profiled step, and every Python
    operation in them is the step's time (goal: at most 10% on the MLP step): they read closure
    cells, not attributes; one tuple is appended per event and nothing is updated after (NOTE
    [ Raw records ]). They are made once per process, not per profile: making them cost a
    profile's start about 1.4 us, and the bench enters a profile around every step.
    """
    # NOTE: time.perf_counter, not perf_counter_ns: a float comes from a free list, a large int is
    # allocated (about 15 ns a reading here); the records are made integer nanoseconds when read.
    get_ident, pc, active = threading.get_ident, time.perf_counter, backends.active
    may_share = np.may_share_memory
    array_types, scalars, other = _ARRAY_TYPES, _SCALARS, _other
    # The bound profile's state; tid None (unbound) makes every hook pass its call through.
    tid: int | None = None
    append: Callable = _discard
    pool_append: Callable = _discard
    syncs: dict = {}
    range_sync: Callable | None = None
    names: dict = {}
    caller: tuple | None = None  # the (module, name) entry of the innermost module call open
    module_name: Callable | None = None
    depth, op_open = 0, False  # nesting of the open events; an op (or backward, update) is open
    # NOTE [ Ranges open at stop ]: the record_function ranges open in the bound profile, as
    # [name, start, depth, binding]; a binding is one start()..stop() of one profile.
    open_ranges: list[list] = []
    binding = 0

    def bind(prof):
        nonlocal tid, append, pool_append, syncs, range_sync, names, caller, module_name
        nonlocal depth, op_open, binding
        rec.profile = prof
        depth, op_open, caller = 0, False, None
        binding += 1
        open_ranges.clear()
        if prof is None:
            tid, append, pool_append, names, module_name = None, _discard, _discard, {}, None
            rec.acquired = not_acquired
            return
        tid, append, pool_append = prof._tid, prof._raw.append, prof._pool_raw.append
        syncs, range_sync = _SYNCS[prof.sync], prof._range_sync
        names, module_name = prof._module_names, prof._module_name
        rec.acquired = acquired if prof.profile_memory else not_acquired

    def mine():
        return get_ident() == tid

    def signature(args):  # _raw_signature with locals; a list (no tuple() copy), never changed
        sig = []
        for v in args:
            t = type(v)
            sig.append((v.shape, v.dtype) if t in array_types else v if t in scalars else other(v))
        return sig

    def forward(ctx, arrays, kwargs):
        nonlocal depth, op_open
        if get_ident() != tid:
            return ctx.forward(*arrays, **kwargs)
        be = ctx.be
        sig = []  # signature(), inlined: the hook that runs most often
        for v in (*arrays, *kwargs.values()) if kwargs else arrays:
            t = type(v)
            sig.append((v.shape, v.dtype) if t in array_types else v if t in scalars else other(v))
        ctx.profile_signature = sig
        sync = syncs[be]
        if sync is not None:
            sync()
        d, outer = depth, op_open
        depth, op_open = d + 1, True
        start = pc()
        try:
            out = ctx.forward(*arrays, **kwargs)
        except BaseException:
            depth, op_open = d, outer
            append(("op", type(ctx), be, start, pc(), d, sig, False))
            raise
        if sync is not None:
            sync()
        end = pc()
        depth, op_open = d, outer
        # What it wrote: bytes, not a signature (one attribute read, no tuples); None for a view of
        # its input, which moved nothing (NOTE [ Views move no bytes ]).
        if ctx.view and type(out) is np.ndarray and may_share(out, arrays[0]):
            written = None
        else:
            written = out.nbytes if type(out) in array_types else _raw_bytes((other(out),))
        append(("op", type(ctx), be, start, end, d, sig, written))
        return out

    def backward(ctx, grad):
        nonlocal depth, op_open
        if get_ident() != tid:
            return ctx.backward(grad)
        be = ctx.be
        sync = syncs[be]
        if sync is not None:
            sync()
        d, outer = depth, op_open
        depth, op_open = d + 1, True
        start = pc()
        try:
            grads = ctx.backward(grad)
        except BaseException:
            depth, op_open = d, outer
            append(("backward", type(ctx), be, start, pc(), d, None, None))
            raise
        if sync is not None:
            sync()
        end = pc()
        depth, op_open = d, outer
        # Bytes written; a gradient passed through as it came (add's), or a view of it (a transpose's,
        # a reshape's, a sum's broadcast), is neither read nor written; one added into the gradient
        # summed so far (a split's) reads and writes its slice (NOTE [ Views move no bytes ]).
        written, host = 0, type(grad) is np.ndarray
        acc = ctx.accumulate_into if ctx.accumulates else None
        for x in grads:
            if x is None or x is grad:
                continue
            if x is acc:
                written += grad.nbytes
            elif not (host and type(x) is np.ndarray and may_share(x, grad)):
                written += x.nbytes if type(x) in array_types else _raw_bytes((other(x),))
        gsig = ((grad.shape, grad.dtype) if type(grad) in array_types else other(grad),)
        fsig = ctx.profile_signature
        added = acc is not None
        append(("backward", type(ctx), be, start, end, d, gsig, written, ctx.needs_grad, fsig, added))
        return grads

    def array_op(name, fn, args, kwargs):
        nonlocal depth, op_open
        if op_open or get_ident() != tid:  # inside an autograd op: recorded there
            return fn(*args, **kwargs)
        be = active()
        sig = signature(_bind(fn, args, kwargs)[0])
        sync = syncs[be]
        if sync is not None:
            sync()
        d, depth, op_open = depth, depth + 1, True
        start = pc()
        try:
            out = fn(*args, **kwargs)
        except BaseException:
            depth, op_open = d, False
            append(("op", name, be, start, pc(), d, sig, False))
            raise
        if sync is not None:
            sync()
        end = pc()
        depth, op_open = d, False
        written = out.nbytes if type(out) in array_types else _raw_bytes((other(out),))
        append(("op", name, be, start, end, d, sig, written))
        return out

    def step(optimizer, update, args):
        nonlocal depth, op_open
        if get_ident() != tid:
            return update(*args)
        be, param, grad, state, _ = args
        sync = syncs[be]
        if sync is not None:
            sync()
        d, outer = depth, op_open
        depth, op_open = d + 1, True
        start = pc()
        try:
            new = update(*args)
        finally:
            if sync is not None:
                sync()
            end = pc()
            depth, op_open = d, outer
        state_bytes = 0  # of the state's arrays: its cost needs no more of them
        for v in state:
            t = type(v)
            if t in array_types:
                state_bytes += v.nbytes
            elif t not in scalars:
                state_bytes += _raw_bytes((other(v),))
        append(("optimizer", type(optimizer), be, start, end, d, signature((param, grad)), state_bytes))
        return new

    def acquired(pool, out, shape, dtype):  # shape and dtype as the pool normalized them
        if get_ident() == tid:
            pool_append((pc(), pool, shape, dtype, pool.bytes_in_use(), depth))
        return out

    def not_acquired(pool, out, shape, dtype):
        return out

    def module(mod, args, kwargs):
        nonlocal depth, caller
        if get_ident() != tid:
            return mod.forward(*args, **kwargs)
        known = names.get(id(mod))
        if known is None or known[0] is not mod:
            known = module_name(mod, caller)
        name = known[1]
        d, outer = depth, caller
        depth, caller = d + 1, known
        start = pc()
        try:
            return mod.forward(*args, **kwargs)
        finally:
            if range_sync is not None:
                range_sync()
            end = pc()
            depth, caller = d, outer
            append(("range", name, None, start, end, d))

    def enter_range(name):
        """Open a range; its token for exit_range (None when this thread is not recorded)."""
        nonlocal depth
        if get_ident() != tid:
            return None
        entry = [name, 0.0, depth, binding]
        depth += 1
        open_ranges.append(entry)
        entry[1] = pc()
        return entry

    def exit_range(entry):
        """Close a range opened by enter_range; nothing if its profile stopped since (NOTE
        [ Ranges open at stop ]: stop() closed it then)."""
        nonlocal depth
        if entry is None or entry[3] != binding:
            return
        if range_sync is not None:
            range_sync()
        end = pc()
        open_ranges.remove(entry)
        depth = entry[2]
        append(("range", entry[0], None, entry[1], end, entry[2]))

    def close_ranges():
        """At stop(): the ranges still open end now, in the profile they began in."""
        end = pc()
        for name, start, d, _ in open_ranges:
            append(("range", name, None, start, end, d))
        open_ranges.clear()

    def range_(name):  # a generator: range() makes it a context manager
        entry = enter_range(name)
        try:
            yield
        finally:
            exit_range(entry)

    rec = _Recorder()
    rec.forward, rec.backward, rec.array_op, rec.step = forward, backward, array_op, step
    rec.module, rec._mine, rec.bind = module, mine, bind
    rec.enter_range, rec.exit_range, rec.close_ranges = enter_range, exit_range, close_ranges
    rec.open_ranges = open_ranges
    rec.range = lambda name: contextlib.contextmanager(range_)(name)
    bind(None)
    return rec


def _discard(record: Any) -> None:
    pass


class profile:
    """Record every op, optimizer step, pool acquisition and module call while active.

    Shaped like ``torch.profiler.profile``: a context manager (``start()``/``stop()`` too), then
    :meth:`key_averages`, :meth:`export_chrome_trace` and :meth:`events`.

    Args:
        record_shapes: keep each op's input shapes and dtypes (``key_averages(group_by_input_shape=True)``
            and the trace's args need them). Costs are computed either way.
        profile_memory: record the pool's acquisitions and its bytes in use (a counter track).
        sync: on a device backend (Taichi), wait for the device before and after each op, so
            that a kernel's time lands on its own op (NOTE: this serializes the device's queue).
        ceilings: where the ceilings come from: None measures them once per process
            (:func:`measure_ceilings`), a path reads a ``taifuse bench`` results.json, or a
            :class:`Ceilings`.
        schedule: ``step -> ProfilerAction`` (:func:`schedule`), as torch.profiler's: which of
            the steps that :meth:`step` marks are recorded. Each step is then a range
            ``ProfilerStep#N``; the results are those of the current cycle (the events of its
            active steps, its warmup dropped; a cycle starts afresh after ``RECORD_AND_SAVE``).
            None: every step is recorded, and a restarted profile adds to its results.
        on_trace_ready: called with the profile at the end of each active cycle (after a
            ``RECORD_AND_SAVE`` step, or at stop() while recording), as torch.profiler's.

    Only the thread that entered the profile is recorded; the others run unrecorded. Profiles do
    not nest (entering a second while one is active raises RuntimeError).

    Example::

        >>> import numpy as np, taifuse, taifuse.functional as F
        >>> from taifuse.profiler import profile
        >>> taifuse.set_backend("numpy")
        >>> with profile() as prof:
        ...     y = F.gelu(np.ones(1000, np.float32))
        >>> [gelu] = [e for e in prof.events() if e.kind == "op"]
        >>> gelu.name, gelu.shapes, gelu.dtypes
        ('gelu', ((1000,), None, None), ('float32', None, None))
        >>> gelu.cost.bytes_moved, gelu.cost.bytes_written  # read 4000 bytes, write 4000
        (8000, 4000)
    """

    # Defaults of the schedule's state, set on the instance when they change.
    schedule: Callable[[int], ProfilerAction] | None = None
    on_trace_ready: Callable[[profile], Any] | None = None
    step_num = 0  # steps ended by step()
    current_action = _RECORD  # the schedule's action for the current step
    _running = False  # between start() and stop()
    _bound = False  # the recorder records into this profile
    _cycle_saved = False  # the last cycle ended with RECORD_AND_SAVE: the next starts afresh
    _step_range: record_function | None = None  # the open ProfilerStep#N range

    def __init__(
        self,
        record_shapes: bool = True,
        profile_memory: bool = True,
        sync: bool = True,
        ceilings: Ceilings | str | os.PathLike | None = None,
        schedule: Callable[[int], ProfilerAction] | None = None,
        on_trace_ready: Callable[[profile], Any] | None = None,
    ) -> None:
        if ceilings is not None and not isinstance(ceilings, (Ceilings, str, os.PathLike)):
            raise TypeError(
                f"profile: ceilings should be a Ceilings, a path or None, got {type(ceilings).__name__}"
            )
        if schedule is not None:  # else the class's defaults below: profile() is on the step's clock
            if not callable(schedule):
                raise TypeError(
                    f"profile: schedule should be callable or None, got {type(schedule).__name__}"
                )
            self.schedule = schedule
            self.current_action = self._action(0)
        if on_trace_ready is not None:
            if not callable(on_trace_ready):
                raise TypeError(
                    f"profile: on_trace_ready should be callable or None, got {type(on_trace_ready).__name__}"
                )
            self.on_trace_ready = on_trace_ready
        self.record_shapes = bool(record_shapes)
        self.profile_memory = bool(profile_memory)
        self.sync = bool(sync)
        self._ceilings_arg = ceilings
        self._events: list[ProfilerEvent] = []
        self._tid: int | None = None
        self._t0 = 0.0  # time.perf_counter() at start
        self.wall_ns = 0
        self._backends: dict[int, tuple[str, str, Callable | None]] = {}
        self._module_names: dict[int, tuple[Any, str]] = {}
        self._roots = 0
        self._pool_raw: list[tuple] = []
        self._raw: list[tuple] = []  # NOTE [ Raw records ]
        self._done = 0
        self._range_sync: Callable | None = None

    # -- lifetime

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        if _profile_hook.ACTIVE is not None:
            raise RuntimeError("profile: another taifuse profiler is already active (profiles do not nest)")
        self._running = True
        if self.schedule is None:
            self._bind()
            return
        self._transit(ProfilerAction.NONE, self.current_action)
        self._open_step_range()

    def stop(self) -> None:
        if not self._running:
            return
        self._running = False
        if self.schedule is None:
            self._unbind()
            return
        self._close_step_range()
        self._transit(self.current_action, None)

    def step(self) -> None:
        """Mark the end of a step (as ``torch.profiler.profile.step``): the schedule's action for
        the next step takes effect (recording starts, stops, or a cycle ends and
        ``on_trace_ready`` is called)."""
        if not self._running:
            raise RuntimeError("profile.step: the profile is not running (start() it or enter it first)")
        self._close_step_range()
        prev = self.current_action
        self.step_num += 1
        self.current_action = _RECORD if self.schedule is None else self._action(self.step_num)
        self._transit(prev, self.current_action)
        self._open_step_range()

    def _action(self, step: int) -> ProfilerAction:
        action = self.schedule(step)
        if not isinstance(action, ProfilerAction):
            raise TypeError(f"profile: schedule({step}) should return a ProfilerAction, got {action!r}")
        return action

    def _open_step_range(self) -> None:
        if self.schedule is not None and self._bound:
            self._step_range = record_function(f"ProfilerStep#{self.step_num}")
            self._step_range.__enter__()

    def _close_step_range(self) -> None:
        if self._step_range is not None:
            rf, self._step_range = self._step_range, None
            rf.__exit__(None, None, None)

    def _transit(self, prev: ProfilerAction, now: ProfilerAction | None) -> None:
        """torch.profiler's transitions between actions (``now`` None: stop())."""
        A = ProfilerAction
        if prev in _RECORDING and (now not in _RECORDING or prev is A.RECORD_AND_SAVE):
            if prev is A.RECORD and now is not None:
                warnings.warn(f"profile: incorrect schedule: RECORD followed by {now.name}", stacklevel=3)
            self._unbind()
            if prev is A.RECORD_AND_SAVE or now is None:
                self._cycle_saved = prev is A.RECORD_AND_SAVE
                if self.on_trace_ready is not None:
                    self.on_trace_ready(self)
        elif prev is A.WARMUP and now not in (A.WARMUP, *_RECORDING):
            if now is not None:
                warnings.warn("profile: incorrect schedule: WARMUP followed by NONE", stacklevel=3)
            self._unbind()
            self._clear()  # what the warmup recorded is dropped
        if now in (A.WARMUP, *_RECORDING):
            if not self._bound:
                if self._cycle_saved:  # a new cycle: the last one was delivered
                    self._clear()
                self._bind()
            elif prev is A.WARMUP and now in _RECORDING:
                # The warmup ends: what it recorded is dropped, ranges it opened too (NOTE
                # [ Ranges open at stop ]), and the cycle is timed from here.
                self._unbind()
                self._clear()
                self._bind()

    def _clear(self) -> None:
        self._events.clear()
        self._raw.clear()
        self._pool_raw.clear()
        self._done, self.wall_ns, self._cycle_saved = 0, 0, False
        if not self._bound:  # while bound, the modules named so far keep their names
            self._roots = 0

    def _bind(self) -> None:
        if self._done < len(self._raw) or self._pool_raw:  # a restart: times of the last run from its start
            self._materialize()
        self._bound = True
        self._tid = threading.get_ident()
        # A range waits for the active backend's device at its end, so that it encloses its kernels.
        self._range_sync = _SYNCS[self.sync][backends.active()]
        if self._range_sync is not None:
            self._range_sync()
        self._t0 = time.perf_counter()
        rec = _recorder()
        rec.bind(self)
        _profile_hook.ACTIVE = rec

    def _unbind(self) -> None:
        self._bound = False
        rec = _profile_hook.ACTIVE
        if rec is not None and rec.profile is self:
            if self._range_sync is not None:
                self._range_sync()
            if rec.open_ranges:
                rec.close_ranges()
            # The wall time of every run of this profile (a restarted profile's runs add up).
            self.wall_ns += round((time.perf_counter() - self._t0) * 1e9)
            _profile_hook.ACTIVE = None
            rec.bind(None)
            self._module_names.clear()

    # NOTE [ Raw records ]
    # While a profile runs, each op, backward, optimizer update and range is one tuple appended to
    # the profile when it ends: (kind, op class or name, backend module, start, end, depth,
    # then what its cost needs: the raw signatures of its inputs, (shape, dtype) pairs, and the
    # bytes it wrote, an int read off its results; for an optimizer update, the signatures of the
    # parameter and gradient and the bytes of its state), and each pool acquisition a tuple (time, the
    # pool, shape, dtype as the pool normalized them, bytes in use, depth); times are raw
    # perf_counter readings. Nothing else is done during the step: times from the profile's
    # start, op names, backend names, dtype names, ProfilerEvents, costs and self times (from the
    # nesting: a parent's duration less its direct children's) are made when the results are
    # first read (events(), key_averages(), export_chrome_trace()), so that a profiled step holds
    # as little of the profiler's own work as possible. The hooks are closures made once per
    # process and bound to the running profile by start() (NOTE [ Profiler hooks ]): they read
    # closure cells, not attributes, and change no record once appended. perf_counter's float
    # keeps nanoseconds while the clock (seconds since boot) is below 2**22 s, about 48 days,
    # and steps of at most 8 ns for 2**25 s, about a year. Records are tuples, not lists: nothing updates them, and a
    # tuple is smaller and quicker to build.

    def _materialize(self) -> list[ProfilerEvent]:
        new = self._done < len(self._raw)
        for r in self._raw[self._done :]:
            kind, who, be, start, end, depth = r[:6]
            start, dur = round((start - self._t0) * 1e9), round((end - start) * 1e9)
            if kind == "range":
                self._events.append(ProfilerEvent(who, kind, "", "", start, dur, depth=depth))
                continue
            info = self._backends.get(id(be)) or self._backend(be)
            sig = r[6]
            if kind == "optimizer":
                name = _step_name(who)
            else:
                name = who if type(who) is str else _op_name(who)
                if kind == "backward":
                    name += "_backward"
            ev = ProfilerEvent(name, kind, info[0], info[1], start, dur, depth=depth)
            split = _split(sig) if sig is not None else None
            if split is not None and self.record_shapes:
                ev.shapes, ev.dtypes = split[0], tuple(None if d is None else str(d) for d in split[1])
            if kind == "optimizer":  # read param, grad, state; write param, state
                param_bytes, grad_bytes = (_raw_bytes((item,)) for item in sig)
                ev.cost = _costs.optimizer_step(param_bytes, grad_bytes, r[7])
            elif kind == "op" and r[7] is None:  # a view: no kernel ran (NOTE [ Views move no bytes ])
                ev.cost = Cost(0, 0, 0)
            elif kind == "op" and r[7] is not False:
                custom = getattr(who, "op_cost", None)  # a custom op's cost= (taifuse.library)
                ev.cost = (
                    _cost_of(name, "forward", split, r[7], (), 0) if custom is None else custom(split, False)
                )
            elif kind == "backward" and r[7] is not None:
                out_bytes, needs_grad, forward_sig, added = r[7:11]
                custom = getattr(who, "op_cost", None)
                forward_split, grad_bytes = _split(forward_sig), _raw_bytes(sig)
                ev.cost = (
                    _cost_of(name, "backward", forward_split, out_bytes, tuple(needs_grad), grad_bytes, added)
                    if custom is None
                    else custom(forward_split, True)
                )
            self._events.append(ev)
        self._done = len(self._raw)
        for now, pool, shape, dtype, in_use, depth in self._pool_raw:
            where = "host" if pool.on_host else "device"
            ev = ProfilerEvent("pool.acquire", "pool", where, "", round((now - self._t0) * 1e9), depth=depth)
            if self.record_shapes:
                ev.shapes, ev.dtypes = (tuple(shape),), (str(dtype),)
            ev.pool_bytes_in_use, ev.cost = in_use, Cost(0, 0, 0)
            self._events.append(ev)
        self._pool_raw.clear()
        if new:
            _self_times(self._events)
        return self._events

    # -- recording (called by the hooks: NOTE [ Profiler hooks ] in taifuse/_profile_hook.py)

    def _backend(self, be: ModuleType) -> tuple[str, str, Callable | None]:
        info = self._backends.get(id(be))
        if info is None:
            name = getattr(be, "NAME", str(be))
            arch = be.describe().get("arch", name) if hasattr(be, "describe") else name
            sync = getattr(be, "sync", None) if self.sync else None
            info = self._backends[id(be)] = (name, str(arch), sync)
        return info

    def _module_name(self, mod: Any, caller: tuple[Any, str] | None) -> tuple[Any, str]:
        """The ``(module, name)`` entry of a module first seen in this profile. A root (called
        from no module) is ``model`` (``model1``, ... for later roots); a module called from
        another is named by its path from that one: its attribute name among the caller's
        children, else its dotted path in the caller's tree (a block of a ModuleList the caller
        indexes), else the caller's name and its type's. Only the caller's children are looked
        at first: walking a whole tree on every profile cost the MLP step about 4 us."""
        if caller is None:
            name = "model" if self._roots == 0 else f"model{self._roots}"
            self._roots += 1
        else:
            parent, parent_name = caller
            name = None
            for key, sub in parent.children_by_name().items():  # named_children(), without its generator
                if sub is mod:
                    name = f"{parent_name}.{key}"
                    break
            if name is None:
                name = next(
                    (path for path, sub in parent.named_modules(parent_name) if sub is mod),
                    f"{parent_name}.{type(mod).__name__}",
                )
        entry = self._module_names[id(mod)] = (mod, name)
        return entry

    def range(self, name: str) -> contextlib.AbstractContextManager:
        """A range named ``name`` around the block (:func:`record_function`), while active."""
        rec = _profile_hook.ACTIVE
        return rec.range(name) if rec is not None and rec.profile is self else contextlib.nullcontext()

    # -- results

    def events(self) -> list[ProfilerEvent]:
        """Every recorded event, in the order they started (a range before the ops inside it)."""
        return sorted(self._materialize(), key=lambda e: (e.start_ns, e.depth))

    @property
    def ceilings(self) -> Ceilings:
        """The ceilings the table judges against (measured on first use unless given)."""
        arg = self._ceilings_arg
        if isinstance(arg, Ceilings):
            return arg
        if arg is not None:
            self._ceilings_arg = ceilings_from_results(arg)
            return self._ceilings_arg
        return measure_ceilings()

    def key_averages(self, group_by_input_shape: bool = False) -> EventList:
        """The events grouped by name (and by input shapes with ``group_by_input_shape``), one
        :class:`EventAverage` per group, in order of first appearance."""
        if group_by_input_shape and not self.record_shapes:
            raise ValueError("key_averages: group_by_input_shape=True needs profile(record_shapes=True)")
        groups: dict[tuple, EventAverage] = {}
        for ev in sorted(self._materialize(), key=lambda e: e.start_ns):
            key = (ev.name, ev.kind, ev.shapes if group_by_input_shape else None)
            avg = groups.get(key)
            if avg is None:
                avg = groups[key] = EventAverage(
                    ev.name, ev.kind, ev.shapes if group_by_input_shape else None
                )
            avg.add(ev)
        wall = self.wall_ns or max((e.end_ns for e in self._events), default=0)
        return EventList(groups.values(), wall_ns=wall, ceilings_fn=lambda: self.ceilings)

    def export_chrome_trace(self, path: str | os.PathLike) -> None:
        """Write the events as Trace Event JSON (Perfetto, chrome://tracing): an ``"X"`` event per
        op and range (``ts``/``dur`` in microseconds, args with shapes, dtypes, bytes and flops)
        and a ``"C"`` counter track of the pool's bytes in use."""
        pid, tid = os.getpid(), self._tid or threading.get_ident()
        trace: list[dict] = [
            {"name": "process_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": "taifuse"}},
        ]
        for ev in sorted(self._materialize(), key=lambda e: (e.start_ns, -e.duration_ns)):
            if ev.kind == "pool":
                trace.append(
                    {
                        "name": f"pool bytes in use ({ev.backend})",
                        "ph": "C",
                        "ts": ev.start_ns / 1e3,
                        "pid": pid,
                        "tid": tid,
                        "args": {"bytes": ev.pool_bytes_in_use},
                    }
                )
                continue
            args: dict[str, Any] = {"backend": ev.backend, "arch": ev.arch}
            if ev.shapes:
                args["shapes"] = [list(s) if s is not None else None for s in ev.shapes]
                args["dtypes"] = list(ev.dtypes)
            if ev.cost is not None:
                args.update(
                    bytes_moved=ev.cost.bytes_moved, bytes_written=ev.cost.bytes_written, flops=ev.cost.flops
                )
            trace.append(
                {
                    "name": ev.name,
                    "cat": ev.kind,
                    "ph": "X",
                    "ts": ev.start_ns / 1e3,
                    "dur": ev.duration_ns / 1e3,
                    "pid": pid,
                    "tid": tid,
                    "args": args,
                }
            )
        with open(path, "w") as f:
            json.dump({"traceEvents": trace, "displayTimeUnit": "ms"}, f)


# ----------------------------------------------------------------------------- averages


@dataclass
class EventAverage:
    """The events of one name (and shape): count, times, and what they moved and computed."""

    name: str
    kind: str
    shapes: tuple | None = None
    count: int = 0
    self_ns: int = 0
    total_ns: int = 0
    bytes_moved: int = 0
    bytes_written: int = 0
    flops: int = 0
    backend: str = ""

    def add(self, ev: ProfilerEvent) -> None:
        self.count += 1
        self.self_ns += ev.self_ns
        self.total_ns += ev.duration_ns
        self.backend = self.backend or ev.backend
        if ev.cost is not None:
            self.bytes_moved += ev.cost.bytes_moved
            self.bytes_written += ev.cost.bytes_written
            self.flops += ev.cost.flops

    @property
    def is_op(self) -> bool:
        return self.kind in ("op", "backward", "optimizer")

    @property
    def mean_ns(self) -> float:
        return self.total_ns / self.count if self.count else 0.0

    @property
    def traffic(self) -> int:
        return traffic_bytes(self.bytes_moved, self.bytes_written)

    @property
    def gbps(self) -> float | None:
        """Achieved GB/s of traffic (NOTE [ Traffic model ]), over the total time."""
        return self.traffic / self.total_ns if self.is_op and self.total_ns and self.bytes_moved else None

    @property
    def gflops(self) -> float | None:
        return self.flops / self.total_ns if self.is_op and self.total_ns and self.flops else None

    def judge(self, ceilings: Ceilings) -> tuple[float | None, str]:
        """(fraction of the ceiling, bound): the bound is ``"compute"`` when the op's arithmetic
        intensity reaches the ridge point (GEMM rate / bandwidth), else ``"memory"``, and
        ``"overhead"`` when the work at the ceilings takes less than one empty op call, so that
        the per-call cost dominates. The fraction is of the GEMM rate for compute-bound ops, of
        the copy bandwidth (of the op's cache level) otherwise."""
        if not self.is_op or not self.count or not self.total_ns:
            return None, ""
        traffic = self.traffic / self.count
        bandwidth, _ = ceilings.bandwidth(self.bytes_moved / self.count)
        flops = self.flops / self.count
        roof_ns = max(traffic / bandwidth, flops / ceilings.gemm_gflops)
        compute = flops > 0 and flops / max(traffic, 1) >= ceilings.gemm_gflops / bandwidth
        if compute:
            fraction = (self.gflops or 0.0) / ceilings.gemm_gflops
        elif self.bytes_moved:
            fraction = (self.gbps or 0.0) / bandwidth
        else:
            fraction = None
        if roof_ns < ceilings.call_overhead_ns:
            return fraction, "overhead"
        return fraction, "compute" if compute else "memory"


_SORT_KEYS: dict[str, Callable[[EventAverage], float]] = {
    "self_time_total": lambda a: a.self_ns,
    "self_cpu_time_total": lambda a: a.self_ns,  # torch.profiler's name
    "total_time": lambda a: a.total_ns,
    "cpu_time_total": lambda a: a.total_ns,
    "count": lambda a: a.count,
    "mean": lambda a: a.mean_ns,
    "gbps": lambda a: a.gbps or 0.0,
    "gflops": lambda a: a.gflops or 0.0,
}


SORT_KEYS = tuple(_SORT_KEYS)  # what table(sort_by=...) and `taifuse profile --sort` take


class EventList(list):
    """:meth:`profile.key_averages`'s result: a list of :class:`EventAverage` with :meth:`table`."""

    def __init__(self, items: Any, wall_ns: int, ceilings_fn: Callable[[], Ceilings]) -> None:
        super().__init__(items)
        self.wall_ns = wall_ns
        self._ceilings_fn = ceilings_fn

    def table(self, sort_by: str = "self_time_total", row_limit: int = 100) -> str:
        """The rows as a text table, sorted by ``sort_by`` (descending), at most ``row_limit`` rows.

        Columns: name, calls, self time (total ms and % of the profiled wall time: the share of the
        step), total time (ms, ranges included), mean per call (µs), the bytes its calls moved
        (MB, ``taifuse._costs``: reads and writes, each counted once), achieved GB/s and GFLOP/s,
        % of the ceiling and the bound. ``sort_by``: one of ``self_time_total``, ``total_time``,
        ``count``, ``mean``, ``gbps``, ``gflops`` (``self_cpu_time_total`` and
        ``cpu_time_total`` as torch.profiler's aliases).
        """
        if sort_by not in _SORT_KEYS:
            raise ValueError(f"table: sort_by should be one of {sorted(_SORT_KEYS)}, got {sort_by!r}")
        if not isinstance(row_limit, int) or isinstance(row_limit, bool) or row_limit < 1:
            raise ValueError(f"table: row_limit should be a positive int, got {row_limit!r}")
        rows = sorted(self, key=_SORT_KEYS[sort_by], reverse=True)[:row_limit]
        ceilings = self._ceilings_fn() if any(r.is_op for r in rows) else None
        header = [
            "Name",
            "Calls",
            "Self ms",
            "Self %",
            "Total ms",
            "Mean us",
            "MB moved",
            "GB/s",
            "GFLOP/s",
            "% ceil",
            "Bound",
        ]
        lines = []
        for r in rows:
            fraction, bound = r.judge(ceilings) if ceilings is not None else (None, "")
            name = r.name if r.shapes is None else f"{r.name} {list(r.shapes)}"
            lines.append(
                [
                    name if r.kind != "range" else f"[{name}]",
                    str(r.count),
                    f"{r.self_ns / 1e6:.3f}",
                    f"{100 * r.self_ns / self.wall_ns:.1f}" if self.wall_ns else "-",
                    f"{r.total_ns / 1e6:.3f}",
                    f"{r.mean_ns / 1e3:.1f}",
                    f"{r.bytes_moved / 1e6:.3f}" if r.is_op and r.bytes_moved else "-",
                    f"{r.gbps:.1f}" if r.gbps is not None else "-",
                    f"{r.gflops:.1f}" if r.gflops is not None else "-",
                    f"{100 * fraction:.0f}" if fraction is not None else "-",
                    bound or "-",
                ]
            )
        widths = [
            max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(header)
        ]
        rule = "  ".join("-" * w for w in widths)

        def fmt(cells: list[str]) -> str:
            return "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
            )

        out = [fmt(header), rule, *(fmt(line) for line in lines), rule]
        ops_self = sum(r.self_ns for r in self if r.is_op)
        out.append(
            f"Profiled wall time {self.wall_ns / 1e6:.3f} ms; ops' self time {ops_self / 1e6:.3f} ms"
            + (f" ({100 * ops_self / self.wall_ns:.1f}%)" if self.wall_ns else "")
            + "; [ranges] are module calls and record_function blocks."
        )
        if ceilings is not None:
            copies = ", ".join(f"{gbps:.0f} at {_size(size)}" for size, gbps in sorted(ceilings.copy))
            out.append(
                f"Ceilings ({ceilings.source}): copy GB/s by working set {copies}; GEMM "
                f"{ceilings.gemm_gflops:.1f} GFLOP/s; empty op call {ceilings.call_overhead_ns / 1e3:.1f} us."
            )
        return "\n".join(out)


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:.4g} MiB" if nbytes >= 2**20 else f"{nbytes // 2**10} KiB"


# ----------------------------------------------------------------------------- record_function


class record_function(contextlib.ContextDecorator):
    """A named range around user code, as ``torch.profiler.record_function``: a context manager or
    a decorator. Without an active profiler it does nothing.

    Example::

        >>> import numpy as np, taifuse.functional as F
        >>> from taifuse.profiler import profile, record_function
        >>> @record_function("activation")
        ... def act(x):
        ...     return F.relu(x)
        >>> with profile() as prof:
        ...     with record_function("block"):
        ...         _ = act(np.ones(4, np.float32))
        >>> [(e.name, e.depth) for e in prof.events() if e.kind != "pool"]
        [('block', 0), ('activation', 1), ('relu', 2)]
    """

    def __init__(self, name: str) -> None:
        if not isinstance(name, str):
            raise TypeError(f"record_function: name should be a str, got {type(name).__name__}")
        self.name = name
        self._ranges: list[Any] = []

    def __enter__(self) -> Self:
        rec = _profile_hook.ACTIVE
        self._ranges.append(rec.enter_range(self.name) if rec is not None else None)
        return self

    def __exit__(self, *exc: object) -> None:
        # NOTE [ Ranges open at stop ]: a range still open when its profile stops ends at the
        # stop (torch.profiler's behaviour); its __exit__ after that records nothing, in that
        # profile or in one started since.
        if not self._ranges:
            raise RuntimeError(
                f"record_function({self.name!r}): __exit__ without a matching __enter__ "
                "(torch's record_function raises here too)"
            )
        entry = self._ranges.pop()
        rec = _profile_hook.ACTIVE
        if entry is not None and rec is not None:
            rec.exit_range(entry)
