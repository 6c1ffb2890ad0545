"""Your own fused op: ``taifuse.library``, shaped like ``torch.library``.

A custom op is its **reference implementation** (NumPy, float64-capable: the specification, as the
reference backend is for taifuse's own kernels), decorated with :func:`custom_op`; each backend
may add a kernel with :meth:`CustomOp.register_kernel`, and the op its gradient with
:meth:`CustomOp.register_autograd`. :func:`opcheck` runs every kernel against the reference,
forward and backward. docs/custom_ops.md walks through a fused SwiGLU.

Example::

    >>> import numpy as np, taifuse
    >>> from taifuse import library
    >>> @library.custom_op("doc::scaled_add")
    ... def scaled_add(a, b, alpha: float):
    ...     return a + alpha * b
    >>> @scaled_add.register_kernel("numba")
    ... def _(a, b, alpha, out):
    ...     np.multiply(b, alpha, out=out)
    ...     out += a
    >>> def backward(ctx, g):
    ...     return g, g * ctx.alpha, None
    >>> def setup_context(ctx, inputs, output):
    ...     ctx.alpha = inputs[2]
    >>> scaled_add.register_autograd(backward, setup_context=setup_context)
    >>> with taifuse.use_backend("numpy"):
    ...     a = taifuse.tensor([1.0, 2.0], requires_grad=True)
    ...     b = taifuse.tensor([3.0, 4.0], requires_grad=True)
    ...     scaled_add(a, b, 0.5).sum().backward()
    ...     b.grad.numpy()
    array([0.5, 0.5], dtype=float32)

How a call runs (NOTE [ Custom op calls ]): the arguments are bound to the reference's signature;
Tensors (or arrays of the active backend) are the op's tensor inputs, everything else is passed
as it is. The checks come first, before anything is allocated or written: the inputs live on one
backend, are float16/32/64 and of a dtype that backend supports, and the ``outputs`` function
(where an op checks its shapes) says each output's shape and dtype. Under ``autocast`` an op with
a policy casts its floating inputs as a built-in op of that policy would. Then the active
backend's kernel runs, called with the input arrays, the non-tensor arguments and one output
buffer per output taken from the pool (``kernel(*args, *outs)``, as taifuse's own kernels take
``out``); it writes every element of them and returns None. Where that backend has no kernel the
reference runs: on a host backend (numpy, numba) directly on the arrays, on a device backend
(taichi) through a copy each way, with a one-time warning. When an input requires grad the op is
one node of the graph; its backward calls the registered ``backward`` on Tensors, under
``no_grad``, so that it may call custom ops itself (a fused backward kernel).

A multi-output op's node runs ``backward`` once per output that receives a gradient (with zeros
for the others): the engine hands each node one gradient, and the sum over outputs is the same.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from taifuse import _profile_hook, backends, pool
from taifuse._costs import Cost
from taifuse._engine import Function, graph_node, is_grad_enabled, no_grad
from taifuse._internal import attach, common_backend, data, is_tensor, wrap
from taifuse._tensor_functions import autocast_args
from taifuse._tensor_math import math_for
from taifuse.tensor import tensor

__all__ = ["ArgInfo", "CustomOp", "OpCheckError", "OpCheckReport", "custom_op", "get_op", "opcheck"]

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*::[A-Za-z_][A-Za-z0-9_.]*$")
_AUTOCAST = {"fp16": "lower", "fp32": "float32", "promote": "widest"}
_FLOATS = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))
_DEVICE_BACKENDS = frozenset({"taichi"})

_registry: dict[str, CustomOp] = {}


def get_op(name: str) -> CustomOp:
    """The custom op registered as ``name`` (``"mylib::swiglu"``); ``KeyError`` naming it otherwise."""
    try:
        return _registry[name]
    except KeyError:
        raise KeyError(f"no custom op {name!r} is registered (known: {sorted(_registry)})") from None


@dataclasses.dataclass(frozen=True)
class ArgInfo:
    """What a ``cost=`` function is given for a tensor argument: its shape and dtype."""

    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


def custom_op(
    name: str,
    fn: Callable | None = None,
    *,
    outputs: int | Callable | None = None,
    cost: Callable | None = None,
    autocast: str | None = None,
) -> Any:
    """Decorator: make ``fn``, the op's reference implementation, a custom op called ``name``.

    Args:
        name: ``"namespace::op"``, unique in the process (``ValueError`` when taken).
        fn: the reference: NumPy arrays (and non-tensor arguments) in, one array or a tuple of
            arrays out; it must work in float64 (:func:`opcheck` differentiates it there).
        outputs: what the op returns, decided before anything runs: ``None`` for one output of the
            first tensor argument's shape and dtype, an int ``n`` for ``n`` such outputs, or a
            function of the op's arguments (arrays, with ``.shape`` and ``.dtype``) returning
            ``(shape, dtype)`` or a list of them. That function is where the op checks its
            shapes: raise ``ValueError`` naming the argument, nothing is written yet.
        cost: ``cost(*args, backward=False)`` giving ``(bytes_moved, bytes_written, flops)`` of
            one call, tensor arguments as :class:`ArgInfo`: the profiler's roofline column. Without
            it the op counts as elementwise (inputs read, outputs written).
        autocast: under ``taifuse.amp.autocast``: ``"fp16"`` casts floating inputs to the
            autocast dtype, ``"fp32"`` to float32, ``"promote"`` to the widest of them; ``None``
            leaves them as they are.
    """
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"custom_op: name should look like 'namespace::op_name', got {name!r}")
    if outputs is not None and not callable(outputs) and not (isinstance(outputs, int) and outputs >= 1):
        raise TypeError(f"custom_op: outputs should be None, a positive int or a function, got {outputs!r}")
    if cost is not None and not callable(cost):
        raise TypeError(f"custom_op: cost should be a function, got {type(cost).__name__}")
    if autocast is not None and autocast not in _AUTOCAST:
        raise ValueError(f"custom_op: autocast should be one of {tuple(_AUTOCAST)} or None, got {autocast!r}")

    def decorate(reference: Callable) -> CustomOp:
        if name in _registry:
            raise ValueError(f"custom_op: {name!r} is already registered (by {_registry[name].reference!r})")
        op = CustomOp(name, reference, outputs, cost, autocast)
        _registry[name] = op
        return op

    return decorate if fn is None else decorate(fn)


def _positional_capacity(fn: Callable) -> tuple[int, float]:
    """(required, most) positional parameters ``fn`` takes (most is inf with ``*args``)."""
    params = inspect.signature(fn).parameters.values()
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = sum(1 for p in positional if p.default is p.empty)
    most = float("inf") if any(p.kind == p.VAR_POSITIONAL for p in params) else len(positional)
    return required, most


class CustomOp:
    """A custom op: call it like a function (Tensors in, Tensors out; arrays in, arrays out)."""

    def __init__(
        self, name: str, reference: Callable, outputs: Any, cost: Callable | None, autocast: str | None
    ) -> None:
        if not callable(reference):
            raise TypeError(f"custom_op {name!r}: the reference should be a function, got {reference!r}")
        self.name = name
        self.reference = reference
        self.signature = inspect.signature(reference)
        for p in self.signature.parameters.values():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise TypeError(
                    f"custom_op {name!r}: the reference should name each argument, got *{p.name} in "
                    f"{self.signature}"
                )
        self.params = tuple(self.signature.parameters)
        self.outputs = outputs
        self.autocast = autocast
        self.kernels: dict[str, Callable] = {}
        self.backward_fn: Callable | None = None
        self.setup_context: Callable | None = None
        self.warned: set[str] = set()
        self.poison_outputs = False  # opcheck fills output buffers with NaN first
        # The graph node: a class per op, whose name the profiler's table shows.
        self.node_class = type(
            name, (_CustomNode,), {"op": self, "op_name": name, "op_cost": _profile_cost(cost, self.params)}
        )
        functools.update_wrapper(self, reference)

    def __repr__(self) -> str:
        return (
            f"<custom op {self.name} kernels={sorted(self.kernels)} autograd={self.backward_fn is not None}>"
        )

    # -- registration

    def register_kernel(self, backend_name: str) -> Callable[[Callable], Callable]:
        """Decorator: ``fn`` is this op's kernel on ``backend_name`` (``"numba"``, ``"taichi"`` or
        ``"numpy"``), called as ``fn(*args, *outs)``: the inputs as that backend's arrays (host
        arrays for numpy and numba, DeviceArrays for taichi), the non-tensor arguments as given,
        then one pooled output buffer per output, which it fills; it returns None."""
        if backend_name not in backends.BACKENDS:
            raise ValueError(
                f"{self.name}.register_kernel: backend should be one of {backends.BACKENDS}, got {backend_name!r}"
            )
        if backend_name in self.kernels:
            raise ValueError(f"{self.name}: a {backend_name} kernel is already registered")

        def decorate(fn: Callable) -> Callable:
            if not callable(fn):
                raise TypeError(
                    f"{self.name}.register_kernel({backend_name!r}): expected a function, got {fn!r}"
                )
            required, most = _positional_capacity(fn)
            n_out = self.outputs if isinstance(self.outputs, int) else 1 if self.outputs is None else None
            least = len(self.params) + (n_out or 1)
            fits = most >= least and (n_out is None or required <= least)
            if not fits:
                raise TypeError(
                    f"{self.name}.register_kernel({backend_name!r}): the kernel should take the op's "
                    f"arguments {self.params} and then {'one buffer per output' if n_out is None else n_out} "
                    f"output buffer(s), got {fn.__name__}{inspect.signature(fn)}"
                )
            self.kernels[backend_name] = fn
            return fn

        return decorate

    def register_autograd(self, backward: Callable, *, setup_context: Callable | None = None) -> None:
        """As ``torch.library.register_autograd``: ``setup_context(ctx, inputs, output)`` saves on
        ``ctx`` what ``backward(ctx, *grads)`` needs; ``backward`` returns one gradient per
        argument of the op (a Tensor, or None where there is none) and runs under ``no_grad``."""
        if self.backward_fn is not None:
            raise ValueError(f"{self.name}: an autograd formula is already registered")
        if not callable(backward):
            raise TypeError(f"{self.name}.register_autograd: backward should be a function, got {backward!r}")
        required, most = _positional_capacity(backward)
        if most < 2 or required > 1 + (self.outputs if isinstance(self.outputs, int) else 1):
            raise TypeError(
                f"{self.name}.register_autograd: backward should take (ctx, *grads), got "
                f"{getattr(backward, '__name__', 'backward')}{inspect.signature(backward)}"
            )
        if setup_context is not None:
            if not callable(setup_context):
                raise TypeError(f"{self.name}.register_autograd: setup_context should be a function or None")
            required, most = _positional_capacity(setup_context)
            if not required <= 3 <= most:
                raise TypeError(
                    f"{self.name}.register_autograd: setup_context should take (ctx, inputs, output), got "
                    f"{getattr(setup_context, '__name__', 'setup_context')}{inspect.signature(setup_context)}"
                )
        self.backward_fn, self.setup_context = backward, setup_context

    # -- calls: NOTE [ Custom op calls ] in the module docstring

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"{self.name}: {exc} (signature {self.signature})") from None
        bound.apply_defaults()
        values = tuple(bound.arguments.values())
        tensors = [v for v in values if is_tensor(v)]
        as_tensors = bool(tensors)
        if as_tensors:
            be = common_backend(tensors, self.name)
            for i, v in enumerate(values):
                if _is_array(v) and not is_tensor(v):
                    raise TypeError(
                        f"{self.name}: {self.params[i]} is an array and other arguments are Tensors; "
                        "pass Tensors (taifuse.tensor) or arrays throughout"
                    )
        else:
            be = backends.active()
            values = tuple(_host_array(v, be, self.name, p) for v, p in zip(values, self.params))
        for v, p in zip(values, self.params):
            if is_tensor(v) or _is_array(v):
                if v.dtype not in _FLOATS:
                    raise TypeError(f"{self.name}: {p} should be float16, float32 or float64, got {v.dtype}")
                be.check_dtype(v.dtype, f"{self.name}: {p}")
        if self.autocast is not None and as_tensors:
            values = autocast_args(_AUTOCAST[self.autocast], *values)
        arrays = tuple(data(v) if is_tensor(v) else v for v in values)
        specs = self.output_specs(arrays, be)
        if not as_tensors:
            outs = self.forward(be, arrays, specs)
            return outs[0] if len(outs) == 1 else outs
        return self._apply(be, values, arrays, specs)

    def output_specs(self, arrays: tuple, be: Any) -> tuple[tuple[tuple[int, ...], np.dtype], ...]:
        """Each output's (shape, dtype), from ``outputs`` (checked)."""
        if self.outputs is None or isinstance(self.outputs, int):
            first = next((a for a in arrays if _is_array(a)), None)
            if first is None:
                raise TypeError(
                    f"{self.name}: the op has no tensor argument; give custom_op an outputs= function"
                )
            return ((tuple(first.shape), first.dtype),) * (self.outputs or 1)
        specs = self.outputs(*arrays)
        if isinstance(specs, tuple) and len(specs) == 2 and not isinstance(specs[0], tuple | list):
            raise TypeError(
                f"{self.name}: outputs should return (shape, dtype) with a tuple shape, got {specs!r}"
            )
        if isinstance(specs, tuple) and len(specs) == 2 and _is_shape(specs[0]):
            specs = [specs]
        out = []
        for spec in specs:
            shape, dtype = spec
            if not _is_shape(shape):
                raise TypeError(f"{self.name}: outputs gave the shape {shape!r}, expected a tuple of ints")
            dtype = np.dtype(dtype)
            be.check_dtype(dtype, f"{self.name}: an output")
            out.append((tuple(int(s) for s in shape), dtype))
        if not out:
            raise ValueError(f"{self.name}: outputs gave no output")
        return tuple(out)

    def forward(self, be: Any, arrays: tuple, specs: tuple) -> tuple:
        """The outputs of the op on ``be``'s arrays: its kernel there, else the reference."""
        kernel = self.kernels.get(be.NAME)
        if kernel is not None:
            outs = tuple(pool.empty(be, shape, dtype) for shape, dtype in specs)
            if self.poison_outputs:
                for o in outs:
                    be.ALLOCATOR.fill(o, float("nan"))
            returned = kernel(*arrays, *outs)
            if returned is not None:
                raise TypeError(
                    f"{self.name}: the {be.NAME} kernel returned {type(returned).__name__}; a kernel writes "
                    "into the output buffers it is given and returns None"
                )
            return outs
        return self._run_reference(be, arrays, specs)

    def _run_reference(self, be: Any, arrays: tuple, specs: tuple) -> tuple:
        on_device = be.NAME in _DEVICE_BACKENDS
        if on_device and be.NAME not in self.warned:
            self.warned.add(be.NAME)
            warnings.warn(
                f"{self.name} has no {be.NAME} kernel: it runs its NumPy reference, through a copy of "
                f"its inputs to the host and of its outputs back (register_kernel({be.NAME!r}) adds one)",
                RuntimeWarning,
                stacklevel=4,
            )
        host = tuple(be.to_numpy(a) if _is_array(a) else a for a in arrays) if on_device else arrays
        result = self.reference(*host)
        results = tuple(result) if isinstance(result, tuple | list) else (result,)
        if len(results) != len(specs):
            raise RuntimeError(
                f"{self.name}: the reference returned {len(results)} output(s), outputs says {len(specs)}"
            )
        outs = []
        for i, (r, (shape, dtype)) in enumerate(zip(results, specs)):
            r = np.asarray(r)
            if r.shape != shape:
                raise RuntimeError(
                    f"{self.name}: the reference's output {i} has shape {r.shape}, outputs says {shape}"
                )
            if on_device:
                from taifuse.backends.taichi._runtime import from_numpy_pooled

                outs.append(from_numpy_pooled(r.astype(dtype, copy=False)))
            else:
                outs.append(r if r.dtype == dtype else r.astype(dtype))
        return tuple(outs)

    def _apply(self, be: Any, values: tuple, arrays: tuple, specs: tuple) -> Any:
        """The op on Tensors, recorded in the graph when an input requires grad (Function.apply's
        steps, for one or more outputs)."""
        record = is_grad_enabled() and any(is_tensor(v) and v.requires_grad for v in values)
        node = self.node_class()
        node.be, node.m = be, math_for(be)
        node.needs_grad = tuple(is_tensor(v) and v.requires_grad and record for v in values)
        node.specs = specs
        rec = _profile_hook.ACTIVE  # NOTE [ Profiler hooks ]
        outs = node.forward(*arrays) if rec is None else rec.forward(node, arrays, {})
        tensors = tuple(wrap(o, be) for o in outs)
        if record:
            node.parents = tuple(graph_node(v) for v in values)
            ctx = _Context(node.needs_grad)
            if self.setup_context is not None:
                inputs = tuple(wrap(data(v), be) if is_tensor(v) else v for v in values)  # detached
                outputs = tuple(wrap(o, be) for o in outs)
                self.setup_context(ctx, inputs, outputs[0] if len(outputs) == 1 else outputs)
            node.ctx = ctx
            for i, t in enumerate(tensors):
                n = node if i == 0 else node.sibling(i)
                attach(t, n)
        return tensors[0] if len(tensors) == 1 else tensors

    def run_backward(self, node: _CustomNode, grad: Any) -> tuple:
        """The gradients of the op's arguments from one output's gradient (the node's)."""
        if self.backward_fn is None:
            raise RuntimeError(
                f"{self.name} has no autograd formula: a gradient flows through it, and it was "
                f"registered without one; add it with {self.name.split('::')[-1]}.register_autograd(backward, "
                "setup_context=...)"
            )
        be, m = node.be, node.m
        grads = [
            wrap(grad, be) if i == node.index else wrap(m.full(shape, 0.0, dtype), be)
            for i, (shape, dtype) in enumerate(node.specs)
        ]
        with no_grad():
            result = self.backward_fn(node.ctx, *grads)
        if not isinstance(result, tuple | list):
            result = (result,)
        if len(result) != len(self.params):
            raise RuntimeError(
                f"{self.name}: backward returned {len(result)} gradient(s), the op has {len(self.params)} "
                f"argument(s) {self.params} (None for a non-tensor one)"
            )
        out = []
        for p, g, needed, shape, dtype in zip(
            self.params, result, node.needs_grad, node.in_shapes, node.in_dtypes
        ):
            if not needed or g is None:
                out.append(None)
                continue
            if is_tensor(g) and g.dtype != dtype:
                with no_grad():
                    g = g.to(dtype)  # as PyTorch's engine casts a gradient to its input's dtype
            arr = data(g) if is_tensor(g) else g
            if not _is_array(arr) or tuple(arr.shape) != shape or arr.dtype != dtype:
                raise RuntimeError(
                    f"{self.name}: backward returned {_describe(arr)} as the gradient of {p}, expected a "
                    f"Tensor of shape {shape}"
                )
            out.append(arr)
        # A leaf may take a fresh gradient as it is instead of copying it (Function.owns_grads):
        # so when no two are one array and none is the incoming gradient or saved state.
        node.owns_grads = _fresh(out, grad, node.ctx)
        return tuple(out)


