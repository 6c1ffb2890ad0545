"""The NumPy reference backend's backward and loss kernels (``taifuse.backends.BACKWARD_KERNEL_NAMES``).

The specification of the autograd layer's kernels, written like the forward ones (``forward.py``).
"""

from __future__ import annotations

import math

import numpy as np

from taifuse.backends._spec import ACTIVATIONS
from taifuse.backends.reference.forward import (
    _SQRT_2_OVER_PI,
    _erf,
    _f64,
    _sigmoid,
    _store,
    dropout,
)

# =============================================================================================
# Backward and loss kernels (the autograd layer's kernels, ``taifuse.backends.BACKWARD_KERNEL_NAMES``)
# =============================================================================================
# Same conventions as the forward kernels: float64 math, one rounding into each output buffer,
# preallocated outputs, no allocation of results. ``tensor.py`` owns the graph; these only compute.
#
# What each backward reads (chosen so that the forward never has to store more than PyTorch does):
# * gelu, relu, leaky_relu, silu: the forward INPUT ``x``.
# * sigmoid, tanh: the forward OUTPUT ``y`` (their derivatives are functions of y).
# * add_relu: the forward output; mul_relu: both inputs.
# * linear_act: the pre-activation ``pre = x @ w.T + b``, which the forward keeps when gradients
#   are needed (as PyTorch keeps the input of the activation); for ``'relu'`` the forward output
#   works as well, since relu(pre) > 0 exactly where pre > 0. ``None`` needs no ``pre``.
# * softmax: its output; log_softmax: its output (log-probabilities).
# * layer_norm: ``x`` and the ``mean``/``rstd`` the forward wrote; rms_norm: ``x`` and ``rstd``.
# * embedding: the indices and the padding row; no forward output.
# * dropout: nothing but ``p`` and ``seed``: the mask is regenerated (NOTE [ Counter-based dropout ]).
# * cross_entropy: the logits and the per-row log-sum-exp ``lse`` the forward wrote.
# An optional gradient output passed as ``None`` is not computed.

LOSS_REDUCTIONS = ("none", "mean", "sum")


def _phi(x: np.ndarray) -> np.ndarray:
    return np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)


def _gelu_grad(x: np.ndarray, approximate: str) -> np.ndarray:
    if approximate == "tanh":
        k = _SQRT_2_OVER_PI
        t = np.tanh(k * (x + 0.044715 * x * x * x))
        return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * x * x)
    return 0.5 * (1.0 + _erf(x / math.sqrt(2.0))) + x * _phi(x)


def _activation_grad(pre: np.ndarray, activation: str | None) -> np.ndarray:
    """d activation(pre) / d pre."""
    if activation is None:
        return np.ones_like(pre)
    if activation == "relu":
        # NaN passes (its comparison with 0 is False); linear_act_backward masks with a where.
        return np.where(pre <= 0, 0.0, 1.0)
    if activation == "gelu":
        return _gelu_grad(pre, "none")
    if activation == "gelu_tanh":
        return _gelu_grad(pre, "tanh")
    if activation == "silu":
        s = _sigmoid(pre)
        return s * (1.0 + pre * (1.0 - s))
    raise ValueError(f"activation should be one of {ACTIVATIONS}, got {activation!r}")


def _relu_mask(v: np.ndarray, g: np.ndarray) -> np.ndarray:
    """g where relu passes it (v > 0 or NaN: PyTorch masks only where v <= 0), else 0."""
    return np.where(v <= 0, 0.0, g)


def _store_opt(out: np.ndarray | None, value: np.ndarray) -> None:
    if out is not None:
        _store(out, value)


# ----------------------------------------------------------------------------- elementwise backward


def gelu_backward(x: np.ndarray, grad_out: np.ndarray, grad_in: np.ndarray, approximate: str) -> None:
    """grad_in = grad_out * gelu'(x).

    ``'none'``: gelu'(x) = Phi(x) + x * phi(x), phi the standard normal density.
    ``'tanh'``: with u = sqrt(2/pi) * (x + 0.044715 x^3) and t = tanh(u),
    gelu'(x) = (1 + t) / 2 + x / 2 * (1 - t^2) * sqrt(2/pi) * (1 + 3 * 0.044715 x^2).
    """
    _store(grad_in, _f64(grad_out) * _gelu_grad(_f64(x), approximate))


