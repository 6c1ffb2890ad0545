"""A small reverse-mode autograd ``Tensor`` on the active backend's arrays.

A :class:`Tensor` holds one array of the backend that was active when it was created
(``numpy.ndarray`` on the ``numpy`` and ``numba`` backends) and, when it came out of a
differentiable op, the :class:`Function` node that made it. ``loss.backward()`` walks those nodes
in reverse topological order (iteratively: a deep MLP is a long chain) and each node's backward
calls its backend's hand-written backward kernel; gradients accumulate into the ``.grad`` of leaf
tensors that ``requires_grad``.

Arithmetic (``+ - * / @``, ``sum``, ``mean``, ``reshape``, ``.T``) goes through
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
from collections.abc import Callable, Iterable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from taifuse import backends
from taifuse._tensor_math import astype, math_for, sum_to_shape

if TYPE_CHECKING:  # annotations only: typing.Self is Python 3.11+
    from typing_extensions import Self

__all__ = ["Function", "GradSlot", "Tensor", "enable_grad", "is_grad_enabled", "no_grad", "tensor"]

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
    what the backward needs on ``self``; :meth:`release` drops it after a backward pass.
    """

    be: ModuleType  # the backend the forward ran on; the backward runs there too
    m: Any  # its tensor math (taifuse._tensor_math)
    needs_grad: tuple[bool, ...]
    # True when backward returns freshly allocated arrays, none of them shared with another
    # input, an output or saved state: a leaf's first gradient then takes the array, not a copy.
    owns_grads: bool = False

    def __init__(self) -> None:
        self.parents: tuple[Tensor | None, ...] = ()
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
        data = ctx.forward(*(a._data if isinstance(a, Tensor) else a for a in args), **kwargs)
        out = Tensor._wrap(data, be)
        if record:
            ctx.parents = tuple(a if isinstance(a, Tensor) else None for a in args)
            out._ctx = ctx
            out._requires_grad = True
        return out

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def backward(self, grad: Any) -> tuple[Any, ...]:
        raise NotImplementedError

    def release(self) -> None:
        """Drop what the forward saved and the links to the inputs (after a backward pass without
        ``retain_graph``), so that the intermediates are freed while the output lives on."""
        self.__dict__ = {k: self.__dict__[k] for k in ("be", "m", "needs_grad")}
        self.parents = ()
        self.released = True

    def __repr__(self) -> str:
        return f"<{type(self).__name__}>"


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
        return _MatMul.apply(*_promoted(self, other, self, "matmul", scalars=False))

    def __rmatmul__(self, other: Any) -> Tensor:
        return _MatMul.apply(*_promoted(other, self, self, "matmul", scalars=False))

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
                value = self._be.from_numpy(np.ascontiguousarray(value))
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
        return _Sum.apply(self, _normalize_dims(dim, self.ndim, "sum"), bool(keepdim), False)

    def mean(self, dim: int | Sequence[int] | None = None, keepdim: bool = False) -> Tensor:
        """Mean over ``dim`` (all dimensions when ``None``)."""
        return _Sum.apply(self, _normalize_dims(dim, self.ndim, "mean"), bool(keepdim), True)

    def reshape(self, *shape: Any) -> Tensor:
        """The same data in ``shape`` (one entry may be -1)."""
        if len(shape) == 1 and not isinstance(shape[0], numbers.Integral):
            shape = tuple(shape[0])
        return _Reshape.apply(self, _resolve_shape(shape, self.shape))

    def transpose(self, dim0: int, dim1: int) -> Tensor:
        """Swap dimensions ``dim0`` and ``dim1``."""
        dims = [_normalize_dims(d, self.ndim, "transpose") for d in (dim0, dim1)]
        axes = list(range(self.ndim))
        if self.ndim:  # a 0-d tensor (dims 0 or -1) is its own transpose
            (d0,), (d1,) = dims
            axes[d0], axes[d1] = axes[d1], axes[d0]
        return _Transpose.apply(self, tuple(axes))

    @property
    def T(self) -> Tensor:
        """The tensor with its dimensions reversed (a matrix transposed)."""
        return _Transpose.apply(self, tuple(reversed(range(self.ndim))))


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
# 0-d Tensor does not widen a dimensioned one of the same kind (a NumPy array counts as
# dimensioned, as torch treats it). The operand of the other dtype goes through a differentiable
# cast (``_Cast``), so every input's gradient comes back in that input's own dtype, as in torch.
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
    dims = [isinstance(v, np.ndarray) or t.ndim > 0 for v, t in ((a, ta), (b, tb))]
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
        return Tensor._wrap(like._be.from_numpy(np.ascontiguousarray(arr)), like._be)
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


def _graph_order(root: Tensor) -> list[Tensor]:
    """Non-leaf tensors reachable from ``root``, each after every tensor it was computed from.

    An iterative depth-first post-order: recursion would overflow on long chains.
    """
    order: list[Tensor] = []
    seen: set[int] = set()
    stack: list[tuple[Tensor, bool]] = [(root, False)]
    while stack:
        t, finished = stack.pop()
        if finished:
            order.append(t)
            continue
        if id(t) in seen:
            continue
        seen.add(id(t))
        stack.append((t, True))
        for p in t._ctx.parents:  # type: ignore[union-attr]
            if p is not None and p._ctx is not None and id(p) not in seen:
                stack.append((p, False))
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
    order = _graph_order(root)
    pending: dict[int, Any] = {id(root): grad}
    del root, grad
    for i in range(len(order) - 1, -1, -1):
        # NOTE: each tensor leaves `order` as its node runs, and no local outlives its iteration,
        # so that arrays are freed as the backward goes (a checkpoint's segment boundaries and
        # recomputed activations, say), not when it ends. `pending` only ever holds the ids of
        # tensors still in `order`, so ids stay unique.
        t, order[i] = order[i], None
        g = pending.pop(id(t), None)
        ctx = t._ctx
        del t
        if g is None or ctx is None:
            continue
        if ctx.released:
            raise RuntimeError(_SECOND_BACKWARD)
        grads = ctx.backward(g)
        parents = ctx.parents
        if not retain_graph:
            ctx.release()
        for parent, pg, needed in zip(parents, grads, ctx.needs_grad):
            if parent is None or pg is None or not needed:
                continue
            if parent._ctx is None:
                _accumulate_leaf(parent, pg, m, owned=ctx.owns_grads)
            elif id(parent) in pending:
                pending[id(parent)] = m.add(pending[id(parent)], pg)
            else:
                pending[id(parent)] = pg
        g = grads = parents = parent = pg = None


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


def tensors_in(values: Iterable[Any]) -> bool:
    """Whether any of ``values`` is a Tensor (the functional ops' dispatch test)."""
    return any(isinstance(v, Tensor) for v in values)