class _CustomNode(Function):
    """A custom op's graph node (a subclass per op, named after it: CustomOp.node_class)."""

    op: CustomOp
    op_name: str
    op_cost: Any = None
    index = 0  # which output's gradient this node receives

    def forward(self, *arrays: Any) -> tuple:
        self.in_shapes = tuple(tuple(a.shape) if _is_array(a) else None for a in arrays)
        self.in_dtypes = tuple(a.dtype if _is_array(a) else None for a in arrays)
        return self.op.forward(self.be, arrays, self.specs)

    def sibling(self, index: int) -> _CustomNode:
        """The node of output ``index``: the same inputs and saved context."""
        twin = type(self)()
        twin.__dict__.update(self.__dict__)
        twin.index = index
        return twin

    def backward(self, grad: Any) -> tuple:
        return self.op.run_backward(self, grad)


class _Context:
    """The ``ctx`` of ``setup_context`` and ``backward``, as PyTorch's: ``save_for_backward``,
    ``saved_tensors``, ``needs_input_grad`` and any attribute the op sets."""

    def __init__(self, needs_grad: tuple[bool, ...]) -> None:
        self.needs_input_grad = needs_grad
        self.saved_tensors: tuple = ()

    def save_for_backward(self, *tensors: Any) -> None:
        self.saved_tensors = tensors


