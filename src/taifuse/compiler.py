"""``taifuse.compile``: trace a training step once per signature, then replay its kernel calls.

NOTE [ What a compiled step records ]
A trace runs the step eagerly, once, with the backend's kernels (``backends/_spec.KERNELS``) and
its tensor math (``_tensor_math.math_for``) wrapped, and ``BufferPool.acquire`` reporting to it
(NOTE [ Step compiler hooks ] in ``_trace_hook.py``). Every outermost call of one of them becomes a
step of the replay: the function and its arguments, each array argument described by the buffer
it lies in (one the trace saw the pool hand out, or an array from outside: a parameter, the
optimizers' flat buffers and state), each seed drawn for dropout by its place in the order of
draws. Everything else the step does in Python (argument checks, dtype promotion, autograd's
graph, the pool's free lists) ran once and is not repeated: the replay is the list of calls. Three
kinds of work are not a list of kernel calls and are kept as host segments, re-run whole at
replay: ``Optimizer.step`` (its bias corrections and learning rate are host numbers that change
every step) and ``LRScheduler.step``, ``BatchNorm*.count_batch`` (host counts), and ``GradScaler.unscale_``, ``step`` and ``update`` (whether to step depends on the
gradients' values: the scaler's decision stays on the host, as ``torch.compile`` leaves it outside
the graph). A value read inside the step (``.item()``, ``.numpy()``, a kernel that returns a host
number outside a host segment) is refused at trace time, as ``mx.compile`` refuses one: its value would be
frozen into the replay.

Buffers: each buffer the trace saw is live from the call that made it to the last call that
reads it. Those still alive after the trace (returned tensors, ``.grad`` arrays, state an
optimizer made) keep the array the trace made, since others hold it; every other one gets a place
in one arena planned from the lifetimes (host) or a shared array of its size (device), so the
plan holds no more than the step's live buffers at its fullest, plus what packing costs.
"""

from __future__ import annotations

import bisect
import functools
import gc
import sys
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from taifuse import _autocast_state, _engine, _random, _trace_hook, backends, pool
from taifuse._internal import backend, data, is_tensor, set_grad, wrap
from taifuse._tensor_math import math_for
from taifuse.amp.grad_scaler import GradScaler
from taifuse.backends import _spec
from taifuse.nn.batchnorm import BatchNorm1d, BatchNorm2d
from taifuse.nn.module import Module
from taifuse.optim.lr_scheduler import LRScheduler
from taifuse.optim.optimizer import Optimizer
from taifuse.tensor import Tensor

__all__ = ["CompiledFunction", "compile"]

# One trace at a time: a trace swaps the backends' kernels for recording wrappers.
_TRACE_LOCK = threading.RLock()
_ALIGN = 64  # bytes: every planned host buffer starts on a cache line
_TRACES_KEPT = 4  # traces kept per signature (differing in their guards)
# Signatures a compiled function traces before new ones run eagerly (NOTE [ The signature cache ]).
CACHE_SIZE_LIMIT = 8

# Methods run whole at replay (NOTE [ What a compiled step records ]).
_HOST_SEGMENTS: tuple[tuple[type, str], ...] = (
    (Optimizer, "step"),
    (LRScheduler, "step"),
    (GradScaler, "unscale_"),
    (GradScaler, "step"),
    (GradScaler, "update"),
    (BatchNorm1d, "count_batch"),
    (BatchNorm2d, "count_batch"),
)
# Tensor-math methods and Tensor methods that read values back to the host.
_VALUE_READS = ("item", "to_numpy")
_TENSOR_VALUE_READS = (
    "numpy",
    "item",
    "tolist",
    "__bool__",
    "__float__",
    "__int__",
    "__index__",
    "__array__",
)


class CompileError(RuntimeError):
    """A step that ``taifuse.compile`` cannot replay faithfully (a value read inside it)."""


def compile(
    fn: Callable | None = None, *, fallback: bool = False, cache_size_limit: int = CACHE_SIZE_LIMIT
) -> Any:
    """Compile a training step: trace ``fn`` once per signature, then replay its kernel calls.

    ``fn`` runs eagerly on its first call with a signature (the shapes, dtypes and backend of its
    Tensor and NumPy array arguments, the other arguments' values, grad mode, autocast's state); that run is
    recorded (NOTE [ What a compiled step records ]) and each later call with the same signature
    replays the recorded kernel calls on the new inputs' values, with buffers planned ahead. A
    parameter whose storage changed, or a ``GradScaler`` whose scale changed since the trace,
    makes the next call trace again. Returned Tensors are new arrays each call, outside the graph.

    Args:
        fn: the step, a function of Tensors and other values. Usable as ``@taifuse.compile``.
        fallback: when the step reads a value (``.item()``, ``.numpy()``) inside,
            run it eagerly from then on with a warning, instead of raising ``CompileError``.
        cache_size_limit: how many signatures are traced; a call with a new signature past them
            runs eagerly, with a warning (``torch._dynamo.config.cache_size_limit``'s rule).

    Example::

        >>> import numpy as np, taifuse
        >>> from taifuse import nn, optim
        >>> import taifuse.functional as F
        >>> taifuse.set_backend("numpy")
        >>> model = nn.Linear(3, 2)
        >>> opt = optim.SGD(model.parameters(), lr=0.1)
        >>> @taifuse.compile
        ... def step(x, y):
        ...     opt.zero_grad()
        ...     loss = F.mse_loss(model(x), y)
        ...     loss.backward()
        ...     opt.step()
        ...     return loss
        >>> x, y = taifuse.tensor(np.ones((4, 3), np.float32)), taifuse.tensor(np.zeros((4, 2), np.float32))
        >>> losses = [step(x, y) for _ in range(3)]  # one trace, two replays
        >>> step.traces
        1
    """
    if isinstance(cache_size_limit, bool) or not isinstance(cache_size_limit, int) or cache_size_limit < 1:
        raise ValueError(f"compile: cache_size_limit should be a positive int, got {cache_size_limit!r}")
    if fn is None:
        return functools.partial(compile, fallback=fallback, cache_size_limit=cache_size_limit)
    if not callable(fn):
        raise TypeError(f"compile: fn should be callable, got {type(fn).__name__}")
    return CompiledFunction(fn, fallback=fallback, cache_size_limit=cache_size_limit)