def relu_backward(x: np.ndarray, grad_out: np.ndarray, grad_in: np.ndarray) -> None:
    """grad_in = 0 where x <= 0, else grad_out, as PyTorch's threshold backward: the gradient at
    0 is 0, a NaN input passes grad_out through, and a masked entry is 0 even where grad_out is
    not finite (a select, not a product)."""
    _store(grad_in, _relu_mask(_f64(x), _f64(grad_out)))


def leaky_relu_backward(
    x: np.ndarray, grad_out: np.ndarray, grad_in: np.ndarray, negative_slope: float
) -> None:
    """grad_in = grad_out if x > 0 else negative_slope * grad_out."""
    g = _f64(grad_out)
    _store(grad_in, np.where(_f64(x) > 0, g, negative_slope * g))


def silu_backward(x: np.ndarray, grad_out: np.ndarray, grad_in: np.ndarray) -> None:
    """grad_in = grad_out * s * (1 + x * (1 - s)), s = sigmoid(x)."""
    _store(grad_in, _f64(grad_out) * _activation_grad(_f64(x), "silu"))


def sigmoid_backward(y: np.ndarray, grad_out: np.ndarray, grad_in: np.ndarray) -> None:
    """grad_in = grad_out * y * (1 - y), ``y`` the forward output sigmoid(x)."""
    y = _f64(y)
    _store(grad_in, _f64(grad_out) * y * (1.0 - y))


def tanh_backward(y: np.ndarray, grad_out: np.ndarray, grad_in: np.ndarray) -> None:
    """grad_in = grad_out * (1 - y^2), ``y`` the forward output tanh(x)."""
    y = _f64(y)
    _store(grad_in, _f64(grad_out) * (1.0 - y * y))


def add_relu_backward(y: np.ndarray, grad_out: np.ndarray, grad_in: np.ndarray) -> None:
    """grad_in = 0 where y = relu(a + b) <= 0, else grad_out (NaN passes, as relu_backward): the
    gradient of both ``a`` and ``b``."""
    _store(grad_in, _relu_mask(_f64(y), _f64(grad_out)))


def mul_relu_backward(
    a: np.ndarray,
    b: np.ndarray,
    grad_out: np.ndarray,
    grad_a: np.ndarray | None,
    grad_b: np.ndarray | None,
) -> None:
    """With gm = grad_out masked to 0 where a * b <= 0 (relu_backward's mask: NaN passes):
    grad_a = gm * b, grad_b = gm * a, as PyTorch differentiates relu(a * b)."""
    a, b = _f64(a), _f64(b)
    g = _relu_mask(a * b, _f64(grad_out))
    _store_opt(grad_a, g * b)
    _store_opt(grad_b, g * a)


def affine_backward(
    x: np.ndarray,
    scale: np.ndarray,
    grad_out: np.ndarray,
    grad_x: np.ndarray | None,
    grad_scale: np.ndarray | None,
    grad_bias: np.ndarray | None,
) -> None:
    """For ``out = x * scale + bias`` with ``x (R, C)``: grad_x = grad_out * scale,
    grad_scale[c] = sum_r grad_out[r, c] * x[r, c], grad_bias[c] = sum_r grad_out[r, c]."""
    g = _f64(grad_out)
    _store_opt(grad_x, g * _f64(scale))
    if grad_scale is not None:
        _store(grad_scale, (g * _f64(x)).sum(axis=0))
    if grad_bias is not None:
        _store(grad_bias, g.sum(axis=0))


# ----------------------------------------------------------------------------- fused linear backward


def linear_act_backward(
    x: np.ndarray,
    w: np.ndarray,
    pre: np.ndarray | None,
    grad_out: np.ndarray,
    activation: str | None,
    grad_pre: np.ndarray | None,
    grad_x: np.ndarray | None,
    grad_w: np.ndarray | None,
    grad_b: np.ndarray | None,
) -> None:
    """Backward of ``out = activation(pre)``, ``pre = x @ w.T + b``, for ``x (N, K)``, ``w (M, K)``.

    One fused pass over ``(N, M)`` forms grad_pre = grad_out * activation'(pre) and
    grad_b[m] = sum_n grad_pre[n, m]; then two matrix products give grad_x = grad_pre @ w
    ``(N, K)`` and grad_w = grad_pre.T @ x ``(M, K)``. ``pre`` may be ``None`` when ``activation``
    is ``None``; for ``'relu'`` it may be the forward output. ``grad_pre`` ``(N, M)`` (dtype of
    ``x``) is scratch the caller may provide for that intermediate, or ``None``: the kernel then
    takes what scratch it needs from the pool (none where it has no use for it: no activation, or
    numba's float16 blocks). Its content afterwards is unspecified (here it holds grad_pre; the
    products use the unrounded float64 values).
    """
    g = _f64(grad_out)
    if activation == "relu":
        g = _relu_mask(_f64(pre), g)  # a select: a masked inf or NaN gradient is 0, as in PyTorch
    elif activation is not None:
        g = g * _activation_grad(_f64(pre), activation)
    _store_opt(grad_pre, g)
    _store_opt(grad_b, g.sum(axis=0))
    _store_opt(grad_x, g @ _f64(w))
    _store_opt(grad_w, g.T @ _f64(x))