def _profile_cost(cost: Callable | None, params: tuple[str, ...]) -> Callable | None:
    """The profiler's cost function of a node class (``(shapes, dtypes, scalars), backward``
    -> Cost) from the user's ``cost(*args, backward=...)``."""
    if cost is None:
        return None

    def op_cost(split: tuple, is_backward: bool) -> Cost:
        shapes, dtypes, scalars = split
        args = [ArgInfo(s, np.dtype(d)) if s is not None else v for s, d, v in zip(shapes, dtypes, scalars)]
        moved, written, flops = cost(*args, backward=is_backward)
        return Cost(int(moved), int(written), int(flops))

    return op_cost


def _root(a: Any) -> int:
    """The identity of the memory ``a`` views: a DeviceArray's buffer, a NumPy view's base."""
    if not isinstance(a, np.ndarray):
        storage = getattr(a, "storage", None)
        return id(a if storage is None else storage)
    while isinstance(a.base, np.ndarray):
        a = a.base
    return id(a)


def _fresh(grads: list, incoming: Any, ctx: Any) -> bool:
    """Whether the gradients ``grads`` are distinct arrays, none the incoming gradient or an
    array the context holds."""
    taken = {_root(incoming)}
    for value in vars(ctx).values():
        for t in value if isinstance(value, tuple | list) else (value,):
            if is_tensor(t):
                taken.add(_root(data(t)))
    for g in grads:
        if g is None:
            continue
        root = _root(g)
        if root in taken:
            return False
        taken.add(root)
    return True