class CompiledFunction:
    """What :func:`compile` returns: ``fn`` with a cache of compiled steps by signature."""

    def __init__(
        self, fn: Callable, fallback: bool = False, cache_size_limit: int = CACHE_SIZE_LIMIT
    ) -> None:
        self.fn = fn
        self.fallback = fallback
        self.cache_size_limit = cache_size_limit
        self._full = False  # warned that the cache is full
        # Per signature, the traces whose guards held when they were made, newest first: a
        # GradScaler's scale that backs off and grows back finds its trace again.
        self._steps: dict[Any, list[_Replay]] = {}
        self._eager: set[Any] = set()
        self.traces = 0  # how many times fn was traced
        self.replays = 0
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        key = _signature(args, kwargs)
        if key in self._eager:
            return self.fn(*args, **kwargs)
        steps = self._steps.get(key)
        if steps is None:  # NOTE [ The signature cache ]
            if len(self._steps) + len(self._eager) >= self.cache_size_limit:
                if not self._full:
                    self._full = True
                    warnings.warn(
                        f"taifuse.compile: {_name(self.fn)} was traced for {self.cache_size_limit} "
                        "signatures (cache_size_limit); calls with a new one run eagerly",
                        stacklevel=2,
                    )
                return self.fn(*args, **kwargs)
            strided = _strided_input(args, kwargs)
            if strided is not None:
                warnings.warn(
                    f"taifuse.compile: {_name(self.fn)} runs eagerly for this signature: {strided}",
                    stacklevel=2,
                )
                self._eager.add(key)
                return self.fn(*args, **kwargs)
            steps = self._steps[key] = []
        args, kwargs = _contiguous_inputs(args), dict(zip(kwargs, _contiguous_inputs(tuple(kwargs.values()))))
        step = next((s for s in steps if s.guards_hold()), None)
        if step is not None and step.confirmed:
            self.replays += 1
            return step.run(args, kwargs)
        new, result, refused = _trace(self.fn, args, kwargs, self.fallback, pending=step)
        self.traces += 1
        if new is not None and step is not None:  # `step` awaits confirming
            refused = new.confirm(step)  # NOTE [ Constants made by host code ]
            if refused is not None and not self.fallback:
                raise CompileError(refused)
            steps.remove(step)
        if new is None and refused is None:
            pass  # the trace moved a parameter's storage: the next call traces again
        elif refused is not None:
            warnings.warn(
                f"taifuse.compile: {_name(self.fn)} runs eagerly from now on: {refused}", stacklevel=2
            )
            self._eager.add(key)
        else:
            steps.insert(0, new)
            del steps[_TRACES_KEPT:]
        return result

    def plan(self, *args: Any, **kwargs: Any) -> PlanStats | None:
        """The buffer plan of the compiled step for these arguments' signature (None before a trace)."""
        steps = self._steps.get(_signature(args, kwargs))
        return steps[0].stats if steps else None


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", type(fn).__name__)


# ----------------------------------------------------------------------------- signatures


def _signature(args: tuple, kwargs: dict) -> tuple:
    state = _autocast_state.active_state()
    autocast = None if state is None else (str(state.dtype), state.cache_enabled)
    parts = [backends.active().NAME, _engine.is_grad_enabled(), autocast]
    parts.extend(_arg_key(value) for value in args)
    parts.extend((name, _arg_key(kwargs[name])) for name in sorted(kwargs))
    return tuple(parts)


def _arg_key(value: Any) -> Any:
    if is_tensor(value):
        if value.requires_grad:  # state, not data: bound by identity (NOTE [ Compiled inputs ])
            return ("state", id(value))
        return ("T", value.shape, value.dtype, backend(value), value.is_contiguous())
    if isinstance(value, np.ndarray):  # data, bound anew at each call (NOTE [ Compiled inputs ])
        return ("A", type(value), value.shape, value.dtype)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_arg_key(v) for v in value))
    try:
        hash(value)
    except TypeError:
        return ("id", id(value))
    return ("v", type(value).__name__, value)


# ----------------------------------------------------------------------------- recording

# NOTE [ Compiled inputs ]
# A Tensor argument that does not require grad, and a NumPy array argument, are data: the
# signature holds their type, shape, dtype (and a Tensor's backend and contiguity), never their
# identity, and the calls that read them (or a view of them) are bound to each call's arrays anew,
# as TinyJit swaps its input buffers and mx.compile keys array inputs by shape and dtype. A NumPy
# array that is not C-contiguous (``tokens[:, :-1]``) reaches the step as a C-contiguous copy, at
# the trace and at each replay, so the recorded views of it hold for any call's array; a
# non-contiguous Tensor would need its own strides bound, so its signature runs eagerly (warned).
# What host code makes from an input is not recorded (NOTE [ Constants made by host code ]), but
# the two conversions every path from a NumPy input to the backend takes are: ``taifuse.tensor``
# (``Tensor(array)``) and the backend's ``from_numpy`` (the upload on Taichi), recorded as calls
# when their argument is a buffer the trace knows, so a replay converts (uploads) each call's
# batch as the eager step does. A Tensor argument that requires grad is state (a parameter passed
# in): it is used itself, and the signature holds its identity.
#
# NOTE [ The signature cache ]
# Each signature keeps its plan (an arena, device arrays), so the cache is bounded, as
# torch.compile bounds its recompiles (``cache_size_limit``, 8): past ``cache_size_limit``
# signatures (traced or refused) a call with a new one runs eagerly, with one warning, and the
# cached ones still replay. Python scalars are part of the signature by value (a trace reads them
# as constants), so a float argument that changes every call (a learning rate passed in) reaches
# the limit; make it a Tensor, or set it on the optimizer, which a host segment reads.


def _strided_input(args: tuple, kwargs: dict) -> str | None:
    """Why a data Tensor among the arguments cannot be compiled (it is not contiguous), or None."""
    for t in _data_inputs(args) + _data_inputs(tuple(kwargs.values())):
        if is_tensor(t) and not t.is_contiguous():
            return (
                f"a Tensor argument of shape {t.shape} is not contiguous (strides {t.stride()}); pass "
                "t.contiguous() to compile the step"
            )
    return None


def _contiguous_inputs(values: tuple) -> tuple:
    """``values`` with each NumPy array not C-contiguous (nested in lists and tuples too) as a
    C-contiguous copy (NOTE [ Compiled inputs ])."""
    if not any(_needs_copy(v) for v in values):
        return values
    out = []
    for v in values:
        if isinstance(v, np.ndarray) and not v.flags.c_contiguous:
            v = np.ascontiguousarray(v)  # (a 0-d array is always C-contiguous)
        elif isinstance(v, (list, tuple)) and _needs_copy(v):
            v = (
                type(v)(_contiguous_inputs(tuple(v)))
                if not hasattr(v, "_fields")
                else type(v)(*_contiguous_inputs(tuple(v)))
            )
        out.append(v)
    return tuple(out)


