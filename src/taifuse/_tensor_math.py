"""Plain tensor arithmetic on a backend's arrays, in one place.

The Tensor's Functions (``_tensor_functions.py``) and the engine (``_engine.py``) do their
arithmetic (``+ - * / @``, reductions, reshapes) and their gradient bookkeeping (broadcast
reductions, accumulation) only through the object :func:`math_for` returns. On the host backends (``numpy``, ``numba``) that is :class:`HostMath`, NumPy on
``numpy.ndarray``. A device backend supplies its own object with the same methods as the module
attribute ``TENSOR_MATH``, so that tensor data stays on the device.

# NOTE [ Tensor storage ]
# A Tensor's array on the host may be a strided NumPy view of another Tensor's memory (NOTE
# [ Views ] in _tensor_functions.py): the methods here take operands of any strides (NumPy's
# ufuncs and BLAS do) and return C-contiguous arrays from the pool, except ``reshape``, which
# returns a view when the strides allow one, as PyTorch's does. The kernels need C-contiguous
# operands: the engine hands them ones (:func:`dense`). A device backend's arrays are always
# contiguous (Taichi ndarrays have no strides or offset), so its views are reshapes only.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np

from taifuse import pool as _pool
from taifuse.backends import _host

_HALF = np.dtype(np.float16)


def _buffer(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A result buffer from the host pool (NOTE [ Buffer ownership ] in taifuse/pool.py; a small
    one from NumPy: NOTE [ Small host buffers ] there)."""
    return _pool.host_empty(shape, dtype)


def _floating(*operands: Any) -> bool:
    return all(o.dtype.kind == "f" for o in operands if isinstance(o, np.ndarray))


def _binary(ufunc: np.ufunc, a: Any, b: Any) -> np.ndarray:
    # Only float operands take a pooled `out`: there np.result_type (Python scalars weak, NEP 50)
    # is exactly the dtype the ufunc picks, so the result is the one it would have allocated.
    if not (_floating(a, b) and (isinstance(a, np.ndarray) or isinstance(b, np.ndarray))):
        return ufunc(a, b)
    shape = np.broadcast_shapes(np.shape(a), np.shape(b))
    out = _buffer(shape, np.result_type(a, b))
    if not _half_binary(ufunc, a, b, out):
        ufunc(a, b, out=out)
    return out


# NOTE [ float16 arithmetic on the host ]
# NumPy's float16 ufuncs widen, compute and round one element at a time in software (an add of
# two float16 arrays of 1M elements took 5.8 ms, a float16 + float32 one 2.2 ms, a float32 one
# 0.14 ms). Where the Numba backend is loaded (so its F16C conversions are: see ``_convert``),
# these ufuncs run on float32 blocks instead and round once into a float16 result, as NumPy's
# loops do (widen both operands, one float32 operation, round): 0.9 and 0.5 ms there. A Python
# scalar is first cast to the result's dtype, as NumPy casts it for its float16 loop.
_HALF_UFUNCS = frozenset((np.add, np.subtract, np.multiply, np.divide, np.maximum, np.minimum))
_HALF_CHUNK = 1 << 18  # elements per block of same-shape operands: 1 MiB of float32 each


def _half_binary(ufunc: np.ufunc, a: Any, b: Any, out: np.ndarray) -> bool:
    """``ufunc(a, b, out=out)`` in float32 blocks when float16 is involved (NOTE [ float16
    arithmetic on the host ]); False (nothing written) where that does not apply."""
    operands = [x for x in (a, b) if isinstance(x, np.ndarray)]
    if (
        ufunc not in _HALF_UFUNCS
        or out.dtype not in (np.float16, np.float32)
        or not any(x.dtype == np.float16 for x in operands)
        or any(x.dtype not in (np.float16, np.float32) for x in operands)
        or not _host.fast_f16()
        or out.size == 0
    ):
        return False
    host = _pool.host_pool()
    a, b = (_half_operand(x, out.dtype) for x in (a, b))
    if all(not isinstance(x, np.ndarray) or (x.shape == out.shape and x.flags.c_contiguous) for x in (a, b)):
        flat = [x.reshape(-1) if isinstance(x, np.ndarray) else x for x in (a, b)]
        dst = out.reshape(-1)
        size = min(_HALF_CHUNK, dst.size)
        scratch = [host.acquire((size,), np.float32) for _ in range(3)]
        for lo in range(0, dst.size, size):
            hi = min(lo + size, dst.size)
            parts = [
                _wide(x[lo:hi], s[: hi - lo]) if isinstance(x, np.ndarray) else x
                for x, s in zip(flat, scratch[:2])
            ]
            if dst.dtype == np.float32:
                ufunc(parts[0], parts[1], out=dst[lo:hi])
            else:
                ufunc(parts[0], parts[1], out=scratch[2][: hi - lo])
                _convert(dst[lo:hi], scratch[2][: hi - lo])
        return True
    # Broadcasting: each float16 operand widened whole (the smaller ones are biases and scales).
    parts = [_wide(x, host.acquire(x.shape, np.float32)) if isinstance(x, np.ndarray) else x for x in (a, b)]
    if out.dtype == np.float32:
        ufunc(parts[0], parts[1], out=out)
    else:
        wide = host.acquire(out.shape, np.float32)
        ufunc(parts[0], parts[1], out=wide)
        _convert(out, wide)
    return True


