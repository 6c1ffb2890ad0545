"""A small reverse-mode autograd ``Tensor`` on the active backend's arrays.

A :class:`Tensor` holds one array of the backend that was active when it was created
(``numpy.ndarray`` on the ``numpy`` and ``numba`` backends) and, when it came out of a
differentiable op, the :class:`Function` node that made it. ``loss.backward()`` walks those nodes
in reverse topological order and each node's backward calls its backend's hand-written backward
kernel; gradients accumulate into the ``.grad`` of leaf tensors that ``requires_grad``.

This module is the Tensor's public face: its methods check their arguments and call the
Functions of taifuse/_tensor_functions.py (arithmetic, ``sum``, ``mean``, ``exp``, ``max``, ...,
and the views: indexing, ``reshape``, ``permute``, ``expand``, :func:`cat`, ...; NOTE [ Views ]
there), which compute through ``taifuse._tensor_math`` (NOTE [ Tensor storage ] there). The
engine (grad mode, ``Function``, the backward walk) is taifuse/_engine.py, the optimizers'
gradient slots taifuse/_grad_slots.py, and the Tensor's fields, as the rest of the package reads
them, taifuse/_internal.py. (The NOTEs this module names without a file, [ Mixed dtypes ],
[ Autocast ] and [ Views ], are in _tensor_functions.py.) The neural-network ops are ``taifuse.functional``'s, which return
differentiable Tensors when given Tensors.

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

import math
import numbers
from collections.abc import Iterable, Iterator, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from taifuse import _engine, backends
from taifuse._engine import Function, enable_grad, is_grad_enabled, no_grad
from taifuse._grad_slots import GradSlot, bind_storage, set_grad_slot, storage_is  # noqa: F401 (their old home)
from taifuse._internal import TensorCore, bump_version, register_tensor_class, share_version, wrap
from taifuse._tensor_functions import (
    Add,
    Amax,
    Cast,
    Cat,
    Contiguous,
    Div,
    Exp,
    Expand,
    IndexOutOfRange,
    Log,
    MaskedFill,
    MatMul,
    MaxDim,
    Mul,
    Neg,
    PowScalar,
    Reshape,
    Sqrt,
    Sub,
    Sum,
    Transpose,
    autocast_args,
    dim_index,
    getitem,
    is_scalar,
    legacy_empty,
    narrow,
    operand,
    promoted,
    setitem,
    shape_of,
    tensor_list,
)
from taifuse._tensor_math import astype, math_for, viewed

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


# ----------------------------------------------------------------------------- Tensor

_DEFAULT_FLOAT = np.dtype(np.float32)


class Tensor(TensorCore):
    """An array of the active backend with reverse-mode autograd.

    Create one with :func:`tensor`. Attributes follow PyTorch: ``shape``, ``dtype``, ``ndim``,
    ``requires_grad``, ``grad`` (a Tensor, accumulated by :meth:`backward`), ``is_leaf``,
    ``grad_fn``.

    dtypes follow PyTorch's type promotion (NOTE [ Mixed dtypes ] in _tensor_functions.py): ``a * b`` of float32 and
    float16 is float32, of float32 and float64 (a Tensor or a NumPy array) float64, each input's
    gradient in its own dtype; Python numbers take the Tensor's dtype, and a 0-d Tensor does not
    widen a dimensioned one. Nothing is narrowed silently: on the ``taichi`` backend, which has no
    float64, a float64 operand raises ``TypeError``. In-place ops keep the tensor's dtype and
    ``backward(gradient)`` casts ``gradient`` to the output's dtype, as PyTorch does.
    """

    # NumPy defers to Tensor's reflected operators (np_array + tensor -> Tensor.__radd__).
    __array_ufunc__ = None

    def __init__(self, data: Any, requires_grad: bool = False, dtype: Any = None) -> None:
        be = backends.active()
        m = math_for(be)
        if isinstance(data, Tensor):
            data = data.numpy()  # a copy below, outside the graph
        if be.is_array(data) and not isinstance(data, np.ndarray):
            arr = m.copy(data) if dtype is None else be.from_numpy(_host_array(be.to_numpy(data), dtype))
        else:
            arr = from_host(be, data, dtype)
        self._data = arr
        self._be = be
        self._ctx: Function | None = None
        self._requires_grad = False
        self._grad: Tensor | None = None
        self._version_counter = [0]
        if arr.dtype.kind == "f":
            be.check_dtype(arr.dtype, "tensor: dtype")
        self.requires_grad = requires_grad

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

    def register_post_accumulate_grad_hook(self, hook: Any) -> _engine.RemovableHandle:
        """Run ``hook(self)`` in every backward pass once this leaf's gradient of that pass is in
        ``self.grad`` (after the last contribution is added), as PyTorch's method of that name;
        returns a handle whose ``remove()`` unregisters it (NOTE [ Gradient hooks ] in _engine.py).

        Raises ``RuntimeError`` on a non-leaf or a tensor that does not require grad (PyTorch's
        rule), ``TypeError`` when ``hook`` is not callable.
        """
        if not callable(hook):
            raise TypeError(f"register_post_accumulate_grad_hook: hook should be callable, got {hook!r}")
        if self._ctx is not None:
            raise RuntimeError("post accumulate grad hooks cannot be registered on non-leaf tensors")
        if not self._requires_grad:
            raise RuntimeError("cannot register a hook on a tensor that doesn't require gradient")
        return _engine.register_post_accumulate_grad_hook(self, hook)

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
        """A tensor sharing this one's data and version counter, outside the graph
        (``requires_grad=False``); in-place changes to it change this one (NOTE [ Views ])."""
        out = wrap(self._data, self._be)
        if self._base is None:
            out._version_counter = self._version_counter
        else:  # a view stays one (its array may be strided), of the same base
            share_version(out, self, True)
        return out

    # -- memory (NOTE [ Views ])

    @property
    def _version(self) -> int:
        """How many in-place changes this tensor's memory has had (shared with its views), as
        PyTorch's ``_version`` (NOTE [ Version counters ] in _engine.py)."""
        return self._version_counter[0]

    def is_contiguous(self) -> bool:
        """Whether the data is laid out in C order without gaps, as ``torch.Tensor.is_contiguous``
        (a transpose, a strided slice or an expand on the host is not; device arrays always are).

        Example::

            >>> import numpy as np, taifuse
            >>> taifuse.set_backend("numpy")
            >>> x = taifuse.tensor(np.zeros((2, 3)))
            >>> x.is_contiguous(), x.t().is_contiguous()
            (True, False)
        """
        return not isinstance(self._data, np.ndarray) or bool(self._data.flags.c_contiguous)

    def contiguous(self) -> Tensor:
        """This tensor if :meth:`is_contiguous`, else a contiguous copy of it (from the pool) that
        autograd differentiates, as ``torch.Tensor.contiguous``.

        Example::

            >>> import numpy as np, taifuse
            >>> taifuse.set_backend("numpy")
            >>> y = taifuse.tensor(np.arange(6.0).reshape(2, 3)).t().contiguous()
            >>> y.is_contiguous(), y.stride()
            (True, (2, 1))
        """
        if self.is_contiguous():
            return self
        return Contiguous.apply(self)

    def stride(self, dim: int | None = None) -> Any:
        """The step in elements between neighbours along each dimension (or along ``dim``), as
        ``torch.Tensor.stride``: 0 along an expanded dimension, negative along a reversed slice
        (which PyTorch refuses to make).

        Example::

            >>> import numpy as np, taifuse
            >>> taifuse.set_backend("numpy")
            >>> taifuse.tensor(np.zeros((2, 3))).t().stride()
            (1, 3)
        """
        if isinstance(self._data, np.ndarray):
            strides = tuple(s // self._data.itemsize for s in self._data.strides)
        else:
            strides = _c_strides(self.shape)
        if dim is None:
            return strides
        return strides[dim_index(dim, self.ndim, "stride")] if self.ndim else 1

    def data_ptr(self) -> int:
        """The address of the first element, as ``torch.Tensor.data_ptr``: a view of another
        tensor's memory has an address inside it. Host backends only: a Taichi device array has
        no address that Python may read (``RuntimeError`` there).

        Example::

            >>> import numpy as np, taifuse
            >>> taifuse.set_backend("numpy")
            >>> x = taifuse.tensor(np.zeros((2, 3), np.float32))
            >>> x[1].data_ptr() - x.data_ptr()
            12
        """
        if isinstance(self._data, np.ndarray):
            return int(self._data.__array_interface__["data"][0])
        raise RuntimeError(
            f"data_ptr: a tensor on the {self._be.NAME!r} backend lives in device memory without a "
            "host address; compare views with is_contiguous()/stride() and _base instead"
        )

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
        return Cast.apply(self, target)

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
        if not self._requires_grad:
            raise RuntimeError("backward: this tensor does not require grad and has no grad_fn")
        m = math_for(self._be)
        if grad is None:
            shape = tuple(self._data.shape)
            if math.prod(shape) != 1:
                raise RuntimeError(
                    f"backward: grad can be implicitly created only for one-element outputs, got shape {shape}"
                )
            g = m.full(shape, 1.0, self._data.dtype)
        else:
            g = _as_array_like(grad, self, "backward: grad")
            if tuple(g.shape) != self.shape:
                raise ValueError(
                    f"backward: grad has shape {tuple(g.shape)} but the tensor has shape {self.shape}"
                )
        _engine.run_backward(self, g, retain_graph)

    # -- arithmetic

    def _binary(self, fn: type[Function], other: Any, reflected: bool = False) -> Tensor:
        op = fn.__name__.lstrip("_").lower()
        a, b = (other, self) if reflected else (self, other)
        return fn.apply(*promoted(a, b, self, op))

    def __add__(self, other: Any) -> Tensor:
        return self._binary(Add, other)

    def __radd__(self, other: Any) -> Tensor:
        return self._binary(Add, other, reflected=True)

    def __sub__(self, other: Any) -> Tensor:
        return self._binary(Sub, other)

    def __rsub__(self, other: Any) -> Tensor:
        return self._binary(Sub, other, reflected=True)

    def __mul__(self, other: Any) -> Tensor:
        return self._binary(Mul, other)

    def __rmul__(self, other: Any) -> Tensor:
        return self._binary(Mul, other, reflected=True)

    def __truediv__(self, other: Any) -> Tensor:
        return self._binary(Div, other)

    def __rtruediv__(self, other: Any) -> Tensor:
        return self._binary(Div, other, reflected=True)

    def __matmul__(self, other: Any) -> Tensor:
        return self._matmul(self, other)

    def __rmatmul__(self, other: Any) -> Tensor:
        return self._matmul(other, self)

    def _matmul(self, a: Any, b: Any) -> Tensor:
        # Autocast first (NOTE [ Autocast ]), so that a float16 operand is not promoted to float32
        # and cast back.
        a, b = autocast_args("lower", operand(a, self, "matmul", False), operand(b, self, "matmul", False))
        return MatMul.apply(*promoted(a, b, self, "matmul", scalars=False))

    # NOTE [ In-place ops ]
    # ``p -= lr * p.grad`` updates the array in place, for optimizer steps under ``no_grad``. With
    # grad mode on, a tensor that requires grad refuses (PyTorch rebases a non-leaf's graph
    # instead; here that is refused, with this error), and so does a view made under no_grad of
    # one (as PyTorch). An expanded view (stride 0) refuses always, as in PyTorch. Every in-place
    # change bumps the version counter the tensor shares with its views, so a graph that saved
    # the old values raises at backward instead of differentiating at the wrong ones (NOTE
    # [ Version counters ] in _engine.py). In-place changes to a view change its base and the
    # other views of it (NOTE [ Views ]).
    def _check_writable(self, op: str) -> None:
        if is_grad_enabled():
            if self._requires_grad:
                raise RuntimeError(
                    f"in-place {op} on a tensor that requires grad; wrap the update in taifuse.no_grad()"
                )
            if self._no_grad_view:
                raise RuntimeError(
                    f"in-place {op}: this view was created in no_grad mode of a tensor that requires grad "
                    "and is being modified in place with grad mode enabled, which autograd cannot track; "
                    "modify it under taifuse.no_grad() too, or make the view with grad mode enabled"
                )
        if isinstance(self._data, np.ndarray) and not self._data.flags.writeable:
            raise RuntimeError(
                f"in-place {op}: unsupported operation: more than one element of the written-to tensor "
                "refers to a single memory location (an expand()ed tensor). Please clone() the tensor "
                "before performing the operation."
            )

    def _inplace(self, other: Any, op: str) -> Self:
        self._check_writable(op)
        m = math_for(self._be)
        if (
            isinstance(other, np.ndarray)
            and other.dtype.kind in "fiub"
            and (self.dtype.kind == "f" or other.dtype.kind != "f")
        ):
            other = other.astype(self.dtype)  # the tensor's dtype, cast on the host before any upload
        integral = isinstance(other, numbers.Integral)
        other = operand(other, self, op)
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
        if np.broadcast_shapes(self.shape, shape_of(value)) != self.shape:
            raise ValueError(
                f"in-place {op}: operand of shape {shape_of(value)} does not broadcast to {self.shape}"
            )
        getattr(m, op)(self._data, value)
        bump_version(self)
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
        self._check_writable("copy_")
        m = math_for(self._be)
        value = self._assigned(src, "copy_: src")
        if np.broadcast_shapes(self.shape, shape_of(value)) != self.shape:
            raise ValueError(f"copy_: src of shape {shape_of(value)} does not broadcast to {self.shape}")
        if isinstance(self._data, np.ndarray):
            np.copyto(self._data, value, casting="unsafe")
        else:
            # NOTE: a device math has no assignment kernel; -0.0 + x is x for every x (signed zeros
            # and NaN included), so a fill and an add copy exactly.
            m.fill_(self._data, -0.0)
            m.add_(self._data, value)
        bump_version(self)
        return self

    def _assigned(self, src: Any, what: str) -> Any:
        """``src`` (a Tensor on this backend, a NumPy array or a number) as an array of this
        tensor's backend and dtype, to be written into it."""
        if isinstance(src, Tensor):
            if src._be is not self._be:
                raise TypeError(f"{what} lives on backend {src._be.NAME!r}, the tensor on {self._be.NAME!r}")
            return src._data if src.dtype == self.dtype else astype(math_for(self._be), src._data, self.dtype)
        if isinstance(src, np.ndarray) or is_scalar(src):
            value = np.asarray(src, dtype=self.dtype)
            if not isinstance(self._data, np.ndarray):
                value = self._be.from_numpy(np.asarray(value, order="C"))
            return value
        raise TypeError(f"{what} should be a Tensor, numpy.ndarray or number, got {type(src).__name__}")

    def __setitem__(self, index: Any, value: Any) -> None:
        """``t[index] = value`` in place, as PyTorch, for a basic index (ints, slices, ``None``,
        ``...``; an integer array index raises ``TypeError``): ``value`` (a Tensor, NumPy array
        or number) broadcast to the indexed shape and cast to this tensor's dtype. The in-place
        rules of ``+=`` apply (NOTE [ In-place ops ]); so ``t[i] += 1`` works on every backend.

        Example::

            >>> import numpy as np, taifuse
            >>> taifuse.set_backend("numpy")
            >>> t = taifuse.tensor(np.zeros((2, 3), np.float32))
            >>> t[:, 1] = 5.0
            >>> t[0] += 1.0
            >>> t.numpy()
            array([[1., 6., 1.],
                   [0., 5., 0.]], dtype=float32)
        """
        self._check_writable("index assignment")
        bump_version(self, setitem(self, index, self._assigned(value, "index assignment: value")))

    def add_(self, other: Any) -> Self:
        """``self += other`` in place, as ``torch.Tensor.add_`` (NOTE [ In-place ops ])."""
        return self._inplace(other, "add_")

    def sub_(self, other: Any) -> Self:
        """``self -= other`` in place, as ``torch.Tensor.sub_`` (NOTE [ In-place ops ])."""
        return self._inplace(other, "sub_")

    def mul_(self, other: Any) -> Self:
        """``self *= other`` in place, as ``torch.Tensor.mul_`` (NOTE [ In-place ops ])."""
        return self._inplace(other, "mul_")

    def zero_(self) -> Self:
        """Fill with zeros in place (``optimizer.zero_grad(set_to_none=False)`` does this to ``.grad``)."""
        self._check_writable("zero_")
        math_for(self._be).fill_(self._data, 0.0)
        bump_version(self)
        return self

    def __neg__(self) -> Tensor:
        return Neg.apply(self)

    def __pos__(self) -> Tensor:
        return self

    def __pow__(self, exponent: Any) -> Tensor:
        if not is_scalar(exponent) or not math.isfinite(float(exponent)):
            raise TypeError(f"pow: the exponent should be a finite real number, got {exponent!r}")
        return PowScalar.apply(self, float(exponent))

    def sum(self, dim: int | Sequence[int] | None = None, keepdim: bool = False) -> Tensor:
        """Sum over ``dim`` (all dimensions when ``None``)."""
        (a,) = autocast_args("float32", self)
        dims = None if dim is None else _normalize_dims(dim, self.ndim, "sum")
        return Sum.apply_one(a, dims, bool(keepdim), False)

    def mean(self, dim: int | Sequence[int] | None = None, keepdim: bool = False) -> Tensor:
        """Mean over ``dim`` (all dimensions when ``None``)."""
        (a,) = autocast_args("float32", self)
        return Sum.apply_one(a, _normalize_dims(dim, self.ndim, "mean"), bool(keepdim), True)

    def reshape(self, *shape: Any) -> Tensor:
        """The same data in ``shape`` (one entry may be -1): a view when the strides allow one
        (always for contiguous data), else a copy, as ``torch.Tensor.reshape`` (NOTE [ Views ])."""
        if len(shape) == 1 and not isinstance(shape[0], numbers.Integral):
            shape = tuple(shape[0])
        return Reshape.apply(self, _resolve_shape(shape, self.shape))

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
            dim_index(d, ndim, "flatten", name) for d, name in ((start_dim, "start_dim"), (end_dim, "end_dim"))
        )
        if start > end:
            raise ValueError(f"flatten: start_dim ({start_dim}) should not come after end_dim ({end_dim})")
        shape = self.shape or (1,)
        return self.reshape(shape[:start] + (math.prod(shape[start : end + 1]),) + shape[end + 1 :])

    def transpose(self, dim0: int, dim1: int) -> Tensor:
        """Swap dimensions ``dim0`` and ``dim1``: a view on the host backends, a copy on taichi
        (NOTE [ Views ]).

        Example::

            >>> import taifuse
            >>> taifuse.set_backend("numpy")
            >>> taifuse.tensor([[1.0, 2.0, 3.0]]).transpose(0, 1).shape
            (3, 1)
        """
        d0, d1 = (dim_index(d, self.ndim, "transpose", name) for d, name in ((dim0, "dim0"), (dim1, "dim1")))
        axes = list(range(self.ndim))
        if self.ndim:  # a 0-d tensor (dims 0 or -1) is its own transpose
            axes[d0], axes[d1] = axes[d1], axes[d0]
        return Transpose.apply(self, tuple(axes))

    @property
    def T(self) -> Tensor:
        """The tensor with its dimensions reversed (a matrix transposed); a view as :meth:`transpose`."""
        return Transpose.apply(self, tuple(reversed(range(self.ndim))))

    def t(self) -> Tensor:
        """A matrix transposed (a tensor of at most 2 dimensions), as ``torch.Tensor.t``; a view
        as :meth:`transpose`.

        Example::

            >>> import taifuse
            >>> taifuse.set_backend("numpy")
            >>> taifuse.tensor([[1.0, 2.0, 3.0]]).t().shape
            (3, 1)
        """
        if self.ndim > 2:
            raise ValueError(f"t: expects a tensor with <= 2 dimensions, but self is {self.ndim}D")
        return Transpose.apply(self, tuple(reversed(range(self.ndim))))

    @property
    def mT(self) -> Tensor:
        """The last two dimensions swapped (a batch of matrices transposed), as ``torch.Tensor.mT``;
        a view as :meth:`transpose`."""
        if self.ndim < 2:
            raise ValueError(
                f"mT: tensor.mT is only supported on matrices or batches of matrices, got {self.ndim}-D"
            )
        return self.transpose(-2, -1)

    # -- views (NOTE [ Views ])

    def view(self, *shape: Any) -> Tensor:
        """The same data in ``shape`` (one entry may be -1), as ``torch.Tensor.view``.

        The result shares the data, and ``backward`` reshapes the gradient back. As PyTorch's, it
        raises ``RuntimeError`` where the strides cannot express the new shape (a transposed
        tensor flattened): use :meth:`reshape` (which copies there) or :meth:`contiguous` first.

        Example::

            >>> import taifuse
            >>> taifuse.set_backend("numpy")
            >>> taifuse.tensor([1.0, 2.0, 3.0, 4.0]).view(2, -1).shape
            (2, 2)
        """
        if len(shape) == 1 and not isinstance(shape[0], numbers.Integral):
            shape = tuple(shape[0])
        new = _resolve_shape(shape, self.shape)
        if isinstance(self._data, np.ndarray) and viewed(self._data, new) is None:
            raise RuntimeError(
                f"view size is not compatible with input tensor's size and stride (at least one dimension "
                f"spans across two contiguous subspaces): shape {self.shape}, strides {self.stride()}, "
                f"view {new}. Use .reshape(...) instead."
            )
        return Reshape.apply(self, new)

    def permute(self, *dims: Any) -> Tensor:
        """The dimensions reordered: dimension ``i`` of the result is ``dims[i]`` of this tensor; a
        view as :meth:`transpose`.

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
        axes = tuple(dim_index(d, self.ndim, "permute", "dims") for d in dims)
        if len(set(axes)) != len(axes):
            raise ValueError(f"permute: dims {dims} repeats a dimension")
        return Transpose.apply(self, axes)

    def unsqueeze(self, dim: int) -> Tensor:
        """A new dimension of size 1 at ``dim`` (in ``[-ndim - 1, ndim]``); shares the data as a reshape.

        Example::

            >>> import taifuse
            >>> taifuse.set_backend("numpy")
            >>> taifuse.tensor([1.0, 2.0]).unsqueeze(-1).shape
            (2, 1)
        """
        d = dim_index(dim, self.ndim + 1, "unsqueeze")
        return Reshape.apply(self, self.shape[:d] + (1,) + self.shape[d:])

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
            dims = {dim_index(d, self.ndim, "squeeze") for d in names}
        shape = tuple(n for i, n in enumerate(self.shape) if not (i in dims and n == 1))
        return Reshape.apply(self, shape)

    def expand(self, *sizes: Any) -> Tensor:
        """This tensor repeated along its size-1 dimensions (and new leading ones) to ``sizes``; -1
        keeps a dimension's size. The backward sums the gradient over the repeats. On the host a
        view with stride 0 along the repeats, which in-place ops refuse, as PyTorch's (a copy on
        taichi: NOTE [ Views ]).

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
        return Expand.apply(self, tuple(shape))

    def split(self, split_size_or_sections: int | Sequence[int], dim: int = 0) -> tuple[Tensor, ...]:
        """Pieces along ``dim``: of ``split_size_or_sections`` entries each (the last may be shorter),
        or of the listed sizes. Each piece is a view on the host backends, a copy on taichi (NOTE
        [ Views ]).

        Example::

            >>> import taifuse
            >>> taifuse.set_backend("numpy")
            >>> [p.shape for p in taifuse.tensor([1.0, 2.0, 3.0, 4.0, 5.0]).split(2)]
            [(2,), (2,), (1,)]
        """
        if not self.ndim:
            raise ValueError("split: expects at least a 1-dimensional tensor")
        d = dim_index(dim, self.ndim, "split")
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
            pieces.append(narrow(self, d, start, int(k)))
            start += k
        return tuple(pieces)

    def chunk(self, chunks: int, dim: int = 0) -> tuple[Tensor, ...]:
        """At most ``chunks`` pieces of ``ceil(size / chunks)`` entries along ``dim`` (the last may be
        shorter), as ``torch.chunk``. Each piece is a view as in :meth:`split`.

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
        n = self.shape[dim_index(dim, self.ndim, "chunk")]
        return self.split(-(-n // int(chunks)) if n else 0, dim)

    def unbind(self, dim: int = 0) -> tuple[Tensor, ...]:
        """The entries along ``dim``, that dimension removed, as ``torch.unbind``; each is a view as
        in :meth:`__getitem__`.

        Example::

            >>> import taifuse
            >>> taifuse.set_backend("numpy")
            >>> [r.numpy().tolist() for r in taifuse.tensor([[1.0, 2.0], [3.0, 4.0]]).unbind(1)]
            [[1.0, 3.0], [2.0, 4.0]]
        """
        if not self.ndim:
            raise ValueError("unbind: dimension specified as 0 but tensor has no dimensions")
        d = dim_index(dim, self.ndim, "unbind")
        lead = (slice(None),) * d
        return tuple(self[lead + (i,)] for i in range(self.shape[d]))

    def __iter__(self) -> Iterator[Tensor]:
        """The entries along the first dimension (``for row in t``), as PyTorch; each is a view as
        in :meth:`__getitem__`."""
        if not self.shape:
            raise TypeError("iteration over a 0-d tensor")
        return (self[i] for i in range(self.shape[0]))

    def __getitem__(self, index: Any) -> Tensor:
        """NumPy/PyTorch indexing: ints, slices (any step, negative too, which PyTorch refuses),
        ``None``, ``...``, and one integer array, list or Tensor along one dimension. Basic indexing
        (no array) returns a view on the host backends, as PyTorch's; an array index, and any
        index on taichi, a copy (NOTE [ Views ]). The backward scatters the gradient back
        (repeated indices accumulate).

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
        return getitem(self, index)

    # -- elementwise math

    def exp(self) -> Tensor:
        """e ** x, elementwise.

        Example::

            >>> import taifuse
            >>> taifuse.set_backend("numpy")
            >>> taifuse.tensor([0.0]).exp().numpy()
            array([1.], dtype=float32)
        """
        return Exp.apply(_require_float_tensor(self, "exp"))

    def log(self) -> Tensor:
        """Natural logarithm, elementwise (NaN below 0, -inf at 0).

        Example::

            >>> import taifuse
            >>> taifuse.set_backend("numpy")
            >>> taifuse.tensor([1.0]).log().numpy()
            array([0.], dtype=float32)
        """
        return Log.apply(_require_float_tensor(self, "log"))

    def sqrt(self) -> Tensor:
        """Square root, elementwise (NaN below 0).

        Example::

            >>> import taifuse
            >>> taifuse.set_backend("numpy")
            >>> taifuse.tensor([4.0]).sqrt().numpy()
            array([2.], dtype=float32)
        """
        return Sqrt.apply(_require_float_tensor(self, "sqrt"))

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
        if not is_scalar(value):
            raise TypeError(f"masked_fill: value should be a real number, got {type(value).__name__}")
        mask_arr = _mask_operand(mask, self)
        try:
            np.broadcast_shapes(self.shape, shape_of(mask_arr))
        except ValueError:
            raise ValueError(
                f"masked_fill: mask of shape {shape_of(mask_arr)} does not broadcast with the tensor's shape {self.shape}"
            ) from None
        return MaskedFill.apply(self, mask_arr, float(value))

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
        dims = tuple(dim_index(d, self.ndim, "amax") for d in names) if self.ndim else ()
        if len(set(dims)) != len(dims):
            raise ValueError(f"amax: dim {dim!r} repeats a dimension")
        dims = dims if names else tuple(range(self.ndim))
        for d in dims:
            if self.shape[d] == 0:
                raise IndexOutOfRange(f"amax: expected reduction dim {d} to have non-zero size")
        if not self.ndim:
            return Reshape.apply(self, ())
        return Amax.apply(self, dims, bool(keepdim))

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
        d = dim_index(dim, self.ndim, "max")
        src = Reshape.apply(self, (1,)) if not self.ndim else self
        keepdim = bool(keepdim) and self.ndim > 0
        if src.shape[d] == 0:
            raise IndexOutOfRange(f"max: expected reduction dim {d} to have non-zero size")
        m = math_for(self._be)
        idx = m.argmax(src._data, d, True)
        values = MaxDim.apply(src, d, keepdim, idx)
        if not keepdim:
            idx = m.reshape(idx, values.shape)
        return MaxResult(values, wrap(idx, self._be))