def _needs_copy(value: Any) -> bool:
    if isinstance(value, np.ndarray):
        return not value.flags.c_contiguous
    if isinstance(value, (list, tuple)):
        return any(_needs_copy(v) for v in value)
    return False


class _Seed(int):
    """A seed drawn during a trace: an int that remembers its place in the order of draws."""

    index: int


class _Buffer:
    """One buffer the trace saw: made by the pool, or returned fresh by a recorded call."""

    __slots__ = (
        "address",
        "array",
        "born",
        "device",
        "dtype",
        "fresh",
        "index",
        "last",
        "nbytes",
        "ref",
        "shape",
        "zero",
    )

    def __init__(self, index: int, array: Any, born: int, zero: bool, fresh: bool = False) -> None:
        self.index = index
        self.shape, self.dtype = tuple(array.shape), np.dtype(array.dtype)
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
        self.device = not isinstance(array, np.ndarray)
        self.address = 0 if self.device else array.__array_interface__["data"][0]
        # Whether it outlives the trace is asked of what keeps its memory: a pool lease's owner
        # object, which every view of it holds (NOTE [ Buffer ownership ] in pool.py), or itself.
        owner = array.base if isinstance(array, np.ndarray) and array.base is not None else array
        if isinstance(owner, np.ndarray) or not hasattr(owner, "__weakref__"):
            owner = array
        self.ref = None if self.device else weakref.ref(owner)
        self.array: Any = array  # dropped at the trace's end (then only `ref`)
        self.born = born
        self.last = born
        self.zero = zero
        self.fresh = fresh  # returned by a recorded call as a new array: made again by each replay


class _Call:
    __slots__ = ("args", "fn", "kwargs", "name", "result", "segment")

    def __init__(self, name: str, fn: Callable, args: Any, kwargs: Any, segment: bool) -> None:
        self.name, self.fn, self.args, self.kwargs, self.segment = name, fn, args, kwargs, segment
        self.result: Any = None


class _Tracer:
    """Records one eager run of the step (NOTE [ What a compiled step records ])."""

    def __init__(self, fallback: bool) -> None:
        self.fallback = fallback
        self.refused: str | None = (
            None  # why the trace stopped recording (fallback: the step runs on eagerly)
        )
        self.scalers: list[tuple[GradScaler, Any]] = []  # (scaler, the scale its scale() used)
        self.calls: list[_Call] = []
        self.buffers: list[_Buffer] = []
        self.inner: dict[int, list[int]] = {}  # call index -> buffers the pool made inside it
        self.depth = 0  # > 0 inside a recorded call
        self.seeds = 0
        self._starts: list[int] = []  # live host buffers by address (sorted), for _find
        self._live: list[_Buffer] = []
        self._device: dict[int, _Buffer] = {}  # id(storage) -> live device buffer
        # Only the tracing thread's work is the step's, and not what a host segment or the trace's
        # own call to the pool does (NOTE [ Step compiler hooks ]).
        self.thread = threading.get_ident()
        self.paused = False
        self.next_seed: Callable[[], int] = _random.next_seed

    def owns(self) -> bool:
        """Whether the work being done now is the step's, to record."""
        return not self.paused and threading.get_ident() == self.thread

    # -- the pool's hook

    def acquire(self, owner: pool.BufferPool, shape: Any, dtype: Any, zero: bool) -> Any:
        if not self.owns():
            return None
        self.paused = True  # the pool's own path, through its hook once more
        try:
            out = owner.acquire(shape, dtype, zero=zero)
        finally:
            self.paused = False
        if self.refused is not None:
            return out
        born = len(self.calls) - 1 if self.depth else len(self.calls)
        buf = self._add(out, born, zero and self.depth == 0)
        if self.depth:
            self.inner.setdefault(born, []).append(buf.index)
        return out

    def _add(self, array: Any, born: int, zero: bool, fresh: bool = False) -> _Buffer:
        buf = _Buffer(len(self.buffers), array, born, zero, fresh)
        self.buffers.append(buf)
        if buf.device:
            storage = getattr(array, "storage", None)
            self._device[id(storage)] = buf
        elif buf.nbytes:
            lo, hi = buf.address, buf.address + buf.nbytes
            # A new lease over memory an earlier one had means that one is dead (the pool took it back).
            i = bisect.bisect_left(self._starts, lo)
            j = i
            while j > 0 and self._live[j - 1].address + self._live[j - 1].nbytes > lo:
                j -= 1
            k = i
            while k < len(self._starts) and self._starts[k] < hi:
                k += 1
            del self._starts[j:k], self._live[j:k]
            self._starts.insert(j, lo)
            self._live.insert(j, buf)
        return buf

    # -- recorded calls

    def refuse(self, why: str) -> None:
        """A value read: an error, or with ``fallback`` the end of recording (the run goes on eagerly)."""
        if not self.fallback:
            raise CompileError(why)
        if self.refused is None:
            self.refused = why

    def record(self, name: str, fn: Callable, args: tuple, kwargs: dict, segment: bool = False) -> Any:
        if self.depth or self.refused is not None or not self.owns():
            return fn(*_plain(args), **_plain(kwargs))
        call = _Call(name, fn, None, None, segment)
        index = len(self.calls)
        self.calls.append(call)
        call.args = self._describe(args, index)
        call.kwargs = self._describe(kwargs, index)
        self.depth += 1
        try:
            if segment:
                self.paused = True
                try:
                    result = fn(*args, **kwargs)
                finally:
                    self.paused = False
                return result
            result = fn(*_plain(args), **_plain(kwargs))
        finally:
            self.depth -= 1
        if segment:
            return result
        call.result = self._result(name, result, index)
        return result

    def _result(self, name: str, result: Any, index: int) -> Any:
        if result is None:
            return None
        if isinstance(result, tuple):
            return tuple(self._result(name, r, index) for r in result)
        if not _is_array(result):
            self.refuse(
                f"{name} returned a host value ({type(result).__name__}) inside a compiled step: the "
                "step's control flow would depend on values the replay does not compute"
            )
            return None
        if self._find(result) is not None:
            return None  # a buffer the trace knows (made inside this call, or a view of one)
        return self._add(result, index, False, fresh=True).index  # a new array: made again at replay

    def _find(self, arr: Any) -> tuple[_Buffer, int] | None:
        """The live buffer ``arr`` lies in and its byte offset there, or None (an outside array)."""
        if not isinstance(arr, np.ndarray):
            buf = self._device.get(id(getattr(arr, "storage", None)))
            return None if buf is None else (buf, 0)
        if arr.size == 0:
            return None
        address = arr.__array_interface__["data"][0]
        i = bisect.bisect_right(self._starts, address) - 1
        if i >= 0:
            buf = self._live[i]
            if address < buf.address + buf.nbytes:
                return buf, address - buf.address
        return None

    def _describe(self, value: Any, index: int) -> Any:
        if isinstance(value, _Seed):
            return ("seed", value.index)
        if _is_array(value):
            if value.size == 0:
                return ("const", value)
            found = self._find(value)
            if found is None:
                return ("ext", _External(value))
            buf, offset = found
            buf.last = max(buf.last, index)
            if buf.device:
                return ("buf", buf.index, tuple(value.shape))  # a device view: a reshape
            return ("buf", buf.index, _HostView(offset, value.shape, value.strides, value.dtype))
        if isinstance(value, (list, tuple)):
            items = [self._describe(v, index) for v in value]
            return ("seq", type(value), items)
        if isinstance(value, dict):
            return ("dict", {k: self._describe(v, index) for k, v in value.items()})
        return ("const", value)

    def draw_seed(self) -> int:
        if not self.owns():
            return self.next_seed()
        seed = _Seed(self.next_seed())
        seed.index = self.seeds
        self.seeds += 1
        return seed


