"""The NumPy reference backend: the living specification of every kernel.

Written for clarity, never for speed: every kernel computes in float64 and rounds once into
``out``. Every other backend is tested against this module.

Kernel conventions (shared by all backends, see ``taifuse.backends.KERNEL_NAMES``):

* Inputs are C-contiguous arrays of the backend's array type; ``out`` is preallocated by the
  caller with the right shape and dtype and is the only thing written. Kernels never allocate
  results and know nothing of autograd.
* Elementwise kernels take arrays of any shape; ``a``/``b`` of binary ops have equal shapes
  (``taifuse.functional`` broadcasts before calling).
* ``softmax`` / ``log_softmax`` take 3-D views ``(A, C, B)`` and reduce over axis 1, so any
  ``dim`` is handled without a transpose (``dim=-1`` is ``B == 1``).
* ``layer_norm`` takes ``x (R, D)`` and normalizes rows; ``affine`` takes ``x (R, C)``.
* ``linear_act`` takes 2-D ``x (N, K)``, ``w (M, K)`` (PyTorch's ``(out, in)``), ``b (M,)`` or
  ``None`` and writes ``out (N, M)``.
"""

from __future__ import annotations

import math

import numpy as np

from taifuse.backends._host import check_dtype, empty, from_numpy, is_array, to_numpy  # noqa: F401

NAME = "numpy"

ACTIVATIONS = (None, "relu", "gelu", "gelu_tanh", "silu")
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_erf = np.vectorize(math.erf, otypes=[np.float64])


def init() -> None:
    """Nothing to start: NumPy is always there."""


def describe() -> dict:
    return {"backend": NAME, "numpy": np.__version__}


def _f64(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, dtype=np.float64)


def _store(out: np.ndarray, value: np.ndarray) -> None:
    out[...] = value  # one rounding, float64 -> out.dtype


# ----------------------------------------------------------------------------- math in float64


def _sigmoid(x: np.ndarray) -> np.ndarray:
    e = np.exp(-np.abs(x))  # never overflows
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def _gelu(x: np.ndarray, approximate: str) -> np.ndarray:
    if approximate == "tanh":
        return 0.5 * x * (1.0 + np.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)))
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))


def _activation(y: np.ndarray, activation: str | None) -> np.ndarray:
    if activation is None:
        return y
    if activation == "relu":
        return np.maximum(y, 0.0)
    if activation == "gelu":
        return _gelu(y, "none")
    if activation == "gelu_tanh":
        return _gelu(y, "tanh")
    if activation == "silu":
        return y * _sigmoid(y)
    raise ValueError(f"activation should be one of {ACTIVATIONS}, got {activation!r}")


# ----------------------------------------------------------------------------- elementwise


def gelu(x: np.ndarray, out: np.ndarray, approximate: str) -> None:
    """out = x * Phi(x) (``'none'``) or its tanh approximation (``'tanh'``), as ``torch.nn.functional.gelu``."""
    _store(out, _gelu(_f64(x), approximate))


def relu(x: np.ndarray, out: np.ndarray) -> None:
    """out = max(x, 0); NaN propagates."""
    _store(out, np.maximum(_f64(x), 0.0))


def leaky_relu(x: np.ndarray, out: np.ndarray, negative_slope: float) -> None:
    """out = x if x > 0 else negative_slope * x."""
    x = _f64(x)
    _store(out, np.where(x > 0, x, negative_slope * x))


def silu(x: np.ndarray, out: np.ndarray) -> None:
    """out = x * sigmoid(x)."""
    x = _f64(x)
    _store(out, x * _sigmoid(x))


def sigmoid(x: np.ndarray, out: np.ndarray) -> None:
    """out = 1 / (1 + exp(-x)), evaluated without overflow."""
    _store(out, _sigmoid(_f64(x)))


def tanh(x: np.ndarray, out: np.ndarray) -> None:
    _store(out, np.tanh(_f64(x)))


def add_relu(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """out = max(a + b, 0)."""
    _store(out, np.maximum(_f64(a) + _f64(b), 0.0))


def mul_relu(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """out = max(a * b, 0)."""
    _store(out, np.maximum(_f64(a) * _f64(b), 0.0))


def affine(x: np.ndarray, scale: np.ndarray, bias: np.ndarray, out: np.ndarray) -> None:
    """out[r, c] = x[r, c] * scale[c] + bias[c] for ``x (R, C)``, ``scale (C,)``, ``bias (C,)``."""
    _store(out, _f64(x) * _f64(scale) + _f64(bias))


# ----------------------------------------------------------------------------- fused linear


def linear_act(
    x: np.ndarray,
    w: np.ndarray,
    b: np.ndarray | None,
    activation: str | None,
    out: np.ndarray,
    pre: np.ndarray | None = None,
) -> None:
    """out = activation(x @ w.T + b), with ``w`` of shape ``(out_features, in_features)``.

    With ``pre`` (the autograd path, which keeps the pre-activation for the backward), ``pre``
    receives ``x @ w.T + b`` and ``out`` the activation of ``pre`` as stored (rounded to its dtype),
    exactly as a linear without activation followed by the activation op would compute them.
    """
    y = _f64(x) @ _f64(w).T
    if b is not None:
        y = y + _f64(b)
    if pre is not None:
        _store(pre, y)
        y = _f64(pre)
    _store(out, _activation(y, activation))


# ----------------------------------------------------------------------------- row reductions


def softmax(x: np.ndarray, out: np.ndarray) -> None:
    """out = exp(x - max) / sum(exp(x - max)) over axis 1 of ``x (A, C, B)``."""
    x = _f64(x)
    e = np.exp(x - x.max(axis=1, keepdims=True))
    _store(out, e / e.sum(axis=1, keepdims=True))


def log_softmax(x: np.ndarray, out: np.ndarray) -> None:
    """out = x - max - log(sum(exp(x - max))) over axis 1 of ``x (A, C, B)``."""
    x = _f64(x)
    shifted = x - x.max(axis=1, keepdims=True)
    _store(out, shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True)))


