"""The optimizer base class: parameter groups, flat buffers, one fused kernel launch per step.

# NOTE [ Flat buffers ]
# On the host backends (numpy, numba) the optimizer gathers each parameter group's parameters of
# one dtype into a *bucket*: one contiguous 1-D array for the parameters, one for the gradients
# and one per state array (momentum, moments). Every Parameter's data becomes a C-contiguous view
# into the parameter buffer (``bind_storage`` in taifuse/_grad_slots.py, once, values unchanged), and every Parameter
# gets a ``GradSlot`` in the gradient buffer (``set_grad_slot``): autograd writes a leaf's
# first gradient into that slot instead of allocating (NOTE [ Gradient slots ] in _grad_slots.py), so
# after ``backward()`` the gradients already lie side by side and a step is one kernel launch over
# the whole bucket, one pass over memory, however many parameters it holds.
#
# Anything that bypasses that path still works, at the cost of a copy: a ``.grad`` assigned by hand
# is copied into its slot before the step, and a parameter whose storage was replaced
# (``Module.load_state_dict``) is copied back into the buffer and re-viewed. A gradient kept by the
# user across ``zero_grad()`` is never written to: while it lives, its slot is not lent again,
# and when a gradient has to be copied into such a slot the bucket moves to a fresh gradient
# buffer first (the kept gradients keep the old one alive).
#
# Parameters without a gradient are skipped, as PyTorch skips them (state untouched, no step
# counted). Each bucket runs one launch per maximal run of consecutive parameters that have a
# gradient and the same step count: one launch in the common case.
#
# The taichi backend's DeviceArray has no offset views yet, so there each parameter is a bucket of
# its own (its data and gradient used in place, no copy): one launch per parameter.

# NOTE [ Non-finite gradients ]
# By default (``check_finite=False``) a step behaves like torch.optim's: the update runs whatever
# the gradients hold, and a NaN or infinity spreads into the parameters and the optimizer state.
# ``check_finite=True`` makes ``step()`` check every gradient it is about to use before it writes
# anything; a NaN or infinity then raises ``ValueError`` naming the parameter, and no parameter,
# state or step count changes. The check costs one more read of every gradient per step (one
# ``all_finite`` call per backend over the flat gradient buffers; on a device backend, one
# read-back of its 4-byte answer), which is why it is off by default.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Mapping
from types import ModuleType
from typing import Any, NamedTuple

import numpy as np

from taifuse import _profile_hook, pool
from taifuse._engine import enable_grad
from taifuse._grad_slots import GradSlot, bind_storage, set_grad_slot, storage_is
from taifuse._internal import backend, bump_version, data, grad_data, wrap
from taifuse.backends.reference.optim import BFLOAT16_BITS, from_bfloat16_bits, to_bfloat16_bits
from taifuse.tensor import Tensor

_NEEDED = object()  # what the zeros factory returns when we only ask which state arrays exist


# ----------------------------------------------------------------------------- validation helpers


def check_number(
    opt: str, name: str, value: Any, low: float, high: float | None = None, *, high_open: bool = False
) -> float:
    """``value`` as a float, or ``ValueError`` naming it when it is not a finite number in range."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise ValueError(f"{opt} {name} should be a finite number, got {value!r}")
    value = float(value)
    if value < low or (high is not None and (value >= high if high_open else value > high)):
        bracket = ")" if high_open else "]"
        where = f"[{low}, {high}{bracket}" if high is not None else f">= {low}"
        raise ValueError(f"{opt} {name} should be {'in ' if high is not None else ''}{where}, got {value}")
    return value


def check_betas(opt: str, betas: Any) -> tuple[float, float]:
    """A pair of betas, each in [0, 1)."""
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"{opt} betas should be a pair (beta1, beta2), got {betas!r}")
    return (
        check_number(opt, "beta1", betas[0], 0.0, 1.0, high_open=True),
        check_number(opt, "beta2", betas[1], 0.0, 1.0, high_open=True),
    )


