"""A small reverse-mode autograd ``Tensor`` on the active backend's arrays.

A :class:`Tensor` holds one array of the backend that was active when it was created
(``numpy.ndarray`` on the ``numpy`` and ``numba`` backends) and, when it came out of a
differentiable op, the :class:`Function` node that made it. ``loss.backward()`` walks those nodes
in reverse topological order (iteratively: a deep MLP is a long chain) and each node's backward
calls its backend's hand-written backward kernel; gradients accumulate into the ``.grad`` of leaf
tensors that ``requires_grad``.

Arithmetic (``+ - * / @``, ``sum``, ``mean``, ``exp``, ``max``, ...) and the views (indexing,
``reshape``, ``permute``, ``expand``, :func:`cat`, ...; NOTE [ Views copy ]) go through
``taifuse._tensor_math`` (NOTE [ Tensor storage ] there); the neural-network ops are
``taifuse.functional``'s, which return differentiable Tensors when given Tensors.

Example::

    >>> import taifuse
    >>> taifuse.set_backend("numpy")
    >>> x = taifuse.tensor([1.0, 2.0, 3.0], requires_grad=True)
    >>> y = (x * x).sum()
    >>> y.backward()
    >>> x.grad.numpy()
    array([2., 4., 6.], dtype=float32)
"""

from __future__ import annotations

import functools
import math
import numbers
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from taifuse import _autocast_state, _profile_hook, backends
from taifuse._tensor_math import astype, math_for, sum_to_shape

if TYPE_CHECKING:  # annotations only: typing.Self is Python 3.11+
    from typing_extensions import Self

__all__ = [
    "Function",
    "GradSlot",
    "MaxResult",
    "Tensor",
    "cat",
    "enable_grad",
    "is_grad_enabled",
    "no_grad",
    "stack",
    "tensor",
]

# ----------------------------------------------------------------------------- grad mode

_grad_mode = threading.local()


def is_grad_enabled() -> bool:
    """Whether ops record the graph in this thread (False inside :class:`no_grad`)."""
    return getattr(_grad_mode, "enabled", True)


def _set_grad_enabled(enabled: bool) -> None:
    _grad_mode.enabled = enabled