def _is_array(value: Any) -> bool:
    return isinstance(value, np.ndarray) or (
        hasattr(value, "storage") and hasattr(value, "shape") and hasattr(value, "dtype")
    )


def _plain(value: Any) -> Any:
    """``value`` with traced seeds as plain ints (a kernel's argument types stay what they were)."""
    if isinstance(value, _Seed):
        return int(value)
    if isinstance(value, tuple) and any(isinstance(v, _Seed) for v in value):
        return tuple(_plain(v) for v in value)
    if isinstance(value, dict) and any(isinstance(v, _Seed) for v in value.values()):
        return {k: _plain(v) for k, v in value.items()}
    return value


class _HostView(NamedTuple):
    """Where a host array argument lies in its buffer."""

    offset: int  # bytes from the buffer's start
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: np.dtype


class _External:
    """An array from outside the trace's buffers (a parameter, an optimizer's flat buffer)."""

    __slots__ = ("array",)

    def __init__(self, arr: Any) -> None:
        self.array = arr


def _owner(arr: Any) -> Any:
    """What keeps ``arr``'s memory: the ndarray at the end of its ``base`` chain, or a device
    array's storage."""
    if isinstance(arr, np.ndarray):
        while isinstance(arr.base, np.ndarray):
            arr = arr.base
        return arr
    return getattr(arr, "storage", arr)


def _held_elsewhere(arr: Any) -> bool:
    """Whether a device array the trace recorded (and holds once) is referred to by others, itself
    or through a reshape view of its storage."""
    # Beyond the trace's: getrefcount's argument and `arr` (and the array's reference to its storage).
    return sys.getrefcount(arr) > 3 or sys.getrefcount(arr.storage) > 2


def _made_inside(externals: list[_External]) -> list[_External]:
    """The outside arrays only the trace still holds: host code made them during the step (a value
    the recorded calls did not compute, which the replay would freeze).

    Counted by references (CPython): an array is held elsewhere when more refer to it than the
    trace's records, and so is its memory's owner (the ndarray at the end of its ``base`` chain, or
    a device array's storage) when more refer to it than the arrays the trace holds over it.
    """
    arrays: dict[int, Any] = {}
    records: dict[int, int] = {}
    for e in externals:
        arrays[id(e.array)] = e.array
        records[id(e.array)] = records.get(id(e.array), 0) + 1
    owners: dict[int, Any] = {}
    over: dict[int, int] = {}  # owner -> held arrays (other than itself) that refer to it
    alive: set[int] = set()
    # NOTE: by key, never binding an array to a local, which would be one more reference.
    for key in arrays:  # noqa: PLC0206
        # Beyond the records: getrefcount's argument and the `arrays` dict.
        if sys.getrefcount(arrays[key]) - 2 - records[key] > 0:
            alive.add(id(_owner(arrays[key])))
        owner_id = id(_owner(arrays[key]))
        if owner_id != key:
            owners[owner_id] = _owner(arrays[key])
            over[owner_id] = over.get(owner_id, 0) + 1
    for key in owners:  # noqa: PLC0206
        # Beyond the arrays over it: getrefcount's argument, the `owners` dict, and the records
        # and the `arrays` entry when the owner is itself a recorded array.
        ours = over[key] + (records[key] + 1 if key in arrays else 0)
        if sys.getrefcount(owners[key]) - 2 - ours > 0:
            alive.add(key)
    return [e for e in externals if id(_owner(e.array)) not in alive]


# NOTE [ Constants made by host code ]
# A recorded call may read an array that host code made during the step (``np.arange`` of the
# positions in the GPT's forward, a cast of the targets on the host): the trace did not record how,
# so the replay reads the values it had. That is right for a constant and wrong for anything
# computed from the inputs' values. Which one it is cannot be seen in one trace, so a step that
# has such arrays is traced a second time, on the next call's inputs, as TinyJit captures on its
# second call: equal values make them constants and the step replays from then on; different
# values are refused (``CompileError``, or eager with a warning under ``fallback``). The same
# inputs twice cannot tell the two apart; the arrays are then what those inputs make.


# ----------------------------------------------------------------------------- the trace


# NOTE [ Memory a trace leaves ]
# What a compiled step holds between calls is its plan: the arena (or the shared device arrays)
# and the buffers it keeps (``PlanStats``). A trace runs the step eagerly and keeps every buffer it
# saw alive until its end, so the pool serves it as many fresh blocks as the step made buffers
# (``PlanStats.planned``, several times the live peak); when the trace ends they are all free in
# the pool, which the replays never ask for them. So a trace gives the pool back the free bytes it
# added: each pool the step used keeps no more wholly free memory than it had before the trace
# (``shrink_to_fit``: least recently freed first), as an eager step leaves it. And a trace that
# waits for a second one to confirm its constants (NOTE [ Constants made by host code ]) gives up
# its plan first: it keeps only the constants to compare. Its arena would be a second one, and its
# ``.grad`` bindings (NOTE [ Gradients a replay leaves ]) would keep the optimizer's gradient slots
# lent, so that the second trace's gradients were buffers of their own, kept besides the flat
# buffer and copied into it by every replay's step.


