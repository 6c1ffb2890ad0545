"""The Functions of the Tensor methods (arithmetic, casts, reductions, views and indexing) and
the argument handling they share: dtype promotion (NOTE [ Mixed dtypes ]), autocast's casts
(NOTE [ Autocast ]) and index arithmetic.

taifuse/tensor.py checks a method's arguments and calls the Function here under its public name
(the table at the end); the classes keep their ``_``-names, which ``grad_fn`` reprs and the
profiler's rows show. The Functions of the functional ops are in taifuse/_autograd_ops.py.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Iterable
from typing import Any

import numpy as np

from taifuse import _autocast_state
from taifuse._engine import Function, is_grad_enabled
from taifuse._internal import TensorCore, backend, common_backend, data, is_tensor, wrap
from taifuse._tensor_math import astype, expanded, math_for, sum_to_shape, transposed


def is_scalar(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


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


def promoted(a: Any, b: Any, like: TensorCore, op: str, scalars: bool = True) -> tuple[Any, Any]:
    """The operands of binary op ``op`` (one of them ``like``), as Tensors of one dtype or numbers."""
    ta, tb = operand(a, like, op, scalars), operand(b, like, op, scalars)
    if not (is_tensor(ta) and is_tensor(tb)) or ta.dtype == tb.dtype:
        return ta, tb
    # Against a NumPy array PyTorch promotes fully, whatever either operand's rank.
    array = isinstance(a, np.ndarray) or isinstance(b, np.ndarray)
    dims = [array or t.ndim > 0 for t in (ta, tb)]
    dtype = _result_dtype(ta.dtype, dims[0], tb.dtype, dims[1])
    if dtype.kind == "f":
        backend(like).check_dtype(dtype, f"{op}: the result of dtypes {ta.dtype} and {tb.dtype}")
    return tuple(t if t.dtype == dtype else _Cast.apply(t, dtype) for t in (ta, tb))  # type: ignore[return-value]


def operand(value: Any, like: TensorCore, op: str, scalars: bool = True) -> Any:
    """One operand of a binary op: a Tensor (a NumPy array becomes a constant one), or a Python
    number kept as a number."""
    if is_tensor(value):
        if backend(value) is not backend(like):
            raise TypeError(
                f"{op}: tensors live on different backends ({backend(like).NAME!r} and {backend(value).NAME!r}); "
                "create them under the same backend"
            )
        return value
    if scalars and is_scalar(value):
        # Weak, as in torch: a float for a float tensor, an integer stays one for an integer tensor.
        return int(value) if like.dtype.kind != "f" and isinstance(value, numbers.Integral) else float(value)
    if isinstance(value, np.ndarray):
        if value.dtype.kind in "biu":
            # An integer array takes the float operand's dtype, as in torch; cast here, on the host.
            arr = value.astype(like.dtype if like.dtype.kind == "f" else np.int64)
        elif value.dtype.kind == "f":
            backend(like).check_dtype(value.dtype, f"{op}: operand")
            arr = value
        else:
            raise TypeError(f"{op}: unsupported operand of dtype {value.dtype}")
        # NOTE: not np.ascontiguousarray, which turns a 0-d array into shape (1,).
        return wrap(backend(like).from_numpy(np.asarray(arr, order="C")), backend(like))
    raise TypeError(f"{op}: unsupported operand of type {type(value).__name__}")


# ----------------------------------------------------------------------------- arithmetic nodes


class _Method(Function):
    """A Tensor method's node: its math (``taifuse._tensor_math``) takes arrays of any strides."""

    strided = True


def shape_of(v: Any) -> tuple[int, ...]:
    return tuple(v.shape) if hasattr(v, "shape") else ()


class _Add(_Method):
    def forward(self, a: Any, b: Any) -> Any:
        self.shapes = (shape_of(a), shape_of(b))
        return self.m.add(a, b)

    def backward(self, g: Any) -> tuple[Any, ...]:
        return tuple(sum_to_shape(self.m, g, s) if n else None for s, n in zip(self.shapes, self.needs_grad))


class _Sub(_Method):
    def forward(self, a: Any, b: Any) -> Any:
        self.shapes = (shape_of(a), shape_of(b))
        return self.m.sub(a, b)

    def backward(self, g: Any) -> tuple[Any, ...]:
        ga = sum_to_shape(self.m, g, self.shapes[0]) if self.needs_grad[0] else None
        gb = self.m.neg(sum_to_shape(self.m, g, self.shapes[1])) if self.needs_grad[1] else None
        return ga, gb


