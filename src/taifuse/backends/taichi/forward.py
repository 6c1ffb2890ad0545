"""Forward kernels of the ``taichi`` backend and their wrappers (``taifuse.backends.KERNEL_NAMES``).

Every kernel takes flat 1-D ndarrays plus plain ints for the logical dimensions, so each kernel
object compiles exactly once per arch (ndarray arguments specialise on dtype and ndim only).
float16 is storage, converted to float32 on load and back on store, except in the few kernels
whose float16 arithmetic gives the float32 path's result bit for bit (NOTE [ float16 arithmetic in
the elementwise kernels ]). The kernels are built per storage dtype, one cached factory per op
family (``elementwise_kernels_for``, ``linear_kernels_for``, ``row_kernels_for``,
``embedding_kernels_for``), when first needed (Taichi must be running); the unary activations are
one op-code kernel specialised per op (NOTE [ Op-code kernels ]).

Rules these kernels follow (docs/backends.md, "Taichi and Metal"):

* Loops are ``for i in range(n)``, never ``for i in x`` over an ndarray (that adds a modulo per
  element on ``ti.cpu``).
* No Taichi autodiff: on the SPIR-V backends (Vulkan, Metal) it writes gradients into the primal
  array. Backward kernels are written by hand (``backward.py``).
* No float64 anywhere and no more than a handful of ndarray arguments per kernel: Metal has no
  f64 and 31 buffer bindings. ``taifuse.backends.metal_check`` proves both for every kernel here.
* Scalar math (gelu, tanh, erf...) is ``_math.py``'s, shared with the backward kernels.

Row reductions (softmax, log_softmax, layer_norm, rms_norm) use one thread per row on ``ti.cpu``
and one block per row on the GPU archs.
"""

# NOTE: no `from __future__ import annotations` here: Taichi reads kernel annotations as objects.

import functools
from types import SimpleNamespace

import numpy as np

from taifuse.backends import reference
from taifuse.backends._spec import Activation, activation_code
from taifuse.backends.taichi._runtime import (
    FLOAT_DTYPES,
    DeviceArray,
    _half_arithmetic,
    _import_taichi,
    _launch_grid,
    _nd,
    _on_gpu,
    _optional,
    _ti_dtype,
)