def _half_operand(x: Any, dtype: np.dtype) -> Any:
    """An array operand as it is, a scalar cast to ``dtype`` (as NumPy's loop would) and widened."""
    if isinstance(x, np.ndarray):
        return x
    return np.float32(np.asarray(x, dtype=dtype))


def _wide(x: np.ndarray, buf: np.ndarray) -> np.ndarray:
    """``x`` as float32: itself, or converted into ``buf``."""
    if x.dtype == np.float32:
        return x
    _convert(buf, x)
    return buf


# NOTE [ Sums of squares in blocks ]
# Elements per block of a host array widened for its sum of squares: 256 KiB of float64, in
# cache, where a whole float64 copy and its square took 4x the array's float32 bytes.
_SQUARES_BLOCK = 1 << 15


# (shape, axis, keepdims) -> the reduction's shape: a small step repeats a few (a dict hit is
# about a tenth of the computation's time, a sizable part of a small sum's).
_REDUCED_SHAPES: dict[tuple, tuple[int, ...]] = {}


def _reduced_shape(shape: tuple[int, ...], axis: tuple[int, ...] | None, keepdims: bool) -> tuple[int, ...]:
    try:
        return _REDUCED_SHAPES[shape, axis, keepdims]
    except KeyError:
        out = _REDUCED_SHAPES[shape, axis, keepdims] = _reduce_shape(shape, axis, keepdims)
        if len(_REDUCED_SHAPES) > 4096:
            _REDUCED_SHAPES.clear()
        return out
    except TypeError:  # an unhashable axis (a list)
        return _reduce_shape(shape, axis, keepdims)


def _reduce_shape(shape: tuple[int, ...], axis: tuple[int, ...] | None, keepdims: bool) -> tuple[int, ...]:
    axes = range(len(shape)) if axis is None else [d % len(shape) for d in axis]
    if keepdims:
        return tuple(1 if i in axes else n for i, n in enumerate(shape))
    return tuple(n for i, n in enumerate(shape) if i not in axes)


# float16 products: float32 BLAS on blocks converted in pooled scratch of about
# ``_host.F16_BLOCK_BYTES`` each, the budget the numba kernels use (NOTE [ float16 products in
# blocks ] in backends/_host.py). NumPy's own float16 matmul is a scalar loop: (8, 256, 64) @
# (8, 64, 256) took 324 ms against 3.7 ms in float32 BLAS, with the same result (it sums in
# float32 too).