def _free_bytes(pools: list[pool.BufferPool]) -> list[int]:
    """The wholly free bytes each pool holds (what ``shrink_to_fit`` bounds)."""
    out = []
    for p in pools:
        s = p.stats()
        out.append(s.bytes_pooled - s.bytes_fragmented)
    return out


def _step_pools() -> list[pool.BufferPool]:
    """The pools a step on the active backend draws from: its own and, off the host, the host pool."""
    own, host = pool.get_pool(backends.active()), pool.host_pool()
    return [own] if own is host else [own, host]


def _trace(
    fn: Callable, args: tuple, kwargs: dict, fallback: bool, pending: _Replay | None = None
) -> tuple[_Replay | None, Any, str | None]:
    """Run ``fn`` once, recording it: (the compiled step, ``fn``'s result, why not compiled or None).
    ``pending``: this signature's trace that awaits confirming, whose plan is given up first."""
    with _TRACE_LOCK:
        pools = _step_pools()
        free_before = _free_bytes(pools)  # NOTE [ Memory a trace leaves ]
        if pending is not None:  # only its constants are needed now
            pending.release()
        try:
            return _record(fn, args, kwargs, fallback)
        finally:
            gc.collect()  # what the trace's graph held in cycles goes back to the pool first
            for p, before in zip(pools, free_before):  # NOTE [ Memory a trace leaves ]
                p.shrink_to_fit(before)


def _record(
    fn: Callable, args: tuple, kwargs: dict, fallback: bool
) -> tuple[_Replay | None, Any, str | None]:
    """``_trace``'s recording run, under its lock."""
    tracer = _Tracer(fallback)
    for arr in _input_arrays(args, kwargs):  # NOTE [ Compiled inputs ]
        tracer._add(arr, 0, False, fresh=True)
    objects = _step_objects(fn, args, kwargs)
    before = _storage_guard(objects)
    undo = _install(tracer)
    hooked = _engine.backward_pass()
    _trace_hook.ACTIVE = tracer
    try:
        result = fn(*args, **kwargs)
    finally:
        _trace_hook.ACTIVE = None
        undo()
    if _engine.backward_pass() != hooked and tracer.refused is None:
        # NOTE [ Gradient hooks ] in _engine.py: Python on the gradients mid-backward.
        tracer.refuse(
            "a backward in the step ran gradient hooks (register_post_accumulate_grad_hook, "
            "DistributedDataParallel's all-reduce), Python that a replay would not run"
        )
    if tracer.refused is not None:
        return None, result, tracer.refused
    if not before():
        # The step moved a parameter's storage (an optimizer took back one assigned from
        # outside): the calls before the move read the old array. Trace the next call again.
        return None, _detach(result), None
    guards = [before]
    grads = _grad_bindings(objects)
    outputs = _describe_outputs(tracer, result)
    detached = _detach(result)
    del result
    gc.collect()  # buffers held only by dead graph nodes in cycles are not kept
    guards.extend(_scaler_guards(tracer.scalers))
    replay = _Replay(tracer, outputs, guards)
    replay.grads = grads
    return replay, detached, None


def _install(tracer: _Tracer) -> Callable[[], None]:
    """Swap in the recording wrappers; returns the function that puts the originals back."""
    undo: list[Callable[[], None]] = []

    def patch(obj: Any, name: str, new: Any) -> None:
        had = name in vars(obj)
        old = vars(obj).get(name)
        setattr(obj, name, new)
        undo.append(lambda: setattr(obj, name, old) if had else delattr(obj, name))

    def recording(name: str, fn: Callable) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            return tracer.record(name, fn, args, kwargs)

        return call

    def converting(name: str, fn: Callable) -> Callable:
        # NOTE [ Compiled inputs ]: recorded when it converts an array the trace knows (an input).
        def call(*args: Any, **kwargs: Any) -> Any:
            if (
                not tracer.depth
                and tracer.refused is None
                and tracer.owns()
                and any(isinstance(a, np.ndarray) and tracer._find(a) is not None for a in args)
            ):
                return tracer.record(name, fn, args, kwargs)
            return fn(*args, **kwargs)

        return call

    def refusing(name: str, fn: Callable) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            if not tracer.depth and tracer.owns():
                tracer.refuse(
                    f"the step reads a value back to the host ({name}); a compiled step is a fixed list of kernel calls, so its control flow "
                    "cannot depend on values. Return the tensor and read it after the call"
                )
            return fn(*args, **kwargs)

        return call

    be = backends.active()
    for kernel in _spec.KERNELS:
        if be.NAME in kernel.backends and hasattr(be, kernel.name):
            patch(be, kernel.name, recording(kernel.name, getattr(be, kernel.name)))
    for name in ("from_numpy", "from_numpy_pooled"):
        if hasattr(be, name):
            patch(be, name, converting(f"{be.NAME}.{name}", getattr(be, name)))
    module = sys.modules[Tensor.__module__]  # taifuse.tensor (the package's `tensor` is the function)
    patch(module, "from_host", converting("taifuse.tensor", module.from_host))
    for name in _TENSOR_VALUE_READS:
        if name in vars(Tensor):
            patch(Tensor, name, refusing(f"Tensor.{name}", vars(Tensor)[name]))
    m = math_for(be)
    for name in dir(type(m)):
        if name.startswith("_") or not callable(getattr(m, name)):
            continue
        if name in _VALUE_READS:
            patch(m, name, refusing(name, getattr(m, name)))
        else:
            patch(m, name, recording(f"tensor math {name}", getattr(m, name)))
    for cls, name in _HOST_SEGMENTS:
        method = getattr(cls, name)  # a function (count_batch: the base class's)

        def segment(
            self: Any, *args: Any, _method: Callable = method, _name: str = name, **kwargs: Any
        ) -> Any:
            return tracer.record(
                f"{type(self).__name__}.{_name}", _method.__get__(self), args, kwargs, segment=True
            )

        patch(cls, name, segment)
    scale = vars(GradScaler)["scale"]

    def scaled(self: GradScaler, outputs: Any) -> Any:
        if tracer.owns():  # the scale the loss is multiplied by, not the one update() leaves
            tracer.scalers.append((self, self.get_scale() if self.is_enabled() else None))
        return scale(self, outputs)

    patch(GradScaler, "scale", scaled)
    tracer.next_seed = _random.next_seed  # the generator's own draw
    patch(_random, "next_seed", tracer.draw_seed)

    def restore() -> None:
        for fn in reversed(undo):
            fn()

    return restore