class _Mul(_Method):
    def forward(self, a: Any, b: Any) -> Any:
        self.a, self.b = a, b
        return self.m.mul(a, b)

    def backward(self, g: Any) -> tuple[Any, ...]:
        m = self.m
        ga = sum_to_shape(m, m.mul(g, self.b), shape_of(self.a)) if self.needs_grad[0] else None
        gb = sum_to_shape(m, m.mul(g, self.a), shape_of(self.b)) if self.needs_grad[1] else None
        return ga, gb


class _Div(_Method):
    def forward(self, a: Any, b: Any) -> Any:
        self.a, self.b = a, b
        return self.m.div(a, b)

    def backward(self, g: Any) -> tuple[Any, ...]:
        m = self.m
        ga = gb = None
        if self.needs_grad[0]:
            ga = sum_to_shape(m, m.div(g, self.b), shape_of(self.a))
        if self.needs_grad[1]:
            # d(a/b)/db = -a / b^2
            gb = m.neg(m.div(m.mul(g, self.a), m.mul(self.b, self.b)))
            gb = sum_to_shape(m, gb, shape_of(self.b))
        return ga, gb


class _Cast(_Method):
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
    state = _autocast_state.current.active  # one attribute read while autocast is off
    if state is None:
        return values
    floats = [v for v in values if is_tensor(v) and v.dtype.kind == "f"]
    target = _autocast_state.cast_target(state, policy, (v.dtype for v in floats))
    return tuple(
        _autocast_state.cached_cast(state, v, target, is_grad_enabled(), _Cast.apply)
        if is_tensor(v) and _autocast_state.casts(v.dtype, target)
        else v
        for v in values
    )


class _Neg(_Method):
    def forward(self, a: Any) -> Any:
        return self.m.neg(a)

    def backward(self, g: Any) -> tuple[Any, ...]:
        return (self.m.neg(g),)


class _PowScalar(_Method):
    def forward(self, a: Any, exponent: float) -> Any:
        self.a, self.exponent = a, exponent
        return self.m.pow_scalar(a, exponent)

    def backward(self, g: Any) -> tuple[Any, ...]:
        m, e = self.m, self.exponent
        if e == 0:
            return m.full(shape_of(self.a), 0.0, self.a.dtype), None
        d = m.mul(m.pow_scalar(self.a, e - 1.0), e) if e != 1 else m.full(shape_of(self.a), 1.0, self.a.dtype)
        return m.mul(g, d), None


def _swap_last(m: Any, a: Any) -> Any:
    # A view on the host: BLAS takes the transposed operand as it is.
    axes = tuple(range(a.ndim - 2)) + (a.ndim - 1, a.ndim - 2)
    return transposed(m, a, axes)


class _MatMul(_Method):
    def forward(self, a: Any, b: Any) -> Any:
        sa, sb = shape_of(a), shape_of(b)
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
        a2 = m.reshape(a, (1,) + shape_of(a)) if a.ndim == 1 else a
        b2 = m.reshape(b, shape_of(b) + (1,)) if b.ndim == 1 else b
        out_shape = np.broadcast_shapes(shape_of(a2)[:-2], shape_of(b2)[:-2]) + (a2.shape[-2], b2.shape[-1])
        g2 = m.reshape(g, out_shape)
        ga = gb = None
        if self.needs_grad[0]:
            ga = m.reshape(sum_to_shape(m, m.matmul(g2, _swap_last(m, b2)), shape_of(a2)), shape_of(a))
        if self.needs_grad[1]:
            gb = m.reshape(sum_to_shape(m, m.matmul(_swap_last(m, a2), g2), shape_of(b2)), shape_of(b))
        return ga, gb


class _Sum(_Method):
    saved = ()  # shapes and flags only: a second backward runs, as PyTorch's (NOTE [ Released nodes ])

    def forward(self, a: Any, dims: tuple[int, ...] | None, keepdim: bool, mean: bool) -> Any:
        self.in_shape = shape_of(a)
        self.dims = tuple(range(a.ndim)) if dims is None else dims
        self.mean = mean
        s = self.m.sum(a, self.dims, keepdim)
        return self.m.div(s, self._count()) if mean else s

    def _count(self) -> int:
        return math.prod([self.in_shape[d] for d in self.dims])

    def backward(self, g: Any) -> tuple[Any, ...]:
        m, dims, in_shape = self.m, self.dims, self.in_shape
        if len(dims) == len(in_shape) and isinstance(g, np.ndarray):
            # a sum of every element: its gradient (0-d, or 1s with keepdim) broadcasts as it is
            g = expanded(m, g, in_shape, copy_small=True)
        else:
            keep_shape = tuple([1 if i in dims else n for i, n in enumerate(in_shape)])
            g = expanded(m, m.reshape(g, keep_shape), in_shape, copy_small=True)
        if self.mean:
            g = m.div(g, self._count())
        return g, None, None, None