BFLOAT16 = "bfloat16"


def check_state_dtype(opt: str, state_dtype: Any) -> bool:
    """Whether ``state_dtype`` asks for bfloat16 state; ``ValueError`` naming it unless it is
    float32 (the default: the state in the parameters' own dtype) or ``"bfloat16"``."""
    if isinstance(state_dtype, str) and state_dtype == BFLOAT16:
        return True
    try:
        if np.dtype(state_dtype) == np.float32:
            return False
    except TypeError:
        pass
    raise ValueError(f"{opt} state_dtype should be np.float32 or 'bfloat16', got {state_dtype!r}")


def _is_host(arr: Any) -> bool:
    return isinstance(arr, np.ndarray)


# ----------------------------------------------------------------------------- buckets


class _Run(NamedTuple):
    lo: int  # element range in the bucket's flat buffers
    hi: int
    first: int  # segment range
    last: int
    step: int


class _Bucket:
    """One group's parameters of one dtype and backend, in flat buffers (NOTE [ Flat buffers ])."""

    def __init__(self, params: list[Tensor], bf16_state: bool = False) -> None:
        self.params = params
        self.be: ModuleType = backend(params[0])
        self.dtype = params[0].dtype
        # NOTE [ bfloat16 optimizer state ] in backends/reference/optim.py: uint16 bit patterns.
        self.state_dtype = BFLOAT16_BITS if bf16_state else self.dtype
        self.flat = _is_host(data(params[0]))
        sizes = [p.size for p in params]
        self.bounds = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64).tolist()
        self.size = self.bounds[-1]
        self.steps = [0] * len(params)
        self.arrays: dict[str, Any] = {}  # state name -> flat array (host) or array (single)
        if self.flat:
            self.param_buf = np.empty(self.size, self.dtype)
            self.param_views = []
            for p, lo, hi in zip(params, self.bounds, self.bounds[1:]):
                view = self.param_buf[lo:hi].reshape(p.shape)
                bind_storage(p, view)
                self.param_views.append(view)
            self._new_grad_buffer()

    def _new_grad_buffer(self) -> None:
        """A fresh flat gradient buffer and a slot in it for every parameter (NOTE [ Gradient slots ]
        in _grad_slots.py: gradients lent from the old buffer keep it alive for as long as they live)."""
        self.grad_buf = np.zeros(self.size, self.dtype)
        self.slots = []
        for p, lo, hi in zip(self.params, self.bounds, self.bounds[1:]):
            slot = GradSlot(self.grad_buf[lo:hi].reshape(p.shape))
            set_grad_slot(p, slot)
            self.slots.append(slot)

    # -- arrays

    def zeros(self) -> Any:
        # NOTE: zeroed explicitly, never on the belief that new memory starts at zero: a pooled
        # block holds an earlier user's values, and Taichi on Vulkan zero-fills a new ndarray in
        # 4-byte units only, so a float16 or bfloat16 array of odd length ends in a stale element.
        return pool.zeros(self.be, (self.size,), self.state_dtype)

    def param_flat(self) -> Any:
        return self.param_buf if self.flat else data(self.params[0]).reshape(-1)

    def grad_flat(self) -> Any:
        return self.grad_buf if self.flat else grad_data(self.params[0]).reshape(-1)

    def grads_in_place(self) -> list[Any]:
        """Every gradient of this bucket as flat arrays that are the ``.grad`` storage itself, so
        that writing them changes ``p.grad`` (``GradScaler.unscale_``): the gradients that lie in
        their slots as slices of the flat buffer, one per run of neighbours, and each other one
        (a ``.grad`` assigned by hand, a kept one) as its own array. Slots of parameters without
        a gradient are left out: they may hold stale values."""
        parts: list[Any] = []
        lo = None
        for i, p in enumerate(self.params):
            g = p.grad
            if self.flat and g is not None and self.slots[i].holds(data(g)):
                lo = self.bounds[i] if lo is None else lo
                continue
            if lo is not None:
                parts.append(self.grad_buf[lo : self.bounds[i]])
                lo = None
            if g is not None:
                parts.append(data(g).reshape(-1))
        if lo is not None:
            parts.append(self.grad_buf[lo : self.size])
        return parts

    def part(self, arr: Any, run: _Run) -> Any:
        if not self.flat or (run.lo == 0 and run.hi == self.size):
            return arr
        return arr[run.lo : run.hi]

    # -- before a step

    def runs(self) -> list[_Run]:
        """Sync views and gradient slots; the launches this step needs (see NOTE [ Flat buffers ])."""
        has_grad = []
        for i, p in enumerate(self.params):
            g = p.grad
            if g is not None:
                if tuple(g.shape) != p.shape or g.dtype != p.dtype:
                    raise ValueError(
                        f"parameter of shape {p.shape} and dtype {p.dtype} has a gradient of shape "
                        f"{tuple(g.shape)} and dtype {g.dtype}"
                    )
                if backend(g) is not self.be:
                    raise ValueError(
                        f"gradient lives on backend {backend(g).NAME!r}, its parameter on {self.be.NAME!r}"
                    )
            if self.flat and not storage_is(p, self.param_views[i]):
                bind_storage(p, self.param_views[i])  # replaced from outside: its values back into the buffer
            has_grad.append(g is not None)
        if self.flat:
            self._gather_grads()
        runs: list[_Run] = []
        i, n = 0, len(self.params)
        while i < n:
            if not has_grad[i]:
                i += 1
                continue
            j = i + 1
            while j < n and has_grad[j] and self.steps[j] == self.steps[i]:
                j += 1
            runs.append(_Run(self.bounds[i], self.bounds[j], i, j, self.steps[i]))
            i = j
        return runs

    def _gather_grads(self) -> None:
        """Copy into the flat buffer every gradient that does not already lie in its slot.

        A slot whose last lent gradient is still alive elsewhere (a ``.grad`` the user kept) must
        not be written: then the bucket moves to a fresh buffer first (NOTE [ Gradient slots ]).
        """
        foreign = [
            i
            for i, p in enumerate(self.params)
            if p.grad is not None and not self.slots[i].holds(grad_data(p))
        ]
        if not foreign:
            return
        if any(self.slots[i].in_use() for i in foreign):
            self._new_grad_buffer()
            foreign = [i for i, p in enumerate(self.params) if p.grad is not None]
        for i in foreign:
            np.copyto(self.slots[i].array, grad_data(self.params[i]))

    def ensure_arrays(self, init: Callable, hyper: NamedTuple) -> None:
        """Allocate (zeroed) every state array the hyperparameters call for that is not there yet."""
        template = init(hyper, lambda: _NEEDED)
        for name, value in template._asdict().items():
            if value is _NEEDED and name not in self.arrays:
                self.arrays[name] = self.zeros()

    def state_for(self, init: Callable, hyper: NamedTuple, run: _Run) -> NamedTuple:
        template = init(hyper, lambda: _NEEDED)
        fields = {
            name: (self.part(self.arrays[name], run) if value is _NEEDED else None)
            for name, value in template._asdict().items()
            if name != "step"
        }
        return template._replace(step=run.step, **fields)

    # -- per-parameter state (state_dict layout)

    def segment_array(self, name: str, i: int) -> np.ndarray:
        """A host copy of state array ``name`` for parameter ``i``, in its shape (bfloat16 state
        as its uint16 bits)."""
        arr = self.arrays[name]
        lo, hi = self.bounds[i], self.bounds[i + 1]
        host = arr[lo:hi] if self.flat else self.be.to_numpy(arr)
        return np.array(host, copy=True).reshape(self.params[i].shape)

    def write_segment(self, name: str, i: int, value: np.ndarray) -> None:
        """Write parameter ``i``'s state array ``name`` from ``value``: floats (rounded to
        bfloat16 for bfloat16 state) or bfloat16 bits (uint16; widened for float state)."""
        if name not in self.arrays:
            self.arrays[name] = self.zeros()
        if self.state_dtype == BFLOAT16_BITS:
            value = value if value.dtype == BFLOAT16_BITS else to_bfloat16_bits(value)
        elif value.dtype == BFLOAT16_BITS:
            value = from_bfloat16_bits(value)
        if self.flat:
            lo, hi = self.bounds[i], self.bounds[i + 1]
            np.copyto(self.arrays[name][lo:hi], value.reshape(-1), casting="unsafe")
        else:
            self.arrays[name] = self.be.from_numpy(
                np.ascontiguousarray(value.reshape(-1), dtype=self.state_dtype)
            )

    def view(self, name: str, i: int) -> Any:
        arr = self.arrays[name]
        if self.state_dtype == BFLOAT16_BITS:  # no bfloat16 view exists: a float32 copy
            values = from_bfloat16_bits(self.segment_array(name, i)).reshape(self.params[i].shape)
            return values if self.flat else self.be.from_numpy(values)
        if self.flat:
            return arr[self.bounds[i] : self.bounds[i + 1]].reshape(self.params[i].shape)
        return arr.reshape(self.params[i].shape)