def _detach(result: Any) -> Any:
    """The trace's result as a replay returns it: Tensors as copies outside the graph."""
    if is_tensor(result):
        arr = data(result)
        return wrap(
            arr.copy() if isinstance(arr, np.ndarray) else math_for(backend(result)).copy(arr),
            backend(result),
        )
    if isinstance(result, (list, tuple)):
        return type(result)(_detach(r) for r in result)
    if isinstance(result, dict):
        return {k: _detach(v) for k, v in result.items()}
    return result


def _describe_outputs(tracer: _Tracer, result: Any) -> Any:
    if is_tensor(result):
        arr = data(result)
        found = tracer._find(arr)
        if found is None:
            return ("ext", backend(result), _External(arr))
        buf, _ = found
        buf.last = len(tracer.calls)
        return ("out", backend(result), tracer._describe(arr, len(tracer.calls)))
    if isinstance(result, (list, tuple)):
        return ("seq", type(result), [_describe_outputs(tracer, r) for r in result])
    if isinstance(result, dict):
        return ("dict", {k: _describe_outputs(tracer, v) for k, v in result.items()})
    return ("const", result)


# ----------------------------------------------------------------------------- guards


def _step_objects(fn: Callable, args: tuple, kwargs: dict) -> list[Any]:
    """The objects the step can reach by name: its arguments, closure and the globals it names."""
    found: list[Any] = list(args) + list(kwargs.values())
    target = getattr(fn, "__func__", fn)
    if hasattr(fn, "__self__"):
        found.append(fn.__self__)
    for cell in getattr(target, "__closure__", None) or ():
        try:
            found.append(cell.cell_contents)
        except ValueError:
            continue
    code = getattr(target, "__code__", None)
    if code is not None:
        g = getattr(target, "__globals__", {})
        found.extend(g[n] for n in code.co_names if n in g)
    return found


def _parameters(objects: list[Any]) -> list[Any]:
    """The parameters of the modules and optimizers among ``objects``, and Tensors that require grad."""
    tensors: dict[int, Any] = {}
    for obj in objects:
        if isinstance(obj, Module):
            for p in obj.parameters():
                tensors[id(p)] = p
        elif isinstance(obj, Optimizer):
            for group in obj.param_groups:
                for p in group["params"]:
                    tensors[id(p)] = p
        elif is_tensor(obj) and obj.requires_grad:
            tensors[id(obj)] = obj
    return list(tensors.values())


def _storage_guard(objects: list[Any]) -> Callable[[], bool]:
    """Checks that the recorded arrays are still the step's: each parameter's storage is the same."""
    held = [(t, data(t)) for t in _parameters(objects)]

    def same_storage() -> bool:
        return all(data(t) is arr for t, arr in held)

    return same_storage


# NOTE [ Gradients a replay leaves ]
# The host segments read ``p.grad`` (the optimizer's step, GradScaler's unscale), and autograd,
# which set it, does not run at replay. So each replay first gives every parameter the ``.grad``
# Tensor the trace left it, whose array the replayed calls write: another signature's trace in
# between (which lent the gradient slots anew, or made the optimizer a new flat buffer) then
# changes nothing for this one's replays.


def _grad_bindings(objects: list[Any]) -> list[tuple[Any, Any]]:
    return [(p, p.grad) for p in _parameters(objects)]


def _scaler_guards(scalers: list[tuple[GradScaler, Any]]) -> list[Callable[[], bool]]:
    """A GradScaler's scale is a host number the loss was multiplied by: a new scale, a new trace."""
    guards = []
    for obj, scale in dict.fromkeys(scalers):

        def same(obj: GradScaler = obj, scale: Any = scale) -> bool:
            return (obj.get_scale() if obj.is_enabled() else None) == scale

        guards.append(same)
    return guards


# ----------------------------------------------------------------------------- the replay


class PlanStats:
    """What a compiled step's buffer plan holds, in bytes."""

    def __init__(
        self, planned: int, arena: int, live_peak: int, kept: int, calls: int, segments: int
    ) -> None:
        self.planned = planned  # buffers placed by the plan (their sum without reuse)
        self.arena = arena  # memory the plan allocated for them
        self.live_peak = live_peak  # the most of them alive at one call
        self.kept = kept  # buffers the trace made that outlive the step (kept as they were)
        self.calls = calls  # kernel and tensor-math calls replayed
        self.segments = segments  # host segments re-run

    def __repr__(self) -> str:
        return (
            f"PlanStats(calls={self.calls}, segments={self.segments}, arena={self.arena}, "
            f"live_peak={self.live_peak}, planned={self.planned}, kept={self.kept})"
        )


