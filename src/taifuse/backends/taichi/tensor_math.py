"""Tensor arithmetic on the taichi backend's DeviceArrays: :class:`TaichiMath`.

The Taichi counterpart of ``taifuse._tensor_math.HostMath`` (same methods, same NumPy
semantics: broadcasting, Python scalars, ``sum`` over an axis tuple with float32 accumulation), so
that a Tensor's data never leaves the device. Every method runs Taichi kernels on the flat
``ti.Ndarray`` storage of a DeviceArray; only :meth:`TaichiMath.to_numpy`, :meth:`TaichiMath.item`
and casts from or to integers copy to the host (counted in ``transfer_stats``).

Every result and scratch buffer comes from the device's buffer pool through :func:`_new`, the one
allocation path of this module and of ``backward.py``.

# NOTE [ Strided views in kernels ]
# DeviceArrays are always C-contiguous, but a kernel may read one through any strides: broadcasting
# is a stride of 0, a transpose is a permutation of strides. Before a launch the host merges
# adjacent dimensions that are contiguous for every operand (and drops size-1 dimensions), then
# pads to MAX_DIMS; a kernel decomposes each flat output index over that padded shape. So
# ``broadcast_to``, ``transpose`` and broadcasting arithmetic are one gather each, and ``matmul``
# reads a transposed operand without copying it (``backward.py`` uses that for linear's
# weight gradient).
#
# NOTE [ Loop limits in reductions ]
# lavapipe stops a shader invocation after ~65k loop iterations in total (measured on lavapipe),
# and a long float32 running sum drifts. So ``sum`` never lets one thread add more than
# REDUCE_CHUNK terms: a pass sums chunks of REDUCE_CHUNK into float32 partials, and passes repeat
# until one value per output is left (a tree with REDUCE_CHUNK-way nodes).
"""

# NOTE: no `from __future__ import annotations`: Taichi reads kernel annotations as objects.

import functools
import math
import numbers
from types import SimpleNamespace
from typing import Any

import numpy as np

from taifuse import pool
from taifuse.backends.taichi._runtime import (
    ALLOCATOR,
    FLOAT_DTYPES,
    INDEX_DTYPE,
    _import_taichi,
    _launch_grid,
    _nd,
    _ti_dtype,
    from_numpy,
    is_array,
)

MAX_DIMS = 6  # dimensions a kernel indexes after merging (NOTE [ Strided views in kernels ])
REDUCE_CHUNK = 256  # terms one thread adds per reduction pass (NOTE [ Loop limits in reductions ])
# Launch sizes, in threads, of the small kernels of the reduction passes and matmul (NOTE [ The
# dispatch size of a runtime range ] in forward.py): on a GPU, a launch of at most that many threads'
# work (partials, output tiles) launches the smallest that covers it; a larger one launches one
# thread per item (a runtime range).
SMALL_GRIDS = (1024, 16384)
# Register tile of matmul: each thread owns TILE x TILE outputs.
TILE = 4

OP_ADD, OP_SUB, OP_MUL, OP_DIV, OP_MAX, OP_MIN, OP_EQ = 0, 1, 2, 3, 4, 5, 6
_OP_NAMES = {
    OP_ADD: "add", OP_SUB: "sub", OP_MUL: "mul", OP_DIV: "div", OP_MAX: "maximum", OP_MIN: "minimum", OP_EQ: "eq",
}  # fmt: skip
UNARY_EXP, UNARY_LOG, UNARY_SQRT = 0, 1, 2
# Terms one thread visits per launch in the index loops (take_backward, argmax); passes repeat
# beyond it (NOTE [ Loop limits in reductions ]).
INDEX_CHUNK = 1024
# pow_scalar modes for a negative base: NumPy gives +|a|^e (even integer e), -|a|^e (odd), nan (else).
POW_EVEN, POW_ODD, POW_FRACTIONAL = 0, 1, 2


def _new(shape: tuple[int, ...], dtype: Any) -> Any:
    """A result or scratch buffer from the pool (its contents are stale: write every element)."""
    return pool.empty(ALLOCATOR, tuple(int(s) for s in shape), np.dtype(dtype))


# ----------------------------------------------------------------------------- kernels
#
# One cached factory per op family, each building its kernels for one storage dtype when first
# needed: elementwise, reductions, matmul, views and indices. The strided-offset ti.func they all
# index with is built once, by _strided.


@functools.cache
def _strided() -> SimpleNamespace:
    """``V``, the padded shape/strides vector type, and ``offset``, the ti.func that places a flat
    index in a strided operand (NOTE [ Strided views in kernels ]); shared by every family."""
    ti = _import_taichi()
    V = ti.types.vector(MAX_DIMS, ti.i32)

    @ti.func
    def offset(i: ti.i32, shape: V, strides: V) -> ti.i32:
        # Position of flat (C-order) index i of `shape` in an operand with `strides`.
        off = 0
        rem = i
        for d in ti.static(range(MAX_DIMS - 1, -1, -1)):
            off += (rem % shape[d]) * strides[d]
            rem = rem // shape[d]
        return off

    return SimpleNamespace(V=V, offset=offset)