class _Reshape(_Method):
    view = True  # when the strides allow it (always for contiguous data), else a copy

    def forward(self, a: Any, shape: tuple[int, ...]) -> Any:
        self.in_shape = shape_of(a)
        return self.m.reshape(a, shape)

    def backward(self, g: Any) -> tuple[Any, ...]:
        return self.m.reshape(g, self.in_shape), None


class _Transpose(_Method):
    view = True  # on the host; a copy on a device

    def forward(self, a: Any, axes: tuple[int, ...]) -> Any:
        self.axes = axes
        return transposed(self.m, a, axes)

    def backward(self, g: Any) -> tuple[Any, ...]:
        inverse = tuple(int(i) for i in np.argsort(self.axes))
        return transposed(self.m, g, inverse), None


# ----------------------------------------------------------------------------- views and indexing

# NOTE [ Views ]
# As PyTorch's: on the host backends (``numpy``, ``numba``) ``view``, ``reshape`` (of data whose
# strides allow it), ``unsqueeze``, ``squeeze``, ``flatten``, ``transpose``, ``permute``, ``t``,
# ``mT``, ``T``, ``expand``, ``split``, ``chunk``, ``unbind``, iteration, basic indexing (ints,
# slices of any step, ``None``, ``...``) and ``detach`` return Tensors over the same memory: their
# arrays are NumPy views with strides (``expand``'s repeats have stride 0 and are read-only),
# their version counter is their input's (NOTE [ Version counters ] in _engine.py) and their
# ``_base`` is the tensor that owns the memory. Writing into one in place changes the others.
# Indexing with an integer array (``t[[0, 2]]``) copies, as in PyTorch; so does ``reshape`` where
# no strides can express the result (``.transpose(0, 1).reshape(-1)``), from the pool.
# The Tensor methods' math (NumPy's ufuncs, BLAS) reads any strides: a transposed operand of
# ``@`` goes to BLAS as it is. A kernel needs C-contiguous arrays, so a Function that is not
# ``strided`` (every functional op's) gets a view's array as a contiguous copy from the pool, and
# its gradient likewise (``Function.apply``, ``_walk`` in _engine.py): the copy happens only where
# a kernel needs it, as PyTorch's ``.contiguous()`` inside its ops. A leaf's ``.grad`` is always
# contiguous. The pool takes a buffer back only once no view of it is alive (NOTE [ Buffer
# ownership ] in pool.py: every NumPy view keeps the lease alive).
# On the ``taichi`` backend a device array is a flat ndarray with a shape, without strides or an
# offset that kernels would honour, so only ``view``/``reshape``/``unsqueeze``/``squeeze``/
# ``flatten`` (and ``detach``) share memory there; the others return copies (a gather through
# strides, ``as_strided`` in its tensor-math table; the backward the matching scatter), as they
# did on every backend before. ``Tensor.is_contiguous()`` and ``stride()`` say which is which.


class IndexOutOfRange(IndexError, ValueError):
    """An out-of-range index or dim: ``IndexError`` as PyTorch raises, and a ``ValueError`` as every
    bad argument in taifuse is (so code catching either works)."""


def dim_index(dim: Any, ndim: int, op: str, name: str = "dim") -> int:
    """``dim`` as an index into ``ndim`` dimensions (a 0-d tensor takes 0 and -1, as PyTorch)."""
    if isinstance(dim, bool) or not isinstance(dim, numbers.Integral):
        raise TypeError(f"{op}: {name} should be an int, got {dim!r}")
    n = max(ndim, 1)
    if not -n <= dim < n:
        raise IndexOutOfRange(
            f"{op}: {name} is out of range (expected to be in range of [{-n}, {n - 1}], but got {dim})"
        )
    return int(dim) % n


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def narrow(t: TensorCore, dim: int, start: int, length: int) -> TensorCore:
    """Entries ``start ... start + length - 1`` of ``t`` along ``dim`` (a view on the host)."""
    strides = _contiguous(t.shape)
    shape = t.shape[:dim] + (length,) + t.shape[dim + 1 :]
    index = (slice(None),) * dim + (slice(start, start + length),)
    return _Strided.apply(t, shape, strides, start * strides[dim] if length else 0, index)


