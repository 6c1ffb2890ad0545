"""The NumPy reference backend's convolution and pooling kernels: the specification of those ops.

Written for clarity, in float64, like ``forward.py`` (whose conventions hold here too: inputs are
C-contiguous, ``out`` and the gradients are preallocated and the only things written).

NOTE [ Convolution kernel arguments ]
Every kernel takes NCHW arrays and its geometry as pairs of ints, resolved by the caller
(``taifuse._conv_ops``): ``stride (sh, sw)``, ``padding (ph, pw)``, ``dilation (dh, dw)`` and, for
pooling, ``kernel_size (kh, kw)``. ``padding`` is the padding before the first row and column;
the output's size is ``out``'s shape (``grad_out``'s in a backward), so a padding that differs
on the two sides (``padding='same'`` with an even kernel, ``ceil_mode``) costs the kernels
nothing: a tap that falls outside the input reads zero (convolution), is skipped (max pooling)
or counts by the divisor rule (average pooling). Input row ``ih`` of output row ``oh`` and tap
``i`` is ``oh * sh - ph + i * dh`` (columns alike).

* ``conv2d``: ``x (N, C, H, W)``, ``w (OC, C // groups, KH, KW)``, ``b (OC,)`` or ``None``; output
  channel ``o`` of group ``g = o // (OC // groups)`` reads input channels
  ``g * C // groups ... (g + 1) * C // groups - 1``.
* ``max_pool2d`` writes the flat index ``ih * W + iw`` of each window's maximum into
  ``indices`` (the backend's index dtype: int64 on the host, int32 on taichi), as PyTorch's
  ``return_indices``; the first maximum in the window's row-major order wins, and a NaN wins over
  any number (the last NaN of the window), as PyTorch's CPU kernel.
* ``avg_pool2d``'s divisor is PyTorch's: with ``count_include_pad`` the window clipped to the
  padded input (``min(start + k, size + pad) - start`` per axis), else clipped to the input;
  ``divisor_override`` (0 for none) replaces it.
* ``adaptive_avg_pool2d``: output row ``oh`` averages input rows ``floor(oh * H / OH)`` to
  ``ceil((oh + 1) * H / OH) - 1`` (columns alike).
"""

from __future__ import annotations

import numpy as np

from taifuse.backends.reference.backward import _activation_grad, _relu_mask, _store_opt
from taifuse.backends.reference.batch_norm import batch_norm_backward, batch_norm_stats
from taifuse.backends.reference.forward import _activation, _f64, _store


def _taps(out_size: int, size: int, k: int, s: int, p: int, d: int) -> tuple[np.ndarray, np.ndarray]:
    """Input index ``(k, out_size)`` of every tap of every output position, and whether it is inside."""
    idx = np.arange(out_size)[None, :] * s - p + np.arange(k)[:, None] * d
    return np.clip(idx, 0, max(size - 1, 0)), (idx >= 0) & (idx < size)


def _im2col(x: np.ndarray, kh: int, kw: int, stride, padding, dilation, oh: int, ow: int) -> np.ndarray:
    """``(N, C, KH, KW, OH, OW)``: the input under every tap of every output position (0 outside)."""
    hi, hv = _taps(oh, x.shape[2], kh, stride[0], padding[0], dilation[0])
    wi, wv = _taps(ow, x.shape[3], kw, stride[1], padding[1], dilation[1])
    cols = x[:, :, hi[:, None, :, None], wi[None, :, None, :]]
    # A select, not a product with the mask: an outside tap reads a clipped index, whose inf or
    # NaN times 0 would be NaN.
    return np.where(hv[:, None, :, None] & wv[None, :, None, :], cols, 0.0)


def _col2im(cols: np.ndarray, shape, stride, padding, dilation) -> np.ndarray:
    """The adjoint of :func:`_im2col`: each tap's value added into the input position it read."""
    _n, _c, kh, kw, oh, ow = cols.shape
    hi, hv = _taps(oh, shape[2], kh, stride[0], padding[0], dilation[0])
    wi, wv = _taps(ow, shape[3], kw, stride[1], padding[1], dilation[1])
    grad = np.zeros(shape)
    mask = hv[:, None, :, None] & wv[None, :, None, :]
    for i in range(kh):
        for j in range(kw):
            rows, colsj = np.meshgrid(hi[i], wi[j], indexing="ij")
            keep = mask[i, j]
            np.add.at(grad, (slice(None), slice(None), rows[keep], colsj[keep]), cols[:, :, i, j][:, :, keep])
    return grad