@functools.cache
def elementwise_kernels_for(dtype: Any) -> SimpleNamespace:
    """Elementwise kernels (arithmetic, pow, abs, exp/log/sqrt, fill, casts) for storage dtype
    ``dtype`` (float32 or float16), built once per process."""
    ti = _import_taichi()
    from taifuse.backends.taichi import _math as M

    T = _ti_dtype(dtype)
    X = ti.types.ndarray(dtype=T, ndim=1)
    F32 = ti.types.ndarray(dtype=ti.f32, ndim=1)
    V, _offset = _strided().V, _strided().offset

    @ti.func
    def _apply(op: ti.i32, u: ti.f32, v: ti.f32) -> ti.f32:
        r = 0.0
        if op == OP_ADD:
            r = u + v
        elif op == OP_SUB:
            r = u - v
        elif op == OP_MUL:
            r = u * v
        elif op == OP_DIV:
            r = u / v
        elif op == OP_MAX:
            r = M.nan_max(u, v)
        elif op == OP_MIN:
            r = M.nan_min(u, v)
        else:
            r = ti.select(u == v, 1.0, 0.0)
        return r

    @ti.kernel
    def binary_flat(a: X, b: X, out: X, op: ti.i32, n: ti.i32):
        for i in range(n):
            out[i] = ti.cast(_apply(op, ti.cast(a[i], ti.f32), ti.cast(b[i], ti.f32)), T)

    @ti.kernel
    def binary(a: X, b: X, out: X, op: ti.i32, n: ti.i32, shape: V, sa: V, sb: V):
        for i in range(n):
            u = ti.cast(a[_offset(i, shape, sa)], ti.f32)
            v = ti.cast(b[_offset(i, shape, sb)], ti.f32)
            out[i] = ti.cast(_apply(op, u, v), T)

    @ti.kernel
    def binary_scalar(a: X, s: ti.f32, out: X, op: ti.i32, n: ti.i32, reverse: ti.i32):
        for i in range(n):
            u = ti.cast(a[i], ti.f32)
            r = 0.0
            if reverse != 0:
                r = _apply(op, s, u)
            else:
                r = _apply(op, u, s)
            out[i] = ti.cast(r, T)

    def make_inplace(grid):
        @ti.kernel
        def inplace(acc: X, b: X, op: ti.i32, n: ti.i32, shape: V, sb: V):
            # grid = 0: a runtime range of n; else exactly `grid` threads, the first n working (NOTE
            # [ The dispatch size of a runtime range ] in forward.py): the caller's choice.
            for i in range(n if ti.static(grid == 0) else grid):
                if i < n:
                    v = ti.cast(b[_offset(i, shape, sb)], ti.f32)
                    acc[i] = ti.cast(_apply(op, ti.cast(acc[i], ti.f32), v), T)

        return inplace

    inplace = make_inplace(0)

    @ti.kernel
    def inplace_scalar(acc: X, s: ti.f32, op: ti.i32, n: ti.i32):
        for i in range(n):
            acc[i] = ti.cast(_apply(op, ti.cast(acc[i], ti.f32), s), T)

    @ti.kernel
    def pow_scalar(a: X, e: ti.f32, out: X, n: ti.i32, negative_mode: ti.i32):
        for i in range(n):
            u = ti.cast(a[i], ti.f32)
            r = ti.pow(ti.abs(u), e)  # pow of a negative base is undefined on GPUs
            if u < 0.0:
                if negative_mode == POW_ODD:
                    r = -r
                elif negative_mode == POW_FRACTIONAL:
                    r = ti.math.nan
            # Vulkan's fast-math pow returns 0 for a NaN base; NumPy (and a NaN norm) keep the NaN.
            out[i] = ti.cast(ti.select(M.is_nan(u), ti.math.nan, r), T)

    @ti.kernel
    def abs_(a: X, out: X, n: ti.i32):
        for i in range(n):
            out[i] = ti.cast(ti.abs(ti.cast(a[i], ti.f32)), T)

    @ti.kernel
    def fill(out: X, value: ti.f32, n: ti.i32):
        for i in range(n):
            out[i] = ti.cast(value, T)

    @ti.kernel
    def cast_from_f32(src: F32, out: X, n: ti.i32):
        for i in range(n):
            out[i] = ti.cast(src[i], T)

    @ti.kernel
    def cast_to_f32(src: X, out: F32, n: ti.i32):
        for i in range(n):
            out[i] = ti.cast(src[i], ti.f32)

    @ti.kernel
    def unary(a: X, out: X, n: ti.i32, op: ti.i32):
        # NumPy's results outside the domain (a GPU's log and sqrt of a negative are undefined).
        for i in range(n):
            u = ti.cast(a[i], ti.f32)
            r = ti.math.nan
            if op == UNARY_EXP:
                r = ti.exp(u)
            elif op == UNARY_LOG:
                if u > 0.0:
                    r = ti.log(u)
                elif u == 0.0:
                    r = -ti.math.inf
            elif u >= 0.0:
                r = ti.sqrt(u)
            if M.is_nan(u):
                r = ti.math.nan
            out[i] = ti.cast(r, T)

    return SimpleNamespace(
        binary_flat=binary_flat,
        binary=binary,
        binary_scalar=binary_scalar,
        inplace=inplace,
        inplace_scalar=inplace_scalar,
        pow_scalar=pow_scalar,
        abs=abs_,
        fill=fill,
        cast_from_f32=cast_from_f32,
        cast_to_f32=cast_to_f32,
        unary=unary,
        **{f"inplace_{grid}": make_inplace(grid) for grid in SMALL_GRIDS},
    )


@functools.cache
def reduce_kernels_for(dtype: Any) -> SimpleNamespace:
    """Sum and max reduction passes (NOTE [ Loop limits in reductions ]) for storage dtype
    ``dtype``, built once per process: float32 partials from, into, or the storage type."""
    ti = _import_taichi()
    from taifuse.backends.taichi import _math as M

    T = _ti_dtype(dtype)
    X = ti.types.ndarray(dtype=T, ndim=1)
    F32 = ti.types.ndarray(dtype=ti.f32, ndim=1)
    V, _offset = _strided().V, _strided().offset

    def make_reduce(IN, OUT, OUT_T, is_max, grid):
        @ti.kernel
        def reduce(
            x: IN,
            out: OUT,
            n_out: ti.i32,
            chunks: ti.i32,
            r_total: ti.i32,
            kshape: V,
            kstride: V,
            rshape: V,
            rstride: V,
            scale: ti.f32,
        ):
            # out[o * chunks + c] = scale * the sum (or the NaN-propagating max) of terms
            # c*REDUCE_CHUNK ... of output o's reduced set. grid = 0: a runtime range of one thread
            # per partial; else exactly `grid` threads (a constant range, NOTE [ The dispatch size of
            # a runtime range ] in forward.py), of which the first n_out * chunks work: the caller
            # launches it only when they are at most `grid`.
            for t in range(n_out * chunks if ti.static(grid == 0) else grid):
                if t < n_out * chunks:
                    o = t // chunks
                    c = t % chunks
                    base = _offset(o, kshape, kstride)
                    s = 0.0
                    if ti.static(is_max):
                        s = -ti.math.inf
                    for r in range(c * REDUCE_CHUNK, ti.min(c * REDUCE_CHUNK + REDUCE_CHUNK, r_total)):
                        v = ti.cast(x[base + _offset(r, rshape, rstride)], ti.f32)
                        if ti.static(is_max):
                            s = M.nan_max(s, v)
                        else:
                            s += v
                    out[t] = ti.cast(s * scale, OUT_T)

        return reduce

    kernels = {}
    for grid in (0, *SMALL_GRIDS):
        suffix = f"_{grid}" if grid else ""
        kernels.update({
            f"reduce_to_f32{suffix}": make_reduce(X, F32, ti.f32, False, grid),
            f"reduce_from_f32{suffix}": make_reduce(F32, X, T, False, grid),
            f"reduce_same{suffix}": make_reduce(X, X, T, False, grid),
            f"max_to_f32{suffix}": make_reduce(X, F32, ti.f32, True, grid),
            f"max_from_f32{suffix}": make_reduce(F32, X, T, True, grid),
            f"max_same{suffix}": make_reduce(X, X, T, True, grid),
        })  # fmt: skip
    return SimpleNamespace(**kernels)