def _is_array(v: Any) -> bool:
    return hasattr(v, "shape") and hasattr(v, "dtype") and not isinstance(v, np.generic) and not is_tensor(v)


def _is_shape(v: Any) -> bool:
    return isinstance(v, tuple | list) and all(isinstance(s, int | np.integer) and s >= 0 for s in v)


def _host_array(v: Any, be: Any, op: str, param: str) -> Any:
    """An array argument of an array call, checked to be an array of ``be``."""
    if _is_array(v) and not be.is_array(v):
        raise TypeError(f"{op}: {param} is a {type(v).__name__}, not an array of the {be.NAME} backend")
    return v


def _describe(v: Any) -> str:
    return f"an array of shape {tuple(v.shape)} ({v.dtype})" if _is_array(v) else repr(type(v).__name__)


# ----------------------------------------------------------------------------- opcheck

# The per-dtype tolerances of taifuse's own tests (tests/helpers.py, NOTE [ Tolerance table ]):
# |got - ref| <= floor + atol * scale + rtol * |ref|, scale the largest |ref| of the output.
TOLERANCES: dict[np.dtype, tuple[float, float, float]] = {
    np.dtype(np.float16): (1e-3, 2e-6, float(np.finfo(np.float16).smallest_subnormal)),
    np.dtype(np.float32): (4e-6, 1e-6, 1e-37),
    np.dtype(np.float64): (1e-12, 1e-13, float(np.finfo(np.float64).tiny)),
}
# Central differences in float64 (step 1e-6) are good to about 1e-8 of the scale.
_FD_TOL = (1e-6, 1e-7, 0.0)