def layer_norm(
    x: np.ndarray,
    weight: np.ndarray | None,
    bias: np.ndarray | None,
    eps: float,
    out: np.ndarray,
    mean: np.ndarray,
    rstd: np.ndarray,
) -> None:
    """Normalize each row of ``x (R, D)`` over its last axis.

    out = (x - mean) * rstd * weight + bias, with the biased variance and
    rstd = 1 / sqrt(var + eps). ``mean`` and ``rstd`` (shape ``(R,)``) are written for the
    backward pass.
    """
    x = _f64(x)
    mu = x.mean(axis=-1, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=-1, keepdims=True)
    r = 1.0 / np.sqrt(var + eps)
    y = (x - mu) * r
    if weight is not None:
        y = y * _f64(weight)
    if bias is not None:
        y = y + _f64(bias)
    _store(out, y)
    _store(mean, mu.reshape(mean.shape))
    _store(rstd, r.reshape(rstd.shape))


# ----------------------------------------------------------------------------- dropout
# See NOTE [ Counter-based dropout ] in taifuse/_random.py.

_MASK32 = 0xFFFFFFFF


def hash32(v):
    """A bijective 32-bit integer mixer ("lowbias32"); works on Python ints and uint32 arrays."""
    if isinstance(v, np.ndarray):
        v = v.astype(np.uint32)
        v ^= v >> 16
        v *= np.uint32(0x7FEB352D)
        v ^= v >> 15
        v *= np.uint32(0x846CA68B)
        v ^= v >> 16
        return v
    v &= _MASK32
    v ^= v >> 16
    v = (v * 0x7FEB352D) & _MASK32
    v ^= v >> 15
    v = (v * 0x846CA68B) & _MASK32
    v ^= v >> 16
    return v


def dropout_key(seed: int) -> int:
    """The per-launch key that element indices are xored with before hashing."""
    return hash32(int(seed))


def dropout_threshold(p: float) -> int:
    """Element i is kept iff ``hash32(i ^ key) >> 8 >= threshold``: probability 1 - p in 2**-24 steps."""
    return int(math.ceil(p * (1 << 24)))


def dropout_scale(p: float) -> float:
    return 0.0 if p >= 1.0 else 1.0 / (1.0 - p)


def dropout(x: np.ndarray, out: np.ndarray, p: float, seed: int) -> None:
    """out = x * (keep / (1 - p)), keep drawn from the counter hash of (element index, seed).

    A dropped NaN stays NaN (x * 0), as in PyTorch.
    """
    idx = np.arange(x.size, dtype=np.uint64).astype(np.uint32)
    keep = (hash32(idx ^ np.uint32(dropout_key(seed))) >> 8) >= dropout_threshold(p)
    _store(out, _f64(x) * np.where(keep.reshape(x.shape), dropout_scale(p), 0.0))


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
# * layer_norm: ``x`` and the ``mean``/``rstd`` the forward wrote.
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
        return (pre > 0).astype(np.float64)
    if activation == "gelu":
        return _gelu_grad(pre, "none")
    if activation == "gelu_tanh":
        return _gelu_grad(pre, "tanh")
    if activation == "silu":
        s = _sigmoid(pre)
        return s * (1.0 + pre * (1.0 - s))
    raise ValueError(f"activation should be one of {ACTIVATIONS}, got {activation!r}")


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
    """grad_in = grad_out where x > 0, else 0 (the gradient at 0 is 0, as in PyTorch)."""
    _store(grad_in, np.where(_f64(x) > 0, _f64(grad_out), 0.0))


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
    """grad_in = grad_out where y = relu(a + b) > 0, else 0: the gradient of both ``a`` and ``b``."""
    _store(grad_in, np.where(_f64(y) > 0, _f64(grad_out), 0.0))


def mul_relu_backward(
    a: np.ndarray,
    b: np.ndarray,
    grad_out: np.ndarray,
    grad_a: np.ndarray | None,
    grad_b: np.ndarray | None,
) -> None:
    """With m = (a * b > 0): grad_a = grad_out * m * b, grad_b = grad_out * m * a."""
    a, b = _f64(a), _f64(b)
    g = np.where(a * b > 0, _f64(grad_out), 0.0)
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
    grad_pre: np.ndarray,
    grad_x: np.ndarray | None,
    grad_w: np.ndarray | None,
    grad_b: np.ndarray | None,
) -> None:
    """Backward of ``out = activation(pre)``, ``pre = x @ w.T + b``, for ``x (N, K)``, ``w (M, K)``.

    One fused pass over ``(N, M)`` forms grad_pre = grad_out * activation'(pre) and
    grad_b[m] = sum_n grad_pre[n, m]; then two matrix products give grad_x = grad_pre @ w
    ``(N, K)`` and grad_w = grad_pre.T @ x ``(M, K)``. ``pre`` may be ``None`` when ``activation``
    is ``None``; for ``'relu'`` it may be the forward output. ``grad_pre`` ``(N, M)`` (dtype of
    ``x``) is scratch the caller provides for that intermediate; its content afterwards is
    unspecified (here it holds grad_pre; the products use the unrounded float64 values).
    """
    g = _f64(grad_out)
    if activation is not None:
        g = g * _activation_grad(_f64(pre), activation)
    _store(grad_pre, g)
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

# The fused optimizer kernels of taifuse.optim (OPTIM_KERNEL_NAMES), specified there.
from taifuse.backends._optim_reference import adam_step, all_finite, lion_step, sgd_step  # noqa: F401