def _index_array(item: Any, t: TensorCore, dim: int) -> Any:
    """An integer-array index along ``dim`` as an array on ``t``'s backend, range-checked on the host."""
    size = t.shape[dim]
    if is_tensor(item):
        if backend(item) is not backend(t):
            raise TypeError(
                f"index: the index tensor lives on backend {backend(item).NAME!r}, the tensor on {backend(t).NAME!r}"
            )
        if item.dtype.kind not in "iu":
            raise TypeError(f"index: tensors used as indices must be integer tensors, got dtype {item.dtype}")
        if not isinstance(data(item), np.ndarray):
            return data(item)  # on the device: not range-checked (Tensor.__getitem__'s docstring)
        arr = data(item)
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
        raise IndexOutOfRange(
            f"index {int(arr[bad].flat[0])} is out of bounds for dimension {dim} with size {size}"
        )
    arr = np.asarray(arr % max(size, 1), dtype=np.int64, order="C")
    return arr if isinstance(data(t), np.ndarray) else backend(t).from_numpy(arr)


def _is_array_index(item: Any) -> bool:
    if is_tensor(item):
        return item.ndim > 0 or item.dtype.kind == "f"
    if isinstance(item, (list, np.ndarray)):
        return np.ndim(item) > 0 or np.asarray(item).dtype.kind not in "iu"
    return False


def _parse_index(t: TensorCore, index: Any) -> tuple:
    """``t[index]`` worked out: (shape, strides and offset into ``t``'s C layout, NumPy's basic
    index, the one array index with its dimension and position in the result, and the positions
    of the advanced indices), with the index checked."""
    items = index if isinstance(index, tuple) else (index,)
    consumed = 0
    for item in items:
        if isinstance(item, bool) or (isinstance(item, np.ndarray) and item.dtype.kind == "b"):
            raise TypeError("index: boolean indices are not supported (use masked_fill)")
        if item is None or item is Ellipsis:
            continue
        if not (isinstance(item, (numbers.Integral, slice)) or _is_array_index(item)
                or is_tensor(item) or isinstance(item, np.ndarray)):  # fmt: skip
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
    basic: list[Any] = []  # the index as NumPy's basic indexing, the array's dimension kept whole
    for pos, item in enumerate(items):
        if item is None:
            shape.append(1)
            strides.append(0)
            basic.append(None)
        elif item is Ellipsis:
            for _ in range(t.ndim - consumed):
                shape.append(t.shape[d])
                strides.append(in_strides[d])
                basic.append(slice(None))
                d += 1
        elif isinstance(item, slice):
            start, stop, step = item.indices(t.shape[d])
            length = len(range(start, stop, step))
            offset += start * in_strides[d] if length else 0
            shape.append(length)
            strides.append(step * in_strides[d])
            # (NumPy reads a negative stop as counted from the end: a reversed slice to the
            # first entry has none.)
            basic.append(slice(start, stop if stop >= 0 else None, step) if length else slice(0, 0))
            d += 1
        elif _is_array_index(item):
            if array_item is not None:
                raise TypeError("index: only one integer array (or Tensor) index is supported")
            array_item, array_dim, array_pos = item, d, len(shape)
            advanced.append(pos)
            shape.append(t.shape[d])
            strides.append(in_strides[d])
            basic.append(slice(None))
            d += 1
        else:  # an int (or a 0-d integer array or Tensor)
            i = int(item.item()) if is_tensor(item) or isinstance(item, np.ndarray) else int(item)
            n = t.shape[d]
            if not -n <= i < n:
                raise IndexOutOfRange(f"index {i} is out of bounds for dimension {d} with size {n}")
            offset += (i % n) * in_strides[d]
            advanced.append(pos)
            basic.append(i % n)
            d += 1
    shape += t.shape[d:]
    strides += in_strides[d:]
    return tuple(shape), tuple(strides), offset, tuple(basic), array_item, array_dim, array_pos, advanced


def getitem(t: TensorCore, index: Any) -> TensorCore:
    shape, strides, offset, basic, array_item, array_dim, array_pos, advanced = _parse_index(t, index)
    out = _Strided.apply(t, shape, strides, offset, basic)
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