class OpCheckError(AssertionError):
    """:func:`opcheck` found a kernel that disagrees with the reference (its report says which)."""

    def __init__(self, report: OpCheckReport) -> None:
        super().__init__(str(report))
        self.report = report


@dataclasses.dataclass
class OpCheckReport:
    """What :func:`opcheck` found: one row per (backend, check), each passed or not, with why."""

    op: str
    rows: list[tuple[str, str, bool, str]] = dataclasses.field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(ok for _, _, ok, _ in self.rows)

    def add(self, backend_name: str, check: str, ok: bool, detail: str = "") -> None:
        self.rows.append((backend_name, check, ok, detail))

    def __str__(self) -> str:
        lines = [f"opcheck {self.op}: {'passed' if self.passed else 'FAILED'}"]
        for be, check, ok, detail in self.rows:
            lines.append(f"  {be:<14} {check:<28} {'ok' if ok else 'FAIL'}  {detail}")
        return "\n".join(lines)


def opcheck(
    op: CustomOp,
    args: Sequence[Any],
    kwargs: dict[str, Any] | None = None,
    *,
    backends_to_check: Sequence[str] | None = None,
    raise_on_failure: bool = True,
    seed: int = 0,
) -> OpCheckReport:
    """Check ``op`` on sample arguments ``args`` (NumPy arrays and non-tensor values), as
    ``torch.library.opcheck``:

    * its backward against float64 central differences of its reference (on the numpy backend);
    * on each backend (``backends_to_check``: names such as ``"numba"`` or ``"taichi-vulkan"``;
      default the active backend, numpy and every backend with a kernel), the op's forward and
      backward against the float64 reference, within the per-dtype tolerances of taifuse's
      tests, at the samples' dtype (float32 where the backend has no float64);
    * that no input is written (forward or backward), and that a kernel fills every element of
      the pooled output buffers it is handed (they start as NaN here).

    Keep the samples small (tens to hundreds of elements): the finite differences call the
    reference twice per input element. Returns the :class:`OpCheckReport`; raises :class:`OpCheckError` with it when a check failed
    (unless ``raise_on_failure=False``).
    """
    if not isinstance(op, CustomOp):
        raise TypeError(f"opcheck: op should be a custom op (taifuse.library.custom_op), got {op!r}")
    kwargs = dict(kwargs or {})
    bound = op.signature.bind(*args, **kwargs)
    bound.apply_defaults()
    samples = tuple(_sample(v) for v in bound.arguments.values())
    report = OpCheckReport(op.name)
    rng = np.random.default_rng(seed)

    f64 = tuple(v.astype(np.float64) if isinstance(v, np.ndarray) else v for v in samples)
    ref_out = _as_tuple(op.reference(*f64))
    ref_out = tuple(np.asarray(r, dtype=np.float64) for r in ref_out)
    grads_out = tuple(rng.standard_normal(r.shape) for r in ref_out)
    has_backward = op.backward_fn is not None
    ref_grads = None
    with backends.use_backend("numpy"):
        if has_backward:
            ref_grads = _run(op, f64, grads_out)[1]
            fd = _finite_differences(op, f64, grads_out)
            _compare(report, "numpy", "backward vs finite diff.", ref_grads, fd, _FD_TOL, op.params)
        else:
            report.add("numpy", "backward", True, "no autograd formula registered: not checked")

    names = list(backends_to_check) if backends_to_check is not None else _default_backends(op)
    for label in names:
        name, _, arch = label.partition("-")
        active = backends.active()
        same = active.NAME == name and (not arch or _taichi_arch() == arch)
        with _on_backend(name, arch or None, same):
            be = backends.active()
            where = label if not (name == "taichi" and not arch) else f"taichi-{_taichi_arch()}"
            supports64 = name != "taichi"
            dtypes = {v.dtype for v in samples if isinstance(v, np.ndarray)}
            dtype = max(dtypes, key=lambda d: d.itemsize) if dtypes else np.dtype(np.float32)
            if dtype == np.float64 and not supports64:
                dtype = np.dtype(np.float32)
            kernel = "kernel" if be.NAME in op.kernels else "reference"
            typed = tuple(v.astype(dtype) if isinstance(v, np.ndarray) else v for v in samples)
            try:
                op.poison_outputs = True
                out, grads, untouched = _run(op, typed, grads_out)
            except Exception as exc:  # noqa: BLE001  a kernel that fails is a failed check, reported
                report.add(where, f"{kernel} ({dtype})", False, f"{type(exc).__name__}: {exc}")
                continue
            finally:
                op.poison_outputs = False
            tol = TOLERANCES[dtype]
            _compare(report, where, f"forward {kernel} ({dtype})", out, ref_out, tol, None)
            if has_backward:
                _compare(report, where, f"backward ({dtype})", grads, ref_grads, tol, op.params)
            report.add(where, "inputs not written", untouched, "" if untouched else "an input changed")
    if raise_on_failure and not report.passed:
        raise OpCheckError(report)
    return report