register_tensor_class(Tensor)  # what taifuse._internal.wrap makes


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


def from_host(be: ModuleType, data: Any, dtype: Any) -> Any:
    """A copy of host ``data`` on backend ``be``: what ``Tensor(data)`` holds. One function, which
    ``taifuse.compile`` records when ``data`` is a step's input (NOTE [ Compiled inputs ])."""
    return be.from_numpy(_host_array(data, dtype))


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
    if isinstance(value, np.ndarray) or is_scalar(value):
        return like._be.from_numpy(np.array(value, dtype=like.dtype, order="C"))
    raise TypeError(f"{what} should be a Tensor or numpy.ndarray, got {type(value).__name__}")


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


def _c_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


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


class MaxResult(NamedTuple):
    """What ``Tensor.max(dim)`` returns, as ``torch.return_types.max``."""

    values: Tensor
    indices: Tensor


def _require_float_tensor(t: Tensor, op: str) -> Tensor:
    if t.dtype.kind != "f":
        raise TypeError(f"{op}: needs a floating-point tensor, got dtype {t.dtype}")
    return t


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
    ts = tensor_list(tensors, "cat")
    for i, t in enumerate(ts):
        if not t.ndim:
            raise ValueError(f"cat: zero-dimensional tensor (at position {i}) cannot be concatenated")
    # As torch.cat: 1-D empty tensors (shape (0,)) are skipped beside the others, whatever their
    # rank; ``dim`` refers to the first of those others (any dim goes when all are empty).
    joined = [i for i, t in enumerate(ts) if not legacy_empty(t.shape)]
    if not joined:
        if isinstance(dim, bool) or not isinstance(dim, numbers.Integral):
            raise TypeError(f"cat: dim should be an int, got {dim!r}")
        return Cat.apply(*ts, dim=0)
    k = joined[0]
    d = dim_index(dim, ts[k].ndim, "cat")
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
    return Cat.apply(*ts, dim=d)


def stack(tensors: Sequence[Tensor], dim: int = 0) -> Tensor:
    """The tensors (all of one shape) joined along a new dimension ``dim``, as ``torch.stack``.

    Example::

        >>> import taifuse
        >>> taifuse.set_backend("numpy")
        >>> taifuse.stack([taifuse.tensor([1.0, 2.0]), taifuse.tensor([3.0, 4.0])], dim=1).shape
        (2, 2)
    """
    ts = tensor_list(tensors, "stack")
    for i, t in enumerate(ts):
        if t.shape != ts[0].shape:
            raise ValueError(
                f"stack: expects each tensor to be equal size, but got {ts[0].shape} at entry 0 and "
                f"{t.shape} at entry {i}"
            )
    d = dim_index(dim, ts[0].ndim + 1, "stack")
    return Cat.apply(*(t.unsqueeze(d) for t in ts), dim=d)


def tensors_in(values: Iterable[Any]) -> bool:
    """Whether any of ``values`` is a Tensor (the functional ops' dispatch test)."""
    for v in values:  # a loop, not any() over a generator: every functional call asks
        if isinstance(v, Tensor):
            return True
    return False