def _convert(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[...] = src``, float16 through the Numba backend's hardware conversions once it is loaded.

    NumPy's float16 casts run in software, 20-40x slower (the note above ``_convert`` in
    backends/numba/_jit.py). The two round identically (a signalling NaN's payload aside; tested),
    so which one runs changes no result; the numpy backend alone, without Numba, keeps NumPy's.
    """
    _host.convert_f16(dst, src)  # NOTE [ Hardware float16 conversions ] in backends/_host.py


def _half_matmul(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """out = a @ b for float16 ``a (..., N, K)``, ``b (..., K, M)``, summed in float32 through BLAS."""
    n, k = a.shape[-2:]
    m = b.shape[-1]
    if out.size == 0 or k == 0:
        np.matmul(a, b, out=out)  # nothing to multiply
        return
    if b.ndim == 2:  # every matrix of a shares b: their rows are one matrix's rows
        _half_matmul_2d(a.reshape(-1, k), b, out.reshape(-1, m))
        return
    batch = out.shape[:-2]
    per = 4 * (n * k + k * m + n * m)  # float32 bytes of one product's operands and result
    if a.shape[:-2] == b.shape[:-2] == batch and per <= _host.F16_BLOCK_BYTES:
        # Small matrices (attention's heads): as many per BLAS call as fit the budget.
        a3, b3, o3 = a.reshape(-1, n, k), b.reshape(-1, k, m), out.reshape(-1, n, m)
        group = min(len(a3), _host.F16_BLOCK_BYTES // per)
        host = _pool.host_pool()
        a32, b32, y32 = (host.acquire((group, *s), np.float32) for s in ((n, k), (k, m), (n, m)))
        for g0 in range(0, len(a3), group):
            g = min(group, len(a3) - g0)
            _convert(a32[:g], a3[g0 : g0 + g])
            _convert(b32[:g], b3[g0 : g0 + g])
            np.matmul(a32[:g], b32[:g], out=y32[:g])
            _convert(o3[g0 : g0 + g], y32[:g])
        return
    ab, bb = np.broadcast_to(a, (*batch, n, k)), np.broadcast_to(b, (*batch, k, m))
    for index in np.ndindex(*batch):
        _half_matmul_2d(ab[index], bb[index], out[index])


def _half_matmul_2d(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """out = a @ b for float16 matrices: rows of a in chunks, columns of b in blocks."""
    n, k = a.shape
    m = b.shape[1]
    rows = _host.f16_rows(n, max(k, m))
    cols = _host.f16_weight_rows(m, k)  # b's columns are a weight's rows
    host = _pool.host_pool()
    a32 = host.acquire((rows, k), np.float32)
    b32 = host.acquire((k * cols,), np.float32)
    y32 = host.acquire((rows * cols,), np.float32)
    if cols == m:
        _convert(b32.reshape(k, m), b)
    for lo in range(0, n, rows):
        hi = min(lo + rows, n)
        _convert(a32[: hi - lo], a[lo:hi])
        for m0 in range(0, m, cols):
            m1 = min(m0 + cols, m)
            bt = b32[: k * (m1 - m0)].reshape(k, m1 - m0)
            if cols < m:  # b's block converted again for each chunk of rows
                _convert(bt, b[:, m0:m1])
            yt = y32[: (hi - lo) * (m1 - m0)].reshape(hi - lo, m1 - m0)
            np.matmul(a32[: hi - lo], bt, out=yt)
            _convert(out[lo:hi, m0:m1], yt)


class HostMath:
    """Tensor arithmetic for backends whose arrays are ``numpy.ndarray``.

    Results are written into buffers from the host pool (``out=``), never freshly allocated.
    """

    @staticmethod
    def asarray(data: Any, dtype: np.dtype | None) -> np.ndarray:
        return np.array(data, dtype=dtype, order="C", copy=True)

    @staticmethod
    def to_numpy(a: np.ndarray) -> np.ndarray:
        return a

    @staticmethod
    def add(a: Any, b: Any) -> np.ndarray:
        return _binary(np.add, a, b)

    @staticmethod
    def sub(a: Any, b: Any) -> np.ndarray:
        return _binary(np.subtract, a, b)

    @staticmethod
    def mul(a: Any, b: Any) -> np.ndarray:
        return _binary(np.multiply, a, b)

    @staticmethod
    def div(a: Any, b: Any) -> np.ndarray:
        return _binary(np.divide, a, b)

    @staticmethod
    def neg(a: np.ndarray) -> np.ndarray:
        if not _floating(a):
            return np.negative(a)
        return np.negative(a, out=_buffer(a.shape, a.dtype))

    @staticmethod
    def maximum(a: Any, b: Any) -> np.ndarray:
        """Elementwise max; NaN where either operand is NaN."""
        return _binary(np.maximum, a, b)

    @staticmethod
    def minimum(a: Any, b: Any) -> np.ndarray:
        """Elementwise min; NaN where either operand is NaN."""
        return _binary(np.minimum, a, b)

    @staticmethod
    def abs(a: np.ndarray) -> np.ndarray:
        if not _floating(a):
            return np.abs(a)
        return np.abs(a, out=_buffer(a.shape, a.dtype))

    @staticmethod
    def pow_scalar(a: np.ndarray, exponent: float) -> np.ndarray:
        # NOTE: x * x, not x ** 2: NumPy's float32 power is far slower (docs/backends.md, "NumPy").
        if exponent == 2:
            return _binary(np.multiply, a, a)
        return _binary(np.power, a, np.asarray(exponent, dtype=a.dtype))

    @staticmethod
    def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        if a.ndim < 2 or b.ndim < 2 or not _floating(a, b):
            return np.matmul(a, b)  # vector promotions: rare, left to NumPy
        shape = np.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1])
        out = _buffer(shape, np.result_type(a, b))
        if a.dtype == b.dtype == np.float16:
            _half_matmul(a, b, out)
            return out
        return np.matmul(a, b, out=out)

    @staticmethod
    def sum(a: np.ndarray, axis: tuple[int, ...] | None, keepdims: bool) -> np.ndarray:
        # float16 sums accumulate in float32 (storage-only dtype), then round once.
        dtype = a.dtype
        if dtype.kind != "f" or dtype == _HALF:  # kind first: == np.float16 converts the type each call
            acc = np.float32 if dtype == _HALF else None
            return np.asarray(np.sum(a, axis=axis, keepdims=keepdims, dtype=acc), dtype=dtype)
        out = _buffer(_reduced_shape(a.shape, axis, keepdims), dtype)
        # np.sum's own reduction, without its Python wrapper (half of a small sum's time).
        np.add.reduce(a, axis=axis, keepdims=keepdims, out=out)
        return out

    @staticmethod
    def max(a: np.ndarray, axis: tuple[int, ...] | None, keepdims: bool) -> np.ndarray:
        """The largest element over ``axis``; NaN where a NaN is among them."""
        out = _buffer(_reduced_shape(a.shape, axis, keepdims), a.dtype)
        np.max(a, axis=axis, keepdims=keepdims, out=out)
        return out

    @staticmethod
    def reshape(a: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        """``a`` in ``shape``: a view when ``a``'s strides allow one (always, for a contiguous ``a``),
        else a contiguous copy from the pool, as ``torch.reshape``."""
        view = viewed(a, shape)
        if view is not None:
            return view
        out = _buffer(tuple(shape), a.dtype)
        np.copyto(out.reshape(a.shape), a)
        return out

    @staticmethod
    def transpose(a: np.ndarray, axes: tuple[int, ...] | None = None) -> np.ndarray:
        view = np.transpose(a, axes)
        out = _buffer(view.shape, a.dtype)
        np.copyto(out, view)
        return out

    @staticmethod
    def broadcast_to(a: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        if tuple(a.shape) == tuple(shape):
            return a
        out = _buffer(tuple(shape), a.dtype)
        # Assignment broadcasts (and raises as np.broadcast_to where it cannot), as np.copyto,
        # without its Python dispatch (a small gradient's fixed cost: NOTE [ The lean apply ]).
        out[...] = a
        return out

    @staticmethod
    def full(shape: tuple[int, ...], value: float, dtype: np.dtype) -> np.ndarray:
        out = _buffer(tuple(shape), np.dtype(dtype))
        if type(value) is float and out.dtype.kind == "f":
            out.fill(value)  # the same cast as np.copyto's below, without its Python dispatch
        else:
            np.copyto(out, value, casting="unsafe")  # what np.full does
        return out

    @staticmethod
    def copy(a: np.ndarray) -> np.ndarray:
        out = _buffer(a.shape, a.dtype)
        out[...] = a  # as np.copyto (same dtype), without its Python dispatch
        return out

    @staticmethod
    def astype(a: np.ndarray, dtype: Any) -> np.ndarray:
        """A copy of ``a`` in ``dtype`` (through :func:`astype`)."""
        dtype = np.dtype(dtype)
        out = _buffer(a.shape, dtype)
        if {a.dtype, dtype} == {np.dtype(np.float16), np.dtype(np.float32)}:
            _convert(out, a)  # autocast's casts: the hardware conversions where Numba is loaded
        else:
            np.copyto(out, a, casting="unsafe")
        return out

    @staticmethod
    def sum_of_squares(a: np.ndarray | list[np.ndarray], dtype: Any) -> np.ndarray:
        """sum(a**2) accumulated in ``dtype``, a 0-d array: ``a`` widened in cache-sized blocks
        (NOTE [ Sums of squares in blocks ]), for gradient clipping's norm. ``a`` may be a list of
        host arrays: the sum over all of them through one scratch block, each array's sum added in
        turn (the GPT example's 29 gradients took ~3 ms per clip as one pool request and one 0-d
        addition each)."""
        dtype = np.dtype(dtype)
        arrays = [a] if isinstance(a, np.ndarray) else list(a)
        flats = [x.reshape(-1) for x in arrays if x.size]
        block = _buffer((min(max((f.size for f in flats), default=0), _SQUARES_BLOCK),), dtype)
        total = None
        for flat in flats:
            term = 0.0
            for lo in range(0, flat.size, _SQUARES_BLOCK):
                b = block[: min(flat.size - lo, _SQUARES_BLOCK)]
                np.copyto(b, flat[lo : lo + b.size])
                term += float(np.dot(b, b))
            total = term if total is None else total + term
        out = _buffer((), dtype)
        out[()] = 0.0 if total is None else total
        return out

    @staticmethod
    def contiguous(a: np.ndarray) -> np.ndarray:
        """``a`` C-contiguous for a kernel: itself, or a strided view's copy from the pool (``dense``).
        A method of the math object, not a bare copy, so that a compiled step records the copy and
        makes it again at each replay (NOTE [ Views ] in _tensor_functions.py)."""
        return dense(a)

    @staticmethod
    def copy_(acc: np.ndarray, a: np.ndarray) -> None:
        """acc[...] = a, in place (a gradient into its slot of an optimizer's flat buffer)."""
        np.copyto(acc, a)

    @staticmethod
    def add_(acc: np.ndarray, a: Any) -> None:
        """acc += a, in place (gradient accumulation into a leaf's ``.grad``, optimizer steps)."""
        if not _half_binary(np.add, acc, a, acc):
            np.add(acc, a, out=acc)

    @staticmethod
    def sub_(acc: np.ndarray, a: Any) -> None:
        np.subtract(acc, a, out=acc)

    @staticmethod
    def mul_(acc: np.ndarray, a: Any) -> None:
        np.multiply(acc, a, out=acc)

    @staticmethod
    def fill_(acc: np.ndarray, value: float) -> None:
        """acc[...] = value, in place (``Tensor.zero_``; unlike ``mul_(acc, 0)``, NaN and inf become 0 too)."""
        acc.fill(value)

    @staticmethod
    def item(a: np.ndarray) -> float | int:
        return a.reshape(()).item()

    # -- views and gathers (NOTE [ Views ] in _tensor_functions.py)

    @staticmethod
    def as_strided(
        a: np.ndarray, shape: tuple[int, ...], strides: tuple[int, ...], offset: int
    ) -> np.ndarray:
        """A contiguous copy of the elements of ``a``'s flat storage at ``offset + index . strides``
        (strides in elements, any sign, 0 to repeat), for every index of ``shape``."""
        out = _buffer(tuple(shape), a.dtype)
        if out.size:
            np.copyto(out, _strided_view(a, shape, strides, offset))
        return out

    @staticmethod
    def scatter_strided_(out: np.ndarray, src: np.ndarray, strides: tuple[int, ...], offset: int) -> None:
        """out.flat[offset + index . strides] = src[index] for every index of ``src``, in place; the
        positions must not overlap (the inverse of :meth:`as_strided` without repeats)."""
        if src.size:
            np.copyto(_strided_view(out, src.shape, strides, offset), src)

    @staticmethod
    def scatter_add_strided_(out: np.ndarray, src: np.ndarray, strides: tuple[int, ...], offset: int) -> None:
        """out.flat[offset + index . strides] += src[index], in place; positions as in :meth:`scatter_strided_`."""
        if not src.size:
            return
        view = _strided_view(out, src.shape, strides, offset)
        if out.dtype != np.float16 or src.dtype != np.float16 or src.ndim == 0:
            np.add(view, src, out=view)
            return
        # NumPy's float16 add is software (NOTE [ float16 arithmetic on the host ]): blocks of the
        # view are gathered contiguous, added on the float32 path and written back.
        src = np.ascontiguousarray(src)
        step = max(1, _HALF_CHUNK // (src.size // src.shape[0]))
        tmp = _buffer((min(step, src.shape[0]), *src.shape[1:]), src.dtype)
        for lo in range(0, src.shape[0], step):
            hi = min(lo + step, src.shape[0])
            t = tmp[: hi - lo]
            np.copyto(t, view[lo:hi])
            if not _half_binary(np.add, t, src[lo:hi], t):
                np.add(t, src[lo:hi], out=t)
            np.copyto(view[lo:hi], t)

    @staticmethod
    def take(a: np.ndarray, index: np.ndarray, axis: int) -> np.ndarray:
        """``numpy.take(a, index, axis)`` for an in-range integer ``index`` (negative counts from the end)."""
        shape = a.shape[:axis] + index.shape + a.shape[axis + 1 :]
        out = _buffer(shape, a.dtype)
        np.take(a, index, axis=axis, out=out)
        return out

    @staticmethod
    def take_backward(g: np.ndarray, index: np.ndarray, axis: int, size: int) -> np.ndarray:
        """The gradient of :meth:`take`: ``g`` summed into an array whose ``axis`` has ``size``
        entries, at the positions ``index`` read (repeated indices accumulate)."""
        lead, k = g.shape[:axis], index.size
        out = _buffer(lead + (size,) + g.shape[axis + index.ndim :], g.dtype)
        out.fill(0)
        g3 = g.reshape(math.prod(lead), k, -1)
        np.add.at(out.reshape(math.prod(lead), size, -1), (slice(None), index.reshape(-1) % max(size, 1)), g3)
        return out

    @staticmethod
    def masked_fill(a: np.ndarray, mask: np.ndarray, value: float) -> np.ndarray:
        """``value`` where ``mask`` (bool or integer, nonzero = fill) is set, else ``a``; broadcast."""
        out = _buffer(np.broadcast_shapes(a.shape, mask.shape), a.dtype)
        np.copyto(out, a)
        np.copyto(out, np.asarray(value, dtype=a.dtype), where=np.broadcast_to(mask != 0, out.shape))
        return out

    # inf and NaN results outside the domain without NumPy's warnings, as torch.
    @staticmethod
    def exp(a: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):
            return np.exp(a, out=_buffer(a.shape, a.dtype))

    @staticmethod
    def log(a: np.ndarray) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.log(a, out=_buffer(a.shape, a.dtype))

    @staticmethod
    def sqrt(a: np.ndarray) -> np.ndarray:
        with np.errstate(invalid="ignore"):
            return np.sqrt(a, out=_buffer(a.shape, a.dtype))

    @staticmethod
    def eq(a: np.ndarray, b: Any) -> np.ndarray:
        """1 where ``a == b`` (broadcast), else 0, in ``a``'s dtype."""
        out = _buffer(np.broadcast_shapes(a.shape, np.shape(b)), a.dtype)
        np.copyto(out, np.equal(a, b), casting="unsafe")
        return out

    @staticmethod
    def argmax(a: np.ndarray, axis: int, keepdims: bool) -> np.ndarray:
        """Index of the first largest element along ``axis`` (of the first NaN, where there is one), int64."""
        return np.argmax(a, axis=axis, keepdims=keepdims).astype(np.int64, copy=False)

    @staticmethod
    def scatter_dim(g: np.ndarray, index: np.ndarray, axis: int, size: int) -> np.ndarray:
        """Zeros with ``axis`` of ``size`` entries and ``g[..., 0, ...]`` put at ``index`` along it
        (``g`` and ``index`` have size 1 along ``axis``): the gradient of a max along ``axis``."""
        shape = g.shape[:axis] + (size,) + g.shape[axis + 1 :]
        out = _buffer(shape, g.dtype)
        out.fill(0)
        np.put_along_axis(out, index, g, axis=axis)
        return out


def viewed(a: np.ndarray, shape: tuple[int, ...]) -> np.ndarray | None:
    """``a`` reshaped to ``shape`` without a copy, or None when its strides do not allow that."""
    if a.flags.c_contiguous:
        return a.reshape(shape)
    try:
        return np.reshape(a, shape, copy=False)
    except ValueError:  # the strides do not allow it
        return None
    except TypeError:  # NumPy before 2.1 has no copy=: setting the shape of a view raises instead
        view = a.view()
        try:
            view.shape = shape
        except AttributeError:
            return None
        return view


def dense(a: Any) -> Any:
    """``a`` C-contiguous: itself, or (a strided host view) a copy from the pool, for a kernel."""
    if not isinstance(a, np.ndarray) or a.flags.c_contiguous:
        return a
    out = _buffer(a.shape, a.dtype)
    np.copyto(out, a)
    return out


def shares_storage(a: Any, b: Any) -> bool:
    """Whether array ``a`` is a view of ``b``'s memory: NumPy views of one array (their ``base``
    is the array that owns the memory, or the pool's lease), or device arrays of one storage."""
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and _owner(a) is _owner(b)
    storage = getattr(a, "storage", None)
    return storage is not None and storage is getattr(b, "storage", None)


def _owner(a: np.ndarray) -> np.ndarray:
    # NumPy collapses view chains: a view's base is the first array that owns its memory or whose
    # base is not an array (a pooled buffer's lease: NOTE [ Buffer ownership ] in pool.py).
    return a.base if isinstance(a.base, np.ndarray) else a


def transposed(m: Any, a: Any, axes: tuple[int, ...]) -> Any:
    """``a`` with its dimensions in the order ``axes``: a view on the host, a copy on a device."""
    if isinstance(a, np.ndarray):
        return a.transpose(axes)
    return m.transpose(a, axes)


def expanded(m: Any, a: Any, shape: tuple[int, ...], *, copy_small: bool = False) -> Any:
    """``a`` broadcast to ``shape``: a read-only view on the host (stride 0 along the repeats, so
    nothing may write it), a copy on a device.

    ``copy_small``: on the host too a copy (from the pool) when the result is at most
    ``pool.SMALL_HOST_BYTES``: for a gradient (a sum's backward), whose view would save no memory
    there, and whose ``np.broadcast_to`` (Python code) took about 4x as long as the copy that a
    kernel's backward then makes of it anyway (kernels take C-contiguous operands; (1, 1) ->
    (8, 16) float32, on a shared machine).
    """
    if isinstance(a, np.ndarray):
        n = math.prod(shape)
        if n == a.size:  # no repeats (new or kept size-1 dimensions): writable
            view = viewed(a, tuple(shape))
            if view is not None:
                return view
        if copy_small and n * a.itemsize <= _pool.SMALL_HOST_BYTES:
            # through the math object, which taifuse.compile records (a bare copy it would not)
            return m.broadcast_to(a, tuple(shape))
        return np.broadcast_to(a, shape)
    return m.broadcast_to(a, shape)


def _strided_view(a: np.ndarray, shape: tuple[int, ...], strides: tuple[int, ...], offset: int) -> np.ndarray:
    # NOTE: as_strided checks no bounds: callers pass positions inside ``a``'s storage. Those
    # are positions in ``a``'s C layout: a strided ``a`` (a view, read by a gather) is first
    # copied to one; the targets of the scatters are always contiguous.
    flat = dense(a).reshape(-1)[offset:]
    return np.lib.stride_tricks.as_strided(flat, tuple(shape), tuple(s * a.itemsize for s in strides))


HOST_MATH = HostMath()


# NOTE [ Host tensor math on a backend's kernels ]
# A Tensor's ``+`` is NumPy's ufunc on the host backends, on one thread. In the GPT example's
# step the residual adds ((16, 128, 256) float32, 2 MiB per operand) were the largest
# memory-bound row of the profile after layer norm, at a fifth of the copy bandwidth. A host
# backend may export ``HOST_MATH_KERNELS`` (the numba backend does): ``add``, ``sub`` and ``mul``
# (``out = a op b``, all of one shape) and ``runs_parallel(size)``. Its tensor math is then
# :class:`KernelHostMath`: where both operands are C-contiguous float32 or float64 arrays of one
# shape and large enough for the backend's parallel kernels, ``+ - *`` and ``+=`` (the autograd
# engine's sums of the residual stream's gradients) run on those kernels (512-bit vectors, the
# backend's threads). Everything else (broadcasting, scalars, strided views, mixed dtypes,
# float16, small arrays) stays NumPy's. Each element is one IEEE operation rounded once either
# way, so the results are NumPy's to the bit. Measured at (2048, 256) float32 with the operands
# rotated over 24 pairs (out of L2, as in the step), one thread each, on a loaded 2-core
# machine: the numba kernel took 0.85x np.add's CPU time [0.82, 0.87] (median [quartiles] of 21
# interleaved rounds; 0.89x [0.86, 0.93] with the operands in L2). Since the parallel threshold
# counts the wake of Numba's worker (NOTE [ A launch wakes the worker ] in numba/_jit.py), the
# GPT example's residual adds, 0.26M and 0.52M elements, are under it and stay NumPy's.
_KERNEL_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


class KernelHostMath(HostMath):
    """HostMath with the large same-shape ``+ - *`` and ``+=`` on a host backend's kernels
    (NOTE [ Host tensor math on a backend's kernels ])."""

    def __init__(self, kernels: Any) -> None:
        self.kernels = kernels

    def _on_kernels(self, a: Any, b: Any) -> bool:
        return (
            type(a) is np.ndarray
            and type(b) is np.ndarray
            and a.shape == b.shape
            and a.dtype == b.dtype
            and a.dtype in _KERNEL_DTYPES
            and a.flags.c_contiguous
            and b.flags.c_contiguous
            and self.kernels.runs_parallel(a.size)
        )

    def _into_new(self, kernel: Callable[..., None], a: np.ndarray, b: np.ndarray) -> np.ndarray:
        out = _buffer(a.shape, a.dtype)
        kernel(a, b, out)
        return out

    def add(self, a: Any, b: Any) -> np.ndarray:
        if self._on_kernels(a, b):
            return self._into_new(self.kernels.add, a, b)
        return _binary(np.add, a, b)

    def sub(self, a: Any, b: Any) -> np.ndarray:
        if self._on_kernels(a, b):
            return self._into_new(self.kernels.sub, a, b)
        return _binary(np.subtract, a, b)

    def mul(self, a: Any, b: Any) -> np.ndarray:
        if self._on_kernels(a, b):
            return self._into_new(self.kernels.mul, a, b)
        return _binary(np.multiply, a, b)

    def add_(self, acc: np.ndarray, a: Any) -> None:
        if self._on_kernels(acc, a):
            self.kernels.add(acc, a, acc)
        else:
            HostMath.add_(acc, a)


class _MathOf(dict):
    """Per backend module, its tensor math, found once (a backend's table never changes it)."""

    def __missing__(self, backend: ModuleType) -> Any:
        self[backend] = math = _find_math(backend)
        return math


# math_for(backend): the tensor-arithmetic object of ``backend``, its ``TENSOR_MATH``, else NumPy's
# for a host backend. A bound dict look-up, no Python frame once the backend is known: every op's
# node asks (NOTE [ The lean apply ] in _engine.py).
math_for: Callable[[ModuleType], Any] = _MathOf().__getitem__


def _find_math(backend: ModuleType) -> Any:
    math = getattr(backend, "TENSOR_MATH", None)
    if math is not None:
        return math
    if backend.is_array(np.empty(0)):
        kernels = getattr(backend, "HOST_MATH_KERNELS", None)
        return HOST_MATH if kernels is None else KernelHostMath(kernels)
    raise NotImplementedError(
        f"Tensors on the {backend.NAME!r} backend are not implemented yet (it has no TENSOR_MATH); "
        "use the numba or numpy backend"
    )


def astype(m: Any, a: Any, dtype: Any) -> Any:
    """A copy of array ``a`` in ``dtype``, through ``m`` (type promotion and its gradient: NOTE [ Mixed
    dtypes ] in _tensor_functions.py)."""
    cast = getattr(m, "astype", None)
    if cast is not None:
        return cast(a, dtype)
    # NOTE: a device math without astype converts through the host: two transfers.
    return m.asarray(a, dtype)


def sum_to_shape(m: Any, grad: Any, shape: tuple[int, ...]) -> Any:
    """Sum ``grad`` over the axes that broadcasting expanded, so that it has ``shape``.

    The gradient of a broadcast input is the sum of the output gradient over every position the
    input was copied to: leading axes the input lacked, and axes where it had size 1.
    """
    shape = tuple(shape)
    if tuple(grad.shape) == shape:
        return grad
    lead = grad.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(
        lead + i for i, n in enumerate(shape) if n == 1 and grad.shape[lead + i] != 1
    )
    reduced = m.sum(grad, axes, True) if axes else grad
    return m.reshape(reduced, shape)