def _default_backends(op: CustomOp) -> list[str]:
    names = ["numpy", backends.active().NAME, *op.kernels]
    return [n for n in dict.fromkeys(names) if n in backends.available_backends()]


def _taichi_arch() -> str | None:
    ti = sys.modules.get("taichi")
    if ti is None:
        return None
    arch = ti.lang.impl.current_cfg().arch
    return "cpu" if arch in (ti.x64, ti.arm64) else arch.name


class _on_backend:
    """``use_backend(name, arch)``, or nothing when that backend is already the active one (so
    that checking Taichi keeps the arch it runs on)."""

    def __init__(self, name: str, arch: str | None, same: bool) -> None:
        self.block = None if same else backends.use_backend(name, arch=arch)

    def __enter__(self) -> None:
        if self.block is not None:
            self.block.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self.block is not None:
            self.block.__exit__(*exc)


def _sample(v: Any) -> Any:
    if is_tensor(v):
        return v.numpy()
    if isinstance(v, np.ndarray):
        if v.dtype not in _FLOATS:
            raise TypeError(f"opcheck: sample arrays should be float16, float32 or float64, got {v.dtype}")
        return v
    return v


def _as_tuple(r: Any) -> tuple:
    return tuple(r) if isinstance(r, tuple | list) else (r,)


