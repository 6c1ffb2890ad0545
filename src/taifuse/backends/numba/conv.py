"""The Numba backend's convolution and pooling kernels (reference: ``backends/reference/conv.py``).

NOTE [ Convolution on the host: im2col in blocks ]
A convolution is a matrix product per group once the input under every tap is laid out as
columns: ``cols[(c, i, j), (n, oh, ow)]``. The products run in BLAS (NumPy's matmul), on blocks
of the batch whose columns sit in scratch from the host pool, never the columns of the whole batch.

The forward shares the batch out between ``numba.get_num_threads()`` Python threads as work
items (attention's ``_run``: each worker takes the next item as it finishes one), BLAS held to
one thread per call for the duration (NOTE [ Numba attention threads ]). An item is one image,
or as many small images as make its product ``ITEM_MIN_COLUMNS`` wide, or a band of output rows
of an image whose columns would pass ``ITEM_MAX_BYTES``. Its worker lays out the item's columns
in its own scratch (288 x 1024 float32, 1.2 MB, at the CIFAR-like 32 -> 64 layer: in L2), runs
one product per group (one stacked matmul for several groups), ``w_g (OCg, K) @ cols_g (K,
width)``, and the epilogue adds the bias and applies the activation (keeping ``pre``) while the
item is in cache. For one image that product IS the image's NCHW output ``(OC, OH * OW)``: it
lands in ``out`` (or ``pre``, where kept) and the epilogue runs in place, with no transposing
pass; items of several images and float16 storage go through channel-major scratch and a
transposing epilogue. At stride 1 each row of an item's columns is ONE contiguous run of the
image's zero-padded planes (``_im2col_padded``), at the padded width, whose extra columns the
epilogue drops (so those items always take the scratch): the per-element layout copies runs of
OW (32) elements, under the vectorized loop's minimum trip count, and cost as much as the
product at 32 -> 64; the padded runs took the 3 -> 32 columns from 8.0 to 1.6 ms (docs/cnn.md).
At stride 1 with enough channels a group (``IMPLICIT_MIN_K``) the items lay out no columns at all:
NOTE [ Implicit GEMM on the host ]. ``conv2d_stats`` runs the same items, its epilogue adding each
plane's shifted sums, the shift of each channel its first output value computed beforehand in
float64 and rounded as stored (``_first_values``: no item has to run before the others). BLAS runs on one
thread per call on one worker too (one numba thread): the items are the parallelism, and
OpenBLAS's own threads around products this small spin more than they compute. The design it replaced
ran im2col and the epilogue as Numba parallel regions around products on OpenBLAS's threads, on
blocks of ``COLS_BLOCK_BYTES``: each phase found the other runtime's workers still spinning
(NOTE [ Serial epilogue between BLAS calls ] in _jit.py), and the conv ran at 9-25% of the GEMM
rate; per-phase figures in docs/cnn.md. Every output element is written by one item, so the
result does not depend on which thread runs it.

The backward runs as the forward does, on the same Python threads with BLAS on one thread per
call (``_Backward``). Its items are parts of consecutive images, each taken a step of whole images
at a time, as many parts as steps (a part's grad_w sum written by its first product, no sum to add
into) up to ``BACKWARD_PARTS`` and ``PARTS_MAX_BYTES`` of sums (more only where Numba has more
threads): the workers take parts as they finish one, so the last to finish waits at most one step
(eight parts of eight images at 32 -> 64, N = 64, left one worker 9-15 ms idle at the end on a loaded
machine). A step is one image, or as
many small ones as make ``ITEM_MIN_COLUMNS`` output pixels (never a band of an image: two bands'
col2im would add into the same input rows). A step writes its grad_pre = grad_out * act'(pre) (or batch norm's input
gradient, ``conv2d_batch_norm_backward``) channel-major into the worker's scratch at the columns'
pitch, with each plane's float64 sum for grad_b; rebuilds the step's columns as the forward's;
adds ``grad_pre_g @ cols_g.T`` (or its transpose) into the part's own grad_w sum; and writes
``w_g.T @ grad_pre_g`` over the columns, which col2im adds into the step's images of grad_x (no other item writes them).
The parts' sums are added in their order at the end (``_sum_parts``: blocks of elements on Numba's
threads, each element's sum in the parts' order): the result does not depend on which worker
took a part, nor on the thread count up to ``BACKWARD_PARTS`` threads (tested bit for bit). At
stride 1 the columns are ``_im2col_padded``'s, at the padded width, and col2im is its adjoint:
each tap's row one contiguous shifted add into the image's zero-padded planes, whose inside is
then grad_x (elsewhere, one shifted add per output row over the columns whose input is inside).
grad_pre's junk columns are zero, so a junk column adds +-0 to every sum (the same bits); the
columns' junk is zeroed before grad_w's product only where the step's images hold an inf or NaN,
and before col2im only where the weight does (``_all_finite``, 0.004 ms an image against
``_zero_junk``'s 0.03 ms a pass), so that no inf or NaN meets a junk column (0 * inf is NaN);
conv2d_batch_norm_backward's kernel does the same. The columns' grad_w product runs
in the order whose output has more rows, ``cols_g @ grad_pre_g.T`` (K, OCg) where K = C * kh *
kw is the larger (every layer but a first one's), summed in that order and transposed once at
the end (``_grad_w_product``): 0.54 against 0.70 ms a 32 x 32 image at 32 -> 64, one BLAS thread
(a loaded machine's ordering). With one image a step, one group, stride 1 and ``TAPS_MIN_CHANNELS``
to ``TAPS_MAX_CHANNELS`` input channels (8 to 31), grad_w needs no columns: it is one product per
tap, ``grad_pre @ xpad[:, off : off + span].T`` over a strided view of the image's padded planes
(saving the columns' copy); those views' junk columns are real values, so an image holding an
inf or NaN takes the columns instead. Under 8 input channels (the first layer's 3) the nine thin
products lose to the columns' one; from 32 the columns' one product, in its (K, OCg) order, wins
back its copy (each of the nine products repacks grad_pre). Where the columns' product would run
in its (K, OCg) order with one image a step, one group and stride 1 (the 32 -> 64 layer, and a
first layer with more output channels than taps takes the (OCg, K) order and the columns), grad_w
is instead one product per kernel row i over the image's padded planes shifted per kernel column,
``xs[(c, j), i * dh * WP:][:, :span] @ grad_pre.T`` (C * kw rows, ``_kw_planes``; conv-gw's 951cb1a
at the padded width): kw copies of the planes instead of the columns' kh * kw, and each element
sums the same products in the same order as the columns' product (the same bits, checked at 32
-> 64); its rows come out (i, c, j), permuted once at the end, and an image holding an inf or
NaN has the copies' junk columns zeroed. One thread, a 32 x 32 image's step (loaded machine,
medians of 8 interleaved rounds over 64 images): 1.33 against 1.51 ms with the columns; the
whole backward's CPU time moved by less than this machine's noise. A dot-product kernel for grad_w at the first
layer's K = 27 taps ran 2-3x slower than BLAS's product there (a loaded machine's ratio), so
every layer takes BLAS. grad_x as an implicit GEMM (the forward's, on grad_pre's planes padded by
the kernel's reach less the padding, with the weight flipped and its channels swapped: 9711173)
tied (64 -> 64) or lost to the columns at every CNN shape tried (3 -> 32 to 128 -> 128, up to 2x
slower, a loaded machine's CPU time): its products have only the C input channels as rows (32 at
32 -> 64), each packing a K = OC * kw operand as wide as the step, where ``w.T @ grad_pre`` has
C * kh * kw (288) rows over K = OC and ran per image in 0.30 ms against the three products' 0.52
ms; col2im took 0.04 ms (one thread: an ordering only). The per-block design this replaced ran
each phase as a Numba parallel region around products on OpenBLAS's threads, which met each
other's spinning workers as the forward's phases did, and one order of the weight gradient's
product stalled (docs/cnn.md); with one BLAS thread per call both orders ran alike. An input
that needs no gradient (a network's first layer) skips the columns' gradient and col2im (the
autograd passes ``grad_x=None``, as PyTorch). A depthwise forward (one input channel per group)
runs a direct kernel instead (``_direct_wins``): it ties with im2col there and needs no columns; everywhere else im2col + BLAS won, by 1.4x to 12x (docs/cnn.md, a loaded
machine's ratios, taken before the work items). float16 is storage only: the columns, the weight
and the sums are float32.

Pooling runs one (image, channel) plane per work item: the max-pool backward scatters each
window's gradient to its recorded index inside its own plane, the averages add the window sums.
The common CNN shapes take shorter paths (NOTE [ Pooling fast paths ]).

NOTE [ Implicit GEMM on the host ]
At stride 1 an output pixel ``(r, q)`` reads the input at ``(r + i * dh - ph, q + j * dw - pw)``
for tap ``(i, j)``. Lay out, per input channel ``c`` and kernel column ``j``, the plane that column
reads at the output's width: row ``(c, j)`` of ``xs`` holds ``x[c, r - ph, q + j * dw - pw]`` at
``e = r * OW + q`` for the padded rows ``r`` (zero outside the input). Tap ``(i, j)`` then reads
row ``(c, j)`` at ``e + i * dh * OW``, a shift by whole rows, which keeps every column in place:
``y (OC, OH * OW) = sum over kernel rows i of w[:, :, i, :] (OC, C * kw) @ xs[:, i * dh * OW:][:,
:OH * OW]``, ONE product with ``K = C * kw`` a kernel row, ``kh`` a group, the first with ``beta =
0``, the others accumulating (``beta = 1``), each reading its operand in place at a row offset.
``kw`` copies of the planes replace im2col's ``kh * kw``. ``_tap_planes`` lays them out; where the
input is as wide as the output and a kernel column reads it unshifted (a "same" convolution:
3 x 3, padding 1), that column's row is the image's planes between zero rows (one contiguous
copy) and every other column's is that row shifted (one contiguous copy), with the one or two
elements per row that the shift carried across a row's end zeroed. The product is the output
itself, at the output's width: an item of one image lands it in the NCHW output (or ``pre``) in
place, and the epilogue adds the bias and applies the activation there (nothing at all without
either). The items are as im2col's (images, or bands of rows, whose planes carry the ``(kh - 1)
* dh`` rows below the band); the planes of an item's images follow each other, so one product
covers them all, the ``(kh - 1) * dh`` rows between images junk (they read the next image's
rows), dropped by the epilogue, which copies out of scratch for such items. Accumulating into a
strided output and reading rows further apart than their length is not NumPy's matmul: the
products call the CBLAS ``?gemm`` of NumPy's own OpenBLAS through ctypes (``_blas.py``), and where
none is loaded (another BLAS) every item takes im2col. The junk rows of several-image items cost
``(OH + (kh - 1) * dh) / OH`` more product (1.125 at 16 x 16); below ``IMPLICIT_MIN_K`` (the first
layer's three channels, ``K = 9``) the thin products lose to im2col's one (``K = 27``). A depthwise
forward takes the direct kernel before either (``_direct_wins``). The layout it replaced flattened
the zero-padded planes at their padded width ``WP = OW + (kw - 1) * dw``, each kernel column's row
a shift of the flat plane, and computed ``OH x WP`` positions, whose ``(kw - 1) * dw`` junk
columns a row the epilogue dropped while it copied the product out of scratch: at the CIFAR-like
32 -> 64 layer (N = 64, 32 x 32) the output's width took the forward's CPU time down by ~7-17%
(conv2d with the bias and ReLU 7-12%, conv2d_stats 9-16%, with GELU keeping ``pre`` 11%, no bias
and no activation 17%; the CNN's 16 -> 32 at 16 x 16, items of four images, conv2d_stats 18%; a
loaded machine's medians of 11-21 interleaved rounds, each with a wide spread): a 6% narrower
product, no copy out of scratch, and a layout in half the time (long copies; ~0.09 -> ~0.045 ms
an image). Per image
there, one thread: the layout ~0.03-0.05 ms, the three products ~0.35-0.5 ms (OpenBLAS at about
its rate on a 1024^3 product on the same loaded core: two images a product, or one product of ``K
= C * kh * kw`` over nine shifted copies, ran no faster), the epilogue ~0.03 ms.

NOTE [ BLAS from Numba threads ]
Where the library's ``?gemm`` address is known (``_blas.address``), the forward's items that land
in place (implicit GEMMs of one image, or of a band of its rows: ``_implicit_in_place``),
conv2d_backward's parts (``_backward_items``; not the per-tap grad_w, nor a backward without
grad_x), the fused block's forward at stride 1 (``_stats_items``: implicit GEMMs in place or
through scratch, and im2col's padded columns) and its backward's parts with batch norm's fill,
with or without grad_x (``_bn_backward_items``; not the per-tap grad_w) run as ONE parallel
Numba kernel whose threads each take the next item as they finish one (an atomic counter,
``_blas.take``), lay out its operands, call ``?gemm``
themselves (``_blas.call_gemm``: the C function at its address, no Python, ctypes or GIL between
calls) and run the epilogue: the same products on the same operands, summed in the same order,
so the bits of the Python items (tested). OpenBLAS is held to one thread for the kernel
(``_blas_single_threaded``): its pthreads build then runs each call on the calling thread, and
calls from several threads at once are safe (its buffers are allocated under a lock; NumPy's
wheels ship that build). Where the address is not found the Python items run. At the CIFAR-like
32 -> 64 layer (N = 64, bias + ReLU, 2 threads), on a quiet machine, 24 interleaved rounds in
subprocesses, the Python items' wall time over the kernel's: forward 1.19x [1.03, 1.28], backward
1.20x [1.13, 1.37], forward + backward 1.21x [1.10, 1.30] (medians, 95% bootstrap intervals; CPU
time 1.11x and 1.15x). On a loaded machine (14 rounds) CPU time was a tie (0.98x, 1.04x): the
per-call overhead it removes (~5 us over 192 calls a forward, ~1 ms) is a few percent of the
products' time, and the rest of the gain is the threads no longer handing the GIL between calls.

NOTE [ Pooling fast paths ]
* ``MaxPool2d(2)`` (2 x 2 windows, stride 2, no dilation) with every window inside the input (no
  padding, and the last window ends inside: not ``ceil_mode`` on an odd size): ``_max_pool_2x2``
  unrolls the four taps with no bounds checks, each a select instead of a branch, in the general
  path's order (the first maximum wins, a NaN wins, the last NaN). The branches mispredict on
  random data: 3-3.5x less time on one thread at (64, 16, 32, 32), a loaded machine's ratio. The
  selects carry the winning tap's offset as a float32 (exact below 2**24: inputs up to that
  width), and a second loop over the output row writes the int64 indices: with the int64 in the
  selects the loop did not vectorize, 2.6x the time on one thread (1.36 ms against 0.52 ms at
  (64, 16, 32, 32), medians of 7 interleaved rounds, a loaded machine's CPU time).
* Max pooling's backward when windows do not overlap (stride at least the dilated kernel, per
  axis): each input element is the maximum of at most one window, so its gradient is that
  window's (plus +0.0, so a -0.0 becomes +0.0 as the sum from zero does) or zero, written
  directly, with no float64 planes. The same values as the general path's sums of one term.
* The global average (``adaptive_avg_pool2d`` to 1 x 1, the classifier head's pooling): one
  float64 sum per plane, and a backward that writes ``g / (H * W)`` over the plane.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from taifuse import pool
from taifuse.backends._spec import activation_code
from taifuse.backends.numba import _blas, _jit
from taifuse.backends.numba._jit import (
    _FMA,
    _FMA_INLINE,
    _FMA_PARALLEL,
    _FMA_REDUCE,
    _GELU,
    _GELU_TANH,
    _IDENTITY,
    _RELU,
    _SILU,
    _bits,
    _gelu,
    _gelu_tanh,
    _like,
    _narrow,
    _relu,
    _silu,
    _widen,
)
from taifuse.backends.numba.attention import _blas_single_threaded, _run, _workers
from taifuse.backends.numba.backward import _grad_pre_span
from taifuse.backends.numba.batch_norm import (
    _backward_planes,
    _backward_planes_parallel,
    _channel_factors,
    _finish_stats,
    _finish_sums,
    _per,
    batch_norm_stats,
)

# The global average's sum reassociates so that it vectorizes.
_REDUCE_PARALLEL = dict(_FMA_REDUCE, parallel=True)


def _compute_dtype(dtype: np.dtype) -> np.dtype:
    return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)


def _as_compute(a: np.ndarray, scratch) -> np.ndarray:
    """``a`` in its compute dtype: float16 converted into pool scratch, others as they are."""
    if a.dtype != np.float16:
        return a
    out = scratch.acquire(a.shape, np.float32)
    _jit._convert(out, a)
    return out


@njit(**_FMA_INLINE)
def _act(v, op):
    if op == _RELU:
        return _relu(v)
    if op == _GELU:
        return _gelu(v)
    if op == _GELU_TANH:
        return _gelu_tanh(v)
    if op == _SILU:
        return _silu(v)
    return v


# ----------------------------------------------------------------------------- im2col / col2im


@njit(**_FMA_INLINE)
def _im2col_row(x, n, c, i, j, sh, sw, ph, pw, dh, dw, ra, rb, oh, ow, dst):
    # dst[(r - ra) * OW + q] = x[n, c, r * sh - ph + i * dh, q * sw - pw + j * dw] for the output
    # rows r in [ra, rb), 0 outside the input: the valid columns of a row are one run (a
    # contiguous copy at stride 1), without a branch per element.
    h, w = x.shape[2], x.shape[3]
    r0, r1 = _valid(oh, sh, i * dh - ph, h)
    off = j * dw - pw
    q0, q1 = _valid(ow, sw, off, w)
    for r in range(ra, rb):
        o = (r - ra) * ow
        if r < r0 or r >= r1:
            for q in range(ow):
                dst[o + q] = 0
            continue
        src = x[n, c, r * sh - ph + i * dh]
        for q in range(q0):
            dst[o + q] = 0
        if sw == 1:
            for q in range(q0, q1):
                dst[o + q] = _widen(src[q + off])
        else:
            for q in range(q0, q1):
                dst[o + q] = _widen(src[q * sw + off])
        for q in range(q1, ow):
            dst[o + q] = 0


@njit(**_FMA)
def _im2col_block(x, n0, n1, ra, rb, kh, kw, sh, sw, ph, pw, dh, dw, oh, ow, cols):
    # _im2col of the output rows [ra, rb) of images [n0, n1) on the calling thread (a forward
    # work item): cols[(c, i, j), (n - n0) * span + (r - ra) * OW + q], span = (rb - ra) * OW.
    c_dim = x.shape[1]
    span = (rb - ra) * ow
    for row in range(c_dim * kh * kw):
        c = row // (kh * kw)
        i = (row // kw) % kh
        j = row % kw
        for n in range(n0, n1):
            base = (n - n0) * span
            _im2col_row(x, n, c, i, j, sh, sw, ph, pw, dh, dw, ra, rb, oh, ow, cols[row, base : base + span])


@njit(**_FMA)
def _im2col_padded(x, n0, n1, ra, rb, kh, kw, ph, pw, dh, dw, ow, xpad, cols):
    # Stride 1: the columns of output rows [ra, rb) of images [n0, n1) at the padded width
    # WP = OW + (kw - 1) * dw, cols[(c, i, j), (n - n0) * span + (r - ra) * WP + q], span =
    # (rb - ra) * WP: each row of cols is ONE contiguous run of the image's zero-padded planes,
    # built once per image in xpad (C, rows * WP + (kw - 1) * dw, the compute dtype). Columns
    # q >= OW of each output row are junk (they read the next padded row), dropped by the
    # epilogue.
    c_dim, h, w = x.shape[1], x.shape[2], x.shape[3]
    wp = ow + (kw - 1) * dw
    rows = rb - ra + (kh - 1) * dh
    span = (rb - ra) * wp
    lo, hi = min(pw, wp), min(wp, pw + w)
    for n in range(n0, n1):
        for c in range(c_dim):
            plane = xpad[c]
            for pr in range(rows):
                ih = ra + pr - ph
                o = pr * wp
                if ih < 0 or ih >= h:
                    for q in range(wp):
                        plane[o + q] = 0
                    continue
                src = x[n, c, ih]
                for q in range(lo):
                    plane[o + q] = 0
                for q in range(lo, hi):
                    plane[o + q] = _widen(src[q - pw])
                for q in range(hi, wp):
                    plane[o + q] = 0
            for q in range(rows * wp, plane.size):
                plane[q] = 0
        base = (n - n0) * span
        for c in range(c_dim):
            plane = xpad[c]
            for i in range(kh):
                for j in range(kw):
                    dst = cols[(c * kh + i) * kw + j, base : base + span]
                    off = i * dh * wp + j * dw
                    for e in range(span):
                        dst[e] = plane[off + e]


@njit(**_FMA_INLINE)
def _fill(dst):
    # Loops over a slice each (the callers take the slices): with the offsets in the index
    # instead, _tap_planes took ~2.7x this time (a loaded machine's ratio).
    for e in range(dst.size):
        dst[e] = 0


@njit(**_FMA_INLINE)
def _copy(dst, src):
    # dst = src[:dst.size] in dst's dtype (the compute dtype).
    for e in range(dst.size):
        dst[e] = _widen(src[e])


@njit(**_FMA)
def _tap_planes(x, n0, n1, ra, rb, kh, kw, ph, pw, dh, dw, ow, xs):
    # The implicit GEMM's operand at the output's width (NOTE [ Implicit GEMM on the host ]):
    # output rows [ra, rb) of images [n0, n1) read padded rows [ra, rb + (kh - 1) * dh) of each
    # image, PROW of them, the images' planes one after another; row c * kw + j of xs is channel
    # c under kernel column j, xs[c * kw + j, (n - n0) * PROW * OW + r * OW + q] = x[n, c, ra + r
    # - ph, q + j * dw - pw] (zero outside the input), in the compute dtype.
    c_dim, h, w = x.shape[1], x.shape[2], x.shape[3]
    prow = rb - ra + (kh - 1) * dh
    size = (n1 - n0) * prow * ow
    # A kernel column that reads the input unshifted, where the rows are as wide as the output's:
    # its row is the input's planes with zero rows around them, and every other column's row is
    # that one shifted, with the columns it reads across a row's end zeroed (long copies).
    jc = pw // dw if w == ow and pw % dw == 0 and pw // dw < kw else -1
    for c in range(c_dim):
        if jc >= 0:
            center = xs[c * kw + jc]
            for n in range(n0, n1):
                base = (n - n0) * prow * ow
                r0 = min(prow, max(0, ph - ra))  # padded rows [r0, r1) lie inside the input
                r1 = max(r0, min(prow, h + ph - ra))
                _fill(center[base : base + r0 * ow])
                src = x[n, c].reshape(h * w)[(ra + r0 - ph) * w :]
                _copy(center[base + r0 * ow : base + r1 * ow], src)
                _fill(center[base + r1 * ow : base + prow * ow])
        for j in range(kw):
            if j == jc:
                continue
            s = j * dw - pw
            q0, q1 = _valid(ow, 1, s, w)
            dst = xs[c * kw + j]
            if jc >= 0:
                e0, e1 = min(size, max(0, -s)), max(0, min(size, size - s))
                _fill(dst[:e0])
                _copy(dst[e0:e1], center[e0 + s :])
                _fill(dst[e1:size])
                for row in range(size // ow):
                    _fill(dst[row * ow : row * ow + q0])
                    _fill(dst[row * ow + q1 : (row + 1) * ow])
                continue
            for n in range(n0, n1):
                base = (n - n0) * prow * ow
                for r in range(prow):
                    ih = ra + r - ph
                    row = dst[base + r * ow : base + (r + 1) * ow]
                    if ih < 0 or ih >= h:
                        _fill(row)
                        continue
                    _fill(row[:q0])
                    _copy(row[q0:q1], x[n, c, ih, q0 + s :])
                    _fill(row[q1:])


# ----------------------------------------------------------------------------- epilogues


@njit(**_FMA)
def _epilogue(y, b, op, n0, c0, span, pitch, ys, ow, out, pre):
    # out[n0 + n, o, c0 + r * OW + q] = act(y[o, n * ys + r * pitch + q] + b[o]) for a work item's
    # images, r < span // OW (pitch > OW: the padded width of _im2col_padded, whose junk columns
    # are dropped here; ys > span // OW * pitch: the implicit GEMM's junk rows
    # between images); pre, where kept, y + b as stored and out the act of that; on the calling
    # thread.
    oc = out.shape[1]
    nb = (y.shape[1] + ys - 1) // ys
    width = span if pitch == ow else ow  # one run per plane where nothing is dropped
    runs = span // width
    for item in range(nb * oc):
        n = item // oc
        o = item % oc
        bias = _widen(b[o]) if b is not None else _like(0.0, y[o, 0])
        for r in range(runs):
            src = y[o, n * ys + r * pitch : n * ys + r * pitch + width]
            dst = out[n0 + n, o, c0 + r * width : c0 + (r + 1) * width]
            if pre is None:
                for q in range(width):
                    dst[q] = _narrow(_act(src[q] + bias, op), out)
            else:
                keep = pre[n0 + n, o, c0 + r * width : c0 + (r + 1) * width]
                for q in range(width):
                    v = _narrow(src[q] + bias, keep)
                    keep[q] = v
                    dst[q] = _narrow(_act(_widen(v), op), out)


@njit(**_FMA)
def _epilogue_in_place(b, op, n, c0, span, out, pre):
    # _epilogue for one image whose product is already in place: in pre where it is kept, else in
    # out (the compute dtype, so nothing is narrowed). Each loop reads and writes through the same
    # array, so LLVM vectorizes it without a runtime overlap check.
    for o in range(out.shape[1]):
        dst = out[n, o, c0 : c0 + span]
        bias = _widen(b[o]) if b is not None else _like(0.0, dst[0])
        if pre is None:
            for q in range(span):
                dst[q] = _act(dst[q] + bias, op)
        else:
            keep = pre[n, o, c0 : c0 + span]
            for q in range(span):
                v = keep[q] + bias
                keep[q] = v
                dst[q] = _act(v, op)


@njit(**_FMA_REDUCE)
def _span_sum(a):
    # The float64 sum of a span, reassociated so that it vectorizes (a sequential float64 sum
    # is one add per 4 cycles).
    s = 0.0
    for q in range(a.size):
        s += a[q]
    return s


@njit(**_FMA_INLINE)
def _stats_span(src, bias, k, dst):
    # dst = src + bias as stored, and the shifted sums sum(dst - k), sum((dst - k)^2) in float64.
    a = 0.0
    q2 = 0.0
    for q in range(dst.size):
        v = _narrow(_widen(src[q]) + bias, dst)
        dst[q] = v
        d = np.float64(_widen(v)) - k
        a += d
        q2 += d * d
    return a, q2


@njit(**_FMA_REDUCE)
def _epilogue_stats(y, b, n0, c0, span, pitch, ys, ow, out, shift, s1, s2, part):
    # out[n0 + n, o, c0 + r * OW + q] = y[o, n * ys + r * pitch + q] + b[o] as stored, laid out
    # as _epilogue's, and those values' shifted sums sum(out - K[o]) and sum((out - K[o])^2) into
    # s1[part + n, o], s2[part + n, o] (NOTE [ Batch norm statistics in one pass ] in
    # batch_norm.py), while the item is still in cache; on the calling thread.
    oc = out.shape[1]
    nb = (y.shape[1] + ys - 1) // ys
    width = span if pitch == ow else ow
    runs = span // width
    for item in range(nb * oc):
        n = item // oc
        o = item % oc
        bias = _widen(b[o]) if b is not None else _like(0.0, _widen(y[o, 0]))
        a = 0.0
        q2 = 0.0
        for r in range(runs):
            src = y[o, n * ys + r * pitch : n * ys + r * pitch + width]
            ra, rq = _stats_span(src, bias, shift[o], out[n0 + n, o, c0 + r * width : c0 + (r + 1) * width])
            a += ra
            q2 += rq
        s1[part + n, o] = a
        s2[part + n, o] = q2


@njit(**_FMA_REDUCE)
def _epilogue_stats_in_place(b, n, c0, span, out, shift, s1, s2, part):
    # _epilogue_stats for one image whose product is already in out (the compute dtype).
    for o in range(out.shape[1]):
        dst = out[n, o, c0 : c0 + span]
        bias = _widen(b[o]) if b is not None else _like(0.0, dst[0])
        a, q2 = _stats_span(dst, bias, shift[o], dst)
        s1[part, o] = a
        s2[part, o] = q2


# ----------------------------------------------------------------------------- direct kernels


@njit(**_FMA_INLINE)
def _valid(count, s, off, size):
    """[lo, hi): the output positions q < count whose tap q * s + off lies in [0, size)."""
    lo = 0 if off >= 0 else min(count, (-off + s - 1) // s)  # a padding past every output: none
    hi = 0 if off >= size else min(count, (size - off + s - 1) // s)
    return lo, max(lo, hi)


@njit(**_FMA_PARALLEL)
def _direct(x, w, b, sh, sw, ph, pw, dh, dw, groups, op, acc_planes, out, pre):
    # One (n, o) output plane per work item, summed tap by tap into its plane of pool scratch:
    # the inner loop runs over the output columns whose tap is inside the input (no branch).
    n_dim, _, h, wd = x.shape
    oc, cg, kh, kw = w.shape
    oh, ow = out.shape[2], out.shape[3]
    ocg = oc // groups
    for item in prange(n_dim * oc):
        n = item // oc
        o = item % oc
        c0 = (o // ocg) * cg
        acc = acc_planes[item]
        bias = _widen(b[o]) if b is not None else 0.0
        acc[:] = bias
        for c in range(cg):
            for i in range(kh):
                r0, r1 = _valid(oh, sh, i * dh - ph, h)
                for j in range(kw):
                    wv = _widen(w[o, c, i, j])
                    off = j * dw - pw
                    q0, q1 = _valid(ow, sw, off, wd)
                    for r in range(r0, r1):
                        src = x[n, c0 + c, r * sh - ph + i * dh]
                        row = acc[r]
                        for q in range(q0, q1):
                            row[q] += wv * _widen(src[q * sw + off])
        dst = out[n, o]
        for r in range(oh):
            for q in range(ow):
                v = acc[r, q]
                if pre is not None:
                    keep = pre[n, o]
                    keep[r, q] = _narrow(v, keep)
                    v = _widen(keep[r, q])
                dst[r, q] = _narrow(_act(v, op), out)


def _direct_wins(groups: int, c: int, oc: int) -> bool:
    """The direct forward for depthwise-like convolutions (a group of one input channel and at most
    a few outputs): a tie in time with im2col there, without the columns (docs/cnn.md). Not for
    the first layer's three channels: re-measured at (64, 3 -> 32, 32 x 32), it took about ten
    times im2col's CPU time (a loaded machine's ratio, 7 interleaved rounds)."""
    return c // groups == 1 and oc // groups <= 4


# A forward work item (NOTE [ Convolution on the host: im2col in blocks ]): its product is at
# least ITEM_MIN_COLUMNS columns wide (images of fewer output pixels share an item), and its
# columns take at most ITEM_MAX_BYTES (an image with more gives items of a band of output rows).
ITEM_MIN_COLUMNS = 1024
ITEM_MAX_BYTES = 4 * 1024 * 1024
# The implicit GEMM's products take K = (C / groups) * kw each: under this, im2col's one product
# (K = C / groups * kh * kw) wins (NOTE [ Implicit GEMM on the host ]).
IMPLICIT_MIN_K = 16


def _product(w2, cols, y) -> None:
    """y = w2 @ cols per group: w2 (G, OCg, K), cols (G * K, width), y (G * OCg, width)."""
    groups, ocg, k = w2.shape
    if groups == 1:
        np.matmul(w2[0], cols, out=y)
    else:
        np.matmul(w2, cols.reshape(groups, k, -1), out=y.reshape(groups, ocg, -1))


class _Forward:
    """The forward's work items (NOTE [ Convolution on the host: im2col in blocks ]): output rows
    ``[ra, rb)`` of images ``[n0, n0 + nb)``, one product per group (BLAS on the worker's thread),
    then ``epilogue(n0, part, c0, span, y, pitch, ys)`` for the ``span`` output pixels from ``c0``
    of each image, image ``n0 + m``'s output row ``r`` at ``y[:, m * ys + r * pitch:][:, :OW]``
    (the epilogue takes these as arguments: a closure that read them from the items would be a
    cycle that keeps the workers' scratch from the pool until the garbage collector runs).

    At stride 1, where the library's ``?gemm`` is reachable (``_blas.gemm``), an item is an
    implicit GEMM (NOTE [ Implicit GEMM on the host ]): ``_tap_planes`` lays out the planes once
    per kernel column at the output's width (``pitch == OW``), and one accumulating product per
    kernel row and group reads them in place, over every padded row of the item (``ys = PROW *
    pitch``). Else the columns
    come from ``_im2col_padded`` (stride 1, at the padded width ``pitch``) or ``_im2col_block``,
    one product per group (one stacked matmul for several groups). An item of one image at
    ``pitch == OW`` whose output ``into`` holds the compute dtype takes the product in place (``y``
    None: no epilogue's copy); others go through channel-major scratch ``y``. ``part`` numbers the
    items' (image, band) pairs: ``n * bands + band``."""

    def __init__(self, x, w, stride, padding, dilation, groups, oh, ow, into, epilogue, workers):
        n, c, _, _ = x.shape
        oc, cg, kh, kw = w.shape
        scratch = pool.host_pool()
        ct = self.ct = _compute_dtype(x.dtype)
        self.padded = tuple(stride) == (1, 1)
        self.gemm = _blas.gemm(ct) if self.padded and cg * kw >= IMPLICIT_MIN_K else None
        # The implicit GEMM's rows are as wide as the output's; im2col's at stride 1 are padded.
        self.pitch = ow + (kw - 1) * dilation[1] if self.padded and self.gemm is None else ow
        rows, p = c * kh * kw, oh * self.pitch
        row_bytes = rows * self.pitch * ct.itemsize
        self.band = oh if rows * p * ct.itemsize <= ITEM_MAX_BYTES else max(1, ITEM_MAX_BYTES // row_bytes)
        self.bands = -(-oh // self.band)
        self.nb = 1 if self.bands > 1 else max(1, min(-(-ITEM_MIN_COLUMNS // p), -(-n // workers)))
        self.n, self.oh, self.ow, self.groups = n, oh, ow, groups
        self.geom = (kh, kw, *stride, *padding, *dilation, oh, ow)
        self.x = np.ascontiguousarray(_bits(x))  # _tap_planes reads an image's plane flat
        wc = _as_compute(w, scratch)
        self.w2 = wc.reshape(groups, oc // groups, cg * kh * kw)
        in_place = self.nb == 1 and self.pitch == ow and into.dtype == ct
        self.into = into if in_place else None
        self.epilogue = epilogue
        width = self.nb * self.band * self.pitch
        if self.gemm is not None:
            # The weight by kernel row: wk[i, o, (c, j)] = w[o, c, i, j]; padded rows an item reads.
            self.wk = scratch.acquire((kh, oc, cg * kw), ct)
            np.copyto(self.wk.reshape(kh, oc, cg, kw), wc.transpose(2, 0, 1, 3))
            self.prow = self.band + (kh - 1) * dilation[0]
            self.ld = self.nb * self.prow * self.pitch  # xs's row stride
            self.xs = scratch.acquire((workers, c * kw, self.ld), ct)
            width = self.ld - (kh - 1) * dilation[0] * self.pitch
        else:
            self.cols = scratch.acquire((workers, rows, width), ct)
            self.xpad = None
            if self.padded:
                plane = (self.band + (kh - 1) * dilation[0]) * self.pitch + (kw - 1) * dilation[1]
                self.xpad = scratch.acquire((workers, c, plane), ct)
        self.y = None if in_place else scratch.acquire((workers, oc * width), ct)

    def items(self) -> list[tuple[int, int]]:
        return [(n0, band) for n0 in range(0, self.n, self.nb) for band in range(self.bands)]

    def in_numba(self) -> bool:
        """Whether every item is an implicit GEMM of one image landing in place and ``?gemm``'s
        address is known: then one parallel Numba kernel runs them all (``_implicit_in_place``)."""
        self.address = _blas.address(self.ct) if self.gemm is not None and self.into is not None else None
        return self.address is not None

    def __call__(self, worker: int, item: tuple[int, int]) -> None:
        n0, band = item
        n1 = min(self.n, n0 + self.nb)
        ra = band * self.band
        rb = min(self.oh, ra + self.band)
        c0, span = ra * self.ow, (rb - ra) * self.ow
        kh, kw, _, _, ph, pw, dh, dw, _, ow = self.geom
        oc = self.w2.shape[0] * self.w2.shape[1]
        if self.gemm is not None:
            prow = rb - ra + (kh - 1) * dh
            width = ((n1 - n0) * prow - (kh - 1) * dh) * self.pitch
            _tap_planes(self.x, n0, n1, ra, rb, kh, kw, ph, pw, dh, dw, ow, self.xs[worker])
            if self.into is not None:
                y, dst = None, self.into[n0, :, c0 : c0 + span]
            else:
                y = dst = self.y[worker, : oc * width].reshape(oc, width)
            self._implicit(worker, width, dst)
            self.epilogue(n0, n0 * self.bands + band, c0, span, y, self.pitch, prow * self.pitch)
            return
        cols = self.cols[worker, :, : (n1 - n0) * (rb - ra) * self.pitch]
        if self.padded:
            _im2col_padded(self.x, n0, n1, ra, rb, kh, kw, ph, pw, dh, dw, ow, self.xpad[worker], cols)
        else:
            _im2col_block(self.x, n0, n1, ra, rb, *self.geom, cols)
        if self.into is not None:
            _product(self.w2, cols, self.into[n0, :, c0 : c0 + span])
            y = None
        else:
            y = self.y[worker, : oc * cols.shape[1]].reshape(oc, -1)
            _product(self.w2, cols, y)
        self.epilogue(n0, n0 * self.bands + band, c0, span, y, self.pitch, (rb - ra) * self.pitch)

    def _implicit(self, worker: int, width: int, dst: np.ndarray) -> None:
        # dst[o, e] = sum over kernel rows i of wk[i, o] @ xs[:, i * dh * pitch + e], e < width,
        # per group: one ?gemm each, the first with beta = 0 (NOTE [ Implicit GEMM on the host ]).
        kh, oc, k = self.wk.shape
        groups = self.groups
        ocg, cgk = oc // groups, k
        dh = self.geom[6]
        xs = self.xs[worker]
        size = xs.itemsize
        ldc = dst.strides[0] // size
        for g in range(groups):
            a = self.wk.ctypes.data + g * ocg * k * size
            b = xs.ctypes.data + g * cgk * self.ld * size
            c = dst.ctypes.data + g * ocg * ldc * size
            for i in range(kh):
                self.gemm(
                    ocg, width, cgk, a + i * oc * k * size, k, b + i * dh * self.pitch * size, self.ld,
                    1.0 if i else 0.0, c, ldc,
                )  # fmt: skip


@njit(**_FMA_PARALLEL)
def _implicit_in_place(
    x, wk, b, op, groups, kh, kw, ph, pw, dh, dw, oh, ow, band, xs, into, out, pre, bare, fn, ilp64, next_item
):  # fmt: skip
    # The forward's implicit GEMM items of one image each, landing in place (NOTE [ BLAS from Numba
    # threads ]): item = (image, band of ``band`` output rows); each of the xs.shape[0] threads
    # takes the next item as it finishes one, lays out its planes in its own xs[t], runs the
    # ``kh`` products per group into ``into`` (out, or pre where kept) and the epilogue in place.
    n, oc, p = into.shape
    k = wk.shape[2]
    ocg = oc // groups
    size = wk.itemsize
    bands = (oh + band - 1) // band
    one, zero = _like(1.0, wk[0, 0, 0]), _like(0.0, wk[0, 0, 0])
    for t in prange(xs.shape[0]):
        xt = xs[t]
        ld = xt.shape[1]
        item = _blas.take(next_item)
        while item < n * bands:
            m, r = item // bands, item % bands
            ra, rb = r * band, min(oh, (r + 1) * band)
            c0, span = ra * ow, (rb - ra) * ow
            _tap_planes(x, m, m + 1, ra, rb, kh, kw, ph, pw, dh, dw, ow, xt)
            for g in range(groups):
                a = wk.ctypes.data + g * ocg * k * size
                bb = xt.ctypes.data + g * k * ld * size
                c = into.ctypes.data + ((m * oc + g * ocg) * p + c0) * size
                for i in range(kh):
                    _blas.call_gemm(
                        fn, ilp64, _blas.NO_TRANS, _blas.NO_TRANS, ocg, span, k, one, a + i * oc * k * size, k,
                        bb + i * dh * ow * size, ld, zero if i == 0 else one, c, p,
                    )  # fmt: skip
            if not bare:
                _epilogue_in_place(b, op, m, c0, span, out, pre)
            item = _blas.take(next_item)


def conv2d(x, w, b, stride, padding, dilation, groups, activation, out, pre=None) -> None:
    """See the reference's conv2d; NOTE [ Convolution on the host: im2col in blocks ]."""
    op = int(activation_code(activation))
    n, c = x.shape[:2]
    oc = w.shape[0]
    oh, ow = out.shape[2:]
    (sh, sw), (ph, pw), (dh, dw) = stride, padding, dilation
    bb = None if b is None else _bits(b)
    pb = None if pre is None else _bits(pre)
    if _direct_wins(groups, c, oc):
        planes = pool.host_pool().acquire((n * oc, oh, ow), _compute_dtype(x.dtype))
        _direct(_bits(x), _bits(w), bb, sh, sw, ph, pw, dh, dw, groups, op, planes, _bits(out), pb)
        return
    p = oh * ow
    o3 = _bits(out).reshape(n, oc, p)
    p3 = None if pb is None else pb.reshape(n, oc, p)
    bare = bb is None and op == _IDENTITY and p3 is None  # out = the product: nothing to add or apply

    def epilogue(n0, part, c0, span, y, pitch, ys):
        if y is not None:
            _epilogue(y, bb, op, n0, c0, span, pitch, ys, ow, o3, p3)
        elif not bare:
            _epilogue_in_place(bb, op, n0, c0, span, o3, p3)

    workers = _workers(n * oh)
    # The product lands in pre where it is kept (pre = y + b, out = act(pre)).
    fw = _Forward(
        x, w, stride, padding, dilation, groups, oh, ow, o3 if p3 is None else p3, epilogue, workers
    )
    # BLAS on one thread, on one worker too (NOTE [ Implicit GEMM on the host ]).
    if fw.in_numba():
        with _blas_single_threaded():
            _implicit_in_place(
                fw.x, fw.wk, bb, op, groups, *fw.geom[:2], *padding, *dilation, oh, ow, fw.band, fw.xs,
                fw.into, o3, p3, bare, *fw.address, np.zeros(1, np.int64),
            )  # fmt: skip
        return
    _run(fw, fw.items(), workers, True)


def conv2d_backward(
    x, w, pre, grad_out, stride, padding, dilation, groups, activation, grad_x, grad_w, grad_b
) -> None:
    """See the reference's conv2d_backward; NOTE [ Convolution on the host: im2col in blocks ]."""
    op = int(activation_code(activation))
    n, oc, oh, ow = grad_out.shape
    p = oh * ow
    g3 = _bits(grad_out).reshape(n, oc, p)
    # pre is read only with an activation; without one, grad_out stands in for the argument.
    p3 = g3 if pre is None else _bits(pre).reshape(n, oc, p)
    sums = None if grad_b is None else pool.host_pool().acquire((n, oc), np.float64)

    def fill(n0, n1, pitch, gp):
        _grad_pre_item(p3, g3, op, n0, n1, pitch, ow, gp, sums)

    bw = _Backward(x, w, fill, oc, stride, padding, dilation, groups, oh, ow, grad_x, grad_w)
    bw.grad_pre = (p3, g3, op, sums)
    bw.run()
    if grad_b is not None:  # the planes' sums, image by image in a fixed order
        np.copyto(grad_b, sums.sum(axis=0), casting="unsafe")


# ----------------------------------------------------------------------------- backward work items


@njit(**_FMA)
def _grad_pre_item(pre, g, op, n0, n1, pitch, ow, gp, sums):
    # Images [n0, n1) on the calling thread (a backward work item): gp[o, (n - n0) * OH * pitch +
    # r * pitch + q] = g[n, o, r * OW + q] * act'(pre[n, o, r * OW + q]), channel-major at the
    # item's pitch (the columns q >= OW are left alone: zero), and sums[n, o] = the plane's
    # float64 sum (for grad_b), one sum over the plane at the pitch, its zero columns included.
    # Without an activation the rows are copied by index: a slice per 32-element row took twice
    # the time (0.09 against 0.04 ms an image's 64 planes, one thread, a loaded machine).
    oc, p = g.shape[1], g.shape[2]
    width = p if pitch == ow else ow  # one run per plane where the pitch adds no columns
    runs = p // width
    span = (p // ow) * pitch
    for n in range(n0, n1):
        base = (n - n0) * span
        for o in range(oc):
            plane = gp[o, base : base + span]
            src = g[n, o]
            if op == _IDENTITY:
                for r in range(runs):
                    for q in range(width):
                        plane[r * pitch + q] = _widen(src[r * width + q])
            else:
                for r in range(runs):
                    _grad_pre_span(
                        pre[n, o, r * width : (r + 1) * width], src[r * width : (r + 1) * width], op,
                        plane[r * pitch : r * pitch + width],
                    )  # fmt: skip
            if sums is not None:
                sums[n, o] = _span_sum(plane)


@njit(**_FMA_INLINE)
def _bn_grad_pre_span(ys, gs, m, a, b, relu, f1, f2, f3, dst):
    # dst = f1 * (g' - f2 - (y - mean) * f3), g' = g masked by the forward's ReLU (NOTE [ The ReLU
    # mask in the backward ] in batch_norm.py).
    if relu:
        for q in range(dst.size):
            yv = _widen(ys[q])
            pre = _widen(_narrow((yv - m) * a + b, gs))
            gv = _like(0.0, yv) if pre <= 0 else _widen(gs[q])
            dst[q] = f1 * (gv - f2 - (yv - m) * f3)
    else:
        for q in range(dst.size):
            yv = _widen(ys[q])
            dst[q] = f1 * (_widen(gs[q]) - f2 - (yv - m) * f3)


@njit(**_FMA)
def _bn_grad_pre_item(y, g, mean, scale, shift, relu, k1, k2, k3, n0, n1, pitch, ow, gp):
    # Batch norm's input gradient in training for images [n0, n1), written as _grad_pre_item's
    # grad_pre for the convolution's products: k1 * (g' - k2 - (y - mean) * k3).
    oc, p = g.shape[1], g.shape[2]
    width = p if pitch == ow else ow
    runs = p // width
    for n in range(n0, n1):
        base = (n - n0) * (p // ow) * pitch
        for o in range(oc):
            for r in range(runs):
                _bn_grad_pre_span(
                    y[n, o, r * width : (r + 1) * width], g[n, o, r * width : (r + 1) * width],
                    mean[o], scale[o], shift[o], relu, k1[o], k2[o], k3[o],
                    gp[o, base + r * pitch : base + r * pitch + width],
                )  # fmt: skip


@njit(**_FMA)
def _zero_junk(a, width, ow, pitch):
    # a[:, s + OW : s + pitch] = 0 at every output row start s < width of a layout at the padded
    # width (_im2col_padded's): the columns that read the next padded row.
    for row in range(a.shape[0]):
        dst = a[row]
        for s in range(0, width, pitch):
            for q in range(s + ow, s + pitch):
                dst[q] = 0


@njit(**_FMA_REDUCE)
def _all_finite(a):
    # Whether every value of ``a`` (C-contiguous) is finite: v * 0 is NaN for an inf or NaN, 0
    # otherwise (a sum that vectorizes, where a per-element test did not).
    flat = a.ravel()
    if flat.size == 0:
        return True
    zero = _like(0.0, _widen(flat[0]))
    acc = zero
    for e in range(flat.size):
        acc += _widen(flat[e]) * zero
    return acc == 0


@njit(**_FMA)
def _pad_image(x, n, kh, kw, ph, pw, dh, dw, oh, ow, xpad):
    # Image n's zero-padded planes at stride 1, as _im2col_padded lays them out in xpad (C, (OH +
    # (kh - 1) * dh) * WP + (kw - 1) * dw), WP = OW + (kw - 1) * dw), and whether every value is
    # finite (the tap products read junk columns against zeros: NOTE [ Convolution on the host:
    # im2col in blocks ]).
    c_dim, h, w = x.shape[1], x.shape[2], x.shape[3]
    wp = ow + (kw - 1) * dw
    rows = oh + (kh - 1) * dh
    lo, hi = min(pw, wp), min(wp, pw + w)
    finite = True
    for c in range(c_dim):
        plane = xpad[c]
        for e in range(plane.size):
            plane[e] = 0
        for ih in range(max(0, -ph), min(h, rows - ph)):
            src = x[n, c, ih]
            dst = plane[(ih + ph) * wp : (ih + ph + 1) * wp]
            for q in range(lo, hi):
                v = _widen(src[q - pw])
                finite &= math.isfinite(v)
                dst[q] = v
    return finite


@njit(**_FMA)
def _kw_planes(x, n, kh, kw, ph, pw, dh, dw, oh, ow, xs):
    # Image n's zero-padded planes at stride 1 (_im2col_padded's, at WP = OW + (kw - 1) * dw), one
    # row per input channel and kernel column: xs[c * kw + j, e] = plane_c[e + j * dw] for e <
    # rows * WP, rows = OH + (kh - 1) * dh. Kernel row i's columns are then the rows' runs from
    # i * dh * WP (NOTE [ Convolution on the host: im2col in blocks ]): row (c, 0) is the plane
    # itself (with its (kw - 1) * dw zeros after the last row), the others its shifted copies.
    c_dim, h, w = x.shape[1], x.shape[2], x.shape[3]
    wp = ow + (kw - 1) * dw
    rows = oh + (kh - 1) * dh
    size = rows * wp
    lo, hi = min(pw, wp), min(wp, pw + w)
    for c in range(c_dim):
        plane = xs[c * kw]
        for pr in range(rows):
            ih = pr - ph
            o = pr * wp
            if ih < 0 or ih >= h:
                for q in range(wp):
                    plane[o + q] = 0
                continue
            src = x[n, c, ih]
            for q in range(lo):
                plane[o + q] = 0
            for q in range(lo, hi):
                plane[o + q] = _widen(src[q - pw])
            for q in range(hi, wp):
                plane[o + q] = 0
        for q in range(size, size + (kw - 1) * dw):
            plane[q] = 0
        for j in range(1, kw):
            dst = xs[c * kw + j, :size]
            src = plane[j * dw : j * dw + size]
            for e in range(size):
                dst[e] = src[e]


@njit(**_FMA)
def _col2im_padded(gcols, n0, n1, kh, kw, ph, pw, dh, dw, oh, ow, xpad, gx):
    # The adjoint of _im2col_padded for whole images [n0, n1) (stride 1), on the calling thread:
    # each tap's row of gcols (junk columns zeroed) is added into the image's zero-padded plane
    # at the tap's offset, one contiguous shifted add, and the plane's inside lands in gx[n, c]
    # (what fell on the padding is dropped).
    c_dim, h, w = gx.shape[1], gx.shape[2], gx.shape[3]
    wp = ow + (kw - 1) * dw
    span = oh * wp
    for n in range(n0, n1):
        base = (n - n0) * span
        for c in range(c_dim):
            plane = xpad[c]
            for e in range(plane.size):
                plane[e] = 0
            for i in range(kh):
                for j in range(kw):
                    src = gcols[(c * kh + i) * kw + j, base : base + span]
                    dst = plane[i * dh * wp + j * dw : i * dh * wp + j * dw + span]
                    for e in range(span):
                        dst[e] += src[e]
            for a in range(h):
                row = plane[(a + ph) * wp + pw : (a + ph) * wp + pw + w]
                out = gx[n, c, a]
                for b in range(w):
                    out[b] = _narrow(row[b], gx)


@njit(**_FMA)
def _col2im_item(gcols, n0, n1, kh, kw, sh, sw, ph, pw, dh, dw, oh, ow, acc, gx):
    # The adjoint of _im2col_block for whole images [n0, n1) (any stride), on the calling thread:
    # each (n, c) plane is summed in acc (C, H, W; the columns' dtype), each tap adding its
    # column row over the output rows and columns whose input lies inside (``_valid``: no branch
    # in the inner loop), then stored into gx[n, c].
    c_dim, h, w = gx.shape[1], gx.shape[2], gx.shape[3]
    p = oh * ow
    for n in range(n0, n1):
        base = (n - n0) * p
        for c in range(c_dim):
            plane = acc[c]
            plane[:] = 0
            for i in range(kh):
                r0, r1 = _valid(oh, sh, i * dh - ph, h)
                for j in range(kw):
                    off = j * dw - pw
                    q0, q1 = _valid(ow, sw, off, w)
                    src = gcols[(c * kh + i) * kw + j]
                    for r in range(r0, r1):
                        row = plane[r * sh - ph + i * dh]
                        s = base + r * ow
                        if sw == 1:
                            for q in range(q0, q1):
                                row[q + off] += src[s + q]
                        else:
                            for q in range(q0, q1):
                                row[q * sw + off] += src[s + q]
            dst = gx[n, c]
            for a in range(h):
                for b in range(w):
                    dst[a, b] = _narrow(plane[a, b], gx)


# The backward's images are shared out as runs of consecutive images, one step each up to
# BACKWARD_PARTS runs (more where Numba has more threads), each summing grad_w in scratch of its
# own (at most PARTS_MAX_BYTES for all parts); the parts are added in their order at the end.
BACKWARD_PARTS = 64
PARTS_MAX_BYTES = 16 * 1024 * 1024
# grad_w takes one product per tap, without the columns, from TAPS_MIN_CHANNELS input channels up
# to (not including) TAPS_MAX_CHANNELS: per image at 32 x 32, the columns' copy and one product
# took 0.05 ms against 0.07-0.16 ms for the nine products at 3 channels, 0.24 against 0.11-0.12 ms
# at 8 (the product's order then grad_pre @ cols.T). With the product as cols @ grad_pre.T
# (_grad_w_product's ``kmajor``), copy and product against the nine: 0.14 against 0.11 ms at 8
# -> 16, 0.29-0.32 against 0.23 at 16 -> 32, 0.69-0.97 against 0.77-1.04 at 32 -> 64 (0.90-0.94 of
# the taps' time, median of 21 interleaved rounds), a tie from 64 channels (0.97-1.02). One BLAS
# thread, CPU time, a loaded machine's figures: an ordering only.
TAPS_MIN_CHANNELS = 8
TAPS_MAX_CHANNELS = 32
# Pool scratch rows get this many elements of padding: a row stride of N * 4 KiB puts every row
# of a BLAS operand in one cache set.
_ROW_PAD = 16


class _Backward:
    """The backward's work items (NOTE [ Convolution on the host: im2col in blocks ]): a part of
    consecutive images, taken ``nb`` images a step (as the forward's items: at least
    ``ITEM_MIN_COLUMNS`` output pixels). A step's ``fill(n0, n1, pitch, gp)`` writes its grad_pre
    channel-major into the worker's scratch ``gp (OC, nb * OH * pitch)``; the step's columns,
    rebuilt as the forward's, give ``grad_w_g += gp_g @ cols_g.T`` into the part's own sum (or one
    product per tap from the image's padded planes: ``taps``), then ``cols_g = w_g.T @ gp_g`` over
    them, which col2im adds into the step's images of grad_x."""

    def __init__(self, x, w, fill, oc, stride, padding, dilation, groups, oh, ow, grad_x, grad_w, bn=None):
        n, c, h, wd = x.shape
        _, cg, kh, kw = w.shape
        scratch = pool.host_pool()
        ct = _compute_dtype(x.dtype)
        self.ct, self.fill, self.grad_x, self.grad_w = ct, fill, grad_x, grad_w
        self.grad_pre = None  # conv2d_backward's fill's arguments: the parts may run in Numba
        self.bn = bn  # conv2d_batch_norm_backward's fill's arguments: the parts may run in Numba
        self.padded = tuple(stride) == (1, 1)
        self.pitch = ow + (kw - 1) * dilation[1] if self.padded else ow
        self.ow, self.span = ow, oh * self.pitch
        self.geom = (kh, kw, *stride, *padding, *dilation, oh, ow)
        self.x = np.ascontiguousarray(_bits(x))  # _tap_planes reads an image's plane flat
        k, ocg = cg * kh * kw, oc // groups
        self.nb = max(1, min(n, -(-ITEM_MIN_COLUMNS // (oh * ow))))
        # One image a step, one group of TAPS_MIN_CHANNELS to TAPS_MAX_CHANNELS, stride 1: grad_w as
        # one product per tap, straight from the image's padded planes (no columns).
        channels = TAPS_MIN_CHANNELS <= c < TAPS_MAX_CHANNELS
        self.taps = self.padded and groups == 1 and self.nb == 1 and channels
        self.offsets = [i * dilation[0] * self.pitch + j * dilation[1] for i in range(kh) for j in range(kw)]
        steps = -(-n // self.nb)
        self.workers = _workers(steps)
        gw_bytes = oc * k * ct.itemsize
        parts = min(steps, max(self.workers, min(BACKWARD_PARTS, PARTS_MAX_BYTES // max(1, gw_bytes))))
        per = -(-steps // parts) * self.nb  # images a part
        self.items = [(i, n0, min(n, n0 + per)) for i, n0 in enumerate(range(0, n, per))]
        width = self.nb * self.span
        workers = self.workers
        # The kernels take whole rows of scratch (C-contiguous, so that their loops vectorize: a
        # view of the first ``width`` columns ran col2im 2.5-4x slower), BLAS the views.
        self.gp = scratch.acquire((workers, oc, width + _ROW_PAD), ct)
        if self.pitch != ow:  # fill never writes the junk columns: zero them once
            for gp in self.gp:
                _zero_junk(gp, width, ow, self.pitch)
        products = grad_x is not None or grad_w is not None
        self.cols = scratch.acquire((workers, c * kh * kw, width + _ROW_PAD), ct) if products else None
        self.xpad = self.acc = None
        if products and self.padded:
            plane = (oh + (kh - 1) * dilation[0]) * self.pitch + (kw - 1) * dilation[1]
            self.xpad = scratch.acquire((workers, c, plane), ct)
        elif grad_x is not None:
            self.acc = scratch.acquire((workers, c, h, wd), ct)
        self.w2 = _as_compute(w, scratch).reshape(groups, ocg, k) if grad_x is not None else None
        self.w2shape = (groups, ocg)
        # The columns' junk columns need zeroing only where a non-finite value meets them (NOTE
        # [ Convolution on the host: im2col in blocks ]).
        self.w_finite = self.w2 is not None and bool(_all_finite(self.w2))
        self.gw = self.tmp = self.xs = None
        # The columns' product writes grad_w's transpose (K, OCg) where K is the larger
        # (_grad_w_product); the parts' sums keep that order until run() transposes their total.
        self.kmajor = k > ocg
        # Or, with one image a step and one group at stride 1, one product per kernel row over the
        # image's planes shifted per kernel column (``_kw_planes``), no columns: its rows (i, c, j).
        self.kwrows = self.padded and groups == 1 and self.nb == 1 and self.kmajor and not self.taps
        # _bn_backward_items writes the columns' layout: where it will run, the columns it is.
        bn_kernel = bn is not None and _blas.address(ct) is not None
        self.kwrows = self.kwrows and grad_w is not None and not bn_kernel
        if self.kwrows:
            rows = oh + (kh - 1) * dilation[0]
            self.xs = scratch.acquire(
                (workers, c * kw, rows * self.pitch + (kw - 1) * dilation[1] + _ROW_PAD), ct
            )
        if grad_w is not None:
            shape = (groups, k, ocg) if self.kmajor else (groups, ocg, k)
            self.gw = scratch.acquire((len(self.items), *shape), ct)
            self.tmp = scratch.acquire((workers, *shape), ct)

    def run(self) -> None:
        address = self._in_numba()
        if address is not None:
            # One parallel Numba kernel runs the parts (NOTE [ BLAS from Numba threads ]).
            p3, g3, op, sums = self.grad_pre
            starts = np.array([n0 for _, n0, _ in self.items], np.int64)
            ends = np.array([n1 for _, _, n1 in self.items], np.int64)
            spare = np.empty((self.workers, 1, 1, 1), self.ct)  # for the scratch that the path needs not
            with _blas_single_threaded():
                _backward_items(
                    self.x, self.w2, p3, g3, op, self.geom, self.padded, self.nb, starts, ends, self.gp,
                    self.cols, spare[:, 0] if self.xpad is None else self.xpad, spare if self.acc is None else self.acc,
                    self.gw, self.tmp, self.kmajor, sums, None if self.grad_x is None else _bits(self.grad_x), self.w_finite,
                    self.kwrows, spare[:, 0] if self.xs is None else self.xs,
                    *address, np.zeros(1, np.int64),
                )  # fmt: skip
        elif not self._bn_in_numba():
            _run(self, self.items, self.workers, True)
        if self.grad_w is None:
            return
        groups, ocg = self.w2shape
        gw = self.grad_w.reshape(groups, ocg, -1)
        direct = gw.dtype == self.ct and not self.kmajor
        total = gw if direct else pool.host_pool().acquire(self.gw.shape[1:], self.ct)
        parts = self.gw.reshape(len(self.items), -1)
        if _jit._parallel(parts.size):  # the parts in their order: the same bits every run
            _sum_parts(parts, total.reshape(-1))
        else:
            np.sum(self.gw, axis=0, out=total)
        if self.kwrows:  # rows (i, c, j) -> grad_w (OC, C, kh, kw)
            kh, kw = self.geom[:2]
            _jit._convert(self.grad_w, total.reshape(kh, -1, kw, ocg).transpose(3, 1, 0, 2))
        elif total is not gw:
            _jit._convert(gw, total.transpose(0, 2, 1) if self.kmajor else total)

    def _in_numba(self) -> tuple[int, bool] | None:
        """``?gemm``'s address where one parallel Numba kernel can run the parts: the fill is
        conv2d_backward's (``grad_pre`` set), both gradients' products are wanted (w2 is grad_x's),
        and no step takes grad_w's per-tap products."""
        if self.grad_pre is None or self.w2 is None or self.taps:
            return None
        return _blas.address(self.ct)

    def _bn_in_numba(self) -> bool:
        """Run the parts of conv2d_batch_norm_backward (``bn``: its fill's arguments) as one parallel
        Numba kernel (``_bn_backward_items``) where ``?gemm``'s address is known and no step takes
        grad_w's per-tap or per-kernel-row products (the kernel writes the columns' layout);
        False (nothing run) otherwise."""
        skip = self.bn is None or self.cols is None or self.taps or self.kwrows
        address = None if skip else _blas.address(self.ct)
        if address is None:
            return False
        starts = np.array([n0 for _, n0, _ in self.items], np.int64)
        ends = np.array([n1 for _, _, n1 in self.items], np.int64)
        spare = np.empty((self.workers, 1, 1, 1), self.ct)  # for the scratch that the path needs not
        *fill, dims = self.bn
        with _blas_single_threaded():
            _bn_backward_items(
                self.x, self.w2, dims, *fill, self.geom, self.padded, self.nb, starts, ends, self.gp, self.cols,
                spare[:, 0] if self.xpad is None else self.xpad, spare if self.acc is None else self.acc, self.gw,
                self.tmp, self.kmajor, None if self.grad_x is None else _bits(self.grad_x), self.w_finite,
                *address, np.zeros(1, np.int64),
            )  # fmt: skip
        return True

    def __call__(self, worker: int, item: tuple[int, int, int]) -> None:
        part, n0, n1 = item
        for s0 in range(n0, n1, self.nb):
            self._step(worker, part, s0, min(n1, s0 + self.nb), s0 > n0)

    def _step(self, worker: int, part: int, n0: int, n1: int, add: bool) -> None:
        kh, kw, _, _, ph, pw, dh, dw, oh, ow = self.geom
        width = (n1 - n0) * self.span
        gp_rows = self.gp[worker]
        self.fill(n0, n1, self.pitch, gp_rows)
        if self.cols is None:
            return
        gp, cols_rows = gp_rows[:, :width], self.cols[worker]
        cols = cols_rows[:, :width]
        junk = self.pitch != ow
        if self.kwrows:
            self._grad_w_kw_rows(worker, part, n0, gp, add)
        elif self.grad_w is not None and not (self.taps and self._grad_w_taps(worker, part, n0, gp, add)):
            if self.padded:
                _im2col_padded(
                    self.x, n0, n1, 0, oh, kh, kw, ph, pw, dh, dw, ow, self.xpad[worker], cols_rows
                )
            else:
                _im2col_block(self.x, n0, n1, 0, oh, *self.geom, cols_rows)
            if junk and not _all_finite(self.x[n0:n1]):  # else junk * 0 adds +-0: the same bits
                _zero_junk(cols_rows, width, ow, self.pitch)
            acc = self.gw[part]
            if add:
                tmp = self.tmp[worker]
                _grad_w_product(gp, cols, tmp, self.kmajor)
                acc += tmp
            else:
                _grad_w_product(gp, cols, acc, self.kmajor)
        if self.grad_x is not None:
            groups, ocg, k = self.w2.shape
            if groups == 1:
                np.matmul(self.w2[0].T, gp, out=cols)
            else:
                np.matmul(
                    self.w2.transpose(0, 2, 1), gp.reshape(groups, ocg, -1), out=cols.reshape(groups, k, -1)
                )
            gx = _bits(self.grad_x)
            if self.padded:
                if junk and not self.w_finite:  # else the columns' junk is w.T @ 0 = +0
                    _zero_junk(cols_rows, width, ow, self.pitch)
                _col2im_padded(cols_rows, n0, n1, kh, kw, ph, pw, dh, dw, oh, ow, self.xpad[worker], gx)
            else:
                _col2im_item(cols_rows, n0, n1, *self.geom, self.acc[worker], gx)

    def _grad_w_kw_rows(self, worker: int, part: int, n: int, gp, add: bool) -> None:
        """The part's grad_w (+)= one product per kernel row i, ``xs[:, i * dh * WP:][:, :span] @
        gp.T`` into its rows (i, c, j), over image ``n``'s shifted planes (``_kw_planes``), whose
        junk columns are zeroed where the image holds an inf or NaN."""
        kh, kw, _, _, ph, pw, dh, dw, oh, ow = self.geom
        xs = self.xs[worker]
        _kw_planes(self.x, n, kh, kw, ph, pw, dh, dw, oh, ow, xs)
        if not _all_finite(self.x[n : n + 1]):
            _zero_junk(xs, (oh + (kh - 1) * dh) * self.pitch, ow, self.pitch)
        acc = self.tmp[worker] if add else self.gw[part]
        out = acc[0].reshape(kh, -1, acc.shape[2])
        for i in range(kh):
            np.matmul(xs[:, i * dh * self.pitch : i * dh * self.pitch + self.span], gp.T, out=out[i])
        if add:
            self.gw[part] += acc

    def _grad_w_taps(self, worker: int, part: int, n: int, gp, add: bool) -> bool:
        """The part's grad_w (+)= one product per tap, ``gp @ xpad[:, off : off + span].T``, where
        image ``n`` is finite (else False: the junk columns would multiply an inf by 0)."""
        kh, kw, _, _, ph, pw, dh, dw, oh, ow = self.geom
        xpad = self.xpad[worker]
        if not _pad_image(self.x, n, kh, kw, ph, pw, dh, dw, oh, ow, xpad):
            return False
        oc = self.w2shape[1]
        c, taps = xpad.shape[0], len(self.offsets)
        tap = self.tmp[worker].reshape(taps, oc, c)
        for t, off in enumerate(self.offsets):
            np.matmul(gp, xpad[:, off : off + self.span].T, out=tap[t])
        if self.kmajor:
            acc, tap = self.gw[part].reshape(c, taps, oc), tap.transpose(2, 0, 1)
        else:
            acc, tap = self.gw[part].reshape(oc, c, taps), tap.transpose(1, 2, 0)
        if add:
            acc += tap
        else:
            np.copyto(acc, tap)
        return True


@njit(**_FMA)
def _cols_grad_w(ct, gpt, dst, groups, ocg, k, kmajor, width, ldc, ldg, fn, ilp64):
    # dst (G, rows, columns) = cols_g @ gp_g.T (K, OCg) where kmajor, else gp_g @ cols_g.T (OCg, K),
    # per group: the backward kernels' grad_w product over a step's columns.
    size = gpt.itemsize
    one, zero = _like(1.0, gpt[0, 0]), _like(0.0, gpt[0, 0])
    nt, tr = _blas.NO_TRANS, _blas.TRANS
    rows, columns = dst.shape[1], dst.shape[2]
    for q in range(groups):
        a = ct.ctypes.data + q * k * ldc * size
        b = gpt.ctypes.data + q * ocg * ldg * size
        c = dst[q].ctypes.data
        if kmajor:
            _blas.call_gemm(fn, ilp64, nt, tr, rows, columns, width, one, a, ldc, b, ldg, zero, c, columns)
        else:
            _blas.call_gemm(fn, ilp64, nt, tr, rows, columns, width, one, b, ldg, a, ldc, zero, c, columns)


@njit(**_FMA)
def _add_part(total, dst):
    # A part's later step: its grad_w product (dst) added into the part's sum, in order.
    for q in range(total.shape[0]):
        for r in range(total.shape[1]):
            for e in range(total.shape[2]):
                total[q, r, e] += dst[q, r, e]


@njit(**_FMA)
def _cols_grad_x(w2, gpt, ct, groups, ocg, k, width, ldc, ldg, fn, ilp64):
    # ct (G * K, width) = w_g.T @ gp_g per group: the columns' gradient, which col2im adds into grad_x.
    size = gpt.itemsize
    one, zero = _like(1.0, gpt[0, 0]), _like(0.0, gpt[0, 0])
    for q in range(groups):
        _blas.call_gemm(
            fn, ilp64, _blas.TRANS, _blas.NO_TRANS, k, width, ocg, one, w2[q].ctypes.data, k,
            gpt.ctypes.data + q * ocg * ldg * size, ldg, zero, ct.ctypes.data + q * k * ldc * size, ldc,
        )  # fmt: skip


@njit(**_FMA_PARALLEL)
def _backward_items(
    x, w2, pre, g, op, geom, padded, nb, starts, ends, gp, cols, xpad, acc, gw, tmp, kmajor, sums, gx, w_finite,
    kwrows, xs, fn, ilp64, next_item,
):  # fmt: skip
    # _Backward's parts on Numba's threads (NOTE [ BLAS from Numba threads ]), each step as
    # _Backward._step with _grad_pre_item's fill: the same products on the same operands, summed
    # in the same order. gw (None: no grad_w) and gx (None: no grad_x) as _Backward's.
    kh, kw, sh, sw, ph, pw, dh, dw, oh, ow = geom
    groups, ocg, k = w2.shape
    size = gp.itemsize
    pitch = ow + (kw - 1) * dw if padded else ow
    span = oh * pitch
    ldg, ldc = gp.shape[2], cols.shape[2]
    one, zero = _like(1.0, gp[0, 0, 0]), _like(0.0, gp[0, 0, 0])
    nt, tr = _blas.NO_TRANS, _blas.TRANS
    for t in prange(gp.shape[0]):
        gpt, ct = gp[t], cols[t]
        part = _blas.take(next_item)
        while part < starts.size:
            for s0 in range(starts[part], ends[part], nb):
                s1 = min(ends[part], s0 + nb)
                width = (s1 - s0) * span
                _grad_pre_item(pre, g, op, s0, s1, pitch, ow, gpt, sums)
                if gw is not None:
                    first = s0 == starts[part]
                    dst = gw[part] if first else tmp[t]
                    rows, columns = dst.shape[1], dst.shape[2]
                    if kwrows:  # as _Backward._grad_w_kw_rows: rows (i, c, j)
                        xst = xs[t]
                        _kw_planes(x, s0, kh, kw, ph, pw, dh, dw, oh, ow, xst)
                        if not _all_finite(x[s0:s1]):
                            _zero_junk(xst, (oh + (kh - 1) * dh) * pitch, ow, pitch)
                        ckw = rows // kh
                        for i in range(kh):
                            _blas.call_gemm(
                                fn, ilp64, nt, tr, ckw, columns, width, one, xst.ctypes.data + i * dh * pitch * size,
                                xs.shape[2], gpt.ctypes.data, ldg, zero, dst.ctypes.data + i * ckw * columns * size,
                                columns,
                            )  # fmt: skip
                    else:
                        if padded:
                            _im2col_padded(x, s0, s1, 0, oh, kh, kw, ph, pw, dh, dw, ow, xpad[t], ct)
                            if pitch != ow and not _all_finite(x[s0:s1]):
                                _zero_junk(ct, width, ow, pitch)
                        else:
                            _im2col_block(x, s0, s1, 0, oh, kh, kw, sh, sw, ph, pw, dh, dw, oh, ow, ct)
                        _cols_grad_w(ct, gpt, dst, groups, ocg, k, kmajor, width, ldc, ldg, fn, ilp64)
                    if not first:
                        _add_part(gw[part], dst)
                if gx is not None:
                    _cols_grad_x(w2, gpt, ct, groups, ocg, k, width, ldc, ldg, fn, ilp64)
                    if padded:
                        if pitch != ow and not w_finite:
                            _zero_junk(ct, width, ow, pitch)
                        _col2im_padded(ct, s0, s1, kh, kw, ph, pw, dh, dw, oh, ow, xpad[t], gx)
                    else:
                        _col2im_item(ct, s0, s1, kh, kw, sh, sw, ph, pw, dh, dw, oh, ow, acc[t], gx)
            part = _blas.take(next_item)


@njit(**_FMA_PARALLEL)
def _sum_parts(parts, out):
    # out = parts[0] + parts[1] + ... element by element, in the parts' order (np.sum(parts,
    # axis=0)'s order and bits), blocks of elements on Numba's threads.
    count, size = parts.shape
    block = 4096
    for b in prange(-(-size // block)):
        lo, hi = b * block, min(size, (b + 1) * block)
        dst = out[lo:hi]
        _copy(dst, parts[0, lo:hi])
        for q in range(1, count):
            src = parts[q, lo:hi]
            for e in range(hi - lo):
                dst[e] += src[e]


@njit(**_FMA_PARALLEL)
def _bn_backward_items(
    x, w2, dims, y, g, mean, scale, shift, relu, k1, k2, k3, geom, padded, nb, starts, ends, gp, cols, xpad, acc,
    gw, tmp, kmajor, gx, w_finite, fn, ilp64, next_item,
):  # fmt: skip
    # conv2d_batch_norm_backward's parts on Numba's threads (NOTE [ BLAS from Numba threads ]): as
    # _backward_items with _bn_grad_pre_item's fill (batch norm's input gradient), and grad_x
    # optional (gx None: a network's first layer, w2 None then); dims = (groups, OCg, K); the junk
    # columns zeroed where an inf or NaN would meet them, as _backward_items.
    kh, kw, sh, sw, ph, pw, dh, dw, oh, ow = geom
    groups, ocg, k = dims
    pitch = ow + (kw - 1) * dw if padded else ow
    span = oh * pitch
    ldg, ldc = gp.shape[2], cols.shape[2]
    for t in prange(gp.shape[0]):
        gpt, ct = gp[t], cols[t]
        part = _blas.take(next_item)
        while part < starts.size:
            for s0 in range(starts[part], ends[part], nb):
                s1 = min(ends[part], s0 + nb)
                width = (s1 - s0) * span
                _bn_grad_pre_item(y, g, mean, scale, shift, relu, k1, k2, k3, s0, s1, pitch, ow, gpt)
                if gw is not None:
                    if padded:
                        _im2col_padded(x, s0, s1, 0, oh, kh, kw, ph, pw, dh, dw, ow, xpad[t], ct)
                        if pitch != ow and not _all_finite(x[s0:s1]):
                            _zero_junk(ct, width, ow, pitch)
                    else:
                        _im2col_block(x, s0, s1, 0, oh, kh, kw, sh, sw, ph, pw, dh, dw, oh, ow, ct)
                    first = s0 == starts[part]
                    dst = gw[part] if first else tmp[t]
                    _cols_grad_w(ct, gpt, dst, groups, ocg, k, kmajor, width, ldc, ldg, fn, ilp64)
                    if not first:
                        _add_part(gw[part], dst)
                if gx is not None:
                    _cols_grad_x(w2, gpt, ct, groups, ocg, k, width, ldc, ldg, fn, ilp64)
                    if padded:
                        if pitch != ow and not w_finite:
                            _zero_junk(ct, width, ow, pitch)
                        _col2im_padded(ct, s0, s1, kh, kw, ph, pw, dh, dw, oh, ow, xpad[t], gx)
                    else:
                        _col2im_item(ct, s0, s1, kh, kw, sh, sw, ph, pw, dh, dw, oh, ow, acc[t], gx)
            part = _blas.take(next_item)


def _grad_w_product(gp, cols, out, kmajor: bool) -> None:
    """out = gp_g @ cols_g.T per group, gp (G * OCg, width), cols (G * K, width): out (G, OCg, K),
    or its transpose cols_g @ gp_g.T (G, K, OCg) where ``kmajor``. OpenBLAS (one thread) ran the
    order whose output has more rows than columns faster: (288, 64) in 0.54 ms against 0.70 ms for
    (64, 288) at 32 -> 64 over one 32 x 32 image (the same bits: each element sums K in order)."""
    a, b = (cols, gp) if kmajor else (gp, cols)
    groups, rows, _ = out.shape
    if groups == 1:
        np.matmul(a, b.T, out=out[0])
    else:
        width = a.shape[1]
        np.matmul(a.reshape(groups, rows, width), b.reshape(groups, -1, width).transpose(0, 2, 1), out=out)


# ----------------------------------------------------------------------------- Conv2d -> BatchNorm -> ReLU


def conv2d_stats(x, w, b, stride, padding, dilation, groups, out, mean, var) -> None:
    """See the reference's conv2d_stats (NOTE [ The fused Conv-BN-ReLU block in training ]): the
    im2col path's epilogue adds each plane's shifted sums while it stores the block; the direct
    path (depthwise) runs batch_norm_stats over its output after it, one more pass."""
    n, c = x.shape[:2]
    oc = w.shape[0]
    oh, ow = out.shape[2:]
    if _direct_wins(groups, c, oc):
        conv2d(x, w, b, stride, padding, dilation, groups, None, out)
        batch_norm_stats(out.reshape(n, oc, oh * ow), mean, var)
        return
    scratch = pool.host_pool()
    p = oh * ow
    bb = None if b is None else _bits(b)
    o3 = _bits(out).reshape(n, oc, p)
    shift = scratch.acquire((oc,), np.float64)

    def epilogue(n0, part, c0, span, y, pitch, ys):
        if y is None:
            _epilogue_stats_in_place(bb, n0, c0, span, o3, shift, s1, s2, part)
        else:
            _epilogue_stats(y, bb, n0, c0, span, pitch, ys, ow, o3, shift, s1, s2, part)

    workers = _workers(n * oh)
    fw = _Forward(x, w, stride, padding, dilation, groups, oh, ow, o3, epilogue, workers)
    s1, s2 = (scratch.acquire((n * fw.bands, oc), np.float64) for _ in range(2))
    _first_values(x, w, b, padding, dilation, groups, out.dtype, shift)
    address = _blas.address(fw.ct) if fw.padded else None
    with _blas_single_threaded():  # on one worker too (NOTE [ Implicit GEMM on the host ])
        if address is None:
            _run(fw, fw.items(), workers, False)  # already held to one thread here
        else:  # one parallel Numba kernel (NOTE [ BLAS from Numba threads ])
            spare = np.empty((workers, 1, 1), fw.ct)  # for the scratch that the path needs not
            implicit = fw.gemm is not None
            y = spare[:, :, 0] if fw.y is None else fw.y
            _stats_items(
                fw.x, fw.w2, fw.wk if implicit else spare, bb, fw.geom, fw.nb, fw.band, implicit,
                fw.xs if implicit else spare, spare if implicit else fw.xpad, spare if implicit else fw.cols,
                y, o3, shift, s1, s2, *address,
                np.zeros(1, np.int64),
            )  # fmt: skip
    _finish_stats(s1, s2, shift, n * p, mean, var)


@njit(**_FMA_PARALLEL)
def _stats_items(
    x, w2, wk, b, geom, nb, band, implicit, xs, xpad, cols, y, out, shift, s1, s2, fn, ilp64, next_item
):  # fmt: skip
    # conv2d_stats's forward items at stride 1 on Numba's threads (NOTE [ BLAS from Numba
    # threads ]), as _Forward.__call__ with conv2d_stats's epilogue: the same products on the same
    # operands, so the same bits. Item ``(n0 // nb) * bands + r`` is the band ``r`` of ``band``
    # output rows of images [n0, n0 + nb). ``implicit``: _tap_planes into xs (wk's kh products a
    # group), else _im2col_padded's columns (one product a group of w2); the product lands in
    # place in ``out`` where an item is one image at out's dtype and width (as _Forward's ``into``);
    # off place, it goes to the front of the thread's y, C-contiguous (OC, width) as the Python
    # items' (a strided view compiled _epilogue_stats's float64 sums with another vectorization:
    # other bits), and _epilogue_stats copies it out.
    kh, kw, _sh, _sw, ph, pw, dh, dw, oh, ow = geom
    n, oc, p = out.shape
    groups, ocg, kk = w2.shape
    size = w2.itemsize
    bands = (oh + band - 1) // band
    pitch = ow if implicit else ow + (kw - 1) * dw
    in_place = nb == 1 and pitch == ow and out.dtype == w2.dtype  # as _Forward's
    one, zero = _like(1.0, w2[0, 0, 0]), _like(0.0, w2[0, 0, 0])
    nt = _blas.NO_TRANS
    for t in prange(y.shape[0]):
        item = _blas.take(next_item)
        while item < ((n + nb - 1) // nb) * bands:
            n0, r = (item // bands) * nb, item % bands
            n1 = min(n, n0 + nb)
            ra, rb = r * band, min(oh, (r + 1) * band)
            c0, span = ra * ow, (rb - ra) * ow
            part = n0 * bands + r
            if implicit:
                xt = xs[t]
                ld, k = xt.shape[1], wk.shape[2]
                prow = rb - ra + (kh - 1) * dh
                width = ((n1 - n0) * prow - (kh - 1) * dh) * pitch
                ys = prow * pitch
                _tap_planes(x, n0, n1, ra, rb, kh, kw, ph, pw, dh, dw, ow, xt)
                # in place, y is (threads, 1): yt unused
                yt = y[t][:1].reshape(1, 1) if in_place else y[t][: oc * width].reshape(oc, width)
                for g in range(groups):
                    if in_place:
                        c, ldc = out.ctypes.data + ((n0 * oc + g * ocg) * p + c0) * size, p
                    else:
                        c, ldc = yt.ctypes.data + g * ocg * width * size, width
                    for i in range(kh):
                        _blas.call_gemm(
                            fn, ilp64, nt, nt, ocg, width, k, one, wk.ctypes.data + (i * oc + g * ocg) * k * size,
                            k, xt.ctypes.data + (g * k * ld + i * dh * pitch) * size, ld, zero if i == 0 else one,
                            c, ldc,
                        )  # fmt: skip
            else:
                ct = cols[t]
                width = (n1 - n0) * (rb - ra) * pitch
                ys = (rb - ra) * pitch
                _im2col_padded(x, n0, n1, ra, rb, kh, kw, ph, pw, dh, dw, ow, xpad[t], ct[:, :width])
                yt = y[t][:1].reshape(1, 1) if in_place else y[t][: oc * width].reshape(oc, width)
                for g in range(groups):
                    if in_place:  # a 1-wide kernel: no junk columns
                        c, ldc = out.ctypes.data + ((n0 * oc + g * ocg) * p + c0) * size, p
                    else:
                        c, ldc = yt.ctypes.data + g * ocg * width * size, width
                    _blas.call_gemm(
                        fn, ilp64, nt, nt, ocg, width, kk, one, w2[g].ctypes.data, kk,
                        ct.ctypes.data + g * kk * ct.shape[1] * size, ct.shape[1], zero, c, ldc,
                    )  # fmt: skip
            if in_place:
                _epilogue_stats_in_place(b, n0, c0, span, out, shift, s1, s2, part)
            else:
                _epilogue_stats(yt, b, n0, c0, span, pitch, ys, ow, out, shift, s1, s2, part)
            item = _blas.take(next_item)


def _first_values(x, w, b, padding, dilation, groups, dtype, shift) -> None:
    """shift[o] = the convolution's first output value (image 0, pixel (0, 0)) plus b[o], in float64
    and rounded to ``dtype`` as stored: the shift of the statistics' sums (NOTE [ Batch norm
    statistics in one pass ] in batch_norm.py), known before any item runs."""
    oc, cg, kh, kw = w.shape
    (ph, pw), (dh, dw) = padding, dilation
    h, wd = x.shape[2:]
    patch = np.zeros((x.shape[1], kh, kw))
    for i in range(kh):
        for j in range(kw):
            r, q = i * dh - ph, j * dw - pw
            if 0 <= r < h and 0 <= q < wd:
                patch[:, i, j] = x[0, :, r, q]
    first = np.einsum("gokl,gkl->go", w.reshape(groups, oc // groups, cg, kh * kw).astype(np.float64),
                      patch.reshape(groups, cg, kh * kw)).reshape(oc)  # fmt: skip
    if b is not None:
        first += b
    np.copyto(shift, first.astype(dtype), casting="unsafe")


def conv2d_batch_norm_backward(
    x, w, y, grad_out, mean, invstd, bn_weight, bn_bias, activation, stride, padding, dilation, groups,
    grad_x, grad_w, grad_b, grad_bn_weight, grad_bn_bias,
) -> None:  # fmt: skip
    """See the reference's conv2d_batch_norm_backward (NOTE [ The fused Conv-BN-ReLU block in
    training ]): one pass of per-channel sums over (y, grad_out), then one pass that writes batch
    norm's input gradient as the convolution's channel-major grad_pre, then the products."""
    n, oc, oh, ow = y.shape
    p = oh * ow
    count = n * p
    scratch = pool.host_pool()
    y3, g3 = _bits(y).reshape(n, oc, p), _bits(grad_out).reshape(n, oc, p)
    m, a, bsh = _channel_factors(y.reshape(n, oc, p), mean, invstd, bn_weight, bn_bias)
    relu = activation == "relu"
    t1, t2 = scratch.acquire((n, oc), np.float64), scratch.acquire((n, oc), np.float64)
    yp, gpl, f1, f2 = y3.reshape(n * oc, p), g3.reshape(n * oc, p), t1.reshape(-1), t2.reshape(-1)
    if _jit._parallel(y.size):
        _backward_planes_parallel(yp, gpl, m, a, bsh, relu, f1, f2, _per(p))
    else:
        _backward_planes(yp, gpl, m, a, bsh, relu, f1, f2, 0, n * oc)
    sum_g, sum_gx = scratch.acquire((oc,), np.float64), scratch.acquire((oc,), np.float64)
    _finish_sums(t1, t2, sum_g, sum_gx)
    np.multiply(sum_gx, invstd, out=sum_gx, casting="unsafe")  # sum(g' * xhat)
    if grad_bn_bias is not None:
        np.copyto(grad_bn_bias, sum_g, casting="unsafe")
    if grad_bn_weight is not None:
        np.copyto(grad_bn_weight, sum_gx, casting="unsafe")
    if grad_b is not None:  # exactly 0 (the reference's docstring)
        grad_b.fill(0)
    if grad_x is None and grad_w is None:
        return
    ct = m.dtype
    k1, k2, k3 = (scratch.acquire((oc,), ct) for _ in range(3))
    np.copyto(k1, a)  # invstd * bn_weight
    np.divide(sum_g, count, out=k2, casting="unsafe")
    np.multiply(sum_gx, invstd, out=k3, casting="unsafe")
    np.divide(k3, count, out=k3)

    def fill(n0, n1, pitch, gp):
        _bn_grad_pre_item(y3, g3, m, a, bsh, relu, k1, k2, k3, n0, n1, pitch, ow, gp)

    dims = (groups, oc // groups, w.shape[1] * w.shape[2] * w.shape[3])
    bn = (y3, g3, m, a, bsh, relu, k1, k2, k3, dims)  # the parts may run in Numba
    bw = _Backward(x, w, fill, oc, stride, padding, dilation, groups, oh, ow, grad_x, grad_w, bn)
    bw.run()


# ----------------------------------------------------------------------------- pooling


@njit(**_FMA_PARALLEL)
def _max_pool(x, kh, kw, sh, sw, ph, pw, dh, dw, out, idx):
    n_dim, c_dim, h, w = x.shape
    oh, ow = out.shape[2], out.shape[3]
    for item in prange(n_dim * c_dim):
        n = item // c_dim
        c = item % c_dim
        plane = x[n, c]
        for r in range(oh):
            for q in range(ow):
                best = _widen(plane[0, 0])
                where = -1
                for i in range(kh):
                    ih = r * sh - ph + i * dh
                    if ih < 0 or ih >= h:
                        continue
                    for j in range(kw):
                        iw = q * sw - pw + j * dw
                        if iw < 0 or iw >= w:
                            continue
                        v = _widen(plane[ih, iw])
                        if where < 0 or v > best or math.isnan(v):
                            best = v
                            where = ih * w + iw
                out[n, c, r, q] = _narrow(best, out)
                idx[n, c, r, q] = where


@njit(**_FMA_PARALLEL)
def _max_pool_backward(idx, g, acc_planes, gx):
    # Each (n, c) plane scatters its windows' gradients into its own float64 plane of pool scratch.
    n_dim, c_dim, h, w = gx.shape
    for item in prange(n_dim * c_dim):
        n = item // c_dim
        c = item % c_dim
        acc = acc_planes[item]
        acc[:] = 0
        src, where = g[n, c].ravel(), idx[n, c].ravel()
        for e in range(src.size):
            acc[where[e]] += _widen(src[e])
        dst = gx[n, c].ravel()
        for e in range(h * w):
            dst[e] = _narrow(acc[e], gx)


@njit(**_FMA_INLINE)
def _max_tap(e, v, k, e1, k1):
    """The running maximum (element, value, tap offset) after the tap ``e1`` at offset ``k1``: it
    replaces the maximum when greater or NaN (a select, not a branch)."""
    v1 = _widen(e1)
    take = (v1 > v) | math.isnan(v1)
    return (e1 if take else e), (v1 if take else v), (k1 if take else k)


@njit(**_FMA_PARALLEL)
def _max_pool_2x2(x, out, idx):
    # MaxPool2d(2) with every window inside the input (NOTE [ Pooling fast paths ]): the four taps
    # of a window in row-major order, unrolled, each a select. The selects carry the winning tap's
    # offset in the plane (0, 1, W or W + 1) as a float32, the values' lane width, into a row of
    # scratch, and a second loop turns it into the int64 index: an int64 carried through the
    # selects kept the loop from vectorizing (2.6x the time, measured). Exact while W + 1 < 2**24
    # (max_pool2d's condition for this path).
    n_dim, c_dim, w = x.shape[0], x.shape[1], x.shape[3]
    oh, ow = out.shape[2], out.shape[3]
    one, fw = np.float32(1.0), np.float32(w)
    for item in prange(n_dim * c_dim):
        n = item // c_dim
        c = item % c_dim
        plane = x[n, c]
        taps = np.empty(ow, np.float32)
        for r in range(oh):
            best, where = out[n, c, r], idx[n, c, r]
            s0, s1 = plane[2 * r], plane[2 * r + 1]
            for q in range(ow):
                e = s0[2 * q]
                v = _widen(e)
                k = np.float32(0.0)
                e, v, k = _max_tap(e, v, k, s0[2 * q + 1], one)
                e, v, k = _max_tap(e, v, k, s1[2 * q], fw)
                e, v, k = _max_tap(e, v, k, s1[2 * q + 1], fw + one)
                best[q] = e
                taps[q] = k
            f0 = 2 * r * w
            for q in range(ow):
                where[q] = f0 + 2 * q + np.int64(taps[q])


@njit(**_FMA_PARALLEL)
def _max_pool_backward_disjoint(idx, g, gx):
    # Windows that share no input element (NOTE [ Pooling fast paths ]): zero the plane, then
    # each window's gradient goes to its maximum's position (g + 0.0: -0.0 becomes +0.0).
    for p in prange(gx.shape[0]):
        dst, src, where = gx[p], g[p], idx[p]
        for e in range(dst.size):
            dst[e] = 0
        for e in range(src.size):
            k = where[e]
            if k >= 0:
                v = _widen(src[e])
                dst[k] = _narrow(v + _like(0.0, v), gx)


@njit(**_REDUCE_PARALLEL)
def _global_avg_pool(x, out):
    # out[p] = the mean of plane p of x (P, S), summed in float64.
    s = x.shape[1]
    for p in prange(x.shape[0]):
        acc = 0.0
        for e in range(s):
            acc += np.float64(_widen(x[p, e]))
        out[p] = _narrow(acc / s, out)


@njit(**_FMA_PARALLEL)
def _global_avg_pool_backward(g, gx):
    # gx[p, :] = g[p] / S, divided in float64 as the general path's window sums.
    s = gx.shape[1]
    for p in prange(gx.shape[0]):
        v = _narrow(np.float64(_widen(g[p])) / s, gx)
        dst = gx[p]
        for e in range(s):
            dst[e] = v


@njit(**_FMA_INLINE)
def _window(o, size, k, s, p, count_include_pad, adaptive, out_size):
    """(start, end, divisor) of output position ``o`` along one axis (the reference's rule)."""
    if adaptive:
        start = (o * size) // out_size
        end = -((-(o + 1) * size) // out_size)
        return start, end, end - start
    start = o * s - p
    end = min(start + k, size + p)
    padded = end - start
    start, end = max(start, 0), min(end, size)
    return start, end, padded if count_include_pad else end - start


@njit(**_FMA_PARALLEL)
def _avg_pool(x, kh, kw, sh, sw, ph, pw, count_include_pad, divisor, adaptive, out):
    n_dim, c_dim, h, w = x.shape
    oh, ow = out.shape[2], out.shape[3]
    for item in prange(n_dim * c_dim):
        n = item // c_dim
        c = item % c_dim
        plane = x[n, c]
        for r in range(oh):
            h0, h1, hd = _window(r, h, kh, sh, ph, count_include_pad, adaptive, oh)
            for q in range(ow):
                w0, w1, wdv = _window(q, w, kw, sw, pw, count_include_pad, adaptive, ow)
                acc = 0.0
                for a in range(h0, h1):
                    for b in range(w0, w1):
                        acc += _widen(plane[a, b])
                div = divisor if divisor else hd * wdv
                out[n, c, r, q] = _narrow(acc / div, out)


@njit(**_FMA_PARALLEL)
def _avg_pool_backward(g, kh, kw, sh, sw, ph, pw, count_include_pad, divisor, adaptive, acc_planes, gx):
    n_dim, c_dim, h, w = gx.shape
    oh, ow = g.shape[2], g.shape[3]
    for item in prange(n_dim * c_dim):
        n = item // c_dim
        c = item % c_dim
        acc = acc_planes[item]
        acc[:] = 0
        for r in range(oh):
            h0, h1, hd = _window(r, h, kh, sh, ph, count_include_pad, adaptive, oh)
            for q in range(ow):
                w0, w1, wdv = _window(q, w, kw, sw, pw, count_include_pad, adaptive, ow)
                div = divisor if divisor else hd * wdv
                v = _widen(g[n, c, r, q]) / div
                for a in range(h0, h1):
                    for b in range(w0, w1):
                        acc[a, b] += v
        dst = gx[n, c]
        for a in range(h):
            for b in range(w):
                dst[a, b] = _narrow(acc[a, b], gx)


# Integers up to this are exact in float32 (_max_pool_2x2 carries its tap offsets as float32).
_FLOAT32_EXACT = 2**24


def _inside(out_size: int, size: int, k: int, s: int, p: int, d: int) -> bool:
    """Whether every window along one axis lies inside the input (no tap in the padding)."""
    return p == 0 and (out_size - 1) * s + (k - 1) * d < size


def _disjoint(kernel_size, stride, dilation) -> bool:
    """Whether no two windows share an input element (along each axis, stride >= dilated kernel)."""
    return all(s >= (k - 1) * d + 1 for k, s, d in zip(kernel_size, stride, dilation))


def max_pool2d(x, kernel_size, stride, padding, dilation, out, indices) -> None:
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = kernel_size, stride, padding, dilation
    (h, w), (oh, ow) = x.shape[2:], out.shape[2:]
    pair = (kh, kw, sh, sw, dh, dw) == (2, 2, 2, 2, 1, 1) and w + 1 < _FLOAT32_EXACT
    if pair and _inside(oh, h, 2, 2, ph, 1) and _inside(ow, w, 2, 2, pw, 1):
        _max_pool_2x2(_bits(x), _bits(out), indices)
        return
    _max_pool(_bits(x), kh, kw, sh, sw, ph, pw, dh, dw, _bits(out), indices)


def _planes(grad_x):
    """float64 accumulators, one (H * W) plane per (image, channel), from the host pool."""
    n, c, h, w = grad_x.shape
    return pool.host_pool().acquire((n * c, h * w), np.float64)


def max_pool2d_backward(indices, grad_out, kernel_size, stride, padding, dilation, grad_x) -> None:
    if _disjoint(kernel_size, stride, dilation):
        n, c, h, w = grad_x.shape
        g2 = _bits(grad_out).reshape(n * c, -1)
        _max_pool_backward_disjoint(indices.reshape(n * c, -1), g2, _bits(grad_x).reshape(n * c, h * w))
        return
    _max_pool_backward(indices, _bits(grad_out), _planes(grad_x), _bits(grad_x))


def avg_pool2d(x, kernel_size, stride, padding, count_include_pad, divisor_override, out) -> None:
    (kh, kw), (sh, sw), (ph, pw) = kernel_size, stride, padding
    _avg_pool(
        _bits(x), kh, kw, sh, sw, ph, pw, bool(count_include_pad), int(divisor_override), False, _bits(out)
    )


def avg_pool2d_backward(
    grad_out, kernel_size, stride, padding, count_include_pad, divisor_override, grad_x
) -> None:
    (kh, kw), (sh, sw), (ph, pw) = kernel_size, stride, padding
    planes = _planes(grad_x).reshape(grad_x.shape[0] * grad_x.shape[1], *grad_x.shape[2:])
    _avg_pool_backward(
        _bits(grad_out), kh, kw, sh, sw, ph, pw, bool(count_include_pad), int(divisor_override), False, planes,
        _bits(grad_x),
    )  # fmt: skip


def adaptive_avg_pool2d(x, out) -> None:
    n, c, h, w = x.shape
    if out.shape[2:] == (1, 1) and h * w:
        _global_avg_pool(_bits(x).reshape(n * c, h * w), _bits(out).reshape(n * c))
        return
    _avg_pool(_bits(x), 0, 0, 1, 1, 0, 0, True, 0, True, _bits(out))


def adaptive_avg_pool2d_backward(grad_out, grad_x) -> None:
    n, c, h, w = grad_x.shape
    if grad_out.shape[2:] == (1, 1):
        _global_avg_pool_backward(_bits(grad_out).reshape(n * c), _bits(grad_x).reshape(n * c, h * w))
        return
    planes = _planes(grad_x).reshape(grad_x.shape[0] * grad_x.shape[1], *grad_x.shape[2:])
    _avg_pool_backward(_bits(grad_out), 0, 0, 1, 1, 0, 0, True, 0, True, planes, _bits(grad_x))