class _Replay:
    """One compiled step: the calls with their arguments bound to planned buffers."""

    def __init__(self, tracer: _Tracer, outputs: Any, guards: list[Callable[[], bool]]) -> None:
        self.guards = guards
        self.seeds = tracer.seeds
        calls = tracer.calls
        # Kept: alive after the trace, so someone holds it. A device array by its storage (its
        # reshape views share it, and the pool takes it back when the last of them dies), of which
        # the trace holds one reference, through the array it recorded.
        held = {b.index: b.array for b in tracer.buffers if b.device and _held_elsewhere(b.array)}
        for buf in tracer.buffers:
            buf.array = None
        # NOTE [ Constants made by host code ]
        self.constants = [
            (next(c.name for c in calls if _reads(c, ext)), _host_copy(ext.array))
            for ext in _made_inside(_externals(calls, outputs))
        ]
        self.confirmed = not self.constants
        kept = {b.index for b in tracer.buffers if (b.index in held if b.device else b.ref() is not None)}
        kept -= {b.index for b in tracer.buffers if b.fresh}
        self.arrays: list[Any] = [None] * len(tracer.buffers)
        for i in kept:
            b = tracer.buffers[i]
            self.arrays[i] = held[i] if b.device else _over(b.ref(), b)
        self.stats = _plan(tracer.buffers, kept, self.arrays, len(calls))
        self.stats.calls = sum(not c.segment for c in calls)
        self.stats.segments = sum(c.segment for c in calls)
        fresh = {b.index for b in tracer.buffers if b.fresh}
        # Each step: (function, arguments, keyword arguments, a host segment?, argument templates
        # to bind at each replay (seeds, fresh results) or None, fresh results it returns).
        self.steps: list[tuple[Callable, Any, Any, bool, Any, Any]] = []
        self.inner: list[Any] = []
        for i, call in enumerate(calls):
            self.inner.extend(self.arrays[b] for b in tracer.inner.get(i, ()))
            templates = args = kwargs = None
            if _is_dynamic(call.args, fresh) or _is_dynamic(call.kwargs, fresh):
                templates = (call.args, call.kwargs)
                patches = None if _is_dynamic(call.kwargs, fresh) else _positions(call.args, tracer.buffers)
                if patches is not None:  # the usual case: bind the rest once, patch those positions
                    templates = patches
                    patched = {pos for pos, _ in patches}
                    args = [
                        None if pos in patched else self._bind(t, {}) for pos, t in enumerate(call.args[2])
                    ]
                    kwargs = self._bind(call.kwargs, {})
            else:
                args, kwargs = self._bind(call.args, {}), self._bind(call.kwargs, {})
            self.steps.append((call.fn, args, kwargs, call.segment, templates, call.result))
        self.zero_fills = [(b.born, self.arrays[b.index]) for b in tracer.buffers if b.zero]
        self.outputs = outputs
        self.be = backends.active()
        self.grads: list[tuple[Any, Any]] = []

    def _bind(self, template: Any, fresh: dict[int, Any]) -> Any:
        kind = template[0]
        if kind == "const":
            return template[1]
        if kind == "ext":
            return template[1].array
        if kind == "seed":
            return fresh[("seed", template[1])]
        if kind == "buf":
            index, view = template[1], template[2]
            base = fresh.get(index, self.arrays[index])
            if isinstance(view, _HostView):
                offset, shape, strides, dtype = view
                if offset == 0 and base.shape == shape and base.strides == strides and base.dtype == dtype:
                    return base
                return np.ndarray(shape, dtype, buffer=base, offset=offset, strides=strides)
            return base if tuple(base.shape) == view else base.reshape(view)
        if kind == "seq":
            items = [self._bind(t, fresh) for t in template[2]]
            return items if template[1] is list else tuple(items)
        if kind == "dict":
            return {k: self._bind(v, fresh) for k, v in template[1].items()}
        raise AssertionError(kind)

    def confirm(self, first: _Replay) -> str | None:
        """Compare this trace's constants with those of ``first``, an earlier trace of the same
        signature on other inputs: None when they are the same values, else what differs."""
        if [name for name, _ in self.constants] != [name for name, _ in first.constants]:
            return "the step made different host arrays in two traces of one signature"
        for (name, value), (_, before) in zip(self.constants, first.constants):
            if (
                value.shape != before.shape
                or value.dtype != before.dtype
                or value.tobytes() != before.tobytes()
            ):
                return (
                    f"{name} reads an array of shape {value.shape} that host code computed inside the "
                    "step from its inputs' values (it differed between two calls), outside the kernel "
                    "and tensor-math calls a trace records: the replay would freeze it. Compute it "
                    "before the call and pass it in, or with Tensor operations"
                )
        self.confirmed = True
        return None

    def release(self) -> None:
        """Give up the plan (arena, kept buffers, ``.grad`` bindings), keeping the constants that a
        second trace compares (NOTE [ Memory a trace leaves ]): the step cannot replay after this."""
        self.confirmed = False
        self.arrays, self.inner, self.zero_fills, self.grads = [], [], [], []
        self.steps, self.outputs = [], ("const", None)

    def guards_hold(self) -> bool:
        return all(g() for g in self.guards)

    def run(self, args: tuple, kwargs: dict) -> Any:
        for p, g in self.grads:  # NOTE [ Gradients a replay leaves ]
            set_grad(p, g)
        fresh: dict[Any, Any] = dict(enumerate(_input_arrays(args, kwargs)))  # NOTE [ Compiled inputs ]
        for i in range(self.seeds):
            fresh[("seed", i)] = _random.next_seed()
        zero = iter(self.zero_fills)
        fill = next(zero, None)
        server = _Server(self.inner)
        _trace_hook.ACTIVE = server
        try:
            for i, (fn, args_, kwargs_, segment, templates, returns) in enumerate(self.steps):
                while fill is not None and fill[0] <= i:
                    _zero(fill[1])
                    fill = next(zero, None)
                if templates is not None:
                    if isinstance(templates, list):  # arguments at positions: seeds, inputs as they are
                        args_ = list(args_)
                        for pos, key in templates:
                            args_[pos] = fresh[key]
                    else:
                        args_, kwargs_ = self._bind(templates[0], fresh), self._bind(templates[1], fresh)
                if segment:
                    server.paused = True
                    fn(*args_, **kwargs_)
                    server.paused = False
                    continue
                result = fn(*args_, **kwargs_)
                if returns is not None:
                    _keep(returns, result, fresh)
        finally:
            _trace_hook.ACTIVE = None
        return self._outputs(self.outputs, fresh)

    def _outputs(self, template: Any, fresh: dict) -> Any:
        kind = template[0]
        if kind == "out":
            arr = self._bind(template[2], fresh)
            copy = arr.copy() if isinstance(arr, np.ndarray) else math_for(template[1]).copy(arr)
            return wrap(copy, template[1])
        if kind == "ext":
            arr = template[2].array
            copy = arr.copy() if isinstance(arr, np.ndarray) else math_for(template[1]).copy(arr)
            return wrap(copy, template[1])
        if kind == "seq":
            items = [self._outputs(t, fresh) for t in template[2]]
            return items if template[1] is list else template[1](items)
        if kind == "dict":
            return {k: self._outputs(v, fresh) for k, v in template[1].items()}
        return template[1]


def _keep(returns: Any, result: Any, fresh: dict) -> None:
    """Note the fresh arrays a replayed call returned, by their buffer indices (``returns``)."""
    if isinstance(returns, int):
        fresh[returns] = result
    elif isinstance(returns, tuple):
        for r, value in zip(returns, result):
            if r is not None:
                _keep(r, value, fresh)


class _Server:
    """The pool's stand-in during a replay: the buffers recorded calls asked for, in order."""

    __slots__ = ("buffers", "i", "paused", "thread")

    def __init__(self, buffers: list[Any]) -> None:
        self.buffers, self.i = buffers, 0
        self.thread, self.paused = threading.get_ident(), False

    def acquire(self, owner: Any, shape: Any, dtype: Any, zero: bool) -> Any:
        if self.paused or threading.get_ident() != self.thread:
            return None  # a host segment's, or another thread's: the pool serves it
        arr = self.buffers[self.i]
        self.i += 1
        if zero:
            _zero(arr)
        return arr