class _GradModeGuard:
    _enabled: bool

    def __enter__(self) -> None:
        # A stack, not one saved flag, so that one instance can be entered re-entrantly.
        self.__dict__.setdefault("_saved", []).append(is_grad_enabled())
        _set_grad_enabled(self._enabled)

    def __exit__(self, *exc: object) -> None:
        _set_grad_enabled(self._saved.pop())

    def __call__(self, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with type(self)():
                return fn(*args, **kwargs)

        return wrapper


class no_grad(_GradModeGuard):
    """Context manager and decorator: ops inside record no graph (per thread), as ``torch.no_grad``.

    Example::

        >>> import taifuse
        >>> taifuse.set_backend("numpy")
        >>> w = taifuse.tensor([1.0], requires_grad=True)
        >>> with taifuse.no_grad():
        ...     y = w * 2
        >>> y.requires_grad
        False
    """

    _enabled = False


class enable_grad(_GradModeGuard):
    """Context manager and decorator that turns graph recording back on inside :class:`no_grad`."""

    _enabled = True


# ----------------------------------------------------------------------------- graph nodes


class Function:
    """One differentiable op: ``forward`` on arrays, ``backward`` from the output's gradient.

    Subclasses implement ``forward(*args)`` (Tensor arguments arrive as their arrays, everything
    else unchanged; returns the output array) and ``backward(grad)`` (returns one gradient per
    positional argument, ``None`` where there is none or ``self.needs_grad[i]`` is False). They keep
    what the backward needs on ``self``; :meth:`release` drops the saved data after a backward pass
    (NOTE [ Released nodes ]).
    """

    be: ModuleType  # the backend the forward ran on; the backward runs there too
    m: Any  # its tensor math (taifuse._tensor_math)
    needs_grad: tuple[bool, ...]
    # True when backward returns freshly allocated arrays, none of them shared with another
    # input, an output or saved state: a leaf's first gradient then takes the array, not a copy.
    owns_grads: bool = False
    # True when backward can add its one input's gradient into a buffer the engine hands it in
    # ``accumulate_into`` (NOTE [ Gradients summed in place ]).
    accumulates: bool = False
    accumulate_into: Any = None

    def __init__(self) -> None:
        # Per argument: a leaf Tensor that requires grad, the creator of a non-leaf one, or None
        # (NOTE [ The graph keeps no data ]).
        self.parents: tuple[Tensor | Function | None, ...] = ()
        self.released = False

    @classmethod
    def apply(cls, *args: Any, **kwargs: Any) -> Tensor:
        """Run the op on ``args`` and, if a Tensor argument requires grad, record it in the graph."""
        tensors = [a for a in args if isinstance(a, Tensor)]
        be = _common_backend(tensors, cls.__name__)
        ctx = cls()
        ctx.be, ctx.m = be, math_for(be)
        record = is_grad_enabled() and any(t.requires_grad for t in tensors)
        ctx.needs_grad = tuple(isinstance(a, Tensor) and a.requires_grad and record for a in args)
        arrays = tuple(a._data if isinstance(a, Tensor) else a for a in args)
        rec = _profile_hook.ACTIVE  # NOTE [ Profiler hooks ]
        data = ctx.forward(*arrays, **kwargs) if rec is None else rec.forward(ctx, arrays, kwargs)
        out = Tensor._wrap(data, be)
        if record:
            ctx.parents = tuple(_graph_node(a) for a in args)
            out._ctx = ctx
            out._requires_grad = True
        return out

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def backward(self, grad: Any) -> tuple[Any, ...]:
        raise NotImplementedError

    def release(self) -> None:
        """Drop the data the forward saved (after this node's backward ran without
        ``retain_graph``), so that the intermediates are freed while the output lives on; keep
        the shapes, dims and dtypes, and the links to the inputs (NOTE [ Released nodes ])."""
        state = self.__dict__
        freed = {k for k, v in state.items() if k not in _KEPT_ON_RELEASE and not _is_metadata(v)}
        for k in freed:
            del state[k]
        state["_freed"] = frozenset(freed | state.get("_freed", frozenset()))
        # A checkpoint's parents are its argument Tensors: keep their nodes, not their arrays.
        self.parents = tuple(_graph_node(p) if isinstance(p, Tensor) else p for p in self.parents)
        self.released = True

    def __getattr__(self, name: str) -> Any:
        # Only called for a name the instance lacks: one that release() dropped is needed again.
        if name in self.__dict__.get("_freed", ()):
            raise RuntimeError(_SECOND_BACKWARD)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __repr__(self) -> str:
        return f"<{type(self).__name__}>"


# NOTE [ Released nodes ]
# As PyTorch frees a node's saved tensors once its backward ran (unless ``retain_graph``), and
# nothing else: the node, its edges and what it keeps besides tensors (sizes, dims, dtypes) live on
# as long as an output refers to them. A node that saved no data (an addition, a reshape, a sum, a
# cast: autocast's cached weight casts among them) can therefore run again, so that a second loss
# sharing part of the graph (``l1 = y.sum(); l2 = (2 * y).sum()``) or gradient accumulation under
# one autocast region backpropagates as in PyTorch; a node whose backward reads freed data raises
# PyTorch's "second time" error when, and only when, it is reached again. What counts as kept is
# decided by value (_is_metadata), not per subclass: ints, strings, dtypes, flags and tuples of
# them; arrays, Tensors, floats (a scalar operand: PyTorch saves it as a tensor too) and callables
# go.
_KEPT_ON_RELEASE = frozenset({"be", "m", "needs_grad", "parents", "released", "_freed", "_profile_signature"})


def _is_metadata(value: Any) -> bool:
    """Whether a node keeps ``value`` after its backward ran (NOTE [ Released nodes ])."""
    if value is None or isinstance(value, (numbers.Integral, str, np.dtype, type, ModuleType)):
        return True
    if isinstance(value, (tuple, list)):
        return all(_is_metadata(v) for v in value)
    return False


def _common_backend(tensors: Sequence[Tensor], op: str) -> ModuleType:
    """The backend the Tensor arguments share (the active one when there are none)."""
    if not tensors:
        return backends.active()
    be = tensors[0]._be
    for t in tensors[1:]:
        if t._be is not be:
            raise TypeError(
                f"{op}: tensors live on different backends ({be.NAME!r} and {t._be.NAME!r}); "
                "create them under the same backend"
            )
    return be


# ----------------------------------------------------------------------------- Tensor

_DEFAULT_FLOAT = np.dtype(np.float32)


def _is_scalar(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


class Tensor:
    """An array of the active backend with reverse-mode autograd.

    Create one with :func:`tensor`. Attributes follow PyTorch: ``shape``, ``dtype``, ``ndim``,
    ``requires_grad``, ``grad`` (a Tensor, accumulated by :meth:`backward`), ``is_leaf``,
    ``grad_fn``.

    dtypes follow PyTorch's type promotion (NOTE [ Mixed dtypes ]): ``a * b`` of float32 and
    float16 is float32, of float32 and float64 (a Tensor or a NumPy array) float64, each input's
    gradient in its own dtype; Python numbers take the Tensor's dtype, and a 0-d Tensor does not
    widen a dimensioned one. Nothing is narrowed silently: on the ``taichi`` backend, which has no
    float64, a float64 operand raises ``TypeError``. In-place ops keep the tensor's dtype and
    ``backward(gradient)`` casts ``gradient`` to the output's dtype, as PyTorch does.
    """

    # NumPy defers to Tensor's reflected operators (np_array + tensor -> Tensor.__radd__).
    __array_ufunc__ = None
    # Where autograd may put this leaf's first gradient (set_grad_slot; NOTE [ Gradient slots ]).
    _grad_slot: GradSlot | None = None

    def __init__(self, data: Any, requires_grad: bool = False, dtype: Any = None) -> None:
        be = backends.active()
        m = math_for(be)
        if isinstance(data, Tensor):
            data = data.numpy()  # a copy below, outside the graph
        if be.is_array(data) and not isinstance(data, np.ndarray):
            arr = m.copy(data) if dtype is None else be.from_numpy(_host_array(be.to_numpy(data), dtype))
        else:
            arr = be.from_numpy(_host_array(data, dtype))
        self._data = arr
        self._be = be
        self._ctx: Function | None = None
        self._requires_grad = False
        self._grad: Tensor | None = None
        if arr.dtype.kind == "f":
            be.check_dtype(arr.dtype, "tensor: dtype")
        self.requires_grad = requires_grad

    @classmethod
    def _wrap(cls, data: Any, be: ModuleType) -> Tensor:
        t = cls.__new__(cls)
        t._data, t._be, t._ctx, t._requires_grad, t._grad = data, be, None, False, None
        return t

    # -- properties

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._data.shape)

    @property
    def dtype(self) -> np.dtype:
        return self._data.dtype

    @property
    def ndim(self) -> int:
        return len(self._data.shape)

    @property
    def size(self) -> int:
        return math.prod(self._data.shape)

    @property
    def backend(self) -> str:
        """Name of the backend this tensor's array lives on."""
        return self._be.NAME

    @property
    def requires_grad(self) -> bool:
        return self._requires_grad

    @requires_grad.setter
    def requires_grad(self, value: bool) -> None:
        if self._ctx is not None and not value:
            raise RuntimeError("requires_grad can only be turned off on a leaf tensor; use .detach()")
        if value and self.dtype.kind != "f":
            raise TypeError(f"only floating-point tensors can require gradients, got dtype {self.dtype}")
        self._requires_grad = bool(value)

    @property
    def grad(self) -> Tensor | None:
        """The gradient :meth:`backward` accumulated into this tensor (None before the first one).

        Assigning it takes a Tensor of this tensor's shape, dtype and backend, or None (as in
        PyTorch); anything else raises ``TypeError`` (``ValueError`` for a wrong shape) at once.
        """
        return self._grad

    @grad.setter
    def grad(self, value: Tensor | None) -> None:
        if value is not None:
            if not isinstance(value, Tensor):
                raise TypeError(
                    "assigned grad expected to be a Tensor or None but got grad of type "
                    f"{type(value).__module__}.{type(value).__qualname__}"
                )
            if value._be is not self._be:
                raise TypeError(
                    f"cannot assign a gradient on backend {value._be.NAME!r} to a tensor on backend {self._be.NAME!r}"
                )
            if value.shape != self.shape:
                raise ValueError(
                    f"cannot assign a gradient of shape {value.shape} to a tensor of shape {self.shape}"
                )
            if value.dtype != self.dtype:
                raise TypeError(
                    f"cannot assign a gradient of dtype {value.dtype} to a tensor of dtype {self.dtype}"
                )
        self._grad = value

    @property
    def is_leaf(self) -> bool:
        return self._ctx is None

    @property
    def grad_fn(self) -> Function | None:
        return self._ctx

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    def __repr__(self) -> str:
        body = np.array2string(self.numpy(), separator=", ", prefix="tensor(")
        extra = f", dtype={self.dtype}" if self.dtype != _DEFAULT_FLOAT else ""
        if self._ctx is not None:
            extra += f", grad_fn={self._ctx!r}"
        elif self.requires_grad:
            extra += ", requires_grad=True"
        return f"tensor({body}{extra})"

    # -- conversion

    def numpy(self) -> np.ndarray:
        """The data as a NumPy array (on the host backends, the tensor's own array, not a copy)."""
        return self._be.to_numpy(self._data)

    def item(self) -> float | int:
        """The value of a one-element tensor as a Python number."""
        if self.size != 1:
            raise ValueError(f"item() needs a tensor with one element, got shape {self.shape}")
        return math_for(self._be).item(self._data)

    def detach(self) -> Tensor:
        """A tensor sharing this one's data, outside the graph (``requires_grad=False``)."""
        return Tensor._wrap(self._data, self._be)

    def to(self, dtype: Any) -> Tensor:
        """This tensor in ``dtype``, as ``torch.Tensor.to(dtype)``: ``self`` when the dtype already
        matches, else a copy that autograd differentiates (its gradient goes back cast to this
        tensor's dtype: the same cast node autocast inserts, NOTE [ Autocast ]).

        Args:
            dtype: float16, float32 or float64 as a NumPy dtype, a NumPy type or a string
                (``np.float16``, ``"float32"``), or a Tensor whose dtype to take. float64 only on the
                backends that store it (``numpy``, ``numba``); the ``taichi`` backend raises
                ``TypeError`` (Metal has no float64). Anything else raises ``TypeError`` naming
                ``dtype``. The source may be an integer tensor (class indices); the target is a
                floating dtype.

        Example::

            >>> import numpy as np, taifuse
            >>> taifuse.set_backend("numpy")
            >>> x = taifuse.tensor([1.0, 2.0], requires_grad=True)
            >>> y = x.to("float16")
            >>> y.dtype
            dtype('float16')
            >>> x.to(np.float32) is x
            True
            >>> (y * 3).sum().backward()
            >>> x.grad.numpy()
            array([3., 3.], dtype=float32)
        """
        target = _cast_dtype(dtype, self._be)
        if target == self.dtype:
            return self
        return _Cast.apply(self, target)

    def half(self) -> Tensor:
        """``self.to(np.float16)`` (:meth:`to`), as ``torch.Tensor.half``.

        Example::

            >>> import taifuse
            >>> taifuse.set_backend("numpy")
            >>> taifuse.tensor([1.0, 0.1]).half().numpy()
            array([1. , 0.1], dtype=float16)
        """
        return self.to(np.float16)

    def float(self) -> Tensor:
        """``self.to(np.float32)`` (:meth:`to`), as ``torch.Tensor.float``.

        Example::

            >>> import numpy as np, taifuse
            >>> taifuse.set_backend("numpy")
            >>> taifuse.tensor(np.array([0.1], np.float16)).float().numpy()
            array([0.09997559], dtype=float32)
        """
        return self.to(np.float32)

    def double(self) -> Tensor:
        """``self.to(np.float64)`` (:meth:`to`), as ``torch.Tensor.double``; on ``numpy`` and
        ``numba`` only (the ``taichi`` backend raises ``TypeError``: Metal has no float64).

        Example::

            >>> import taifuse
            >>> taifuse.set_backend("numpy")
            >>> taifuse.tensor([0.5]).double().dtype
            dtype('float64')
        """
        return self.to(np.float64)

    # -- autograd

    def backward(self, grad: Any = None, retain_graph: bool = False) -> None:
        """Accumulate d(self)/d(leaf) * grad into the ``.grad`` of every leaf that requires grad.

        Args:
            grad: the gradient of the final objective with respect to this tensor (its shape);
                optional for a one-element tensor (then 1).
            retain_graph: keep the saved intermediates so that the graph can be differentiated
                again; otherwise a second backward through it raises ``RuntimeError``.
        """
        if not self.requires_grad:
            raise RuntimeError("backward: this tensor does not require grad and has no grad_fn")
        m = math_for(self._be)
        if grad is None:
            if self.size != 1:
                raise RuntimeError(
                    f"backward: grad can be implicitly created only for one-element outputs, got shape {self.shape}"
                )
            g = m.full(self.shape, 1.0, self.dtype)
        else:
            g = _as_array_like(grad, self, "backward: grad")
            if tuple(g.shape) != self.shape:
                raise ValueError(
                    f"backward: grad has shape {tuple(g.shape)} but the tensor has shape {self.shape}"
                )
        _run_backward(self, g, retain_graph)

    # -- arithmetic

    def _binary(self, fn: type[Function], other: Any, reflected: bool = False) -> Tensor:
        op = fn.__name__.lstrip("_").lower()
        a, b = (other, self) if reflected else (self, other)
        return fn.apply(*_promoted(a, b, self, op))

    def __add__(self, other: Any) -> Tensor:
        return self._binary(_Add, other)

    def __radd__(self, other: Any) -> Tensor:
        return self._binary(_Add, other, reflected=True)

    def __sub__(self, other: Any) -> Tensor:
        return self._binary(_Sub, other)

    def __rsub__(self, other: Any) -> Tensor:
        return self._binary(_Sub, other, reflected=True)

    def __mul__(self, other: Any) -> Tensor:
        return self._binary(_Mul, other)

    def __rmul__(self, other: Any) -> Tensor:
        return self._binary(_Mul, other, reflected=True)

    def __truediv__(self, other: Any) -> Tensor:
        return self._binary(_Div, other)

    def __rtruediv__(self, other: Any) -> Tensor:
        return self._binary(_Div, other, reflected=True)

    def __matmul__(self, other: Any) -> Tensor:
        return self._matmul(self, other)

    def __rmatmul__(self, other: Any) -> Tensor:
        return self._matmul(other, self)

    def _matmul(self, a: Any, b: Any) -> Tensor:
        # Autocast first (NOTE [ Autocast ]), so that a float16 operand is not promoted to float32
        # and cast back.
        a, b = autocast_args("lower", _operand(a, self, "matmul", False), _operand(b, self, "matmul", False))
        return _MatMul.apply(*_promoted(a, b, self, "matmul", scalars=False))

    # NOTE [ In-place ops ]
    # ``p -= lr * p.grad`` updates the array in place, for optimizer steps under ``no_grad``. With
    # grad mode on, a tensor that requires grad refuses (as in PyTorch), since its graph would be
    # differentiated at the wrong values. Unlike PyTorch there is no version counter: changing in
    # place, under no_grad, a tensor that a live graph saved makes that graph's gradients wrong.
    def _inplace(self, other: Any, op: str) -> Self:
        if is_grad_enabled() and self.requires_grad:
            raise RuntimeError(
                f"in-place {op} on a tensor that requires grad; wrap the update in taifuse.no_grad()"
            )
        m = math_for(self._be)
        if (
            isinstance(other, np.ndarray)
            and other.dtype.kind in "fiub"
            and (self.dtype.kind == "f" or other.dtype.kind != "f")
        ):
            other = other.astype(self.dtype)  # the tensor's dtype, cast on the host before any upload
        integral = isinstance(other, numbers.Integral)
        other = _operand(other, self, op)
        kind = other.dtype.kind if isinstance(other, Tensor) else ("i" if integral else "f")
        if kind == "f" and self.dtype.kind != "f":
            # As torch: the result of an in-place op must fit the tensor's dtype (NOTE [ Mixed dtypes ]).
            raise TypeError(
                f"in-place {op}: result type {other.dtype if isinstance(other, Tensor) else 'float'} can't "
                f"be cast to the tensor's dtype {self.dtype}"
            )
        if isinstance(other, Tensor):
            value = other._data if other.dtype == self.dtype else astype(m, other._data, self.dtype)
        else:
            value = other
        if np.broadcast_shapes(self.shape, _shape(value)) != self.shape:
            raise ValueError(
                f"in-place {op}: operand of shape {_shape(value)} does not broadcast to {self.shape}"
            )
        getattr(m, op)(self._data, value)
        return self

    def __iadd__(self, other: Any) -> Self:
        return self._inplace(other, "add_")

    def __isub__(self, other: Any) -> Self:
        return self._inplace(other, "sub_")

    def __imul__(self, other: Any) -> Self:
        return self._inplace(other, "mul_")

    def copy_(self, src: Any) -> Self:
        """Copy ``src`` into this tensor in place, as ``torch.Tensor.copy_``: a Tensor on this
        backend, a NumPy array or a number, broadcast to this shape and cast to this dtype.

        Example::

            >>> import numpy as np, taifuse
            >>> taifuse.set_backend("numpy")
            >>> t = taifuse.tensor([1.0, 2.0])
            >>> t.copy_(np.array([3.0, 4.0])).numpy()
            array([3., 4.], dtype=float32)
        """
        if is_grad_enabled() and self.requires_grad:
            raise RuntimeError("in-place copy_ on a tensor that requires grad; wrap it in taifuse.no_grad()")
        m = math_for(self._be)
        if isinstance(src, Tensor):
            if src._be is not self._be:
                raise TypeError(
                    f"copy_: src lives on backend {src._be.NAME!r}, the tensor on {self._be.NAME!r}"
                )
            value = src._data if src.dtype == self.dtype else astype(m, src._data, self.dtype)
        elif isinstance(src, np.ndarray) or _is_scalar(src):
            value = np.asarray(src, dtype=self.dtype)
            if not isinstance(self._data, np.ndarray):
                value = self._be.from_numpy(np.asarray(value, order="C"))
        else:
            raise TypeError(
                f"copy_: src should be a Tensor, numpy.ndarray or number, got {type(src).__name__}"
            )
        if np.broadcast_shapes(self.shape, _shape(value)) != self.shape:
            raise ValueError(f"copy_: src of shape {_shape(value)} does not broadcast to {self.shape}")
        if isinstance(self._data, np.ndarray):
            np.copyto(self._data, value, casting="unsafe")
        else:
            # NOTE: a device math has no assignment kernel; -0.0 + x is x for every x (signed zeros
            # and NaN included), so a fill and an add copy exactly.
            m.fill_(self._data, -0.0)
            m.add_(self._data, value)
        return self

    def zero_(self) -> Self:
        """Fill with zeros in place (``optimizer.zero_grad(set_to_none=False)`` does this to ``.grad``)."""
        if is_grad_enabled() and self.requires_grad:
            raise RuntimeError("in-place zero_ on a tensor that requires grad; wrap it in taifuse.no_grad()")
        math_for(self._be).fill_(self._data, 0.0)
        return self

    def __neg__(self) -> Tensor:
        return _Neg.apply(self)

    def __pos__(self) -> Tensor:
        return self

    def __pow__(self, exponent: Any) -> Tensor:
        if not _is_scalar(exponent) or not math.isfinite(float(exponent)):
            raise TypeError(f"pow: the exponent should be a finite real number, got {exponent!r}")
        return _PowScalar.apply(self, float(exponent))

    def sum(self, dim: int | Sequence[int] | None = None, keepdim: bool = False) -> Tensor:
        """Sum over ``dim`` (all dimensions when ``None``)."""
        (a,) = autocast_args("float32", self)
        return _Sum.apply(a, _normalize_dims(dim, self.ndim, "sum"), bool(keepdim), False)

    def mean(self, dim: int | Sequence[int] | None = None, keepdim: bool = False) -> Tensor:
        """Mean over ``dim`` (all dimensions when ``None``)."""
        (a,) = autocast_args("float32", self)
        return _Sum.apply(a, _normalize_dims(dim, self.ndim, "mean"), bool(keepdim), True)

    def reshape(self, *shape: Any) -> Tensor:
        """The same data in ``shape`` (one entry may be -1)."""
        if len(shape) == 1 and not isinstance(shape[0], numbers.Integral):
            shape = tuple(shape[0])
        return _Reshape.apply(self, _resolve_shape(shape, self.shape))

    def flatten(self, start_dim: int = 0, end_dim: int = -1) -> Tensor:
        """Dimensions ``start_dim`` to ``end_dim`` merged into one, as ``torch.Tensor.flatten`` (a reshape).

        Example::

            >>> import taifuse
            >>> taifuse.set_backend("numpy")
            >>> taifuse.tensor([[[1.0, 2.0], [3.0, 4.0]]]).flatten(1).shape
            (1, 4)
        """
        ndim = max(self.ndim, 1)
        start, end = (
            _dim(d, ndim, "flatten", name) for d, name in ((start_dim, "start_dim"), (end_dim, "end_dim"))
        )
        if start > end:
            raise ValueError(f"flatten: start_dim ({start_dim}) should not come after end_dim ({end_dim})")
        shape = self.shape or (1,)
        return self.reshape(shape[:start] + (math.prod(shape[start : end + 1]),) + shape[end + 1 :])

    def transpose(self, dim0: int, dim1: int) -> Tensor:
        """Swap dimensions ``dim0`` and ``dim1`` (returns a copy, unlike PyTorch's view: NOTE [ Views copy ]).

        Example::

            >>> import taifuse
            >>> taifuse.set_backend("numpy")
            >>> taifuse.tensor([[1.0, 2.0, 3.0]]).transpose(0, 1).shape
            (3, 1)
        """
        d0, d1 = (_dim(d, self.ndim, "transpose", name) for d, name in ((dim0, "dim0"), (dim1, "dim1")))
        axes = list(range(self.ndim))
        if self.ndim:  # a 0-d tensor (dims 0 or -1) is its own transpose
            axes[d0], axes[d1] = axes[d1], axes[d0]
        return _Transpose.apply(self, tuple(axes))

    @property
    def T(self) -> Tensor:
        """The tensor with its dimensions reversed (a matrix transposed)."""
        return _Transpose.apply(self, tuple(reversed(range(self.ndim))))

    # -- views (NOTE [ Views copy ])

    def view(self, *shape: Any) -> Tensor:
        """The same data in ``shape`` (one entry may be -1), as ``torch.Tensor.view``.

        Tensors are always contiguous, so this is :meth:`reshape`; the result shares the data (as
        PyTorch's view does), and ``backward`` reshapes the gradient back.

        Example::

            >>> import taifuse
            >>> taifuse.set_backend("numpy")
            >>> taifuse.tensor([1.0, 2.0, 3.0, 4.0]).view(2, -1).shape
            (2, 2)
        """
        return self.reshape(*shape)

    def permute(self, *dims: Any) -> Tensor:
        """The dimensions reordered: dimension ``i`` of the result is ``dims[i]`` of this tensor
        (returns a copy, unlike PyTorch's view: NOTE [ Views copy ]).

        Example::

            >>> import numpy as np, taifuse
            >>> taifuse.set_backend("numpy")
            >>> taifuse.tensor(np.zeros((2, 3, 4))).permute(2, 0, 1).shape
            (4, 2, 3)
        """
        if len(dims) == 1 and not isinstance(dims[0], numbers.Integral):
            dims = tuple(dims[0])
        if len(dims) != self.ndim:
            raise ValueError(
                f"permute: dims {dims} should name each of the tensor's {self.ndim} dimensions once"
            )
        axes = tuple(_dim(d, self.ndim, "permute", "dims") for d in dims)
        if len(set(axes)) != len(axes):
            raise ValueError(f"permute: dims {dims} repeats a dimension")
        return _Transpose.apply(self, axes)

    def unsqueeze(self, dim: int) -> Tensor:
        """A new dimension of size 1 at ``dim`` (in ``[-ndim - 1, ndim]``); shares the data as a reshape.

        Example::

            >>> import taifuse
            >>> taifuse.set_backend("numpy")
            >>> taifuse.tensor([1.0, 2.0]).unsqueeze(-1).shape
            (2, 1)
        """
        d = _dim(dim, self.ndim + 1, "unsqueeze")
        return _Reshape.apply(self, self.shape[:d] + (1,) + self.shape[d:])

    def squeeze(self, dim: int | Sequence[int] | None = None) -> Tensor:
        """Drop the dimensions of size 1 (only those in ``dim`` when given; others named there stay).

        Example::

            >>> import numpy as np, taifuse
            >>> taifuse.set_backend("numpy")
            >>> taifuse.tensor(np.zeros((1, 2, 1))).squeeze().shape
            (2,)
        """
        if dim is None:
            dims = set(range(self.ndim))
        else:
            names = (dim,) if isinstance(dim, numbers.Integral) else tuple(dim)
            dims = {_dim(d, self.ndim, "squeeze") for d in names}
        shape = tuple(n for i, n in enumerate(self.shape) if not (i in dims and n == 1))
        return _Reshape.apply(self, shape)

    def expand(self, *sizes: Any) -> Tensor:
        """This tensor repeated along its size-1 dimensions (and new leading ones) to ``sizes``; -1
        keeps a dimension's size. The backward sums the gradient over the repeats. Returns a copy,
        unlike PyTorch's view (NOTE [ Views copy ]).

        Example::

            >>> import taifuse
            >>> taifuse.set_backend("numpy")
            >>> taifuse.tensor([[1.0], [2.0]]).expand(2, 3).numpy()
            array([[1., 1., 1.],
                   [2., 2., 2.]], dtype=float32)
        """
        if len(sizes) == 1 and not isinstance(sizes[0], numbers.Integral):
            sizes = tuple(sizes[0])
        if not all(isinstance(n, numbers.Integral) and not isinstance(n, bool) for n in sizes):
            raise TypeError(f"expand: sizes should be ints, got {sizes!r}")
        lead = len(sizes) - self.ndim
        if lead < 0:
            raise ValueError(
                f"expand: the number of sizes provided ({len(sizes)}) must be greater or equal to the "
                f"number of dimensions in the tensor ({self.ndim})"
            )
        shape = []
        for i, n in enumerate(sizes):
            n = int(n)
            old = self.shape[i - lead] if i >= lead else None
            if n == -1 and old is not None:
                n = old
            if n < 0:
                raise ValueError(f"expand: sizes {sizes}: size {n} is not allowed at dimension {i}")
            if old is not None and old != 1 and n != old:
                raise ValueError(
                    f"expand: the expanded size of the tensor ({n}) must match the existing size ({old}) at "
                    f"non-singleton dimension {i}; sizes {tuple(sizes)}, tensor shape {self.shape}"
                )
            shape.append(n)
        return _Expand.apply(self, tuple(shape))

    def split(self, split_size_or_sections: int | Sequence[int], dim: int = 0) -> tuple[Tensor, ...]:
        """Pieces along ``dim``: of ``split_size_or_sections`` entries each (the last may be shorter),
        or of the listed sizes. Each piece is a copy, unlike PyTorch's views (NOTE [ Views copy ]).

        Example::

            >>> import taifuse
            >>> taifuse.set_backend("numpy")
            >>> [p.shape for p in taifuse.tensor([1.0, 2.0, 3.0, 4.0, 5.0]).split(2)]
            [(2,), (2,), (1,)]
        """
        if not self.ndim:
            raise ValueError("split: expects at least a 1-dimensional tensor")
        d = _dim(dim, self.ndim, "split")
        n = self.shape[d]
        s = split_size_or_sections
        if isinstance(s, numbers.Integral) and not isinstance(s, bool):
            if s < 0 or (s == 0 and n):
                raise ValueError(f"split: split_size_or_sections should be a positive int, got {s}")
            sizes = [int(s)] * (n // s) + ([n % s] if n % s else []) if n else [0]
        else:
            sizes = list(s)
            if not all(isinstance(k, numbers.Integral) and not isinstance(k, bool) and k >= 0 for k in sizes):
                raise TypeError(
                    f"split: split_size_or_sections should be an int or a list of non-negative ints, got {s!r}"
                )
            if sum(sizes) != n:
                raise ValueError(
                    f"split: split_size_or_sections {sizes} should sum exactly to {n} (the tensor's size at "
                    f"dimension {d})"
                )
        pieces, start = [], 0
        for k in sizes:
            pieces.append(_narrow(self, d, start, int(k)))
            start += k
        return tuple(pieces)

    def chunk(self, chunks: int, dim: int = 0) -> tuple[Tensor, ...]:
        """At most ``chunks`` pieces of ``ceil(size / chunks)`` entries along ``dim`` (the last may be
        shorter), as ``torch.chunk``. Each piece is a copy (NOTE [ Views copy ]).

        Example::

            >>> import taifuse
            >>> taifuse.set_backend("numpy")
            >>> [p.shape for p in taifuse.tensor([1.0, 2.0, 3.0, 4.0, 5.0]).chunk(2)]
            [(3,), (2,)]
        """
        if isinstance(chunks, bool) or not isinstance(chunks, numbers.Integral) or chunks <= 0:
            raise ValueError(f"chunk: chunks should be a positive int, got {chunks!r}")
        if not self.ndim:
            raise ValueError("chunk: expects at least a 1-dimensional tensor")
        n = self.shape[_dim(dim, self.ndim, "chunk")]
        return self.split(-(-n // int(chunks)) if n else 0, dim)

    def __iter__(self) -> Iterator[Tensor]:
        """The entries along the first dimension (``for row in t``), as PyTorch; each is a copy."""
        if not self.shape:
            raise TypeError("iteration over a 0-d tensor")
        return (self[i] for i in range(self.shape[0]))

    def __getitem__(self, index: Any) -> Tensor:
        """NumPy/PyTorch indexing: ints, slices (any step, negative too, which PyTorch refuses),
        ``None``, ``...``, and one integer array, list or Tensor along one dimension. Returns a copy,
        unlike PyTorch's views of basic indexing (NOTE [ Views copy ]); the backward scatters the
        gradient back (repeated indices accumulate).

        Raises ``IndexError`` for an index out of range, as PyTorch. An integer Tensor already on
        the taichi device is not range-checked (that would copy it to the host): an entry out of
        range gives NaN, as a bad class index does (NOTE [ Class indices on the device ]).

        Example::

            >>> import numpy as np, taifuse
            >>> taifuse.set_backend("numpy")
            >>> x = taifuse.tensor(np.arange(6, dtype=np.float32).reshape(2, 3))
            >>> x[1, ::-1].numpy()
            array([5., 4., 3.], dtype=float32)
            >>> x[:, [0, 0]].shape
            (2, 2)
        """
        return _getitem(self, index)

    # -- elementwise math

    def exp(self) -> Tensor:
        """e ** x, elementwise.

        Example::

            >>> import taifuse
            >>> taifuse.set_backend("numpy")
            >>> taifuse.tensor([0.0]).exp().numpy()
            array([1.], dtype=float32)
        """
        return _Exp.apply(_require_float_tensor(self, "exp"))

    def log(self) -> Tensor:
        """Natural logarithm, elementwise (NaN below 0, -inf at 0).

        Example::

            >>> import taifuse
            >>> taifuse.set_backend("numpy")
            >>> taifuse.tensor([1.0]).log().numpy()
            array([0.], dtype=float32)
        """
        return _Log.apply(_require_float_tensor(self, "log"))

    def sqrt(self) -> Tensor:
        """Square root, elementwise (NaN below 0).

        Example::

            >>> import taifuse
            >>> taifuse.set_backend("numpy")
            >>> taifuse.tensor([4.0]).sqrt().numpy()
            array([2.], dtype=float32)
        """
        return _Sqrt.apply(_require_float_tensor(self, "sqrt"))

    def masked_fill(self, mask: Any, value: float) -> Tensor:
        """``value`` where ``mask`` is True, this tensor elsewhere; ``mask`` broadcasts with it.

        ``mask`` is a boolean NumPy array (or a nested list of bools), or an integer Tensor (taifuse
        stores booleans as integers; nonzero is True). The gradient is 0 where the mask filled.

        Example::

            >>> import numpy as np, taifuse
            >>> taifuse.set_backend("numpy")
            >>> taifuse.tensor([1.0, 2.0]).masked_fill(np.array([True, False]), -1.0).numpy()
            array([-1.,  2.], dtype=float32)
        """
        _require_float_tensor(self, "masked_fill")
        if not _is_scalar(value):
            raise TypeError(f"masked_fill: value should be a real number, got {type(value).__name__}")
        mask_arr = _mask_operand(mask, self)
        try:
            np.broadcast_shapes(self.shape, _shape(mask_arr))
        except ValueError:
            raise ValueError(
                f"masked_fill: mask of shape {_shape(mask_arr)} does not broadcast with the tensor's shape {self.shape}"
            ) from None
        return _MaskedFill.apply(self, mask_arr, float(value))

    # -- reductions with indices

    def amax(self, dim: int | Sequence[int] = (), keepdim: bool = False) -> Tensor:
        """The largest element over ``dim`` (every dimension when ``()``), as ``torch.amax``.

        The gradient is split evenly among the elements equal to the maximum.

        Example::

            >>> import taifuse
            >>> taifuse.set_backend("numpy")
            >>> x = taifuse.tensor([[1.0, 3.0], [3.0, 2.0]], requires_grad=True)
            >>> x.amax().backward()
            >>> x.grad.numpy()
            array([[0. , 0.5],
                   [0.5, 0. ]], dtype=float32)
        """
        _require_float_tensor(self, "amax")
        names = (dim,) if isinstance(dim, numbers.Integral) else tuple(dim)
        dims = tuple(_dim(d, self.ndim, "amax") for d in names) if self.ndim else ()
        if len(set(dims)) != len(dims):
            raise ValueError(f"amax: dim {dim!r} repeats a dimension")
        dims = dims if names else tuple(range(self.ndim))
        for d in dims:
            if self.shape[d] == 0:
                raise _IndexOutOfRange(f"amax: expected reduction dim {d} to have non-zero size")
        if not self.ndim:
            return _Reshape.apply(self, ())
        return _Amax.apply(self, dims, bool(keepdim))

    def max(self, dim: int | None = None, keepdim: bool = False) -> Any:
        """The largest element: of all (a Tensor; the gradient split evenly among ties), or along
        ``dim`` as ``(values, indices)`` (``torch.return_types.max``; the gradient goes to the index
        returned, the first maximum, or the first NaN). Indices are int64 on the host backends and
        int32 on taichi (NOTE [ Class indices on the device ]).

        Example::

            >>> import taifuse
            >>> taifuse.set_backend("numpy")
            >>> values, indices = taifuse.tensor([[1.0, 3.0], [4.0, 2.0]]).max(dim=1)
            >>> values.numpy(), indices.numpy()
            (array([3., 4.], dtype=float32), array([1, 0]))
        """
        if dim is None:
            return self.amax()
        _require_float_tensor(self, "max")
        d = _dim(dim, self.ndim, "max")
        src = _Reshape.apply(self, (1,)) if not self.ndim else self
        keepdim = bool(keepdim) and self.ndim > 0
        if src.shape[d] == 0:
            raise _IndexOutOfRange(f"max: expected reduction dim {d} to have non-zero size")
        m = math_for(self._be)
        idx = m.argmax(src._data, d, True)
        values = _MaxDim.apply(src, d, keepdim, idx)
        if not keepdim:
            idx = m.reshape(idx, values.shape)
        return MaxResult(values, Tensor._wrap(idx, self._be))


def _cast_dtype(dtype: Any, be: ModuleType) -> np.dtype:
    """The floating dtype ``Tensor.to`` casts to, checked against backend ``be``."""
    if isinstance(dtype, Tensor):
        dtype = dtype.dtype
    try:
        resolved = None if dtype is None else np.dtype(dtype)
    except TypeError:
        resolved = None
    if resolved is None or resolved.kind != "f":
        raise TypeError(f"to: dtype should be float16, float32 or float64, got {dtype!r}")
    be.check_dtype(resolved, "to: dtype")
    return resolved


def _host_array(data: Any, dtype: Any) -> np.ndarray:
    if isinstance(data, np.ndarray):
        arr = data
    else:
        arr = np.asarray(data)
        if dtype is None and arr.dtype.kind == "f":
            arr = arr.astype(_DEFAULT_FLOAT)
    if dtype is not None:
        arr = arr.astype(dtype)
    if arr.dtype.kind == "b" or arr.dtype.kind in "iu":
        arr = arr.astype(np.int64)
    elif arr.dtype.kind != "f":
        raise TypeError(f"tensor: data should be numbers, got an array of dtype {arr.dtype}")
    return np.array(arr, order="C", copy=True)


def tensor(data: Any, requires_grad: bool = False, dtype: Any = None) -> Tensor:
    """A new :class:`Tensor` on the active backend holding a copy of ``data``.

    Args:
        data: a NumPy array, nested sequence or number (or a Tensor, copied without its graph).
        requires_grad: record operations on it for :meth:`Tensor.backward`.
        dtype: float16, float32 or float64 (or an integer dtype for class indices). Default: the
            NumPy array's dtype; float32 for Python floats (PyTorch's default), int64 for integers.

    Example::

        >>> import numpy as np, taifuse
        >>> taifuse.set_backend("numpy")
        >>> taifuse.tensor(np.ones(2), dtype=np.float32).dtype
        dtype('float32')
    """
    return Tensor(data, requires_grad=requires_grad, dtype=dtype)


def _as_array_like(value: Any, like: Tensor, what: str) -> Any:
    """``value`` (Tensor, NumPy array or number) as an array on ``like``'s backend in ``like``'s dtype.

    A value of another dtype is cast to it, as PyTorch casts a ``backward()`` gradient to the
    output's dtype (NOTE [ Mixed dtypes ]).
    """
    if isinstance(value, Tensor):
        if value._be is not like._be:
            raise TypeError(f"{what} lives on backend {value._be.NAME!r}, the tensor on {like._be.NAME!r}")
        if value.dtype != like.dtype:
            return astype(math_for(like._be), value._data, like.dtype)
        return value._data
    if isinstance(value, np.ndarray) or _is_scalar(value):
        return like._be.from_numpy(np.array(value, dtype=like.dtype, order="C"))
    raise TypeError(f"{what} should be a Tensor or numpy.ndarray, got {type(value).__name__}")


# NOTE [ Mixed dtypes ]
# Binary arithmetic (+ - * / @) follows PyTorch's type promotion, so that code ports unchanged and
# nothing is narrowed behind the user's back. Operands of different dtypes compute in
# ``torch.result_type`` of the two: float16 < float32 < float64; an integer operand takes the
# float operand's dtype; a Python number (or NumPy scalar) is weak and takes the Tensor's dtype; a
# 0-d Tensor does not widen a dimensioned one of the same kind. A NumPy array (0-d too) counts as
# dimensioned, and so does a 0-d Tensor beside one: torch promotes a Tensor and an array fully.
# The operand of the other dtype goes through a differentiable cast (``_Cast``), so every input's
# gradient comes back in that input's own dtype, as in torch.
# So a float32 Tensor times a float64 array is float64 on ``numpy`` and ``numba``; the ``taichi``
# backend has no float64 (Metal has none), so there it raises ``TypeError`` instead of computing in
# float32. Two places cast to a dtype a tensor fixes, as torch does: an in-place op (``a += b``)
# keeps ``a``'s dtype (a float operand into an integer tensor raises), and ``backward(gradient)``
# casts the gradient to the output's dtype.


def _result_dtype(a: np.dtype, a_dimensioned: bool, b: np.dtype, b_dimensioned: bool) -> np.dtype:
    """``torch.result_type`` of two operands of different dtypes (NOTE [ Mixed dtypes ])."""
    if (a.kind == "f") != (b.kind == "f"):
        return a if a.kind == "f" else b
    if a_dimensioned != b_dimensioned:
        return a if a_dimensioned else b
    return np.promote_types(a, b)


def _promoted(a: Any, b: Any, like: Tensor, op: str, scalars: bool = True) -> tuple[Any, Any]:
    """The operands of binary op ``op`` (one of them ``like``), as Tensors of one dtype or numbers."""
    ta, tb = _operand(a, like, op, scalars), _operand(b, like, op, scalars)
    if not (isinstance(ta, Tensor) and isinstance(tb, Tensor)) or ta.dtype == tb.dtype:
        return ta, tb
    # Against a NumPy array PyTorch promotes fully, whatever either operand's rank.
    array = isinstance(a, np.ndarray) or isinstance(b, np.ndarray)
    dims = [array or t.ndim > 0 for t in (ta, tb)]
    dtype = _result_dtype(ta.dtype, dims[0], tb.dtype, dims[1])
    if dtype.kind == "f":
        like._be.check_dtype(dtype, f"{op}: the result of dtypes {ta.dtype} and {tb.dtype}")
    return tuple(t if t.dtype == dtype else _Cast.apply(t, dtype) for t in (ta, tb))  # type: ignore[return-value]


def _operand(value: Any, like: Tensor, op: str, scalars: bool = True) -> Any:
    """One operand of a binary op: a Tensor (a NumPy array becomes a constant one), or a Python
    number kept as a number."""
    if isinstance(value, Tensor):
        if value._be is not like._be:
            raise TypeError(
                f"{op}: tensors live on different backends ({like._be.NAME!r} and {value._be.NAME!r}); "
                "create them under the same backend"
            )
        return value
    if scalars and _is_scalar(value):
        # Weak, as in torch: a float for a float tensor, an integer stays one for an integer tensor.
        return int(value) if like.dtype.kind != "f" and isinstance(value, numbers.Integral) else float(value)
    if isinstance(value, np.ndarray):
        if value.dtype.kind in "biu":
            # An integer array takes the float operand's dtype, as in torch; cast here, on the host.
            arr = value.astype(like.dtype if like.dtype.kind == "f" else np.int64)
        elif value.dtype.kind == "f":
            like._be.check_dtype(value.dtype, f"{op}: operand")
            arr = value
        else:
            raise TypeError(f"{op}: unsupported operand of dtype {value.dtype}")
        # NOTE: not np.ascontiguousarray, which turns a 0-d array into shape (1,).
        return Tensor._wrap(like._be.from_numpy(np.asarray(arr, order="C")), like._be)
    raise TypeError(f"{op}: unsupported operand of type {type(value).__name__}")


def _normalize_dims(dim: Any, ndim: int, op: str) -> tuple[int, ...] | None:
    if dim is None:
        return None
    dims = (dim,) if isinstance(dim, numbers.Integral) and not isinstance(dim, bool) else tuple(dim)
    out = []
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, numbers.Integral):
            raise TypeError(f"{op}: dim should be an int or a sequence of ints, got {dim!r}")
        if not -max(ndim, 1) <= d < max(ndim, 1):
            raise ValueError(f"{op}: dim {d} is out of range for a {ndim}-D tensor")
        out.append(int(d) % max(ndim, 1))
    if len(set(out)) != len(out):
        raise ValueError(f"{op}: dim {dim!r} repeats a dimension")
    # A 0-d tensor accepts dim 0 and -1, as in PyTorch, but has no axis to apply them to.
    return tuple(out) if ndim else ()


def _resolve_shape(shape: Sequence[Any], old: tuple[int, ...]) -> tuple[int, ...]:
    if not all(isinstance(n, numbers.Integral) and not isinstance(n, bool) for n in shape):
        raise TypeError(f"reshape: shape should be ints, got {tuple(shape)!r}")
    shape = tuple(int(n) for n in shape)
    size = math.prod(old)
    if shape.count(-1) > 1 or any(n < -1 for n in shape):
        raise ValueError(f"reshape: invalid shape {shape}")
    if -1 in shape:
        known = math.prod(n for n in shape if n != -1)
        if known == 0 or size % known:
            raise ValueError(f"reshape: cannot reshape a tensor of shape {old} into {shape}")
        shape = tuple(size // known if n == -1 else n for n in shape)
    if math.prod(shape) != size:
        raise ValueError(f"reshape: cannot reshape a tensor of shape {old} into {shape}")
    return shape


# ----------------------------------------------------------------------------- backward engine


# NOTE [ The graph keeps no data ]
# A node's ``parents`` hold what the backward needs of each argument, as PyTorch's edges do: a
# leaf that requires grad (its ``.grad`` is written), the creator (``Function``) of a non-leaf
# tensor, None for anything else. Never a non-leaf Tensor: that would keep its array alive as long
# as the graph, although only the arrays a node saves for its backward need to live that long.
# An intermediate that no backward reads (a residual branch's output, the float32 input of an
# autocast cast to float16, a cast's float32 copy that an addition consumed) is then freed as soon
# as the forward drops it, not at the end of the backward. A Tensor that is a non-leaf (a
# checkpoint's arguments) stands for its creator.


def _graph_node(a: Any) -> Tensor | Function | None:
    """What a node keeps of argument ``a``: NOTE [ The graph keeps no data ]."""
    if not isinstance(a, Tensor) or not a._requires_grad:
        return None
    return a if a._ctx is None else a._ctx


def _creator(parent: Tensor | Function | None) -> Function | None:
    return parent if isinstance(parent, Function) else None if parent is None else parent._ctx


def _graph_order(root: Function) -> list[Function]:
    """Nodes reachable from ``root``, each after every node that computed one of its inputs.

    An iterative depth-first post-order: recursion would overflow on long chains.
    """
    order: list[Function] = []
    seen: set[int] = set()
    stack: list[tuple[Function, bool]] = [(root, False)]
    while stack:
        node, finished = stack.pop()
        if finished:
            order.append(node)
            continue
        if id(node) in seen:
            continue
        seen.add(id(node))
        stack.append((node, True))
        for p in node.parents:
            creator = _creator(p)
            if creator is not None and id(creator) not in seen:
                stack.append((creator, False))
    return order


_SECOND_BACKWARD = (
    "backward: trying to backward through the graph a second time (or after its saved values were "
    "freed); pass retain_graph=True to the first backward() if you need to do that"
)


# NOTE [ Gradient slots ]
# An optimizer keeps a bucket's gradients side by side in one flat buffer, so that a step is one
# kernel launch (NOTE [ Flat buffers ] in taifuse/optim/optimizer.py), and gives each of its leaves
# a GradSlot: the leaf's place in that buffer. Autograd writes a leaf's first gradient straight
# into the slot, so that the step needs no copy. But PyTorch's ``.grad`` is a tensor of its own:
# once ``zero_grad()`` (or anyone) drops it, the next backward makes a new one, and a gradient the
# user kept (``g = w.grad``, ``w.grad.numpy()``, any view of either) never changes again. So a slot
# is *lent*: every gradient made in it is an array whose base is a fresh lease object, which every
# view of that memory keeps alive (the memory is exported through ``__array_interface__``, as the
# pool does: NOTE [ Buffer ownership ] in taifuse/pool.py), and the slot keeps only a weak
# reference to the lease. While the lease lives, something may still read the old gradient: the
# slot is not lent again, the next backward makes a gradient of its own as PyTorch would, and the
# optimizer moves its bucket to a fresh flat buffer before it copies anything in. Once the lease is
# gone (the usual loop: ``zero_grad()`` dropped the only reference), the slot is lent again, free.


class _SlotLease:
    """Owns one lent gradient's memory: every NumPy view of it keeps this object alive."""

    def __init__(self, buffer: np.ndarray, interface: dict) -> None:
        self.__array_interface__ = interface
        self._buffer = buffer  # keeps the optimizer's flat buffer alive as long as the gradient


class GradSlot:
    """A leaf's place in an optimizer's flat gradient buffer (NOTE [ Gradient slots ]).

    ``array`` is the place itself (a host view into the flat buffer, the leaf's shape). Autograd
    asks :meth:`lend` for the memory of a leaf's first gradient; the optimizer asks :meth:`holds`
    whether a ``.grad`` already lies in the slot and :meth:`in_use` whether it may write there.
    """

    __slots__ = ("_interface", "_lease", "array")

    def __init__(self, array: np.ndarray) -> None:
        self.array = array
        self._interface = dict(array.__array_interface__)
        self._lease: weakref.ref | None = None

    def in_use(self) -> bool:
        """Whether a gradient lent from this slot may still be read by someone."""
        return self._lease is not None and self._lease() is not None

    def lend(self) -> np.ndarray | None:
        """The slot's memory as an array for a new gradient, or None while the last one lives on."""
        if self.in_use():
            return None
        lease = _SlotLease(self.array, self._interface)
        self._lease = weakref.ref(lease)
        return np.asarray(lease)

    def holds(self, data: Any) -> bool:
        """Whether ``data`` is the array of the gradient currently lent from this slot."""
        lease = None if self._lease is None else self._lease()
        return lease is not None and isinstance(data, np.ndarray) and data.base is lease


# NOTE [ Buffer hooks ]
# The optimizers keep parameters and gradients in flat buffers (NOTE [ Flat buffers ] in
# taifuse/optim/optimizer.py). These three functions are the only way code outside this module
# places a tensor's storage or gradient there, so that a Tensor's invariants (C-contiguous data of
# its shape and dtype on its backend; gradients lent, not shared) are kept here.


def bind_storage(t: Tensor, view: np.ndarray) -> None:
    """Make host array ``view`` (``t``'s shape and dtype, C-contiguous) the storage of ``t``, with
    ``t``'s values copied in: an optimizer moves a parameter into its flat buffer this way."""
    if not isinstance(t._data, np.ndarray) or not isinstance(view, np.ndarray):
        raise TypeError(f"bind_storage: only host (NumPy) storage can be rebound, not {t.backend!r} arrays")
    if view.shape != t.shape or view.dtype != t.dtype or not view.flags.c_contiguous:
        raise ValueError(
            f"bind_storage: a tensor of shape {t.shape} and dtype {t.dtype} needs C-contiguous storage of "
            f"that shape and dtype, got {view.shape} {view.dtype}"
        )
    if t._data is not view:
        np.copyto(view, t._data)
        t._data = view


def storage_is(t: Tensor, view: Any) -> bool:
    """Whether ``view`` is still ``t``'s storage (code that replaced it, such as a module's
    ``load_state_dict``, makes this False)."""
    return t._data is view


def set_grad_slot(t: Tensor, slot: GradSlot | None) -> None:
    """Give leaf ``t`` a slot for its gradients (None: none), see NOTE [ Gradient slots ]."""
    if slot is not None and (slot.array.shape != t.shape or slot.array.dtype != t.dtype):
        raise ValueError(
            f"set_grad_slot: a slot of shape {slot.array.shape} and dtype {slot.array.dtype} for a tensor of "
            f"shape {t.shape} and dtype {t.dtype}"
        )
    t._grad_slot = slot


def _accumulate_leaf(leaf: Tensor, grad: Any, m: Any, owned: bool = False) -> None:
    # owned: ``grad`` is a fresh array nothing else refers to (Function.owns_grads), so a leaf
    # without a gradient may keep it as is.
    if tuple(grad.shape) != leaf.shape:
        raise RuntimeError(
            f"internal error: gradient of shape {tuple(grad.shape)} for a leaf of shape {leaf.shape}"
        )
    if leaf._grad is None:
        # A copy: backward functions may hand the same array to several inputs, and .grad is
        # accumulated in place afterwards. An optimizer may have given the leaf a slot in its
        # flat gradient buffer: copy there when it is free (NOTE [ Gradient slots ]).
        slot = leaf._grad_slot
        lent = slot.lend() if slot is not None and isinstance(grad, np.ndarray) else None
        if lent is not None:
            np.copyto(lent, grad)
            leaf._grad = Tensor._wrap(lent, leaf._be)
        else:
            leaf._grad = Tensor._wrap(grad if owned else m.copy(grad), leaf._be)
    else:
        m.add_(leaf._grad._data, grad)


def _run_backward(root: Tensor, grad: Any, retain_graph: bool) -> None:
    m = math_for(root._be)
    if root._ctx is None:
        _accumulate_leaf(root, grad, m)
        return
    order = _graph_order(root._ctx)
    pending: dict[int, Any] = {id(root._ctx): grad}
    # The ids in `pending` whose gradient is an array the engine may add into in place (NOTE
    # [ Gradients summed in place ]).
    summable: set[int] = set()
    del root, grad
    for i in range(len(order) - 1, -1, -1):
        # NOTE: each node leaves `order` as it runs, and no local outlives its iteration, so that
        # arrays are freed as the backward goes (a checkpoint's segment boundaries and recomputed
        # activations, say), not when it ends. `pending` only ever holds the ids of nodes still in
        # `order`, so ids stay unique.
        ctx, order[i] = order[i], None
        g = pending.pop(id(ctx), None)
        summable.discard(id(ctx))
        if g is None:
            continue
        acc = _summed_so_far(ctx, g, pending, summable)
        ctx.accumulate_into = acc
        rec = _profile_hook.ACTIVE  # NOTE [ Profiler hooks ]
        grads = ctx.backward(g) if rec is None else rec.backward(ctx, g)
        ctx.accumulate_into = None
        parents = ctx.parents
        if not retain_graph:
            ctx.release()
        for parent, pg, needed in zip(parents, grads, ctx.needs_grad):
            if parent is None or pg is None or not needed:
                continue
            creator = _creator(parent)
            if creator is None:
                _accumulate_leaf(parent, pg, m, owned=ctx.owns_grads)  # type: ignore[arg-type]
            elif id(creator) in pending:
                so_far = pending[id(creator)]
                if pg is so_far:  # added in place by ctx.backward (acc)
                    continue
                if id(creator) in summable and _same_layout(so_far, pg):
                    m.add_(so_far, pg)
                else:
                    pending[id(creator)] = m.add(so_far, pg)
                    summable.add(id(creator))
            else:
                pending[id(creator)] = pg
                if ctx.accumulates:  # a fresh array of the input's shape (owns_grads)
                    summable.add(id(creator))
        g = grads = parents = parent = creator = pg = ctx = acc = so_far = None


# NOTE [ Gradients summed in place ]
# A tensor read by several ops gets one gradient from each, summed before its creator's backward
# runs. The engine sums into the first array it made itself (a sum, or a Function's fresh
# ``accumulates`` gradient) in place instead of allocating a sum per contribution, and a Function
# that ``accumulates`` (a strided gather: indexing, ``split``) adds its slice's gradient straight
# into that sum instead of scattering into a zeroed array of its input's shape first. So
# CausalSelfAttention's q, k, v split of c_attn's output builds one gradient of that output, not
# three full ones and their sums (the GPT step's peak: the transformer suite's memory row).


def _same_layout(a: Any, b: Any) -> bool:
    return tuple(a.shape) == tuple(b.shape) and a.dtype == b.dtype


def _summed_so_far(ctx: Function, g: Any, pending: dict[int, Any], summable: set[int]) -> Any:
    """The gradient of ctx's input summed so far, when ctx may add into it in place; else None."""
    if not ctx.accumulates or not ctx.parents or not ctx.needs_grad[0]:
        return None
    creator = _creator(ctx.parents[0])
    if creator is None or id(creator) not in summable:
        return None
    acc = pending[id(creator)]
    return acc if acc.dtype == g.dtype else None


# ----------------------------------------------------------------------------- arithmetic nodes


def _shape(v: Any) -> tuple[int, ...]:
    return tuple(v.shape) if hasattr(v, "shape") else ()


class _Add(Function):
    def forward(self, a: Any, b: Any) -> Any:
        self.shapes = (_shape(a), _shape(b))
        return self.m.add(a, b)

    def backward(self, g: Any) -> tuple[Any, ...]:
        return tuple(sum_to_shape(self.m, g, s) if n else None for s, n in zip(self.shapes, self.needs_grad))


class _Sub(Function):
    def forward(self, a: Any, b: Any) -> Any:
        self.shapes = (_shape(a), _shape(b))
        return self.m.sub(a, b)

    def backward(self, g: Any) -> tuple[Any, ...]:
        ga = sum_to_shape(self.m, g, self.shapes[0]) if self.needs_grad[0] else None
        gb = self.m.neg(sum_to_shape(self.m, g, self.shapes[1])) if self.needs_grad[1] else None
        return ga, gb


class _Mul(Function):
    def forward(self, a: Any, b: Any) -> Any:
        self.a, self.b = a, b
        return self.m.mul(a, b)

    def backward(self, g: Any) -> tuple[Any, ...]:
        m = self.m
        ga = sum_to_shape(m, m.mul(g, self.b), _shape(self.a)) if self.needs_grad[0] else None
        gb = sum_to_shape(m, m.mul(g, self.a), _shape(self.b)) if self.needs_grad[1] else None
        return ga, gb


class _Div(Function):
    def forward(self, a: Any, b: Any) -> Any:
        self.a, self.b = a, b
        return self.m.div(a, b)

    def backward(self, g: Any) -> tuple[Any, ...]:
        m = self.m
        ga = gb = None
        if self.needs_grad[0]:
            ga = sum_to_shape(m, m.div(g, self.b), _shape(self.a))
        if self.needs_grad[1]:
            # d(a/b)/db = -a / b^2
            gb = m.neg(m.div(m.mul(g, self.a), m.mul(self.b, self.b)))
            gb = sum_to_shape(m, gb, _shape(self.b))
        return ga, gb


class _Cast(Function):
    """``a`` in another dtype; the gradient goes back in ``a``'s (NOTE [ Mixed dtypes ])."""

    owns_grads = True  # the backward's cast is a new array

    def forward(self, a: Any, dtype: np.dtype) -> Any:
        self.in_dtype = a.dtype
        return astype(self.m, a, dtype)

    def backward(self, g: Any) -> tuple[Any, ...]:
        return astype(self.m, g, self.in_dtype), None


# NOTE [ Autocast ]
# Under ``taifuse.amp.autocast`` (its state, cast policy and cast cache live in
# taifuse/_autocast_state.py) an op of the low-precision list casts its floating Tensor arguments
# to the autocast dtype (``policy="lower"``), one of the float32 list to float32 (``"float32"``),
# and one of the promote list to the widest of its arguments' dtypes (``"widest"``), as PyTorch's
# CastPolicy does; the lists are in docs/amp.md. float64 arguments are never cast down. Each cast
# is a ``_Cast`` node, so gradients go back in the argument's own dtype; a parameter's cast to the
# autocast dtype is cached for the outermost region (NOTE [ Autocast cache ]).


def autocast_args(policy: str, *values: Any) -> tuple[Any, ...]:
    """``values`` with their floating Tensors cast as autocast's ``policy`` says ("lower",
    "float32" or "widest"; NOTE [ Autocast ]), or unchanged when autocast is off."""
    state = _autocast_state.active_state()
    if state is None:
        return values
    floats = [v for v in values if isinstance(v, Tensor) and v.dtype.kind == "f"]
    target = _autocast_state.cast_target(state, policy, (v.dtype for v in floats))
    return tuple(
        _autocast_state.cached_cast(state, v, target, is_grad_enabled(), _Cast.apply)
        if isinstance(v, Tensor) and _autocast_state.casts(v.dtype, target)
        else v
        for v in values
    )


class _Neg(Function):
    def forward(self, a: Any) -> Any:
        return self.m.neg(a)

    def backward(self, g: Any) -> tuple[Any, ...]:
        return (self.m.neg(g),)


class _PowScalar(Function):
    def forward(self, a: Any, exponent: float) -> Any:
        self.a, self.exponent = a, exponent
        return self.m.pow_scalar(a, exponent)

    def backward(self, g: Any) -> tuple[Any, ...]:
        m, e = self.m, self.exponent
        if e == 0:
            return m.full(_shape(self.a), 0.0, self.a.dtype), None
        d = m.mul(m.pow_scalar(self.a, e - 1.0), e) if e != 1 else m.full(_shape(self.a), 1.0, self.a.dtype)
        return m.mul(g, d), None


def _swap_last(m: Any, a: Any) -> Any:
    axes = tuple(range(a.ndim - 2)) + (a.ndim - 1, a.ndim - 2)
    return m.transpose(a, axes)


class _MatMul(Function):
    def forward(self, a: Any, b: Any) -> Any:
        sa, sb = _shape(a), _shape(b)
        if not sa or not sb:
            raise ValueError(f"matmul: both operands need at least 1 dimension, got shapes {sa} and {sb}")
        k_a = sa[-1]
        k_b = sb[-2] if len(sb) > 1 else sb[0]
        if k_a != k_b:
            raise ValueError(
                f"matmul: shapes {sa} and {sb} are not aligned: {k_a} (dim -1 of the first) != "
                f"{k_b} (dim {-2 if len(sb) > 1 else 0} of the second)"
            )
        try:
            np.broadcast_shapes(sa[:-2], sb[:-2])
        except ValueError:
            raise ValueError(
                f"matmul: batch dimensions of shapes {sa} and {sb} cannot be broadcast"
            ) from None
        self.a, self.b = a, b
        return self.m.matmul(a, b)

    def backward(self, g: Any) -> tuple[Any, ...]:
        m, a, b = self.m, self.a, self.b
        # Promote vectors to matrices as matmul does, differentiate, and undo the promotion.
        a2 = m.reshape(a, (1,) + _shape(a)) if a.ndim == 1 else a
        b2 = m.reshape(b, _shape(b) + (1,)) if b.ndim == 1 else b
        out_shape = np.broadcast_shapes(_shape(a2)[:-2], _shape(b2)[:-2]) + (a2.shape[-2], b2.shape[-1])
        g2 = m.reshape(g, out_shape)
        ga = gb = None
        if self.needs_grad[0]:
            ga = m.reshape(sum_to_shape(m, m.matmul(g2, _swap_last(m, b2)), _shape(a2)), _shape(a))
        if self.needs_grad[1]:
            gb = m.reshape(sum_to_shape(m, m.matmul(_swap_last(m, a2), g2), _shape(b2)), _shape(b))
        return ga, gb


class _Sum(Function):
    def forward(self, a: Any, dims: tuple[int, ...] | None, keepdim: bool, mean: bool) -> Any:
        self.in_shape = _shape(a)
        self.dims = tuple(range(a.ndim)) if dims is None else dims
        self.count = math.prod(self.in_shape[d] for d in self.dims)
        self.keep_shape = tuple(1 if i in self.dims else n for i, n in enumerate(self.in_shape))
        self.mean = mean
        s = self.m.sum(a, self.dims, keepdim)
        return self.m.div(s, self.count) if mean else s

    def backward(self, g: Any) -> tuple[Any, ...]:
        m = self.m
        g = m.broadcast_to(m.reshape(g, self.keep_shape), self.in_shape)
        if self.mean:
            g = m.div(g, self.count)
        return g, None, None, None


class _Reshape(Function):
    def forward(self, a: Any, shape: tuple[int, ...]) -> Any:
        self.in_shape = _shape(a)
        return self.m.reshape(a, shape)

    def backward(self, g: Any) -> tuple[Any, ...]:
        return self.m.reshape(g, self.in_shape), None


class _Transpose(Function):
    def forward(self, a: Any, axes: tuple[int, ...]) -> Any:
        self.axes = axes
        return self.m.transpose(a, axes)

    def backward(self, g: Any) -> tuple[Any, ...]:
        inverse = tuple(int(i) for i in np.argsort(self.axes))
        return self.m.transpose(g, inverse), None


# ----------------------------------------------------------------------------- views and indexing

# NOTE [ Views copy ]
# A Tensor's array is always C-contiguous (NOTE [ Tensor storage ] in _tensor_math.py), so the ops
# that are views in PyTorch (indexing, permute, transpose, expand, split, chunk) return copies
# here: writing into the result in place does not change the tensor it came from, and vice versa.
# reshape, view, unsqueeze and squeeze do share the data. Each copy is one gather through
# strides (``as_strided`` in the tensor-math tables), and its backward the matching scatter.


class _IndexOutOfRange(IndexError, ValueError):
    """An out-of-range index or dim: ``IndexError`` as PyTorch raises, and a ``ValueError`` as every
    bad argument in taifuse is (so code catching either works)."""


class MaxResult(NamedTuple):
    """What ``Tensor.max(dim)`` returns, as ``torch.return_types.max``."""

    values: Tensor
    indices: Tensor


def _dim(dim: Any, ndim: int, op: str, name: str = "dim") -> int:
    """``dim`` as an index into ``ndim`` dimensions (a 0-d tensor takes 0 and -1, as PyTorch)."""
    if isinstance(dim, bool) or not isinstance(dim, numbers.Integral):
        raise TypeError(f"{op}: {name} should be an int, got {dim!r}")
    n = max(ndim, 1)
    if not -n <= dim < n:
        raise _IndexOutOfRange(
            f"{op}: {name} is out of range (expected to be in range of [{-n}, {n - 1}], but got {dim})"
        )
    return int(dim) % n


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def _require_float_tensor(t: Tensor, op: str) -> Tensor:
    if t.dtype.kind != "f":
        raise TypeError(f"{op}: needs a floating-point tensor, got dtype {t.dtype}")
    return t


def _narrow(t: Tensor, dim: int, start: int, length: int) -> Tensor:
    """Entries ``start ... start + length - 1`` of ``t`` along ``dim``, as a copy."""
    strides = _contiguous(t.shape)
    shape = t.shape[:dim] + (length,) + t.shape[dim + 1 :]
    return _Strided.apply(t, shape, strides, start * strides[dim] if length else 0)


def _mask_operand(mask: Any, like: Tensor) -> Any:
    """``masked_fill``'s mask as an array on ``like``'s backend (bool or integer, nonzero = True)."""
    if isinstance(mask, Tensor):
        if mask._be is not like._be:
            raise TypeError(
                f"masked_fill: mask lives on backend {mask._be.NAME!r}, the tensor on {like._be.NAME!r}"
            )
        if mask.dtype.kind not in "biu":
            raise TypeError(f"masked_fill: mask should be boolean (or integer 0/1), got dtype {mask.dtype}")
        return mask._data
    arr = np.asarray(mask)
    if arr.dtype.kind != "b":
        raise TypeError(f"masked_fill: mask should be a boolean array, got dtype {arr.dtype}")
    return arr if isinstance(like._data, np.ndarray) else like._be.from_numpy(np.asarray(arr, order="C"))


def _index_array(item: Any, t: Tensor, dim: int) -> Any:
    """An integer-array index along ``dim`` as an array on ``t``'s backend, range-checked on the host."""
    size = t.shape[dim]
    if isinstance(item, Tensor):
        if item._be is not t._be:
            raise TypeError(
                f"index: the index tensor lives on backend {item._be.NAME!r}, the tensor on {t._be.NAME!r}"
            )
        if item.dtype.kind not in "iu":
            raise TypeError(f"index: tensors used as indices must be integer tensors, got dtype {item.dtype}")
        if not isinstance(item._data, np.ndarray):
            return item._data  # on the device: not range-checked (Tensor.__getitem__'s docstring)
        arr = item._data
    else:
        arr = np.asarray(item)
        if isinstance(item, list) and arr.size == 0:
            arr = arr.astype(np.int64)  # ``t[[]]``: an empty list selects nothing, as in PyTorch
        if arr.dtype.kind not in "iu":
            raise TypeError(
                f"index: an array index should hold integers, got dtype {arr.dtype} (boolean masks are "
                "not supported: use masked_fill)"
            )
    bad = (arr < -size) | (arr >= size)
    if bad.any():
        raise _IndexOutOfRange(
            f"index {int(arr[bad].flat[0])} is out of bounds for dimension {dim} with size {size}"
        )
    arr = np.asarray(arr % max(size, 1), dtype=np.int64, order="C")
    return arr if isinstance(t._data, np.ndarray) else t._be.from_numpy(arr)


def _is_array_index(item: Any) -> bool:
    if isinstance(item, Tensor):
        return item.ndim > 0 or item.dtype.kind == "f"
    if isinstance(item, (list, np.ndarray)):
        return np.ndim(item) > 0 or np.asarray(item).dtype.kind not in "iu"
    return False


def _getitem(t: Tensor, index: Any) -> Tensor:
    items = index if isinstance(index, tuple) else (index,)
    consumed = 0
    for item in items:
        if isinstance(item, bool) or (isinstance(item, np.ndarray) and item.dtype.kind == "b"):
            raise TypeError("index: boolean indices are not supported (use masked_fill)")
        if item is None or item is Ellipsis:
            continue
        if not (isinstance(item, (numbers.Integral, slice)) or _is_array_index(item)
                or isinstance(item, (Tensor, np.ndarray))):  # fmt: skip
            raise TypeError(f"index: unsupported index {item!r} of type {type(item).__name__}")
        consumed += 1
    if sum(item is Ellipsis for item in items) > 1:
        raise IndexError("index: an index can only have a single ellipsis ('...')")
    if consumed > t.ndim:
        raise IndexError(f"index: too many indices for tensor of dimension {t.ndim}")
    in_strides = _contiguous(t.shape)
    shape: list[int] = []
    strides: list[int] = []
    offset = d = 0
    array_item = array_dim = array_pos = None
    advanced: list[int] = []  # positions in ``items`` of the ints and the array (NumPy's advanced indices)
    for pos, item in enumerate(items):
        if item is None:
            shape.append(1)
            strides.append(0)
        elif item is Ellipsis:
            for _ in range(t.ndim - consumed):
                shape.append(t.shape[d])
                strides.append(in_strides[d])
                d += 1
        elif isinstance(item, slice):
            start, stop, step = item.indices(t.shape[d])
            length = len(range(start, stop, step))
            offset += start * in_strides[d] if length else 0
            shape.append(length)
            strides.append(step * in_strides[d])
            d += 1
        elif _is_array_index(item):
            if array_item is not None:
                raise TypeError("index: only one integer array (or Tensor) index is supported")
            array_item, array_dim, array_pos = item, d, len(shape)
            advanced.append(pos)
            shape.append(t.shape[d])
            strides.append(in_strides[d])
            d += 1
        else:  # an int (or a 0-d integer array or Tensor)
            i = int(item.item()) if isinstance(item, (Tensor, np.ndarray)) else int(item)
            n = t.shape[d]
            if not -n <= i < n:
                raise _IndexOutOfRange(f"index {i} is out of bounds for dimension {d} with size {n}")
            offset += (i % n) * in_strides[d]
            advanced.append(pos)
            d += 1
    shape += t.shape[d:]
    strides += in_strides[d:]
    out = _Strided.apply(t, tuple(shape), tuple(strides), offset)
    if array_item is None:
        return out
    index_arr = _index_array(array_item, t, array_dim)
    out = _Take.apply(out, index_arr, array_pos)
    if advanced != list(range(advanced[0], advanced[-1] + 1)) and array_pos:
        # NumPy's rule: advanced indices separated by a slice put their dimensions first.
        k = index_arr.ndim
        dims = (
            tuple(range(array_pos, array_pos + k))
            + tuple(range(array_pos))
            + tuple(range(array_pos + k, out.ndim))
        )
        out = _Transpose.apply(out, dims)
    return out


class _Strided(Function):
    """A gather through strides (basic indexing, split); the backward scatters into zeros, or adds
    into the input's gradient summed so far (NOTE [ Gradients summed in place ])."""

    owns_grads = True
    accumulates = True

    def forward(self, a: Any, shape: tuple[int, ...], strides: tuple[int, ...], offset: int) -> Any:
        self.in_shape, self.strides, self.offset = _shape(a), strides, offset
        return self.m.as_strided(a, shape, strides, offset)

    def backward(self, g: Any) -> tuple[Any, ...]:
        out = self.accumulate_into
        if out is not None:
            self.m.scatter_add_strided_(out, g, self.strides, self.offset)
            return out, None, None, None
        out = self.m.full(self.in_shape, 0.0, g.dtype)
        self.m.scatter_strided_(out, g, self.strides, self.offset)
        return out, None, None, None


class _Take(Function):
    owns_grads = True

    def forward(self, a: Any, index: Any, axis: int) -> Any:
        self.index, self.axis, self.size = index, axis, a.shape[axis]
        return self.m.take(a, index, axis)

    def backward(self, g: Any) -> tuple[Any, ...]:
        if not self.index.size:  # ``t[[]]``: nothing was read, so the gradient is all zeros
            k = self.index.ndim
            shape = _shape(g)[: self.axis] + (self.size,) + _shape(g)[self.axis + k :]
            return self.m.full(shape, 0.0, g.dtype), None, None
        return self.m.take_backward(g, self.index, self.axis, self.size), None, None


class _Expand(Function):
    def forward(self, a: Any, shape: tuple[int, ...]) -> Any:
        self.in_shape = _shape(a)
        return self.m.broadcast_to(a, shape)

    def backward(self, g: Any) -> tuple[Any, ...]:
        return sum_to_shape(self.m, g, self.in_shape), None


class _MaskedFill(Function):
    owns_grads = True

    def forward(self, a: Any, mask: Any, value: float) -> Any:
        self.in_shape, self.mask = _shape(a), mask
        return self.m.masked_fill(a, mask, value)

    def backward(self, g: Any) -> tuple[Any, ...]:
        ga = sum_to_shape(self.m, self.m.masked_fill(g, self.mask, 0.0), self.in_shape)
        return ga, None, None


class _Exp(Function):
    owns_grads = True

    def forward(self, a: Any) -> Any:
        self.out = self.m.exp(a)
        return self.out

    def backward(self, g: Any) -> tuple[Any, ...]:
        return (self.m.mul(g, self.out),)


class _Log(Function):
    owns_grads = True

    def forward(self, a: Any) -> Any:
        self.a = a
        return self.m.log(a)

    def backward(self, g: Any) -> tuple[Any, ...]:
        return (self.m.div(g, self.a),)


class _Sqrt(Function):
    owns_grads = True

    def forward(self, a: Any) -> Any:
        self.out = self.m.sqrt(a)
        return self.out

    def backward(self, g: Any) -> tuple[Any, ...]:
        # d sqrt(x) = 1 / (2 sqrt(x))
        return (self.m.div(g, self.m.mul(self.out, 2.0)),)


class _Amax(Function):
    owns_grads = True

    def forward(self, a: Any, dims: tuple[int, ...], keepdim: bool) -> Any:
        self.a, self.dims = a, dims
        self.values = self.m.max(a, dims, True)
        if keepdim:
            return self.values
        return self.m.reshape(self.values, tuple(n for i, n in enumerate(_shape(a)) if i not in dims))

    def backward(self, g: Any) -> tuple[Any, ...]:
        # As torch.amax: the gradient is split evenly among the elements equal to the maximum.
        m = self.m
        ties = m.eq(self.a, self.values)
        share = m.div(m.reshape(g, _shape(self.values)), m.sum(ties, self.dims, True))
        return m.mul(ties, share), None, None


class _MaxDim(Function):
    owns_grads = True

    def forward(self, a: Any, dim: int, keepdim: bool, index: Any) -> Any:
        self.dim, self.size, self.index = dim, a.shape[dim], index
        return self.m.max(a, (dim,), keepdim)

    def backward(self, g: Any) -> tuple[Any, ...]:
        g = self.m.reshape(g, _shape(self.index))
        return self.m.scatter_dim(g, self.index, self.dim, self.size), None, None, None


def _legacy_empty(shape: tuple[int, ...]) -> bool:
    """A 1-D empty tensor, which ``torch.cat`` skips beside tensors of any rank."""
    return shape == (0,)


class _Cat(Function):
    owns_grads = True

    def forward(self, *arrays: Any, dim: int) -> Any:
        # The legacy empty (0,) pieces are skipped (cat() checked the others' shapes), unless all are.
        joined = [a for a in arrays if not _legacy_empty(_shape(a))] or list(arrays)
        shape = list(_shape(joined[0]))
        shape[dim] = sum(a.shape[dim] for a in joined)
        out = self.m.full(tuple(shape), 0.0, arrays[0].dtype)
        self.strides = _contiguous(tuple(shape))
        self.pieces: list[tuple[tuple[int, ...], int | None]] = []
        offset = 0
        for a in arrays:
            if len(joined) < len(arrays) and _legacy_empty(_shape(a)):
                self.pieces.append(((0,), None))
                continue
            self.m.scatter_strided_(out, a, self.strides, offset)
            self.pieces.append((_shape(a), offset))
            offset += a.shape[dim] * self.strides[dim]
        return out

    def backward(self, g: Any) -> tuple[Any, ...]:
        grads = []
        for (shape, offset), need in zip(self.pieces, self.needs_grad):
            if not need:
                grads.append(None)
            elif offset is None:  # a skipped (0,) piece
                grads.append(self.m.full(shape, 0.0, g.dtype))
            else:
                grads.append(self.m.as_strided(g, shape, self.strides, offset))
        return tuple(grads)


def _tensor_list(tensors: Any, op: str) -> list[Tensor]:
    if isinstance(tensors, Tensor) or not isinstance(tensors, Iterable):
        raise TypeError(f"{op}: tensors should be a sequence of Tensors, got {type(tensors).__name__}")
    ts = list(tensors)
    if not ts:
        raise ValueError(f"{op}: tensors should not be empty")
    for i, t in enumerate(ts):
        if not isinstance(t, Tensor):
            raise TypeError(f"{op}: tensors[{i}] should be a Tensor, got {type(t).__name__}")
    _common_backend(ts, op)
    dtype = functools.reduce(np.promote_types, (t.dtype for t in ts))
    if dtype.kind == "f":
        ts[0]._be.check_dtype(dtype, f"{op}: the result dtype")
    return [t if t.dtype == dtype else _Cast.apply(t, dtype) for t in ts]


def cat(tensors: Sequence[Tensor], dim: int = 0) -> Tensor:
    """The tensors joined along the existing dimension ``dim``, as ``torch.cat``; their other sizes
    must match. Mixed dtypes promote (NOTE [ Mixed dtypes ]). The backward slices the gradient.
    As in PyTorch, 1-D empty tensors (shape ``(0,)``) are skipped beside tensors of any rank.

    Example::

        >>> import taifuse
        >>> taifuse.set_backend("numpy")
        >>> taifuse.cat([taifuse.tensor([[1.0]]), taifuse.tensor([[2.0, 3.0]])], dim=1).numpy()
        array([[1., 2., 3.]], dtype=float32)
    """
    ts = _tensor_list(tensors, "cat")
    for i, t in enumerate(ts):
        if not t.ndim:
            raise ValueError(f"cat: zero-dimensional tensor (at position {i}) cannot be concatenated")
    # As torch.cat: 1-D empty tensors (shape (0,)) are skipped beside the others, whatever their
    # rank; ``dim`` refers to the first of those others (any dim goes when all are empty).
    joined = [i for i, t in enumerate(ts) if not _legacy_empty(t.shape)]
    if not joined:
        if isinstance(dim, bool) or not isinstance(dim, numbers.Integral):
            raise TypeError(f"cat: dim should be an int, got {dim!r}")
        return _Cat.apply(*ts, dim=0)
    k = joined[0]
    d = _dim(dim, ts[k].ndim, "cat")
    first = ts[k].shape
    for i in joined:
        t = ts[i]
        if t.ndim != len(first) or any(a != b for j, (a, b) in enumerate(zip(t.shape, first)) if j != d):
            note = (
                " (an empty tensor is skipped only when it is 1-D, of shape (0,), as in torch.cat)"
                if 0 in t.shape or 0 in first
                else ""
            )
            raise ValueError(
                f"cat: sizes of tensors must match except in dimension {d}: tensors[{k}] has shape {first}, "
                f"tensors[{i}] has shape {t.shape}{note}"
            )
    return _Cat.apply(*ts, dim=d)


def stack(tensors: Sequence[Tensor], dim: int = 0) -> Tensor:
    """The tensors (all of one shape) joined along a new dimension ``dim``, as ``torch.stack``.

    Example::

        >>> import taifuse
        >>> taifuse.set_backend("numpy")
        >>> taifuse.stack([taifuse.tensor([1.0, 2.0]), taifuse.tensor([3.0, 4.0])], dim=1).shape
        (2, 2)
    """
    ts = _tensor_list(tensors, "stack")
    for i, t in enumerate(ts):
        if t.shape != ts[0].shape:
            raise ValueError(
                f"stack: expects each tensor to be equal size, but got {ts[0].shape} at entry 0 and "
                f"{t.shape} at entry {i}"
            )
    d = _dim(dim, ts[0].ndim + 1, "stack")
    return _Cat.apply(*(t.unsqueeze(d) for t in ts), dim=d)


def tensors_in(values: Iterable[Any]) -> bool:
    """Whether any of ``values`` is a Tensor (the functional ops' dispatch test)."""
    return any(isinstance(v, Tensor) for v in values)