def setitem(t: TensorCore, index: Any, value: Any) -> Any:
    """``t[index] = value`` for a basic index (ints, slices, ``None``, ``...``), ``value`` (an
    array of ``t``'s backend and dtype) broadcast to the indexed shape; writes ``t``'s memory.
    Returns the part written, a view (on the host), or None (all of it, on a device)."""
    shape, strides, offset, basic, array_item, *_ = _parse_index(t, index)
    if array_item is not None:
        raise TypeError(
            "index assignment: only basic indices (ints, slices, None, ...) are supported, not an "
            "integer array or Tensor index"
        )
    try:
        fits = np.broadcast_shapes(shape, shape_of(value)) == shape
    except ValueError:
        fits = False
    if not fits:
        raise ValueError(
            f"index assignment: value of shape {shape_of(value)} does not broadcast to the indexed shape {shape}"
        )
    arr = data(t)
    if isinstance(arr, np.ndarray):
        part = arr[basic]
        np.copyto(part, value, casting="unsafe")
        return part
    if 0 not in shape:
        m = math_for(backend(t))
        m.scatter_strided_(arr, m.broadcast_to(value, shape), strides, offset)
    return None


class _Strided(_Method):
    """Basic indexing and ``split``: a NumPy view on the host (``index``, NumPy's basic index),
    a gather through strides on a device (``strides`` and ``offset`` into the input's C layout:
    NOTE [ Views ]); the backward scatters into zeros, or adds into the input's gradient summed so
    far (NOTE [ Gradients summed in place ])."""

    owns_grads = True
    accumulates = True
    view = True

    def forward(
        self, a: Any, shape: tuple[int, ...], strides: tuple[int, ...], offset: int, index: tuple
    ) -> Any:
        self.in_shape, self.strides, self.offset = shape_of(a), strides, offset
        if isinstance(a, np.ndarray):
            return a[index]
        return self.m.as_strided(a, shape, strides, offset)

    def backward(self, g: Any) -> tuple[Any, ...]:
        out = self.accumulate_into
        if out is not None:
            self.m.scatter_add_strided_(out, g, self.strides, self.offset)
            return out, None, None, None, None
        out = self.m.full(self.in_shape, 0.0, g.dtype)
        self.m.scatter_strided_(out, g, self.strides, self.offset)
        return out, None, None, None, None


class _Contiguous(_Method):
    """A contiguous copy of a strided view (``Tensor.contiguous``); the gradient passes through."""

    def forward(self, a: Any) -> Any:
        return self.m.copy(a)

    def backward(self, g: Any) -> tuple[Any, ...]:
        return (g,)


class _Take(_Method):
    owns_grads = True

    def forward(self, a: Any, index: Any, axis: int) -> Any:
        self.index, self.axis, self.size = index, axis, a.shape[axis]
        return self.m.take(a, index, axis)

    def backward(self, g: Any) -> tuple[Any, ...]:
        if not self.index.size:  # ``t[[]]``: nothing was read, so the gradient is all zeros
            k = self.index.ndim
            shape = shape_of(g)[: self.axis] + (self.size,) + shape_of(g)[self.axis + k :]
            return self.m.full(shape, 0.0, g.dtype), None, None
        return self.m.take_backward(g, self.index, self.axis, self.size), None, None


class _Expand(_Method):
    view = True  # on the host (read-only: stride 0 along the repeats); a copy on a device

    def forward(self, a: Any, shape: tuple[int, ...]) -> Any:
        self.in_shape = shape_of(a)
        return expanded(self.m, a, shape)

    def backward(self, g: Any) -> tuple[Any, ...]:
        return sum_to_shape(self.m, g, self.in_shape), None


class _MaskedFill(_Method):
    owns_grads = True

    def forward(self, a: Any, mask: Any, value: float) -> Any:
        self.in_shape, self.mask = shape_of(a), mask
        return self.m.masked_fill(a, mask, value)

    def backward(self, g: Any) -> tuple[Any, ...]:
        ga = sum_to_shape(self.m, self.m.masked_fill(g, self.mask, 0.0), self.in_shape)
        return ga, None, None


class _Exp(_Method):
    owns_grads = True

    def forward(self, a: Any) -> Any:
        self.out = self.m.exp(a)
        return self.out

    def backward(self, g: Any) -> tuple[Any, ...]:
        return (self.m.mul(g, self.out),)