def _grouped(cols: np.ndarray, groups: int) -> np.ndarray:
    """``(N, C, KH, KW, OH, OW)`` -> ``(N, groups, C // groups * KH * KW, OH * OW)``."""
    n, c, kh, kw, oh, ow = cols.shape
    return cols.reshape(n, groups, c // groups * kh * kw, oh * ow)


def conv2d(
    x: np.ndarray,
    w: np.ndarray,
    b: np.ndarray | None,
    stride: tuple[int, int],
    padding: tuple[int, int],
    dilation: tuple[int, int],
    groups: int,
    activation: str | None,
    out: np.ndarray,
    pre: np.ndarray | None = None,
) -> None:
    """out[n, o] = activation(sum_{c, i, j} w[o, c, i, j] * x[n, g*Cg + c, oh*sh - ph + i*dh, ow*sw - pw + j*dw] + b[o]).

    The arguments are NOTE [ Convolution kernel arguments ]'s. As ``linear_act``: with ``pre``,
    ``pre`` receives the convolution plus bias and ``out`` the activation of ``pre`` as stored.
    """
    n, oc, oh, ow = out.shape
    kh, kw = w.shape[2:]
    cols = _grouped(_im2col(_f64(x), kh, kw, stride, padding, dilation, oh, ow), groups)
    wg = _f64(w).reshape(groups, oc // groups, -1)
    y = np.einsum("gok,ngkp->ngop", wg, cols).reshape(n, oc, oh, ow)
    if b is not None:
        y = y + _f64(b)[:, None, None]
    if pre is not None:
        _store(pre, y)
        y = _f64(pre)
    _store(out, _activation(y, activation))


def conv2d_backward(
    x: np.ndarray,
    w: np.ndarray,
    pre: np.ndarray | None,
    grad_out: np.ndarray,
    stride: tuple[int, int],
    padding: tuple[int, int],
    dilation: tuple[int, int],
    groups: int,
    activation: str | None,
    grad_x: np.ndarray | None,
    grad_w: np.ndarray | None,
    grad_b: np.ndarray | None,
) -> None:
    """Backward of :func:`conv2d`: grad_pre = grad_out * activation'(pre) (``pre`` as ``linear_act_backward``
    takes it: ``None`` without an activation, the output for ``'relu'``), then grad_b[o] = sum of
    grad_pre over (n, oh, ow), grad_w = grad_pre correlated with the input, grad_x = the transposed
    convolution of grad_pre. An output passed as ``None`` is not computed.
    """
    g = _f64(grad_out)
    if activation == "relu":
        g = _relu_mask(_f64(pre), g)
    elif activation is not None:
        g = g * _activation_grad(_f64(pre), activation)
    n, oc, oh, ow = g.shape
    kh, kw = w.shape[2:]
    gg = g.reshape(n, groups, oc // groups, oh * ow)
    _store_opt(grad_b, g.sum(axis=(0, 2, 3)))
    if grad_w is not None:
        cols = _grouped(_im2col(_f64(x), kh, kw, stride, padding, dilation, oh, ow), groups)
        _store(grad_w, np.einsum("ngop,ngkp->gok", gg, cols).reshape(w.shape))
    if grad_x is not None:
        wg = _f64(w).reshape(groups, oc // groups, -1)
        cols = np.einsum("gok,ngop->ngkp", wg, gg).reshape(n, x.shape[1], kh, kw, oh, ow)
        _store(grad_x, _col2im(cols, x.shape, stride, padding, dilation))


# ----------------------------------------------------------------------------- Conv2d -> BatchNorm -> ReLU

# NOTE [ The fused Conv-BN-ReLU block in training ]
# The block y = conv2d(x, w) + b, out = act((y - mean) * invstd * bn_weight + bn_bias) with the batch
# statistics of y runs as three kernels over the activation instead of five: ``conv2d_stats``
# writes y and its per-channel statistics (the host's convolution accumulates them in its epilogue,
# while each block of y is still in cache; the device's in one pass over y), ``batch_norm_update``
# turns them into invstd and moves the running statistics, and ``batch_norm_elemt`` normalizes,
# applies the affine map and the ReLU in one pass. The backward, ``conv2d_batch_norm_backward``,
# reads y and grad_out once for the per-channel sums and once more to form the convolution's
# grad_pre (batch norm's input gradient) straight into the layout the convolution's products read,
# so batch norm's input gradient is never stored and read back. Only x, y and the (mean, invstd)
# are kept for it, as batch norm's own backward.


def conv2d_stats(
    x: np.ndarray,
    w: np.ndarray,
    b: np.ndarray | None,
    stride: tuple[int, int],
    padding: tuple[int, int],
    dilation: tuple[int, int],
    groups: int,
    out: np.ndarray,
    mean: np.ndarray,
    var: np.ndarray,
) -> None:
    """``out = conv2d(x, w, b)`` (no activation) and the per-channel mean and biased variance of
    ``out`` as stored, over (N, OH, OW), as ``batch_norm_stats`` computes them (``N * OH * OW > 0``).

    The arguments are :func:`conv2d`'s and ``batch_norm_stats``'; NOTE [ The fused Conv-BN-ReLU
    block in training ].
    """
    conv2d(x, w, b, stride, padding, dilation, groups, None, out)
    n, oc = out.shape[:2]
    batch_norm_stats(out.reshape(n, oc, -1), mean, var)


def conv2d_batch_norm_backward(
    x: np.ndarray,
    w: np.ndarray,
    y: np.ndarray,
    grad_out: np.ndarray,
    mean: np.ndarray,
    invstd: np.ndarray,
    bn_weight: np.ndarray | None,
    bn_bias: np.ndarray | None,
    activation: str | None,
    stride: tuple[int, int],
    padding: tuple[int, int],
    dilation: tuple[int, int],
    groups: int,
    grad_x: np.ndarray | None,
    grad_w: np.ndarray | None,
    grad_b: np.ndarray | None,
    grad_bn_weight: np.ndarray | None,
    grad_bn_bias: np.ndarray | None,
) -> None:
    """Backward of the training-mode block: ``y = conv2d(x, w) + b`` (saved), then
    ``batch_norm_elemt(y, mean, invstd, bn_weight, bn_bias, activation)`` with y's batch statistics.

    grad_y is ``batch_norm_backward``'s input gradient in training (kept in float64 here, never
    rounded to y's dtype), then grad_x and grad_w are ``conv2d_backward``'s of grad_y without an
    activation. grad_b is exactly 0: batch norm subtracts the batch mean of y, which absorbs any
    per-channel constant (the sum of grad_y over a channel is 0 in exact arithmetic; an unfused
    composition returns its rounding error). Any gradient may be None (not computed).
    """
    n, oc = y.shape[:2]
    _store_opt(grad_b, np.zeros(oc))
    needs_y = grad_x is not None or grad_w is not None
    gy = np.empty(y.shape) if needs_y else None
    batch_norm_backward(
        y.reshape(n, oc, -1), grad_out.reshape(n, oc, -1), mean, invstd, bn_weight, bn_bias, activation,
        True, None if gy is None else gy.reshape(n, oc, -1), grad_bn_weight, grad_bn_bias,
    )  # fmt: skip
    if needs_y:
        conv2d_backward(x, w, None, gy, stride, padding, dilation, groups, None, grad_x, grad_w, None)


# ----------------------------------------------------------------------------- pooling


def max_pool2d(
    x: np.ndarray,
    kernel_size: tuple[int, int],
    stride: tuple[int, int],
    padding: tuple[int, int],
    dilation: tuple[int, int],
    out: np.ndarray,
    indices: np.ndarray,
) -> None:
    """out[n, c, oh, ow] = the maximum of x over the window's taps inside the input; ``indices``
    its flat position ``ih * W + iw`` (NOTE [ Convolution kernel arguments ])."""
    xv = _f64(x)
    _, _, h, w = xv.shape
    oh, ow = out.shape[2:]
    hi, hv = _taps(oh, h, kernel_size[0], stride[0], padding[0], dilation[0])
    wi, wv = _taps(ow, w, kernel_size[1], stride[1], padding[1], dilation[1])
    best = np.full(out.shape, -np.inf)
    where = np.full(out.shape, -1, dtype=np.int64)
    for i in range(kernel_size[0]):
        for j in range(kernel_size[1]):
            val = xv[:, :, hi[i][:, None], wi[j][None, :]]
            inside = hv[i][:, None] & wv[j][None, :]
            flat = hi[i][:, None] * w + wi[j][None, :]
            take = inside & ((where < 0) | (val > best) | np.isnan(val))
            best = np.where(take, val, best)
            where = np.where(take, flat, where)
    _store(out, best)
    indices[...] = where


def max_pool2d_backward(
    indices: np.ndarray,
    grad_out: np.ndarray,
    kernel_size: tuple[int, int],
    stride: tuple[int, int],
    padding: tuple[int, int],
    dilation: tuple[int, int],
    grad_x: np.ndarray,
) -> None:
    """grad_x[n, c, p] = sum of grad_out over the windows whose maximum was at flat position ``p``."""
    n, c, h, w = grad_x.shape
    grad = np.zeros((n * c, h * w))
    rows = np.repeat(np.arange(n * c), indices[0, 0].size)
    np.add.at(grad, (rows, np.asarray(indices, dtype=np.int64).reshape(-1)), _f64(grad_out).reshape(-1))
    _store(grad_x, grad.reshape(grad_x.shape))


def _avg_windows(out_size: int, size: int, k: int, s: int, p: int, count_include_pad: bool):
    """Per output position: the first and one-past-last input index of its window, and its divisor."""
    start = np.arange(out_size) * s - p
    end = np.minimum(start + k, size + p)
    padded = end - start
    start, end = np.maximum(start, 0), np.minimum(end, size)
    return start, end, padded if count_include_pad else end - start


def _adaptive_windows(out_size: int, size: int):
    o = np.arange(out_size)
    start = (o * size) // out_size
    end = -((-(o + 1) * size) // out_size)
    return start, end, end - start


def _window_matrix(start: np.ndarray, end: np.ndarray, size: int) -> np.ndarray:
    """``(out_size, size)``: 1 where input index i lies in output position o's window."""
    i = np.arange(size)[None, :]
    return ((i >= start[:, None]) & (i < end[:, None])).astype(np.float64)


def _window_mean(x, hwin, wwin, divisor: float) -> np.ndarray:
    (hs, he, hd), (ws, we, wd) = hwin, wwin
    mh, mw = _window_matrix(hs, he, x.shape[2]), _window_matrix(ws, we, x.shape[3])
    div = divisor if divisor else hd[:, None] * wd[None, :]
    return np.einsum("ai,ncij,bj->ncab", mh, x, mw) / div


def _window_mean_backward(g, hwin, wwin, divisor: float, shape) -> np.ndarray:
    (hs, he, hd), (ws, we, wd) = hwin, wwin
    mh, mw = _window_matrix(hs, he, shape[2]), _window_matrix(ws, we, shape[3])
    div = divisor if divisor else hd[:, None] * wd[None, :]
    return np.einsum("ai,ncab,bj->ncij", mh, g / div, mw)


def avg_pool2d(
    x: np.ndarray,
    kernel_size: tuple[int, int],
    stride: tuple[int, int],
    padding: tuple[int, int],
    count_include_pad: bool,
    divisor_override: int,
    out: np.ndarray,
) -> None:
    """out[n, c, oh, ow] = the sum of x over the window inside the input / the divisor (NOTE
    [ Convolution kernel arguments ])."""
    oh, ow = out.shape[2:]
    hwin = _avg_windows(oh, x.shape[2], kernel_size[0], stride[0], padding[0], count_include_pad)
    wwin = _avg_windows(ow, x.shape[3], kernel_size[1], stride[1], padding[1], count_include_pad)
    _store(out, _window_mean(_f64(x), hwin, wwin, divisor_override))


def avg_pool2d_backward(
    grad_out: np.ndarray,
    kernel_size: tuple[int, int],
    stride: tuple[int, int],
    padding: tuple[int, int],
    count_include_pad: bool,
    divisor_override: int,
    grad_x: np.ndarray,
) -> None:
    """grad_x[n, c, ih, iw] = the sum of grad_out / divisor over the windows that hold (ih, iw)."""
    oh, ow = grad_out.shape[2:]
    h, w = grad_x.shape[2:]
    hwin = _avg_windows(oh, h, kernel_size[0], stride[0], padding[0], count_include_pad)
    wwin = _avg_windows(ow, w, kernel_size[1], stride[1], padding[1], count_include_pad)
    _store(grad_x, _window_mean_backward(_f64(grad_out), hwin, wwin, divisor_override, grad_x.shape))


def adaptive_avg_pool2d(x: np.ndarray, out: np.ndarray) -> None:
    """out[n, c, oh, ow] = the mean of x over PyTorch's adaptive window (NOTE [ Convolution kernel arguments ])."""
    oh, ow = out.shape[2:]
    hwin, wwin = _adaptive_windows(oh, x.shape[2]), _adaptive_windows(ow, x.shape[3])
    _store(out, _window_mean(_f64(x), hwin, wwin, 0))


def adaptive_avg_pool2d_backward(grad_out: np.ndarray, grad_x: np.ndarray) -> None:
    """grad_x[n, c, ih, iw] = the sum of grad_out / window size over the windows that hold (ih, iw)."""
    oh, ow = grad_out.shape[2:]
    hwin, wwin = _adaptive_windows(oh, grad_x.shape[2]), _adaptive_windows(ow, grad_x.shape[3])
    _store(grad_x, _window_mean_backward(_f64(grad_out), hwin, wwin, 0, grad_x.shape))