@functools.cache
def matmul_kernels_for(dtype: Any) -> SimpleNamespace:
    """The batched, strided matmul for storage dtype ``dtype``, built once per process."""
    ti = _import_taichi()

    T = _ti_dtype(dtype)
    X = ti.types.ndarray(dtype=T, ndim=1)
    V, _offset = _strided().V, _strided().offset

    def make_matmul(grid):
        @ti.kernel
        def matmul(
            a: X,
            b: X,
            out: X,
            n_rows: ti.i32,
            m_cols: ti.i32,
            k_dim: ti.i32,
            batch: ti.i32,
            bshape: V,
            sa_batch: V,
            sb_batch: V,
            sa_n: ti.i32,
            sa_k: ti.i32,
            sb_k: ti.i32,
            sb_m: ti.i32,
        ):
            # out[p, n, m] = sum_k a[p, n, k] * b[p, k, m] for out (batch, n_rows, m_cols) C-contiguous and
            # a, b read through strides (NOTE [ Strided views in kernels ]). One TILE x TILE register tile
            # per thread; edge tiles clamp their loads and mask their stores. grid = 0: a runtime range of
            # one thread per tile; else exactly `grid` threads (a constant range, NOTE [ The dispatch
            # size of a runtime range ] in forward.py), of which the first batch * tiles work: the
            # caller launches it only when they are at most `grid`.
            tiles_m = (m_cols + TILE - 1) // TILE
            tiles = ((n_rows + TILE - 1) // TILE) * tiles_m
            for t in range(batch * tiles if ti.static(grid == 0) else grid):
                if t < batch * tiles:
                    p = t // tiles
                    tt = t % tiles
                    n0 = (tt // tiles_m) * TILE
                    m0 = (tt % tiles_m) * TILE
                    a0 = _offset(p, bshape, sa_batch)
                    b0 = _offset(p, bshape, sb_batch)
                    arow = ti.Vector([0] * TILE, dt=ti.i32)
                    bcol = ti.Vector([0] * TILE, dt=ti.i32)
                    for i in ti.static(range(TILE)):
                        arow[i] = a0 + ti.min(n0 + i, n_rows - 1) * sa_n
                        bcol[i] = b0 + ti.min(m0 + i, m_cols - 1) * sb_m
                    acc = ti.Matrix.zero(ti.f32, TILE, TILE)
                    for k in range(k_dim):
                        av = ti.Vector.zero(ti.f32, TILE)
                        bv = ti.Vector.zero(ti.f32, TILE)
                        for i in ti.static(range(TILE)):
                            av[i] = ti.cast(a[arow[i] + k * sa_k], ti.f32)
                            bv[i] = ti.cast(b[bcol[i] + k * sb_k], ti.f32)
                        for i, j in ti.static(ti.ndrange(TILE, TILE)):
                            acc[i, j] += av[i] * bv[j]
                    for i, j in ti.static(ti.ndrange(TILE, TILE)):
                        if n0 + i < n_rows and m0 + j < m_cols:
                            out[(p * n_rows + n0 + i) * m_cols + m0 + j] = ti.cast(acc[i, j], T)

        return matmul

    small = {f"matmul_{grid}": make_matmul(grid) for grid in SMALL_GRIDS}
    return SimpleNamespace(matmul=make_matmul(0), **small)


@functools.cache
def index_kernels_for(dtype: Any) -> SimpleNamespace:
    """View and index kernels (gather, scatter, take, masked_fill, first_index; NOTE [ Views ]
    in taifuse/_tensor_functions.py) for storage dtype ``dtype``, built once per process."""
    ti = _import_taichi()
    from taifuse.backends.taichi import _math as M

    T = _ti_dtype(dtype)
    X = ti.types.ndarray(dtype=T, ndim=1)
    I32 = ti.types.ndarray(dtype=ti.i32, ndim=1)
    V, _offset = _strided().V, _strided().offset

    @ti.kernel
    def gather(a: X, out: X, n: ti.i32, shape: V, sa: V):
        for i in range(n):
            out[i] = a[_offset(i, shape, sa)]

    @ti.kernel
    def gather_at(a: X, out: X, n: ti.i32, offset: ti.i32, shape: V, sa: V):
        for i in range(n):
            out[i] = a[offset + _offset(i, shape, sa)]

    @ti.kernel
    def scatter_at(src: X, out: X, n: ti.i32, offset: ti.i32, shape: V, so: V):
        # The positions never overlap (no stride 0 on a dimension longer than 1): no atomics.
        for i in range(n):
            out[offset + _offset(i, shape, so)] = src[i]

    @ti.kernel
    def scatter_add_at(src: X, out: X, n: ti.i32, offset: ti.i32, shape: V, so: V):
        # As scatter_at: distinct positions, so a plain read-modify-write (no float atomics).
        for i in range(n):
            j = offset + _offset(i, shape, so)
            out[j] = out[j] + src[i]

    @ti.kernel
    def take(a: X, index: I32, out: X, n: ti.i32, k_len: ti.i32, inner: ti.i32, size: ti.i32):
        # out (outer, k_len, inner) = a (outer, size, inner) at index[k]; NaN out of range
        # (a device index is not range-checked: NOTE [ Class indices on the device ]).
        for i in range(n):
            r = i % inner
            t = i // inner
            j = index[t % k_len]
            if j < 0:
                j += size
            v = ti.math.nan
            if j >= 0 and j < size:
                v = ti.cast(a[((t // k_len) * size + j) * inner + r], ti.f32)
            out[i] = ti.cast(v, T)

    @ti.kernel
    def take_backward(
        g: X, index: I32, out: X, n: ti.i32, k_len: ti.i32, inner: ti.i32, size: ti.i32, k0: ti.i32,
        k1: ti.i32, accumulate: ti.i32,
    ):  # fmt: skip
        # out (outer, size, inner) (+)= the sum of g (outer, k_len, inner) over the k in [k0, k1)
        # with index[k] == j. One thread per output entry, so repeated indices need no atomics
        # (Metal has no float atomics): each thread scans the index, at most INDEX_CHUNK per launch.
        for i in range(n):
            r = i % inner
            t = i // inner
            j = t % size
            base = (t // size) * k_len
            s = 0.0
            if accumulate != 0:
                s = ti.cast(out[i], ti.f32)
            for k in range(k0, k1):
                jk = index[k]
                if jk < 0:
                    jk += size
                if jk == j:
                    s += ti.cast(g[(base + k) * inner + r], ti.f32)
            out[i] = ti.cast(s, T)

    @ti.kernel
    def masked_fill(a: X, mask: I32, out: X, n: ti.i32, value: ti.f32, shape: V, sa: V, sm: V):
        for i in range(n):
            v = a[_offset(i, shape, sa)]
            if mask[_offset(i, shape, sm)] != 0:
                v = ti.cast(value, T)
            out[i] = v

    @ti.kernel
    def first_index(
        a: X, values: X, index: I32, n_out: ti.i32, r_len: ti.i32, inner: ti.i32, r0: ti.i32, r1: ti.i32,
    ):  # fmt: skip
        # index[o, c] = the first r in [r0, r1) with a[o, r, c] == values[o, c] (NaN matching NaN),
        # unless an earlier pass found one; r_len means none yet. Passes go in increasing r.
        for t in range(n_out):
            c = t % inner
            base = (t // inner) * r_len * inner + c
            v = ti.cast(values[t], ti.f32)
            found = r_len
            if r0 > 0:
                found = index[t]
            for r in range(r0, r1):
                u = ti.cast(a[base + r * inner], ti.f32)
                if found == r_len and (u == v or (M.is_nan(u) and M.is_nan(v))):
                    found = r
            index[t] = found

    @ti.kernel
    def scatter_dim(g: X, index: I32, out: X, n: ti.i32, r_len: ti.i32, inner: ti.i32):
        # out (outer, r_len, inner) = g (outer, 1, inner) at r == index[o, c], else 0.
        for i in range(n):
            c = i % inner
            t = i // inner
            src = (t // r_len) * inner + c
            v = ti.cast(0.0, T)
            if index[src] == t % r_len:
                v = g[src]
            out[i] = v

    return SimpleNamespace(
        gather=gather,
        gather_at=gather_at,
        scatter_at=scatter_at,
        scatter_add_at=scatter_add_at,
        take=take,
        take_backward=take_backward,
        masked_fill=masked_fill,
        first_index=first_index,
        scatter_dim=scatter_dim,
    )


# The families, in the order all_kernels lists them.
_FAMILIES = (elementwise_kernels_for, reduce_kernels_for, matmul_kernels_for, index_kernels_for)


def all_kernels() -> list:
    """Every (name, kernel) pair TaichiMath may launch, for ``metal_check``."""
    pairs = []
    for dtype in FLOAT_DTYPES:
        for family in _FAMILIES:
            for name, kernel in vars(family(dtype)).items():
                pairs.append((f"tm_{name}_{dtype.name}", kernel))
    return pairs


# ----------------------------------------------------------------------------- host-side geometry


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = []
    step = 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def _broadcast_strides(shape: tuple[int, ...], out_shape: tuple[int, ...]) -> tuple[int, ...]:
    """Strides reading an operand of ``shape`` as if broadcast to ``out_shape`` (0 on broadcast axes)."""
    lead = len(out_shape) - len(shape)
    own = _contiguous_strides(shape)
    return tuple(0 if i < lead or shape[i - lead] == 1 else own[i - lead] for i in range(len(out_shape)))


def _merge(shape: tuple[int, ...], *strides: tuple[int, ...]) -> tuple[Any, ...]:
    """(shape, strides...) padded to MAX_DIMS after merging dims contiguous in every operand."""
    dims: list = []
    for i, n in enumerate(shape):
        if n == 1:
            continue
        st = [s[i] for s in strides]
        if dims and all(ps == s * n for ps, s in zip(dims[-1][1], st)):
            dims[-1] = (dims[-1][0] * n, st)
        else:
            dims.append((n, st))
    if len(dims) > MAX_DIMS:
        raise NotImplementedError(
            f"the taichi backend indexes at most {MAX_DIMS} non-contiguous dimensions, got shape {shape}"
        )
    dims = [(1, [0] * len(strides))] * (MAX_DIMS - len(dims)) + dims
    ti = _import_taichi()
    out_shape = ti.Vector([n for n, _ in dims], dt=ti.i32)
    return (out_shape,) + tuple(ti.Vector([st[j] for _, st in dims], dt=ti.i32) for j in range(len(strides)))


def _is_number(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


# NOTE [ No integer arithmetic ]
# Integer DeviceArrays are int32 class indices (NOTE [ Class indices on the device ] in
# backward.py). Arithmetic on them is refused, not emulated: Metal has no 64-bit integers,
# so the int64 results PyTorch (and the host backends) give could not be matched, and int32 results
# would wrap where theirs do not; the same reason float64 is refused rather than cast. Views
# (reshape) and copies to the host stay available.
def _require_float(op: str, *operands: tuple[str, Any]) -> None:
    """Refuse (before anything is allocated or written) an integer operand of ``op``, naming it."""
    for which, value in operands:
        if not _is_number(value) and value.dtype.kind != "f":
            raise TypeError(
                f"{op}: the {which} has dtype {value.dtype}; the taichi backend has no integer arithmetic "
                "(its integer tensors hold int32 class indices: Metal has no 64-bit integers). Convert it "
                "to float32 first (taifuse.tensor(t.numpy(), dtype=np.float32)), or use the numpy or numba backend"
            )


# ----------------------------------------------------------------------------- reductions


def reduce_into(
    x: Any,
    out: Any,
    kept_shape: tuple[int, ...],
    kept_strides: tuple[int, ...],
    red_shape: tuple[int, ...],
    red_strides: tuple[int, ...],
    scale: float = 1.0,
    *,
    take_max: bool = False,
) -> None:
    """out[o] = scale * sum over the reduced index set of ``x``, in float32 (NOTE [ Loop limits in reductions ]).

    With ``take_max`` it is the largest term instead (NaN when any term is NaN, as NumPy's max),
    and ``scale`` must be 1. ``x`` (float32 or the dtype of ``out``) is read at kept offset +
    reduced offset; ``out`` is C-contiguous with ``prod(kept_shape)`` elements. Nothing may be empty.
    """
    n_out = math.prod(kept_shape)
    r_total = math.prod(red_shape)
    kshape, kstride = _merge(tuple(kept_shape), tuple(kept_strides))
    rshape, rstride = _merge(tuple(red_shape), tuple(red_strides))
    src = x
    while True:
        chunks = -(-r_total // REDUCE_CHUNK)
        # A GPU launches a small pass as a constant range; the CPU has no idle blocks to save.
        grid = _launch_grid(n_out * chunks, SMALL_GRIDS)
        suffix = "" if grid is None else f"_{grid}"
        src_k = reduce_kernels_for(src.dtype)
        if chunks == 1:
            if src.dtype == out.dtype:
                name = "max_same" if take_max else "reduce_same"
                kernel = getattr(src_k, name + suffix)
            else:  # float32 partials into a float16 result
                name = "max_from_f32" if take_max else "reduce_from_f32"
                kernel = getattr(reduce_kernels_for(out.dtype), name + suffix)
            kernel(_nd(src), _nd(out), n_out, 1, r_total, kshape, kstride, rshape, rstride, float(scale))
            return
        partial = _new((n_out, chunks), np.float32)
        getattr(src_k, ("max_to_f32" if take_max else "reduce_to_f32") + suffix)(
            _nd(src), _nd(partial), n_out, chunks, r_total, kshape, kstride, rshape, rstride, 1.0
        )
        # The next pass reduces each output's row of float32 partials.
        src, r_total = partial, chunks
        kshape, kstride = _merge((n_out,), (chunks,))
        rshape, rstride = _merge((chunks,), (1,))


def sum_rows_into(x: Any, out: Any, rows: int, cols: int, scale: float = 1.0) -> None:
    """out[c] = scale * sum_r x[r, c] for ``x (rows, cols)`` C-contiguous (float32 or out's dtype)."""
    reduce_into(x, out, (cols,), (1,), (rows,), (cols,), scale)


# ----------------------------------------------------------------------------- TaichiMath


class TaichiMath:
    """Tensor arithmetic for the taichi backend: ``_tensor_math.HostMath``'s methods on DeviceArrays."""

    @staticmethod
    def asarray(data: Any, dtype: np.dtype | None) -> Any:
        if is_array(data):
            if dtype is None or np.dtype(dtype) == data.dtype:
                return TaichiMath.copy(data)
            data = data.numpy()
        return from_numpy(np.array(data, dtype=dtype, order="C", copy=True))

    @staticmethod
    def astype(a: Any, dtype: Any) -> Any:
        """A copy of ``a`` in ``dtype``: float16 <-> float32 on the device, other casts through the host."""
        dtype = np.dtype(dtype)
        if a.dtype not in FLOAT_DTYPES or dtype not in FLOAT_DTYPES or dtype == a.dtype:
            return TaichiMath.asarray(a, dtype)
        out = _new(a.shape, dtype)
        if out.size:
            if dtype == np.float32:
                elementwise_kernels_for(a.dtype).cast_to_f32(_nd(a), _nd(out), out.size)
            else:
                elementwise_kernels_for(dtype).cast_from_f32(_nd(a), _nd(out), out.size)
        return out

    @staticmethod
    def to_numpy(a: Any) -> np.ndarray:
        return a.numpy()

    @staticmethod
    def _binary(a: Any, b: Any, op: int) -> Any:
        if _is_number(a) and _is_number(b):
            raise TypeError("taichi tensor math needs at least one DeviceArray operand")
        _require_float(_OP_NAMES[op], ("left operand", a), ("right operand", b))
        if _is_number(b) or _is_number(a):
            arr, s, reverse = (a, b, 0) if _is_number(b) else (b, a, 1)
            out = _new(arr.shape, arr.dtype)
            if out.size:
                elementwise_kernels_for(arr.dtype).binary_scalar(
                    _nd(arr), float(s), _nd(out), op, out.size, reverse
                )
            return out
        if a.dtype != b.dtype:
            raise TypeError(f"operands have dtypes {a.dtype} and {b.dtype}")
        shape = tuple(np.broadcast_shapes(a.shape, b.shape))
        out = _new(shape, a.dtype)
        if not out.size:
            return out
        k = elementwise_kernels_for(a.dtype)
        if a.shape == b.shape:
            k.binary_flat(_nd(a), _nd(b), _nd(out), op, out.size)
        else:
            geo = _merge(shape, _broadcast_strides(a.shape, shape), _broadcast_strides(b.shape, shape))
            k.binary(_nd(a), _nd(b), _nd(out), op, out.size, *geo)
        return out

    @staticmethod
    def add(a: Any, b: Any) -> Any:
        return TaichiMath._binary(a, b, OP_ADD)

    @staticmethod
    def sub(a: Any, b: Any) -> Any:
        return TaichiMath._binary(a, b, OP_SUB)

    @staticmethod
    def mul(a: Any, b: Any) -> Any:
        return TaichiMath._binary(a, b, OP_MUL)

    @staticmethod
    def div(a: Any, b: Any) -> Any:
        return TaichiMath._binary(a, b, OP_DIV)

    @staticmethod
    def neg(a: Any) -> Any:
        _require_float("neg", ("operand", a))
        # 0 - x would turn -0.0 into +0.0; -1 * x keeps the sign bit as NumPy's negative does.
        return TaichiMath._binary(a, -1.0, OP_MUL)

    @staticmethod
    def maximum(a: Any, b: Any) -> Any:
        """Elementwise max; NaN where either operand is NaN (as NumPy's ``maximum``)."""
        return TaichiMath._binary(a, b, OP_MAX)

    @staticmethod
    def minimum(a: Any, b: Any) -> Any:
        """Elementwise min; NaN where either operand is NaN (as NumPy's ``minimum``)."""
        return TaichiMath._binary(a, b, OP_MIN)

    @staticmethod
    def abs(a: Any) -> Any:
        _require_float("abs", ("operand", a))
        out = _new(a.shape, a.dtype)
        if out.size:
            elementwise_kernels_for(a.dtype).abs(_nd(a), _nd(out), out.size)
        return out

    @staticmethod
    def pow_scalar(a: Any, exponent: float) -> Any:
        _require_float("pow", ("operand", a))
        if exponent == 2:
            return TaichiMath._binary(a, a, OP_MUL)
        out = _new(a.shape, a.dtype)
        if out.size:
            e = float(exponent)
            if e.is_integer():
                mode = POW_ODD if int(e) % 2 else POW_EVEN
            else:
                mode = POW_FRACTIONAL
            elementwise_kernels_for(a.dtype).pow_scalar(_nd(a), e, _nd(out), out.size, mode)
        return out

    @staticmethod
    def matmul(a: Any, b: Any) -> Any:
        """NumPy's matmul: 1-D operands are promoted (and the promoted axis dropped), batches broadcast."""
        _require_float("matmul", ("left operand", a), ("right operand", b))
        if a.dtype != b.dtype:
            raise TypeError(f"matmul: operands have dtypes {a.dtype} and {b.dtype}")
        a2 = a.reshape((1,) + a.shape) if a.ndim == 1 else a
        b2 = b.reshape(b.shape + (1,)) if b.ndim == 1 else b
        (n, k), (k_b, m) = a2.shape[-2:], b2.shape[-2:]
        if k != k_b:
            raise ValueError(f"matmul: shapes {a.shape} and {b.shape} are not aligned")
        batch_shape = tuple(np.broadcast_shapes(a2.shape[:-2], b2.shape[:-2]))
        out = _new(batch_shape + (n, m), a.dtype)
        if out.size:
            matmul_into(
                a2, b2, out, batch_shape,
                _broadcast_strides(a2.shape[:-2], batch_shape) if batch_shape else (),
                _broadcast_strides(b2.shape[:-2], batch_shape) if batch_shape else (),
                transpose_a=False, transpose_b=False,
            )  # fmt: skip
        shape = batch_shape + ((n,) if a.ndim > 1 else ()) + ((m,) if b.ndim > 1 else ())
        return out.reshape(shape)

    @staticmethod
    def sum(a: Any, axis: tuple[int, ...] | None, keepdims: bool) -> Any:
        return TaichiMath._reduce("sum", a, axis, keepdims)

    @staticmethod
    def max(a: Any, axis: tuple[int, ...] | None, keepdims: bool) -> Any:
        """The largest element over ``axis``; NaN where a NaN is among them (as NumPy's ``max``)."""
        return TaichiMath._reduce("max", a, axis, keepdims)

    @staticmethod
    def _reduce(op: str, a: Any, axis: tuple[int, ...] | None, keepdims: bool) -> Any:
        _require_float(op, ("operand", a))
        axes = tuple(range(a.ndim)) if axis is None else tuple(d % max(a.ndim, 1) for d in axis)
        kept = tuple(n for d, n in enumerate(a.shape) if d not in axes)
        red = tuple(n for d, n in enumerate(a.shape) if d in axes)
        if op == "max" and math.prod(red) == 0:
            raise ValueError(f"max: the reduced axes {axes} of shape {a.shape} are empty: a max of nothing")
        shape = tuple(1 if d in axes else n for d, n in enumerate(a.shape)) if keepdims else kept
        out = _new(shape, a.dtype)
        if not out.size:
            return out
        if not a.size:  # a sum over nothing is 0
            elementwise_kernels_for(a.dtype).fill(_nd(out), 0.0, out.size)
            return out
        strides = _contiguous_strides(a.shape)
        reduce_into(
            a,
            out,
            kept,
            tuple(s for d, s in enumerate(strides) if d not in axes),
            red,
            tuple(s for d, s in enumerate(strides) if d in axes),
            take_max=op == "max",
        )
        return out

    @staticmethod
    def reshape(a: Any, shape: tuple[int, ...]) -> Any:
        return a.reshape(tuple(shape))  # a view: DeviceArrays are always contiguous

    @staticmethod
    def transpose(a: Any, axes: tuple[int, ...] | None = None) -> Any:
        _require_float("transpose", ("operand", a))
        axes = tuple(reversed(range(a.ndim))) if axes is None else tuple(axes)
        shape = tuple(a.shape[d] for d in axes)
        out = _new(shape, a.dtype)
        if out.size:
            strides = _contiguous_strides(a.shape)
            geo = _merge(shape, tuple(strides[d] for d in axes))
            index_kernels_for(a.dtype).gather(_nd(a), _nd(out), out.size, *geo)
        return out

    @staticmethod
    def broadcast_to(a: Any, shape: tuple[int, ...]) -> Any:
        _require_float("broadcast_to", ("operand", a))
        shape = tuple(shape)
        if a.shape == shape:
            return a
        if tuple(np.broadcast_shapes(a.shape, shape)) != shape:
            raise ValueError(f"broadcast_to: cannot broadcast shape {a.shape} to {shape}")
        out = _new(shape, a.dtype)
        if out.size:
            geo = _merge(shape, _broadcast_strides(a.shape, shape))
            index_kernels_for(a.dtype).gather(_nd(a), _nd(out), out.size, *geo)
        return out

    @staticmethod
    def full(shape: tuple[int, ...], value: float, dtype: Any) -> Any:
        out = _new(shape, dtype)
        if out.size:
            elementwise_kernels_for(out.dtype).fill(_nd(out), float(value), out.size)
        return out

    @staticmethod
    def copy(a: Any) -> Any:
        _require_float("copy", ("operand", a))
        out = _new(a.shape, a.dtype)
        if out.size:
            elementwise_kernels_for(a.dtype).binary_scalar(_nd(a), 1.0, _nd(out), OP_MUL, out.size, 0)
        return out

    @staticmethod
    def sum_of_squares(a: Any, dtype: Any) -> Any:
        """sum(a**2) in ``dtype``, a 0-d array (gradient clipping's norm)."""
        a = a if a.dtype == np.dtype(dtype) else TaichiMath.astype(a, dtype)
        return TaichiMath.sum(TaichiMath.mul(a, a), None, False)

    @staticmethod
    def contiguous(a: Any) -> Any:
        """``a`` itself: a device array is always contiguous (HostMath.contiguous's counterpart)."""
        return a

    @staticmethod
    def copy_(acc: Any, a: Any) -> None:
        _require_float("copy_", ("tensor updated", acc), ("operand", a))
        if tuple(a.shape) != tuple(acc.shape) or a.dtype != acc.dtype:
            raise TypeError(f"copy_: operand {a.dtype}{tuple(a.shape)} into {acc.dtype}{tuple(acc.shape)}")
        if acc.size:
            elementwise_kernels_for(acc.dtype).binary_scalar(_nd(a), 1.0, _nd(acc), OP_MUL, acc.size, 0)

    @staticmethod
    def _inplace(acc: Any, a: Any, op: int) -> None:
        _require_float(f"in-place {_OP_NAMES[op]}", ("tensor updated", acc), ("operand", a))
        if not acc.size:
            return
        k = elementwise_kernels_for(acc.dtype)
        if _is_number(a):
            k.inplace_scalar(_nd(acc), float(a), op, acc.size)
            return
        if a.dtype != acc.dtype:
            raise TypeError(f"in-place operand has dtype {a.dtype}, the array {acc.dtype}")
        geo = _merge(acc.shape, _broadcast_strides(a.shape, acc.shape))
        grid = _launch_grid(acc.size, SMALL_GRIDS)
        (k.inplace if grid is None else getattr(k, f"inplace_{grid}"))(_nd(acc), _nd(a), op, acc.size, *geo)

    @staticmethod
    def add_(acc: Any, a: Any) -> None:
        """acc += a, in place (gradient accumulation into a leaf's ``.grad``, optimizer steps)."""
        TaichiMath._inplace(acc, a, OP_ADD)

    @staticmethod
    def sub_(acc: Any, a: Any) -> None:
        TaichiMath._inplace(acc, a, OP_SUB)

    @staticmethod
    def mul_(acc: Any, a: Any) -> None:
        TaichiMath._inplace(acc, a, OP_MUL)

    @staticmethod
    def fill_(acc: Any, value: float) -> None:
        """acc[...] = value, in place (``Tensor.zero_``; unlike ``mul_(acc, 0)``, NaN and inf become 0 too)."""
        if not acc.size:
            return
        if acc.dtype.kind == "f":
            elementwise_kernels_for(acc.dtype).fill(_nd(acc), float(value), acc.size)
        else:  # int32 class indices: a store, not arithmetic (NOTE [ No integer arithmetic ]); Taichi's own fill
            _nd(acc).fill(int(value))

    # -- views and indices (NOTE [ Views ] in taifuse/_tensor_functions.py)

    @staticmethod
    def as_strided(a: Any, shape: tuple[int, ...], strides: tuple[int, ...], offset: int) -> Any:
        """A contiguous copy of ``a``'s flat storage read at ``offset + index . strides`` (in elements)."""
        _require_float("as_strided", ("operand", a))
        out = _new(shape, a.dtype)
        if out.size:
            geo = _merge(tuple(shape), tuple(strides))
            index_kernels_for(a.dtype).gather_at(_nd(a), _nd(out), out.size, int(offset), *geo)
        return out

    @staticmethod
    def scatter_strided_(out: Any, src: Any, strides: tuple[int, ...], offset: int) -> None:
        """out's flat storage at ``offset + index . strides`` = src[index], in place (no overlaps)."""
        _require_float("scatter", ("tensor updated", out), ("operand", src))
        if src.dtype != out.dtype:
            raise TypeError(f"scatter: operand has dtype {src.dtype}, the array {out.dtype}")
        if src.size:
            geo = _merge(tuple(src.shape), tuple(strides))
            index_kernels_for(out.dtype).scatter_at(_nd(src), _nd(out), src.size, int(offset), *geo)

    @staticmethod
    def scatter_add_strided_(out: Any, src: Any, strides: tuple[int, ...], offset: int) -> None:
        """out's flat storage at ``offset + index . strides`` += src[index], in place (no overlaps)."""
        _require_float("scatter", ("tensor updated", out), ("operand", src))
        if src.dtype != out.dtype:
            raise TypeError(f"scatter: operand has dtype {src.dtype}, the array {out.dtype}")
        if src.size:
            geo = _merge(tuple(src.shape), tuple(strides))
            index_kernels_for(out.dtype).scatter_add_at(_nd(src), _nd(out), src.size, int(offset), *geo)

    @staticmethod
    def take(a: Any, index: Any, axis: int) -> Any:
        """``numpy.take(a, index, axis)`` with an int32 device ``index``; NaN where it is out of range."""
        _require_float("take", ("operand", a))
        size = a.shape[axis]
        out = _new(a.shape[:axis] + index.shape + a.shape[axis + 1 :], a.dtype)
        if not out.size:
            return out
        k = index_kernels_for(a.dtype)
        if not a.size:  # every index is out of range
            elementwise_kernels_for(a.dtype).fill(_nd(out), math.nan, out.size)
            return out
        inner = math.prod(a.shape[axis + 1 :])
        k.take(_nd(a), _nd(index), _nd(out), out.size, index.size, inner, size)
        return out

    @staticmethod
    def take_backward(g: Any, index: Any, axis: int, size: int) -> Any:
        """The gradient of :meth:`take` (repeated indices accumulate), without atomics."""
        _require_float("take backward", ("gradient", g))
        k_len = index.size
        out = _new(g.shape[:axis] + (size,) + g.shape[axis + index.ndim :], g.dtype)
        if not out.size:
            return out
        k = index_kernels_for(g.dtype)
        if not k_len:
            elementwise_kernels_for(g.dtype).fill(_nd(out), 0.0, out.size)
            return out
        inner = math.prod(g.shape[axis + index.ndim :])
        for k0 in range(0, k_len, INDEX_CHUNK):
            k1 = min(k0 + INDEX_CHUNK, k_len)
            k.take_backward(_nd(g), _nd(index), _nd(out), out.size, k_len, inner, size, k0, k1, int(k0 > 0))
        return out

    @staticmethod
    def masked_fill(a: Any, mask: Any, value: float) -> Any:
        """``value`` where the int32 ``mask`` is nonzero, else ``a``; the two broadcast."""
        _require_float("masked_fill", ("operand", a))
        shape = tuple(np.broadcast_shapes(a.shape, mask.shape))
        out = _new(shape, a.dtype)
        if out.size:
            geo = _merge(shape, _broadcast_strides(a.shape, shape), _broadcast_strides(mask.shape, shape))
            index_kernels_for(a.dtype).masked_fill(_nd(a), _nd(mask), _nd(out), out.size, float(value), *geo)
        return out

    @staticmethod
    def _unary(a: Any, op: int, name: str) -> Any:
        _require_float(name, ("operand", a))
        out = _new(a.shape, a.dtype)
        if out.size:
            elementwise_kernels_for(a.dtype).unary(_nd(a), _nd(out), out.size, op)
        return out

    @staticmethod
    def exp(a: Any) -> Any:
        return TaichiMath._unary(a, UNARY_EXP, "exp")

    @staticmethod
    def log(a: Any) -> Any:
        return TaichiMath._unary(a, UNARY_LOG, "log")

    @staticmethod
    def sqrt(a: Any) -> Any:
        return TaichiMath._unary(a, UNARY_SQRT, "sqrt")

    @staticmethod
    def eq(a: Any, b: Any) -> Any:
        """1 where ``a == b`` (broadcast), else 0, in ``a``'s dtype."""
        return TaichiMath._binary(a, b, OP_EQ)

    @staticmethod
    def argmax(a: Any, axis: int, keepdims: bool) -> Any:
        """Index of the first largest element along ``axis`` (of the first NaN, where there is one), int32."""
        values = TaichiMath.max(a, (axis,), True)
        index = _new(values.shape, INDEX_DTYPE)
        r_len = a.shape[axis]
        inner = math.prod(a.shape[axis + 1 :])
        if index.size:
            k = index_kernels_for(a.dtype)
            for r0 in range(0, r_len, INDEX_CHUNK):
                r1 = min(r0 + INDEX_CHUNK, r_len)
                k.first_index(_nd(a), _nd(values), _nd(index), index.size, r_len, inner, r0, r1)
        if keepdims:
            return index
        return index.reshape(a.shape[:axis] + a.shape[axis + 1 :])

    @staticmethod
    def scatter_dim(g: Any, index: Any, axis: int, size: int) -> Any:
        """Zeros with ``size`` entries along ``axis`` and ``g`` put at ``index`` (the gradient of a max)."""
        _require_float("scatter_dim", ("gradient", g))
        out = _new(g.shape[:axis] + (size,) + g.shape[axis + 1 :], g.dtype)
        if out.size:
            inner = math.prod(g.shape[axis + 1 :])
            index_kernels_for(g.dtype).scatter_dim(_nd(g), _nd(index), _nd(out), out.size, size, inner)
        return out

    @staticmethod
    def item(a: Any) -> Any:
        return a.numpy().reshape(()).item()


def matmul_into(
    a: Any,
    b: Any,
    out: Any,
    batch_shape: tuple[int, ...] = (),
    a_batch_strides: tuple[int, ...] = (),
    b_batch_strides: tuple[int, ...] = (),
    *,
    transpose_a: bool,
    transpose_b: bool,
) -> None:
    """out (batch..., N, M) = op(a) @ op(b), op = transpose of the last two axes when asked (no copy).

    ``a``'s last two axes are (N, K), or (K, N) with ``transpose_a``; ``b``'s are (K, M), or (M, K)
    with ``transpose_b``. Batch axes are read through the given strides (0 to broadcast).
    """
    ra, ca = a.shape[-2:]
    rb, cb = b.shape[-2:]
    n, k = (ca, ra) if transpose_a else (ra, ca)
    m = rb if transpose_b else cb
    sa_n, sa_k = (1, ca) if transpose_a else (ca, 1)
    sb_k, sb_m = (1, cb) if transpose_b else (cb, 1)
    if not out.size:
        return
    if k == 0:  # an empty sum: zeros, and the operands are empty (no storage to launch with)
        elementwise_kernels_for(out.dtype).fill(_nd(out), 0.0, out.size)
        return
    batch = math.prod(batch_shape)
    # Batch strides come in units of whole matrices; the kernel wants elements.
    bshape, sab, sbb = _merge(
        tuple(batch_shape),
        tuple(s * ra * ca for s in a_batch_strides),
        tuple(s * rb * cb for s in b_batch_strides),
    )
    tiles = batch * -(-n // TILE) * -(-m // TILE)
    grid = _launch_grid(tiles, SMALL_GRIDS)
    kernels = matmul_kernels_for(out.dtype)
    (kernels.matmul if grid is None else getattr(kernels, f"matmul_{grid}"))(
        _nd(a), _nd(b), _nd(out), n, m, k, batch, bshape, sab, sbb, sa_n, sa_k, sb_k, sb_m
    )


TENSOR_MATH = TaichiMath()