class _Log(_Method):
    owns_grads = True

    def forward(self, a: Any) -> Any:
        self.a = a
        return self.m.log(a)

    def backward(self, g: Any) -> tuple[Any, ...]:
        return (self.m.div(g, self.a),)


class _Sqrt(_Method):
    owns_grads = True

    def forward(self, a: Any) -> Any:
        self.out = self.m.sqrt(a)
        return self.out

    def backward(self, g: Any) -> tuple[Any, ...]:
        # d sqrt(x) = 1 / (2 sqrt(x))
        return (self.m.div(g, self.m.mul(self.out, 2.0)),)


class _Amax(_Method):
    owns_grads = True

    def forward(self, a: Any, dims: tuple[int, ...], keepdim: bool) -> Any:
        self.a, self.dims = a, dims
        self.values = self.m.max(a, dims, True)
        if keepdim:
            return self.values
        return self.m.reshape(self.values, tuple(n for i, n in enumerate(shape_of(a)) if i not in dims))

    def backward(self, g: Any) -> tuple[Any, ...]:
        # As torch.amax: the gradient is split evenly among the elements equal to the maximum.
        m = self.m
        ties = m.eq(self.a, self.values)
        share = m.div(m.reshape(g, shape_of(self.values)), m.sum(ties, self.dims, True))
        return m.mul(ties, share), None, None


class _MaxDim(_Method):
    owns_grads = True

    def forward(self, a: Any, dim: int, keepdim: bool, index: Any) -> Any:
        self.dim, self.size, self.index = dim, a.shape[dim], index
        return self.m.max(a, (dim,), keepdim)

    def backward(self, g: Any) -> tuple[Any, ...]:
        g = self.m.reshape(g, shape_of(self.index))
        return self.m.scatter_dim(g, self.index, self.dim, self.size), None, None, None


def legacy_empty(shape: tuple[int, ...]) -> bool:
    """A 1-D empty tensor, which ``torch.cat`` skips beside tensors of any rank."""
    return shape == (0,)


class _Cat(_Method):
    owns_grads = True

    def forward(self, *arrays: Any, dim: int) -> Any:
        # The legacy empty (0,) pieces are skipped (cat() checked the others' shapes), unless all are.
        joined = [a for a in arrays if not legacy_empty(shape_of(a))] or list(arrays)
        shape = list(shape_of(joined[0]))
        shape[dim] = sum(a.shape[dim] for a in joined)
        out = self.m.full(tuple(shape), 0.0, arrays[0].dtype)
        self.strides = _contiguous(tuple(shape))
        self.pieces: list[tuple[tuple[int, ...], int | None]] = []
        offset = 0
        for a in arrays:
            if len(joined) < len(arrays) and legacy_empty(shape_of(a)):
                self.pieces.append(((0,), None))
                continue
            self.m.scatter_strided_(out, a, self.strides, offset)
            self.pieces.append((shape_of(a), offset))
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


def tensor_list(tensors: Any, op: str) -> list[TensorCore]:
    if is_tensor(tensors) or not isinstance(tensors, Iterable):
        raise TypeError(f"{op}: tensors should be a sequence of Tensors, got {type(tensors).__name__}")
    ts = list(tensors)
    if not ts:
        raise ValueError(f"{op}: tensors should not be empty")
    for i, t in enumerate(ts):
        if not is_tensor(t):
            raise TypeError(f"{op}: tensors[{i}] should be a Tensor, got {type(t).__name__}")
    common_backend(ts, op)
    dtype = functools.reduce(np.promote_types, (t.dtype for t in ts))
    if dtype.kind == "f":
        backend(ts[0]).check_dtype(dtype, f"{op}: the result dtype")
    return [t if t.dtype == dtype else _Cast.apply(t, dtype) for t in ts]


# The Tensor methods' entry points (taifuse/tensor.py).
Add, Sub, Mul, Div, Cast, Neg, PowScalar, MatMul = _Add, _Sub, _Mul, _Div, _Cast, _Neg, _PowScalar, _MatMul
Sum, Reshape, Transpose, Strided, Take, Expand = _Sum, _Reshape, _Transpose, _Strided, _Take, _Expand
MaskedFill, Exp, Log, Sqrt, Amax, MaxDim, Cat = _MaskedFill, _Exp, _Log, _Sqrt, _Amax, _MaxDim, _Cat
Contiguous = _Contiguous