def _run(op: CustomOp, samples: tuple, grads_out: tuple) -> tuple:
    """Forward and backward of ``op`` on the active backend: (outputs, input gradients, whether
    the inputs were left as they were), all as NumPy arrays."""
    tensors = tuple(
        tensor(v, requires_grad=op.backward_fn is not None) if isinstance(v, np.ndarray) else v
        for v in samples
    )
    before = tuple(v.numpy().copy() if is_tensor(v) else None for v in tensors)
    outs = _as_tuple(op(*tensors))
    got = tuple(o.numpy().astype(np.float64) for o in outs)
    grads: tuple = ()
    if op.backward_fn is not None:
        loss = None
        for o, g in zip(outs, grads_out):
            term = (o * tensor(g.astype(o.dtype))).sum()
            loss = term if loss is None else loss + term
        loss.backward()
        grads = tuple(
            v.grad.numpy().astype(np.float64) if is_tensor(v) and v.grad is not None else None
            for v in tensors
        )
    untouched = all(
        b is None or np.array_equal(b, t.numpy(), equal_nan=True) for b, t in zip(before, tensors)
    )
    return got, grads, untouched


def _finite_differences(op: CustomOp, f64: tuple, grads_out: tuple, step: float = 1e-6) -> tuple:
    """d/d(input) of sum_i <reference(inputs)_i, grads_out_i>, by central differences in float64."""

    def objective(values: tuple) -> float:
        return sum(
            float(np.sum(np.asarray(o) * g)) for o, g in zip(_as_tuple(op.reference(*values)), grads_out)
        )

    result = []
    for i, v in enumerate(f64):
        if not isinstance(v, np.ndarray):
            result.append(None)
            continue
        grad = np.empty_like(v)
        for j in range(v.size):
            shifted = [list(f64), list(f64)]
            for k, sign in enumerate((1.0, -1.0)):
                w = v.copy()
                w.flat[j] += sign * step
                shifted[k][i] = w
            grad.flat[j] = (objective(tuple(shifted[0])) - objective(tuple(shifted[1]))) / (2 * step)
        result.append(grad)
    return tuple(result)


def _compare(
    report: OpCheckReport,
    where: str,
    check: str,
    got: tuple,
    ref: tuple,
    tol: tuple[float, float, float],
    names: tuple[str, ...] | None,
) -> None:
    rtol, atol, floor = tol
    worst, detail = 0.0, ""
    for i, (g, r) in enumerate(zip(got, ref)):
        if g is None or r is None:
            continue
        what = f"output {i}" if names is None else f"grad of {names[i]}"
        if g.shape != r.shape:
            report.add(where, check, False, f"{what}: shape {g.shape}, reference {r.shape}")
            return
        if r.size == 0:
            continue
        scale = float(np.max(np.abs(r)))
        bound = floor + atol * scale + rtol * np.abs(r)
        err = np.abs(g - r)
        ratio = float(np.max(np.where(np.isnan(err), np.inf, err / bound)))
        if ratio > worst:
            worst, detail = (
                ratio,
                f"{what}: max err {float(np.nanmax(err)) if not np.isnan(err).all() else np.nan:.3g}",
            )
    ok = worst <= 1.0
    report.add(where, check, ok, f"worst err/bound {worst:.3g}" + ("" if ok else f" ({detail})"))