# Register tile of the linear kernel: each thread owns TILE_N x TILE_M outputs.
TILE_N = 4
TILE_M = 4
# Shared-memory linear (GPU archs): a block of BLOCK_THREADS threads owns a BLOCK_N x BLOCK_M output
# tile and walks K in chunks of BLOCK_K staged through threadgroup memory; each thread keeps a
# TILE_N x TILE_M register tile. 2 * BLOCK_K * 64 floats = 8 KiB of shared memory per block.
BLOCK_N = 64
BLOCK_M = 64
BLOCK_K = 16
BLOCK_THREADS = (BLOCK_N // TILE_N) * (BLOCK_M // TILE_M)
# Launch sizes, in blocks, of the shared-memory linear's small-product kernels (NOTE [ The dispatch
# size of a runtime range ]): a product of at most that many output tiles launches the smallest
# that covers them; a larger one launches one block per tile (a runtime range).
SHARED_GRIDS = (8, 64)

# NOTE [ The dispatch size of a runtime range ]
# Taichi 1.7's SPIR-V code generator launches a parallel loop whose range is known only at run time
# (`for g in range(blocks * BLOCK_THREADS)`) as a grid-stride loop over 131072 threads, whatever
# the range: 512 blocks of 256 threads for the shared-memory linear, all but a few of them finding
# no work on a small product. A GPU retires an idle block in microseconds; lavapipe (the CPU Vulkan
# of the Linux tests) spends ~0.2 ms of CPU on each idle block of a kernel with barriers, so a
# linear of a few tiles cost ~90 ms of CPU per launch whatever its size (loaded machine). A
# constant range launches exactly its length, so a product of at most 8 (64) tiles goes to a kernel
# of 8 (64) blocks: ~4 ms there. A larger product keeps the runtime range: its blocks are busy.
# Kernels without barriers pay too (~10-20 ms of CPU per launch on lavapipe, loaded machine, for a
# reduction pass, a matmul or an in-place op of a few elements): tensor_math launches those of at
# most 1024 (16384) threads' work as a constant range of exactly that many (SMALL_GRIDS).

# ----------------------------------------------------------------------------- kernels
#
# One cached factory per op family, each building its kernels for one storage dtype when first
# needed: elementwise (the unary and binary op-code kernels, affine, dropout), linear, rows
# (softmax, log_softmax, layer_norm, rms_norm) and embedding.
#
# NOTE [ Op-code kernels ]
# The unary activations are one kernel body, as numba's ``_unary_span``, specialised per op: the op
# code is a compile-time constant (the factory's closure variable, read through ``ti.static``), so
# each op compiles to its own kernel holding only its own arithmetic, with no branch on the op in
# the element loop. Numba branches once per call, outside its loops; a runtime op argument here
# would branch inside the element loop, Taichi's parallel loop. Not a ``ti.template()`` argument:
# ``ti.aot.Module.add_kernel`` (metal_check) cannot instantiate a template beside ndarray
# arguments, and one kernel object per op keeps one name per compiled kernel. add_relu and
# mul_relu are the binary kernel's two ops the same way.

# The unary kernel's ops, by kernel name (the names metal_check reports).
UNARY_OPS = {
    "gelu_erf": Activation.GELU,
    "gelu_tanh": Activation.GELU_TANH,
    "relu": Activation.RELU,
    "leaky_relu": Activation.LEAKY_RELU,
    "silu": Activation.SILU,
    "sigmoid": Activation.SIGMOID,
    "tanh": Activation.TANH,
}
# The binary kernel's ops: relu(a + b) and relu(a * b).
BINARY_OPS = {"add_relu": 0, "mul_relu": 1}
_ADD_RELU = BINARY_OPS["add_relu"]


@functools.cache
def elementwise_kernels_for(dtype: np.dtype) -> SimpleNamespace:
    """The elementwise kernels (unary and binary activations, affine, dropout) for storage dtype
    ``dtype`` (float32 or float16), built once per process."""
    ti = _import_taichi()
    from taifuse.backends.taichi import _math as M

    T = _ti_dtype(dtype)
    X = ti.types.ndarray(dtype=T, ndim=1)

    # NOTE [ float16 arithmetic in the elementwise kernels ]
    # On float16 data, relu, leaky_relu, add_relu, mul_relu and dropout compute in float16 (T), and
    # give bit for bit the float32 path's results: a select is exact, and one float16 + or * of two
    # float16 operands is correctly rounded, as is float32's result rounded to float16 (double
    # rounding is harmless when the wider format has at least 2p + 2 bits: 24 >= 2 * 11 + 2). A
    # multiplier that is a float32 argument (leaky_relu's slope, dropout's scale) joins the float16
    # path only when float16 holds it exactly; 0.01 or 1 / 0.9 would be rounded first, so those
    # stay on the float32 path. The float16 + and * run on the GPU archs only (``math16``): ti.cpu
    # has no float16 arithmetic on x86 and its float16 leaky_relu measured ~8x its float32 path's
    # time (add_relu ~1.6x); the results being the same bit for bit, the choice is only speed. Kept
    # in float32: affine (x * scale rounded before
    # + bias loses the bias-cancelling digits a float32 product keeps), the linear epilogue (its
    # accumulator is float32, and a float16 add of the rounded sum would round twice), and every
    # transcendental (gelu, silu, sigmoid, tanh, softmax, norms, losses: float16 exp/erf polynomials
    # would not meet the float16 tolerance of one ulp).

    @ti.func
    def relu_t(v):  # relu in the storage type; NaN < 0 is false: NaN propagates
        # NOTE: the float16 zero is made inside Taichi scope: one made outside and captured by the
        # kernels crashed ti.cpu (a segfault in add_relu's first launch, Taichi 1.7.4).
        zero = ti.cast(0.0, T)
        return ti.select(v < zero, zero, v)

    @ti.func
    def unary_f32(v: ti.f32, op: ti.template()) -> ti.f32:
        # The float32 ops; op is a compile-time constant (NOTE [ Op-code kernels ]).
        r = v
        if ti.static(op == M.GELU):
            r = M.gelu_erf(v)
        elif ti.static(op == M.GELU_TANH):
            r = M.gelu_tanh(v)
        elif ti.static(op == M.SILU):
            r = v * M.sigmoid(v)
        elif ti.static(op == M.SIGMOID):
            r = M.sigmoid(v)
        elif ti.static(op == M.TANH):
            r = M.tanh(v)
        return r

    def make_unary(op: int):
        @ti.kernel
        def unary(x: X, out: X, n: ti.i32, slope: ti.f32, math16: ti.i32):
            # slope is leaky_relu's, math16 relu's and leaky_relu's (other ops ignore them); relu
            # is a select, exact in the storage type where float16 arithmetic keeps subnormals.
            for i in range(n):
                if ti.static(op == M.RELU):
                    if math16 != 0:
                        out[i] = relu_t(x[i])
                    else:  # CUDA (_half_arithmetic): a float16 compare flushes subnormals there
                        out[i] = ti.cast(M.relu(ti.cast(x[i], ti.f32)), T)
                elif ti.static(op == M.LEAKY_RELU):
                    if math16 != 0:
                        v = x[i]
                        out[i] = ti.select(v > ti.cast(0.0, T), v, ti.cast(slope, T) * v)
                    else:
                        v = ti.cast(x[i], ti.f32)
                        out[i] = ti.cast(ti.select(v > 0.0, v, slope * v), T)
                else:
                    out[i] = ti.cast(unary_f32(ti.cast(x[i], ti.f32), op), T)

        return unary

    @ti.func
    def combine(u, v, op: ti.template()):
        r = u * v
        if ti.static(op == _ADD_RELU):
            r = u + v
        return r

    def make_binary(op: int):
        @ti.kernel
        def binary(a: X, b: X, out: X, n: ti.i32, math16: ti.i32):
            for i in range(n):
                if math16 != 0:
                    out[i] = relu_t(combine(a[i], b[i], op))
                else:
                    out[i] = ti.cast(M.relu(combine(ti.cast(a[i], ti.f32), ti.cast(b[i], ti.f32), op)), T)

        return binary

    @ti.kernel
    def affine(x: X, scale: X, bias: X, out: X, rows: ti.i32, cols: ti.i32):
        for r, c in ti.ndrange(rows, cols):
            i = r * cols + c
            v = ti.cast(x[i], ti.f32) * ti.cast(scale[c], ti.f32) + ti.cast(bias[c], ti.f32)
            out[i] = ti.cast(v, T)

    @ti.kernel
    def dropout(x: X, out: X, n: ti.i32, key: ti.u32, threshold: ti.u32, scale: ti.f32, math16: ti.i32):
        for i in range(n):
            keep = ti.bit_shr(M.hash32(ti.cast(i, ti.u32) ^ key), 8) >= threshold
            if math16 != 0:  # x * 0 keeps a dropped NaN NaN, as the reference
                out[i] = x[i] * ti.select(keep, ti.cast(scale, T), ti.cast(0.0, T))
            else:
                out[i] = ti.cast(ti.cast(x[i], ti.f32) * ti.select(keep, scale, 0.0), T)

    return SimpleNamespace(
        **{name: make_unary(int(op)) for name, op in UNARY_OPS.items()},
        **{name: make_binary(op) for name, op in BINARY_OPS.items()},
        affine=affine,
        dropout=dropout,
    )


@functools.cache
def linear_kernels_for(dtype: np.dtype) -> SimpleNamespace:
    """The fused linear kernels (register-tiled, and threadgroup-memory for the GPU archs) for
    storage dtype ``dtype``, built once per process."""
    ti = _import_taichi()
    from taifuse.backends.taichi import _math as M

    T = _ti_dtype(dtype)
    X = ti.types.ndarray(dtype=T, ndim=1)

    @ti.kernel
    def linear_act(
        x: X, w: X, b: X, out: X, n_rows: ti.i32, m_cols: ti.i32, k_dim: ti.i32, has_bias: ti.i32, act: ti.i32
    ):
        # out (n_rows, m_cols) = act(x (n_rows, k_dim) @ w (m_cols, k_dim).T + b), one TILE_N x TILE_M
        # register tile per thread. Edge tiles clamp their load indices (no branch in the K loop)
        # and mask their stores.
        tiles_m = (m_cols + TILE_M - 1) // TILE_M
        tiles = ((n_rows + TILE_N - 1) // TILE_N) * tiles_m
        for t in range(tiles):
            n0 = (t // tiles_m) * TILE_N
            m0 = (t % tiles_m) * TILE_M
            xrow = ti.Vector([0] * TILE_N, dt=ti.i32)
            wrow = ti.Vector([0] * TILE_M, dt=ti.i32)
            for i in ti.static(range(TILE_N)):
                xrow[i] = ti.min(n0 + i, n_rows - 1) * k_dim
            for j in ti.static(range(TILE_M)):
                wrow[j] = ti.min(m0 + j, m_cols - 1) * k_dim
            acc = ti.Matrix.zero(ti.f32, TILE_N, TILE_M)
            for k in range(k_dim):
                xv = ti.Vector.zero(ti.f32, TILE_N)
                wv = ti.Vector.zero(ti.f32, TILE_M)
                for i in ti.static(range(TILE_N)):
                    xv[i] = ti.cast(x[xrow[i] + k], ti.f32)
                for j in ti.static(range(TILE_M)):
                    wv[j] = ti.cast(w[wrow[j] + k], ti.f32)
                for i, j in ti.static(ti.ndrange(TILE_N, TILE_M)):
                    acc[i, j] += xv[i] * wv[j]
            for i, j in ti.static(ti.ndrange(TILE_N, TILE_M)):
                if n0 + i < n_rows and m0 + j < m_cols:
                    v = acc[i, j]
                    if has_bias != 0:
                        v += ti.cast(b[m0 + j], ti.f32)
                    out[(n0 + i) * m_cols + m0 + j] = ti.cast(M.activate(v, act), T)

    def make_shared(grid: int):
        @ti.kernel
        def linear_act_shared(
            x: X,
            w: X,
            b: X,
            out: X,
            n_rows: ti.i32,
            m_cols: ti.i32,
            k_dim: ti.i32,
            has_bias: ti.i32,
            act: ti.i32,
        ):
            # Same contract as linear_act, for archs with threadgroup memory (Metal, Vulkan, CUDA).
            # Loop index g = block * BLOCK_THREADS + thread: the launch has exactly BLOCK_THREADS threads
            # per block, so every thread of a block reaches each barrier the same number of times.
            # grid = 0: one block per output tile (a runtime range); else exactly `grid` blocks (a
            # constant range, NOTE [ The dispatch size of a runtime range ]), block g // BLOCK_THREADS
            # computing tiles g // BLOCK_THREADS, + grid, ... (at most one each: the caller's choice).
            blocks_m = (m_cols + BLOCK_M - 1) // BLOCK_M
            blocks = ((n_rows + BLOCK_N - 1) // BLOCK_N) * blocks_m
            ti.loop_config(block_dim=BLOCK_THREADS)
            for g in range(blocks * BLOCK_THREADS if ti.static(grid == 0) else grid * BLOCK_THREADS):
                tid = g % BLOCK_THREADS
                ty = tid // (BLOCK_M // TILE_M)
                tx = tid % (BLOCK_M // TILE_M)
                # K-major staging: a thread's TILE_N (TILE_M) operands for one k are contiguous.
                xs = ti.simt.block.SharedArray((BLOCK_K * BLOCK_N,), ti.f32)
                ws = ti.simt.block.SharedArray((BLOCK_K * BLOCK_M,), ti.f32)
                blk = g // BLOCK_THREADS
                while blk < blocks:
                    n_base = (blk // blocks_m) * BLOCK_N
                    m_base = (blk % blocks_m) * BLOCK_M
                    acc = ti.Matrix.zero(ti.f32, TILE_N, TILE_M)
                    for chunk in range((k_dim + BLOCK_K - 1) // BLOCK_K):
                        k0 = chunk * BLOCK_K
                        # Cooperative, coalesced loads: consecutive threads read consecutive k of a row.
                        for r in ti.static(range(BLOCK_K * BLOCK_N // BLOCK_THREADS)):
                            e = tid + r * BLOCK_THREADS
                            row = e // BLOCK_K
                            kk = e % BLOCK_K
                            v = 0.0
                            if n_base + row < n_rows and k0 + kk < k_dim:
                                v = ti.cast(x[(n_base + row) * k_dim + k0 + kk], ti.f32)
                            xs[kk * BLOCK_N + row] = v
                        for r in ti.static(range(BLOCK_K * BLOCK_M // BLOCK_THREADS)):
                            e = tid + r * BLOCK_THREADS
                            col = e // BLOCK_K
                            kk = e % BLOCK_K
                            v = 0.0
                            if m_base + col < m_cols and k0 + kk < k_dim:
                                v = ti.cast(w[(m_base + col) * k_dim + k0 + kk], ti.f32)
                            ws[kk * BLOCK_M + col] = v
                        ti.simt.block.sync()
                        for kk in range(BLOCK_K):
                            xv = ti.Vector.zero(ti.f32, TILE_N)
                            wv = ti.Vector.zero(ti.f32, TILE_M)
                            for i in ti.static(range(TILE_N)):
                                xv[i] = xs[kk * BLOCK_N + ty * TILE_N + i]
                            for j in ti.static(range(TILE_M)):
                                wv[j] = ws[kk * BLOCK_M + tx * TILE_M + j]
                            for i, j in ti.static(ti.ndrange(TILE_N, TILE_M)):
                                acc[i, j] += xv[i] * wv[j]
                        ti.simt.block.sync()  # the next chunk overwrites xs/ws
                    for i, j in ti.static(ti.ndrange(TILE_N, TILE_M)):
                        n = n_base + ty * TILE_N + i
                        m = m_base + tx * TILE_M + j
                        if n < n_rows and m < m_cols:
                            v = acc[i, j]
                            if has_bias != 0:
                                v += ti.cast(b[m], ti.f32)
                            out[n * m_cols + m] = ti.cast(M.activate(v, act), T)
                    blk += blocks if ti.static(grid == 0) else grid

        return linear_act_shared

    small = {f"linear_act_shared_{grid}": make_shared(grid) for grid in SHARED_GRIDS}
    return SimpleNamespace(linear_act=linear_act, linear_act_shared=make_shared(0), **small)


@functools.cache
def row_kernels_for(dtype: np.dtype) -> SimpleNamespace:
    """The row-reduction kernels (softmax and log_softmax, layer_norm, rms_norm: one thread per row,
    and ``*_rows``, one block per row for the GPU archs) for storage dtype ``dtype``, built once
    per process."""
    ti = _import_taichi()
    from taifuse.backends.taichi import _math as M

    T = _ti_dtype(dtype)
    ROW_THREADS = M.ROW_THREADS
    X = ti.types.ndarray(dtype=T, ndim=1)
    F32 = ti.types.ndarray(dtype=ti.f32, ndim=1)

    @ti.kernel
    def softmax(x: X, out: X, a_dim: ti.i32, c_dim: ti.i32, b_dim: ti.i32, log: ti.i32):
        # One thread per (a, b) row; the reduced axis has stride b_dim.
        for r in range(a_dim * b_dim):
            base = (r // b_dim) * c_dim * b_dim + r % b_dim
            m = -ti.math.inf
            for c in range(c_dim):
                m = ti.max(m, ti.cast(x[base + c * b_dim], ti.f32))
            s = M.row_sum(x, base, b_dim, c_dim, m, M.SUM_TERM_EXP)
            if log != 0:
                # (x - m) - log(s), not x - (m + log(s)): m + log(s) would round at |m|'s scale.
                log_s = ti.log(s)
                for c in range(c_dim):
                    i = base + c * b_dim
                    out[i] = ti.cast((ti.cast(x[i], ti.f32) - m) - log_s, T)
            else:
                inv = 1.0 / s
                for c in range(c_dim):
                    i = base + c * b_dim
                    out[i] = ti.cast(ti.exp(ti.cast(x[i], ti.f32) - m) * inv, T)

    @ti.kernel
    def layer_norm(
        x: X,
        weight: X,
        bias: X,
        out: X,
        mean: F32,
        rstd: F32,
        rows: ti.i32,
        cols: ti.i32,
        eps: ti.f32,
        has_weight: ti.i32,
        has_bias: ti.i32,
    ):
        # One thread per row, two passes (mean, then centred variance: no E[x^2] - E[x]^2 cancellation).
        for r in range(rows):
            base = r * cols
            mu = M.row_sum(x, base, 1, cols, 0.0, M.SUM_TERM_VALUE) / cols
            q = M.row_sum(x, base, 1, cols, mu, M.SUM_TERM_SQUARE)
            inv = 1.0 / ti.sqrt(q / cols + eps)
            mean[r] = mu
            rstd[r] = inv
            for c in range(cols):
                v = (ti.cast(x[base + c], ti.f32) - mu) * inv
                if has_weight != 0:
                    v *= ti.cast(weight[c], ti.f32)
                if has_bias != 0:
                    v += ti.cast(bias[c], ti.f32)
                out[base + c] = ti.cast(v, T)

    @ti.kernel
    def softmax_rows(x: X, out: X, a_dim: ti.i32, c_dim: ti.i32, b_dim: ti.i32, log: ti.i32):
        # softmax for GPU archs: one block per (a, b) row; see ROW_THREADS in _math.py.
        ti.loop_config(block_dim=ROW_THREADS)
        for g in range(a_dim * b_dim * ROW_THREADS):
            tid = g % ROW_THREADS
            r = g // ROW_THREADS
            base = (r // b_dim) * c_dim * b_dim + r % b_dim
            red = ti.simt.block.SharedArray((ROW_THREADS,), ti.f32)
            mine = (c_dim - tid + ROW_THREADS - 1) // ROW_THREADS  # elements tid, tid + ROW_THREADS, ...
            start = base + tid * b_dim
            stride = ROW_THREADS * b_dim
            m = -ti.math.inf
            for j in range(mine):
                m = ti.max(m, ti.cast(x[start + j * stride], ti.f32))
            m = M.block_reduce(red, tid, m, True)
            s = M.block_reduce(red, tid, M.row_sum(x, start, stride, mine, m, M.SUM_TERM_EXP), False)
            if log != 0:
                log_s = ti.log(s)  # see softmax: subtract m first
                for j in range(mine):
                    i = start + j * stride
                    out[i] = ti.cast((ti.cast(x[i], ti.f32) - m) - log_s, T)
            else:
                inv = 1.0 / s
                for j in range(mine):
                    i = start + j * stride
                    out[i] = ti.cast(ti.exp(ti.cast(x[i], ti.f32) - m) * inv, T)

    @ti.kernel
    def layer_norm_rows(
        x: X,
        weight: X,
        bias: X,
        out: X,
        mean: F32,
        rstd: F32,
        rows: ti.i32,
        cols: ti.i32,
        eps: ti.f32,
        has_weight: ti.i32,
        has_bias: ti.i32,
    ):
        # layer_norm for GPU archs: one block per row; see ROW_THREADS in _math.py.
        ti.loop_config(block_dim=ROW_THREADS)
        for g in range(rows * ROW_THREADS):
            tid = g % ROW_THREADS
            r = g // ROW_THREADS
            red = ti.simt.block.SharedArray((ROW_THREADS,), ti.f32)
            mine = (cols - tid + ROW_THREADS - 1) // ROW_THREADS
            start = r * cols + tid
            mu = (
                M.block_reduce(red, tid, M.row_sum(x, start, ROW_THREADS, mine, 0.0, M.SUM_TERM_VALUE), False)
                / cols
            )
            q = M.block_reduce(red, tid, M.row_sum(x, start, ROW_THREADS, mine, mu, M.SUM_TERM_SQUARE), False)
            inv = 1.0 / ti.sqrt(q / cols + eps)
            if tid == 0:
                mean[r] = mu
                rstd[r] = inv
            for j in range(mine):
                c = tid + j * ROW_THREADS
                v = (ti.cast(x[r * cols + c], ti.f32) - mu) * inv
                if has_weight != 0:
                    v *= ti.cast(weight[c], ti.f32)
                if has_bias != 0:
                    v += ti.cast(bias[c], ti.f32)
                out[r * cols + c] = ti.cast(v, T)

    @ti.kernel
    def rms_norm(
        x: X, weight: X, out: X, rstd: F32, rows: ti.i32, cols: ti.i32, eps: ti.f32, has_weight: ti.i32
    ):
        # One thread per row: the sum of squares, then one write pass.
        for r in range(rows):
            base = r * cols
            inv = 1.0 / ti.sqrt(M.row_sum(x, base, 1, cols, 0.0, M.SUM_TERM_SQUARE) / cols + eps)
            rstd[r] = inv
            for c in range(cols):
                v = ti.cast(x[base + c], ti.f32) * inv
                if has_weight != 0:
                    v *= ti.cast(weight[c], ti.f32)
                out[base + c] = ti.cast(v, T)

    @ti.kernel
    def rms_norm_rows(
        x: X, weight: X, out: X, rstd: F32, rows: ti.i32, cols: ti.i32, eps: ti.f32, has_weight: ti.i32
    ):
        # rms_norm for GPU archs: one block per row; see ROW_THREADS in _math.py.
        ti.loop_config(block_dim=ROW_THREADS)
        for g in range(rows * ROW_THREADS):
            tid = g % ROW_THREADS
            r = g // ROW_THREADS
            red = ti.simt.block.SharedArray((ROW_THREADS,), ti.f32)
            mine = (cols - tid + ROW_THREADS - 1) // ROW_THREADS
            start = r * cols + tid
            q = M.block_reduce(
                red, tid, M.row_sum(x, start, ROW_THREADS, mine, 0.0, M.SUM_TERM_SQUARE), False
            )
            inv = 1.0 / ti.sqrt(q / cols + eps)
            if tid == 0:
                rstd[r] = inv
            for j in range(mine):
                c = tid + j * ROW_THREADS
                v = ti.cast(x[r * cols + c], ti.f32) * inv
                if has_weight != 0:
                    v *= ti.cast(weight[c], ti.f32)
                out[r * cols + c] = ti.cast(v, T)

    return SimpleNamespace(
        softmax=softmax,
        layer_norm=layer_norm,
        softmax_rows=softmax_rows,
        layer_norm_rows=layer_norm_rows,
        rms_norm=rms_norm,
        rms_norm_rows=rms_norm_rows,
    )


@functools.cache
def embedding_kernels_for(dtype: np.dtype) -> SimpleNamespace:
    """The embedding gather for storage dtype ``dtype``, built once per process."""
    ti = _import_taichi()

    T = _ti_dtype(dtype)
    X = ti.types.ndarray(dtype=T, ndim=1)
    I32 = ti.types.ndarray(dtype=ti.i32, ndim=1)

    @ti.kernel
    def embedding(indices: I32, weight: X, out: X, n: ti.i32, cols: ti.i32, vocab: ti.i32):
        # One thread per output element, a row gather. An index outside [0, vocab) (possible only for
        # indices already on the device) gives a NaN row: NOTE [ Class indices on the device ].
        for i in range(n * cols):
            v = indices[i // cols]
            if v >= 0 and v < vocab:
                out[i] = weight[v * cols + i % cols]
            else:
                out[i] = ti.cast(ti.math.nan, T)

    return SimpleNamespace(embedding=embedding)


# The families, in the order all_kernels lists them.
_FAMILIES = (elementwise_kernels_for, linear_kernels_for, row_kernels_for, embedding_kernels_for)


def all_kernels() -> list[tuple[str, object]]:
    """Every (name, kernel) pair the forward wrappers may launch, in every dtype specialisation."""
    pairs = []
    for dtype in FLOAT_DTYPES:
        for family in _FAMILIES:
            for name, kernel in vars(family(dtype)).items():
                pairs.append((f"{name}_{dtype.name}", kernel))
    return pairs


# ----------------------------------------------------------------------------- wrappers
# ----------------------------------------------------------------------------- wrappers


def _unary(name: str, x: DeviceArray, out: DeviceArray, slope: float = 0.0, math16: int = 0) -> None:
    getattr(elementwise_kernels_for(x.dtype), name)(_nd(x), _nd(out), x.size, slope, math16)


def gelu(x: DeviceArray, out: DeviceArray, approximate: str) -> None:
    _unary("gelu_tanh" if approximate == "tanh" else "gelu_erf", x, out)


def relu(x: DeviceArray, out: DeviceArray) -> None:
    _unary("relu", x, out, 0.0, _math16(x.dtype))


_FLOAT16_MAX = float(np.finfo(np.float16).max)


def _math16(dtype: np.dtype, multiplier: float = 1.0) -> int:
    """1 when a kernel may compute in float16 (NOTE [ float16 arithmetic in the elementwise
    kernels ]): float16 data on Metal or Vulkan (``_half_arithmetic``), and float16 holds
    ``multiplier`` exactly; else 0.

    A multiplier past float16's range (dropout's 1 / (1 - p) once p > 1 - 2**-16) is not held: the
    range is checked first, as casting it to float16 would overflow (and warn) to answer the same.
    """
    return int(
        dtype == np.float16
        and _half_arithmetic()
        and abs(multiplier) <= _FLOAT16_MAX
        and float(np.float16(multiplier)) == multiplier
    )


def leaky_relu(x: DeviceArray, out: DeviceArray, negative_slope: float) -> None:
    slope = float(negative_slope)
    _unary("leaky_relu", x, out, slope, _math16(x.dtype, slope))


def silu(x: DeviceArray, out: DeviceArray) -> None:
    _unary("silu", x, out)


def sigmoid(x: DeviceArray, out: DeviceArray) -> None:
    _unary("sigmoid", x, out)


def tanh(x: DeviceArray, out: DeviceArray) -> None:
    _unary("tanh", x, out)


def add_relu(a: DeviceArray, b: DeviceArray, out: DeviceArray) -> None:
    elementwise_kernels_for(a.dtype).add_relu(_nd(a), _nd(b), _nd(out), a.size, _math16(a.dtype))


def mul_relu(a: DeviceArray, b: DeviceArray, out: DeviceArray) -> None:
    elementwise_kernels_for(a.dtype).mul_relu(_nd(a), _nd(b), _nd(out), a.size, _math16(a.dtype))


def affine(x: DeviceArray, scale: DeviceArray, bias: DeviceArray, out: DeviceArray) -> None:
    rows, cols = x.shape
    elementwise_kernels_for(x.dtype).affine(_nd(x), _nd(scale), _nd(bias), _nd(out), rows, cols)


def linear_act(
    x: DeviceArray,
    w: DeviceArray,
    b: DeviceArray | None,
    activation: str | None,
    out: DeviceArray,
    pre: DeviceArray | None = None,
) -> None:
    code = activation_code(activation)
    if pre is not None:
        # Two launches: the tiled product with the bias into pre, then the activation kernel.
        linear_act(x, w, b, None, pre)
        if activation is None:
            linear_act(x, w, b, None, out)
        elif activation in ("gelu", "gelu_tanh"):
            gelu(pre, out, "tanh" if activation == "gelu_tanh" else "none")
        else:
            {"relu": relu, "silu": silu}[activation](pre, out)
        return
    n_rows, k_dim = x.shape
    m_cols = w.shape[0]
    kernels = linear_kernels_for(x.dtype)
    if _on_gpu():
        grid = _launch_grid(-(-n_rows // BLOCK_N) * -(-m_cols // BLOCK_M), SHARED_GRIDS)
        kernel = kernels.linear_act_shared if grid is None else getattr(kernels, f"linear_act_shared_{grid}")
    else:
        kernel = kernels.linear_act
    # With k_dim = 0, x and w are empty (no storage) and the kernels' K loops read nothing: a
    # stand-in gets them launched, and out is activation(bias), or zeros without a bias.
    kernel(
        _optional(x if k_dim else None, x.dtype),
        _optional(w if k_dim else None, x.dtype),
        _optional(b, x.dtype),
        _nd(out),
        n_rows,
        m_cols,
        k_dim,
        int(b is not None),
        int(code),
    )


def softmax(x: DeviceArray, out: DeviceArray) -> None:
    k = row_kernels_for(x.dtype)
    (k.softmax_rows if _on_gpu() else k.softmax)(_nd(x), _nd(out), *x.shape, 0)


def log_softmax(x: DeviceArray, out: DeviceArray) -> None:
    k = row_kernels_for(x.dtype)
    (k.softmax_rows if _on_gpu() else k.softmax)(_nd(x), _nd(out), *x.shape, 1)


def layer_norm(
    x: DeviceArray,
    weight: DeviceArray | None,
    bias: DeviceArray | None,
    eps: float,
    out: DeviceArray,
    mean: DeviceArray,
    rstd: DeviceArray,
) -> None:
    rows, cols = x.shape
    k = row_kernels_for(x.dtype)
    (k.layer_norm_rows if _on_gpu() else k.layer_norm)(
        _nd(x),
        _optional(weight, x.dtype),
        _optional(bias, x.dtype),
        _nd(out),
        _nd(mean),
        _nd(rstd),
        rows,
        cols,
        float(eps),
        int(weight is not None),
        int(bias is not None),
    )


def rms_norm(
    x: DeviceArray, weight: DeviceArray | None, eps: float, out: DeviceArray, rstd: DeviceArray
) -> None:
    rows, cols = x.shape
    k = row_kernels_for(x.dtype)
    (k.rms_norm_rows if _on_gpu() else k.rms_norm)(
        _nd(x),
        _optional(weight, x.dtype),
        _nd(out),
        _nd(rstd),
        rows,
        cols,
        float(eps),
        int(weight is not None),
    )


def embedding(indices: DeviceArray, weight: DeviceArray, out: DeviceArray) -> None:
    """See the reference's embedding; ``indices`` is an int32 DeviceArray (NOTE [ Class indices on the device ])."""
    vocab, cols = weight.shape
    embedding_kernels_for(weight.dtype).embedding(
        _nd(indices), _nd(weight), _nd(out), indices.size, cols, vocab
    )


def dropout(x: DeviceArray, out: DeviceArray, p: float, seed: int) -> None:
    # Key, threshold and scale come from the reference, so the mask is bit-identical to it.
    elementwise_kernels_for(x.dtype).dropout(
        _nd(x),
        _nd(out),
        x.size,
        reference.dropout_key(seed),
        reference.dropout_threshold(p),
        reference.dropout_scale(p),
        _math16(x.dtype, reference.dropout_scale(p)),
    )