# ----------------------------------------------------------------------------- Optimizer


class Optimizer:
    """Base class: parameter groups with per-group hyperparameters, flat buffers, fused steps.

    Subclasses set ``_init`` / ``_update`` (pure functions of ``taifuse.optim._functional``),
    ``_hyper(group)`` (the group's hyperparameters as the update's NamedTuple, validated), and
    ``_STEP_IN_STATE`` (whether ``state_dict`` records a per-parameter ``'step'``, as PyTorch's
    Adam does and its SGD does not).
    """

    _init: Callable
    _update: Callable
    _STEP_IN_STATE = False

    def __init__(
        self,
        params: Any,
        defaults: dict[str, Any],
        *,
        check_finite: bool = False,
        state_dtype: Any = np.float32,
    ) -> None:
        self.defaults = dict(defaults)
        self.check_finite = bool(check_finite)
        self._bf16_state = check_state_dtype(type(self).__name__, state_dtype)
        self.param_groups: list[dict[str, Any]] = []
        self._buckets: list[list[_Bucket]] = []
        if isinstance(params, Tensor):
            raise TypeError("params should be an iterable of Tensors or of dicts, got a single Tensor")
        groups = list(params)
        if not groups:
            raise ValueError(f"{type(self).__name__} got an empty parameter list")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        for group in groups:
            self.add_param_group(group)

    @property
    def _name(self) -> str:
        return type(self).__name__

    def _hyper(self, group: dict[str, Any]) -> NamedTuple:
        raise NotImplementedError

    # -- groups

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group of parameters with its own hyperparameters (defaults fill the rest).

        Raises ``ValueError`` before changing anything when a parameter is already optimized
        here, appears twice, or a hyperparameter is out of range.
        """
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group should be a dict, got {type(param_group).__name__}")
        params = param_group.get("params")
        if params is None:
            raise ValueError("param_group should have a 'params' entry")
        params = [params] if isinstance(params, Tensor) else list(params)
        for p in params:
            if not isinstance(p, Tensor):
                raise TypeError(f"{self._name} can only optimize Tensors, got {type(p).__name__}")
            if not p.is_leaf:
                raise ValueError(f"{self._name} can't optimize a non-leaf Tensor (shape {p.shape})")
            if p.dtype.kind != "f":
                raise TypeError(f"{self._name} can only optimize floating-point Tensors, got dtype {p.dtype}")
        ids = [id(p) for p in params]
        if len(set(ids)) != len(ids):
            raise ValueError(f"{self._name}: a parameter group contains the same parameter twice")
        existing = {id(p) for g in self.param_groups for p in g["params"]}
        if existing & set(ids):
            raise ValueError(f"{self._name}: some parameters appear in more than one parameter group")
        group = {**self.defaults, **{k: v for k, v in param_group.items() if k != "params"}, "params": params}
        self._hyper(group)  # validates, names the bad value
        if self._bf16_state and any(p.dtype != np.float32 for p in params):
            bad = next(p.dtype for p in params if p.dtype != np.float32)
            raise TypeError(f"{self._name} state_dtype='bfloat16' needs float32 parameters, got {bad}")
        # Buckets by (backend, dtype), in first-appearance order (NOTE [ Flat buffers ]).
        by_key: dict[tuple, list[Tensor]] = {}
        for p in params:
            by_key.setdefault((id(backend(p)), p.dtype), []).append(p)
        buckets = []
        for members in by_key.values():
            if _is_host(data(members[0])):
                buckets.append(_Bucket(members, self._bf16_state))
            else:
                buckets.extend(_Bucket([p], self._bf16_state) for p in members)
        self.param_groups.append(group)
        self._buckets.append(buckets)

    # -- gradients

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset every parameter's gradient, as ``torch.optim``: drop it (the default), or, with
        ``set_to_none=False``, fill the existing ``.grad`` with zeros in place (a reference to it
        sees the zeros; a parameter without a gradient keeps none)."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()

    # -- the step

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One update of every parameter that has a gradient; returns ``closure()`` if given.

        Checks everything first (hyperparameters, gradient shapes, finiteness: NOTE [ Non-finite
        gradients ]) and then runs one fused kernel launch per group and dtype.
        """
        loss = None
        if closure is not None:
            with enable_grad():
                loss = closure()
        plan = []
        for group, buckets in zip(self.param_groups, self._buckets):
            hyper = self._hyper(group)
            for bucket in buckets:
                runs = bucket.runs()
                if runs:
                    plan.append((hyper, bucket, runs))
        if self.check_finite:
            self._check_finite(plan)
        for hyper, bucket, runs in plan:
            bucket.ensure_arrays(type(self)._init, hyper)
            param, grad = bucket.param_flat(), bucket.grad_flat()
            for run in runs:
                state = bucket.state_for(type(self)._init, hyper, run)
                update = type(self)._update
                args = (bucket.be, bucket.part(param, run), bucket.part(grad, run), state, hyper)
                rec = _profile_hook.ACTIVE  # NOTE [ Profiler hooks ]
                new = update(*args) if rec is None else rec.step(self, update, args)
                for i in range(run.first, run.last):
                    bucket.steps[i] = new.step
                    bump_version(bucket.params[i])  # an in-place change (NOTE [ Version counters ])
        return loss

    def grad_buffers(self) -> list[tuple[ModuleType, list[Any]]]:
        """The gradients the next step will read, as flat buffers, for code that works on all of
        them at once (``GradScaler.unscale_``; later, a data-parallel all-reduce).

        One ``(backend, arrays)`` per bucket (a parameter group's parameters of one dtype and
        backend: NOTE [ Flat buffers ]), in group order; buckets without any gradient are left out.
        ``arrays`` are 1-D arrays of the bucket's dtype on ``backend`` that *are* the ``.grad``
        storage, not copies: writing them changes ``p.grad``. On the host backends the gradients
        that lie in their slots come as slices of the bucket's flat gradient buffer, one per run
        of neighbouring parameters (one array in the usual loop); a gradient elsewhere (assigned
        by hand, or kept by the user across ``zero_grad()``) comes as its own array. On the
        taichi backend each parameter is a bucket and its ``.grad`` the one array. Parameters
        without a gradient are left out (their slots may hold stale values). The arrays are valid
        until the next ``backward()`` or ``zero_grad()``.
        """
        out = []
        for buckets in self._buckets:
            for bucket in buckets:
                parts = bucket.grads_in_place()
                if parts:
                    out.append((bucket.be, parts))
        return out

    def _check_finite(self, plan: list) -> None:
        """One ``all_finite`` call per backend over every gradient the step will use; on failure,
        find and name the first offending parameter."""
        by_backend: dict[int, tuple[ModuleType, list]] = {}
        for _, bucket, runs in plan:
            grad = bucket.grad_flat()
            parts = by_backend.setdefault(id(bucket.be), (bucket.be, []))[1]
            parts.extend(bucket.part(grad, run) for run in runs)
        if all(be.all_finite(parts) for be, parts in by_backend.values()):
            return
        for _, bucket, runs in plan:
            for run in runs:
                for i in range(run.first, run.last):
                    g = bucket.slots[i].array if bucket.flat else grad_data(bucket.params[i])
                    if not bucket.be.all_finite([g]):
                        raise ValueError(
                            f"{self._name}.step: the gradient of parameter {self._index_of(bucket.params[i])} "
                            f"(shape {bucket.params[i].shape}) has NaN or infinite values; nothing was updated "
                            "(pass check_finite=False to update anyway, as torch.optim does)"
                        )

    def _index_of(self, param: Tensor) -> int:
        index = 0
        for group in self.param_groups:
            for p in group["params"]:
                if p is param:
                    return index
                index += 1
        raise KeyError("parameter not in this optimizer")

    # -- state

    def _array_names(self, hyper: NamedTuple) -> list[str]:
        template = type(self)._init(hyper, lambda: _NEEDED)
        return [name for name, value in template._asdict().items() if value is _NEEDED]

    def _has_state(self, hyper: NamedTuple, bucket: _Bucket, i: int) -> bool:
        # PyTorch keeps no state for a parameter that never stepped, nor for SGD without momentum.
        return bucket.steps[i] > 0 and (self._STEP_IN_STATE or bool(self._array_names(hyper)))

    @property
    def state(self) -> dict[Tensor, dict[str, Any]]:
        """Per-parameter state, as ``torch.optim``: ``{param: {'step': ..., 'exp_avg': Tensor, ...}}``.

        The Tensors are views into the optimizer's buffers (changing them changes the state),
        except with ``state_dtype="bfloat16"``: then they are float32 copies of the state.
        """
        out: dict[Tensor, dict[str, Any]] = {}
        for group, buckets in zip(self.param_groups, self._buckets):
            hyper = self._hyper(group)
            names = self._array_names(hyper)
            for bucket in buckets:
                for i, p in enumerate(bucket.params):
                    if not self._has_state(hyper, bucket, i):
                        continue
                    entry: dict[str, Any] = {"step": float(bucket.steps[i])} if self._STEP_IN_STATE else {}
                    for name in names:
                        entry[name] = wrap(bucket.view(name, i), bucket.be) if name in bucket.arrays else None
                    out[p] = entry
        return out

    def _segments(self) -> list[list[tuple[_Bucket, int]]]:
        """(bucket, index) of every parameter, per group, in the group's parameter order."""
        out = []
        for group, buckets in zip(self.param_groups, self._buckets):
            where = {id(p): (b, i) for b in buckets for i, p in enumerate(b.params)}
            out.append([where[id(p)] for p in group["params"]])
        return out

    def state_dict(self) -> dict[str, Any]:
        """The state in ``torch.optim``'s layout: ``{'state': {index: {...}}, 'param_groups': [...]}``.

        Parameters are numbered in group order; arrays are NumPy copies; ``'step'`` is a float.
        With ``state_dtype="bfloat16"`` the arrays are the state's uint16 bit patterns and every
        group records ``'state_dtype': 'bfloat16'``, so that loading restores the state exactly.
        """
        state: dict[int, dict[str, Any]] = {}
        groups = []
        index = 0
        for group, segments in zip(self.param_groups, self._segments()):
            hyper = self._hyper(group)
            names = self._array_names(hyper)
            ids = []
            for bucket, i in segments:
                if self._has_state(hyper, bucket, i):
                    entry: dict[str, Any] = {"step": float(bucket.steps[i])} if self._STEP_IN_STATE else {}
                    for name in names:
                        entry[name] = bucket.segment_array(name, i) if name in bucket.arrays else None
                    state[index] = entry
                ids.append(index)
                index += 1
            saved = {k: (tuple(v) if isinstance(v, list) else v) for k, v in group.items() if k != "params"}
            if self._bf16_state:
                saved["state_dtype"] = BFLOAT16
            groups.append({**saved, "params": ids})
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore hyperparameters and state saved by :meth:`state_dict` (or by the same ``torch.optim`` class).

        Everything is checked first (the layout, group and parameter counts, hyperparameter names
        and ranges, state entries, steps and shapes); on any mismatch ``ValueError`` (a wrong value)
        or ``TypeError`` (a wrong type) names the entry and nothing changes. State arrays are cast
        to their parameter's dtype, as PyTorch does; between float32 and bfloat16 state (a group's
        ``'state_dtype'``) they are converted, rounding to nearest even into bfloat16.
        """
        if not isinstance(state_dict, Mapping) or set(state_dict) != {"state", "param_groups"}:
            raise ValueError("state_dict should be a dict with exactly the keys 'state' and 'param_groups'")
        saved_groups, saved_state = state_dict["param_groups"], state_dict["state"]
        if not isinstance(saved_state, Mapping):
            raise TypeError(
                "loaded state dict's 'state' should be a dict {parameter index: state}, got "
                f"{type(saved_state).__name__}"
            )
        if not isinstance(saved_groups, (list, tuple)):
            raise TypeError(
                f"loaded state dict's 'param_groups' should be a list of dicts, got {type(saved_groups).__name__}"
            )
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"loaded state dict has {len(saved_groups)} parameter group(s), this optimizer {len(self.param_groups)}"
            )
        for g, saved in enumerate(saved_groups):
            if not isinstance(saved, Mapping):
                raise TypeError(
                    f"loaded state dict's parameter group {g} should be a dict, got {type(saved).__name__}"
                )
            if "params" not in saved:
                raise ValueError(f"loaded state dict's parameter group {g} has no 'params' entry")
            if isinstance(saved["params"], (str, bytes)) or not isinstance(saved["params"], Iterable):
                raise TypeError(
                    f"loaded state dict's parameter group {g} 'params' should be a list of parameter "
                    f"indices, got {saved['params']!r}"
                )
        new_groups, writes = [], []
        for g, (saved, group, segments) in enumerate(zip(saved_groups, self.param_groups, self._segments())):
            saved = {**saved, "params": list(saved["params"])}
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(
                    f"loaded state dict's group {g} has {len(saved['params'])} parameters, this optimizer's "
                    f"{len(group['params'])}"
                )
            missing = set(self.defaults) - set(saved)
            if missing:
                raise ValueError(
                    f"loaded state dict is not from a {self._name} (its group {g} lacks {sorted(missing)})"
                )
            saved_bf16 = _saved_state_dtype(saved.pop("state_dtype", np.float32), g)
            merged = {**group, **{k: saved[k] for k in saved if k != "params"}, "params": group["params"]}
            if isinstance(merged.get("betas"), tuple):
                merged["betas"] = tuple(merged["betas"])
            hyper = self._hyper(merged)
            names = set(self._array_names(hyper))
            for key, (bucket, i) in zip(saved["params"], segments):
                entry = saved_state.get(key)
                p = bucket.params[i]
                if entry is None:
                    writes.append((bucket, i, 0, {}))
                    continue
                if not isinstance(entry, Mapping):
                    raise TypeError(
                        f"loaded state dict's state of parameter {key} should be a dict, got {type(entry).__name__}"
                    )
                expected = names | ({"step"} if self._STEP_IN_STATE else set())
                if set(entry) != expected:
                    raise ValueError(
                        f"loaded state dict is not from a {self._name} with these settings: parameter {key} "
                        f"has state {sorted(entry)}, expected {sorted(expected)}"
                    )
                arrays = {name: _saved_array(entry[name], name, key, p, saved_bf16) for name in names}
                step = _saved_step(entry["step"], key) if self._STEP_IN_STATE else 1
                writes.append((bucket, i, step, arrays))
            new_groups.append(merged)
        # Everything checked: now write.
        for group, merged in zip(self.param_groups, new_groups):
            group.clear()
            group.update(merged)
        for bucket, i, step, arrays in writes:
            bucket.steps[i] = step
            if not arrays:  # no saved state: the parameter starts afresh
                for name in list(bucket.arrays):
                    bucket.write_segment(name, i, np.zeros(bucket.params[i].shape, bucket.dtype))
            for name, arr in arrays.items():
                bucket.write_segment(name, i, arr)

    def __repr__(self) -> str:
        lines = [f"{self._name} ("]
        for g, group in enumerate(self.param_groups):
            lines.append(f"Parameter Group {g}")
            for key in sorted(k for k in group if k != "params"):
                lines.append(f"    {key}: {group[key]}")
        lines.append(")")
        return "\n".join(lines)


def _saved_state_dtype(value: Any, g: int) -> bool:
    """Whether a loaded group's ``'state_dtype'`` says its arrays are bfloat16 bits."""
    try:
        return check_state_dtype("loaded state dict's", value)
    except ValueError:
        raise ValueError(
            f"loaded state dict's group {g} 'state_dtype' should be 'float32' or 'bfloat16', got {value!r}"
        ) from None