def _zero(arr: Any) -> None:
    if isinstance(arr, np.ndarray):
        arr.fill(0)
    else:
        math_for(backends.active()).fill_(arr, 0.0)


def _over(owner: Any, b: _Buffer) -> np.ndarray:
    """The array of ``b``'s shape and dtype over the memory ``owner`` (its lease, or itself) keeps."""
    arr = owner if isinstance(owner, np.ndarray) else np.asarray(owner)
    if arr.shape == b.shape and arr.dtype == b.dtype:
        return arr
    return arr.reshape(-1).view(np.uint8)[: b.nbytes].view(b.dtype).reshape(b.shape)


def _positions(args: Any, buffers: list[_Buffer]) -> list[tuple[int, Any]] | None:
    """For a call whose dynamic arguments are all top-level seeds or whole fresh arrays (a data
    input, a fresh result, as they are): ``[(position, key in the replay's fresh values)]``; None
    when some argument needs a view built at each replay."""
    patches = []
    for pos, t in enumerate(args[2]):
        if t[0] == "seed":
            patches.append((pos, ("seed", t[1])))
        elif t[0] == "buf" and buffers[t[1]].fresh:
            b, view = buffers[t[1]], t[2]
            whole = (
                view == b.shape
                if b.device
                else view.offset == 0
                and view.shape == b.shape
                and view.dtype == b.dtype
                and view.strides == _c_strides(b.shape, b.dtype)
            )
            if not whole:
                return None
            patches.append((pos, t[1]))
        elif t[0] in ("seq", "dict") and _is_dynamic(t, {b.index for b in buffers if b.fresh}):
            return None
    return patches


def _c_strides(shape: tuple[int, ...], dtype: np.dtype) -> tuple[int, ...]:
    strides, step = [], dtype.itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def _is_dynamic(template: Any, fresh: set[int]) -> bool:
    kind = template[0]
    if kind == "seed":
        return True
    if kind == "buf":
        return template[1] in fresh
    if kind == "seq":
        return any(_is_dynamic(t, fresh) for t in template[2])
    if kind == "dict":
        return any(_is_dynamic(t, fresh) for t in template[1].values())
    return False


def _data_inputs(values: tuple) -> list[Any]:
    """The data inputs among ``values`` (NOTE [ Compiled inputs ]): Tensors that do not require
    grad and NumPy arrays, in lists and tuples too, in order."""
    out = []
    for v in values:
        if (is_tensor(v) and not v.requires_grad) or isinstance(v, np.ndarray):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out.extend(_data_inputs(tuple(v)))
    return out


def _input_arrays(args: tuple, kwargs: dict) -> list[Any]:
    """The arrays of a call's data inputs, in the order a trace numbers them."""
    inputs = _data_inputs(args) + _data_inputs(tuple(kwargs[k] for k in sorted(kwargs)))
    return [data(v) if is_tensor(v) else v for v in inputs]


def _host_copy(arr: Any) -> np.ndarray:
    return np.array(arr, copy=True) if isinstance(arr, np.ndarray) else arr.numpy()


def _reads(call: _Call, ext: _External) -> bool:
    return any(e is ext for e in _externals([call], ("const", None)))


def _externals(calls: list[_Call], outputs: Any) -> list[_External]:
    found: list[_External] = []

    def walk(t: Any) -> None:
        if not isinstance(t, tuple) or not t:
            return
        if t[0] == "ext":
            found.append(t[-1])
        elif t[0] == "seq":
            for x in t[2]:
                walk(x)
        elif t[0] == "dict":
            for x in t[1].values():
                walk(x)
        elif t[0] == "out":
            walk(t[2])

    for c in calls:
        walk(c.args)
        walk(c.kwargs)
    walk(outputs)
    return found


def _plan(buffers: list[_Buffer], kept: set[int], arrays: list[Any], ncalls: int) -> PlanStats:
    """Place every buffer not kept: host ones in one arena by their lifetimes, device ones in
    shared arrays of their exact size. Fills ``arrays``; buffers returned fresh by a call stay None."""
    placed = [b for b in buffers if b.index not in kept and b.nbytes and not b.fresh]
    live_peak = _live_peak(placed, ncalls)
    host = [b for b in placed if not b.device]
    arena_bytes = 0
    if host:
        offsets, arena_bytes = _pack(host)
        arena = np.empty(arena_bytes, np.uint8)
        for b, off in zip(host, offsets):
            arrays[b.index] = arena[off : off + b.nbytes].view(b.dtype).reshape(b.shape)
    device = [b for b in placed if b.device]
    free: dict[tuple, list[tuple[int, Any]]] = {}
    be = backends.active()
    for b in sorted(device, key=lambda b: b.born):
        key = (b.dtype, int(np.prod(b.shape)))
        slots = free.setdefault(key, [])
        arr = None
        for j, (last, candidate) in enumerate(slots):
            if last < b.born:
                arr = candidate
                slots[j] = (b.last, candidate)
                break
        if arr is None:
            arr = pool.empty(be, (key[1],), b.dtype)
            slots.append((b.last, arr))
            arena_bytes += b.nbytes
        arrays[b.index] = arr.reshape(b.shape)
    kept_bytes = sum(buffers[i].nbytes for i in kept)
    return PlanStats(sum(b.nbytes for b in placed), arena_bytes, live_peak, kept_bytes, 0, 0)


def _live_peak(placed: list[_Buffer], ncalls: int) -> int:
    delta = [0] * (ncalls + 2)
    for b in placed:
        delta[b.born] += b.nbytes
        delta[b.last + 1] -= b.nbytes
    peak = live = 0
    for d in delta:
        live += d
        peak = max(peak, live)
    return peak


def _pack(bufs: list[_Buffer]) -> tuple[list[int], int]:
    """Offsets for ``bufs`` in one arena such that two alive at the same call never overlap:
    largest first, each at the lowest aligned offset free over its lifetime."""
    order = sorted(range(len(bufs)), key=lambda i: (-bufs[i].nbytes, bufs[i].born))
    offsets = [0] * len(bufs)
    placed: list[tuple[int, int, int, int]] = []  # (born, last, lo, hi)
    size = 0
    for i in order:
        b = bufs[i]
        need = -(-b.nbytes // _ALIGN) * _ALIGN
        clashes = sorted((lo, hi) for born, last, lo, hi in placed if born <= b.last and b.born <= last)
        at = 0
        for lo, hi in clashes:
            if at + need <= lo:
                break
            at = max(at, hi)
        offsets[i] = at
        placed.append((b.born, b.last, at, at + need))
        size = max(size, at + need)
    return offsets, size