# ----------------------------------------------------------------------------- row reductions backward


def softmax_backward(y: np.ndarray, grad_out: np.ndarray, grad_in: np.ndarray) -> None:
    """grad_in = y * (grad_out - sum_c(grad_out * y)) over axis 1 of ``(A, C, B)``, ``y`` = softmax(x)."""
    y, g = _f64(y), _f64(grad_out)
    _store(grad_in, y * (g - (g * y).sum(axis=1, keepdims=True)))


def log_softmax_backward(y: np.ndarray, grad_out: np.ndarray, grad_in: np.ndarray) -> None:
    """grad_in = grad_out - exp(y) * sum_c(grad_out) over axis 1 of ``(A, C, B)``, ``y`` = log_softmax(x)."""
    g = _f64(grad_out)
    _store(grad_in, g - np.exp(_f64(y)) * g.sum(axis=1, keepdims=True))


def layer_norm_backward(
    x: np.ndarray,
    weight: np.ndarray | None,
    mean: np.ndarray,
    rstd: np.ndarray,
    grad_out: np.ndarray,
    grad_x: np.ndarray | None,
    grad_weight: np.ndarray | None,
    grad_bias: np.ndarray | None,
) -> None:
    """Backward of :func:`layer_norm` over rows of ``x (R, D)``, from the forward's ``mean``/``rstd``.

    With xhat = (x - mean) * rstd and gy = grad_out * weight (grad_out without a weight):
    grad_x = rstd * (gy - mean_d(gy) - xhat * mean_d(gy * xhat)),
    grad_weight[d] = sum_r grad_out * xhat, grad_bias[d] = sum_r grad_out.
    """
    g = _f64(grad_out)
    mu = _f64(mean).reshape(-1, 1)
    r = _f64(rstd).reshape(-1, 1)
    xhat = (_f64(x) - mu) * r
    gy = g * _f64(weight) if weight is not None else g
    if grad_x is not None:
        _store(
            grad_x,
            r * (gy - gy.mean(axis=1, keepdims=True) - xhat * (gy * xhat).mean(axis=1, keepdims=True)),
        )
    if grad_weight is not None:
        _store(grad_weight, (g * xhat).sum(axis=0))
    if grad_bias is not None:
        _store(grad_bias, g.sum(axis=0))


def rms_norm_backward(
    x: np.ndarray,
    weight: np.ndarray | None,
    rstd: np.ndarray,
    grad_out: np.ndarray,
    grad_x: np.ndarray | None,
    grad_weight: np.ndarray | None,
) -> None:
    """Backward of :func:`rms_norm` over rows of ``x (R, D)``, from the forward's ``rstd``.

    With xhat = x * rstd and gy = grad_out * weight (grad_out without a weight):
    grad_x = rstd * (gy - xhat * mean_d(gy * xhat)), grad_weight[d] = sum_r grad_out * xhat.
    """
    g = _f64(grad_out)
    r = _f64(rstd).reshape(-1, 1)
    xhat = _f64(x) * r
    gy = g * _f64(weight) if weight is not None else g
    if grad_x is not None:
        _store(grad_x, r * (gy - xhat * (gy * xhat).mean(axis=1, keepdims=True)))
    if grad_weight is not None:
        _store(grad_weight, (g * xhat).sum(axis=0))