def _saved_array(value: Any, name: str, key: Any, param: Tensor, bf16_bits: bool = False) -> np.ndarray:
    """A loaded state array as NumPy in ``param``'s dtype (or, when ``bf16_bits``, as the
    bfloat16 bit patterns it holds), or the error naming the entry."""
    if isinstance(value, Tensor):
        value = value.numpy()
    elif hasattr(value, "detach"):  # a torch.Tensor
        value = value.detach().cpu()
        # NumPy has no bfloat16: widened to float32 (exact), rounded back to the same bits on writing.
        value = value.float().numpy() if str(value.dtype) == "torch.bfloat16" else value.numpy()
    arr = np.asarray(value)
    if bf16_bits:
        if arr.dtype != BFLOAT16_BITS:
            raise TypeError(
                f"loaded state dict's {name!r} of parameter {key} should hold bfloat16 bits (uint16), "
                f"got dtype {arr.dtype}"
            )
        if arr.shape != param.shape:
            raise ValueError(
                f"loaded state dict's {name!r} of parameter {key} has shape {arr.shape}, the parameter {param.shape}"
            )
        return arr.copy()
    if arr.dtype.kind not in "fiu":
        raise TypeError(
            f"loaded state dict's {name!r} of parameter {key} should be an array of numbers, got {value!r}"
        )
    if arr.shape != param.shape:
        raise ValueError(
            f"loaded state dict's {name!r} of parameter {key} has shape {arr.shape}, the parameter {param.shape}"
        )
    return arr.astype(param.dtype)


def _saved_step(value: Any, key: Any) -> int:
    """A loaded ``'step'`` (a number or a one-element tensor, as torch saves it) as a positive int."""
    what = f"loaded state dict's 'step' of parameter {key} should be a positive integer"
    if isinstance(value, (str, bytes, bool)) or value is None:
        raise TypeError(f"{what}, got {value!r}")
    try:
        step = float(value)  # a number, or a 0-d tensor as torch.optim saves it
    except (TypeError, ValueError):
        raise TypeError(f"{what}, got {value!r}") from None
    if not math.isfinite(step) or step != int(step) or step < 1:
        raise ValueError(f"{what}, got {step}")
    return int(step)