def embedding_backward(
    indices: np.ndarray, grad_out: np.ndarray, grad_weight: np.ndarray, padding_idx: int
) -> None:
    """Backward of :func:`embedding`: grad_weight[v] = sum over n with indices[n] == v of grad_out[n].

    A scatter-add into ``grad_weight (V, D)`` (every row written, zero where no index points),
    accumulating repeated indices; the row ``padding_idx`` (in ``[0, V)``, or -1 for none) stays
    zero, as PyTorch's. ``indices (N,)``, ``grad_out (N, D)``.
    """
    acc = np.zeros(grad_weight.shape, np.float64)
    np.add.at(acc, np.asarray(indices, dtype=np.int64), _f64(grad_out))
    if padding_idx >= 0:
        acc[padding_idx] = 0.0
    _store(grad_weight, acc)


def dropout_backward(grad_out: np.ndarray, grad_in: np.ndarray, p: float, seed: int) -> None:
    """grad_in = grad_out * (keep / (1 - p)) with the forward's mask, regenerated from ``seed``.

    This is :func:`dropout` applied to ``grad_out``: the mask depends only on the element index
    and the seed (NOTE [ Counter-based dropout ] in ``taifuse/_random.py``).
    """
    dropout(grad_out, grad_in, p, seed)


# ----------------------------------------------------------------------------- losses


def _reduce_loss(loss: np.ndarray, reduction: str) -> np.ndarray:
    if reduction == "none":
        return loss
    total = loss.sum()
    return np.array([total / loss.size if reduction == "mean" else total])


def _loss_grad_scale(grad_out: np.ndarray, reduction: str, count: int) -> np.ndarray:
    """The upstream gradient of each element's loss: grad_out itself, or its one value (/ count for mean)."""
    g = _f64(grad_out)
    if reduction == "none":
        return g
    return g.reshape(()) / count if reduction == "mean" else g.reshape(())


def mse_loss(input: np.ndarray, target: np.ndarray, out: np.ndarray, reduction: str) -> None:
    """loss = (input - target)^2 elementwise; ``'mean'``/``'sum'`` reduce it into ``out`` of shape ``(1,)``.

    ``input`` and ``target`` have equal shapes; with ``'none'`` ``out`` has that shape too.
    """
    d = _f64(input) - _f64(target)
    _store(out, _reduce_loss(d * d, reduction))


def mse_loss_backward(
    input: np.ndarray, target: np.ndarray, grad_out: np.ndarray, grad_in: np.ndarray, reduction: str
) -> None:
    """grad_in = 2 * (input - target) * g, g = grad_out (``'none'``), grad_out[0] (``'sum'``) or
    grad_out[0] / input.size (``'mean'``). The target's gradient is -grad_in."""
    g = _loss_grad_scale(grad_out, reduction, input.size)
    _store(grad_in, 2.0 * (_f64(input) - _f64(target)) * g)


def cross_entropy(
    logits: np.ndarray, target: np.ndarray, out: np.ndarray, reduction: str, lse: np.ndarray
) -> None:
    """loss[n] = lse[n] - logits[n, target[n]], lse[n] = log(sum_c exp(logits[n, c])).

    ``logits (N, C)``, ``target (N,)`` int64 class indices in ``[0, C)`` (checked by the caller).
    ``out`` is ``(N,)`` for ``'none'``, else ``(1,)`` holding the sum or the mean over N.
    ``lse`` ``(N,)`` (float32; float64 for float64 logits) is written for the backward pass.
    """
    x = _f64(logits)
    m = x.max(axis=1, keepdims=True)
    row_lse = (m + np.log(np.exp(x - m).sum(axis=1, keepdims=True)))[:, 0]
    picked = x[np.arange(x.shape[0]), np.asarray(target, dtype=np.int64)]
    _store(lse, row_lse)
    _store(out, _reduce_loss(row_lse - picked, reduction))


def cross_entropy_backward(
    logits: np.ndarray,
    target: np.ndarray,
    lse: np.ndarray,
    grad_out: np.ndarray,
    grad_in: np.ndarray,
    reduction: str,
) -> None:
    """The fused log_softmax + nll backward: grad_in[n, c] = g[n] * (softmax(logits)[n, c] - [c == target[n]]).

    softmax is exp(logits - lse) from the forward's ``lse``; g[n] = grad_out[n] (``'none'``),
    grad_out[0] (``'sum'``) or grad_out[0] / N (``'mean'``).
    """
    x = _f64(logits)
    n = x.shape[0]
    g = _loss_grad_scale(grad_out, reduction, n)
    p = np.exp(x - _f64(lse).reshape(-1, 1))
    p[np.arange(n), np.asarray(target, dtype=np.int64)] -= 1.0
    _store(grad_in, p * (g.reshape(-1, 1) if g.ndim else g))
