"""The reference batch norm kernels: the specification of ``batch_norm`` on every backend.

Batch norm is split into four kernels so that a fused block (a convolution whose epilogue
accumulates the per-channel sums, then one normalize-affine-ReLU pass) can reuse the last three:

* ``batch_norm_stats``: per-channel mean and biased variance of ``x (N, C, S)`` (training);
* ``batch_norm_update``: ``invstd`` from a variance, and the running statistics' update;
* ``batch_norm_elemt``: ``act((x - mean) * invstd * weight + bias)``;
* ``batch_norm_backward``: every gradient, from ``x`` and the saved ``(mean, invstd)`` alone.

Every input is viewed as ``(N, C, S)``: ``(N, C)`` is ``S == 1``, ``(N, C, L)`` is ``S == L`` and
``(N, C, H, W)`` is ``S == H * W``; statistics reduce over axes 0 and 2, ``M = N * S`` values per
channel. The per-channel arrays (``mean``, ``var``, ``invstd``) are float32 (float64 for float64
input); ``weight``, ``bias``, the running statistics and the parameter gradients have the
parameters' dtype, which is the input's or, for float16 input, float32 (PyTorch's mixed batch norm).
"""

from __future__ import annotations

import numpy as np

from taifuse.backends.reference.forward import _activation, _f64, _store


def batch_norm_stats(x: np.ndarray, mean: np.ndarray, var: np.ndarray) -> None:
    """Per-channel mean and biased variance of ``x (N, C, S)`` over axes 0 and 2 (``M = N * S > 0``).

    mean[c] = sum(x[:, c, :]) / M, var[c] = sum((x[:, c, :] - mean[c])^2) / M.
    """
    x = _f64(x)
    mu = x.mean(axis=(0, 2))
    _store(mean, mu)
    _store(var, ((x - mu[None, :, None]) ** 2).mean(axis=(0, 2)))


def batch_norm_update(
    mean: np.ndarray,
    var: np.ndarray,
    count: int,
    eps: float,
    momentum: float,
    running_mean: np.ndarray | None,
    running_var: np.ndarray | None,
    invstd: np.ndarray,
) -> None:
    """invstd = 1 / sqrt(var + eps); with running statistics (both or neither), in place, as PyTorch:

    running_mean = (1 - momentum) * running_mean + momentum * mean,
    running_var = (1 - momentum) * running_var + momentum * var * count / (count - 1),

    the unbiased variance of the ``count`` values the biased ``var`` came from (``count > 1``).
    """
    v = _f64(var)
    _store(invstd, 1.0 / np.sqrt(v + eps))
    if running_mean is None:
        return
    m = float(momentum)
    _store(running_mean, (1.0 - m) * _f64(running_mean) + m * _f64(mean))
    _store(running_var, (1.0 - m) * _f64(running_var) + m * v * (count / (count - 1)))


def batch_norm_elemt(
    x: np.ndarray,
    mean: np.ndarray,
    invstd: np.ndarray,
    weight: np.ndarray | None,
    bias: np.ndarray | None,
    activation: str | None,
    out: np.ndarray,
) -> None:
    """out = act((x - mean[c]) * invstd[c] * weight[c] + bias[c]) over ``x (N, C, S)``.

    ``weight`` None is 1, ``bias`` None is 0; ``activation`` None or ``'relu'``.
    """
    _store(out, _activation(_pre_activation(x, mean, invstd, weight, bias), activation))


def _pre_activation(x, mean, invstd, weight, bias) -> np.ndarray:
    y = (_f64(x) - _f64(mean)[None, :, None]) * _f64(invstd)[None, :, None]
    if weight is not None:
        y = y * _f64(weight)[None, :, None]
    if bias is not None:
        y = y + _f64(bias)[None, :, None]
    return y


def batch_norm_backward(
    x: np.ndarray,
    grad_out: np.ndarray,
    mean: np.ndarray,
    invstd: np.ndarray,
    weight: np.ndarray | None,
    bias: np.ndarray | None,
    activation: str | None,
    training: bool,
    grad_x: np.ndarray | None,
    grad_weight: np.ndarray | None,
    grad_bias: np.ndarray | None,
) -> None:
    """Backward of :func:`batch_norm_elemt` over ``x (N, C, S)``, from the saved ``mean``/``invstd``.

    With g = grad_out * act'(pre) (pre recomputed from x and the saved statistics; ReLU's g is 0
    where ``pre <= 0`` as stored in the output's dtype, as PyTorch's ReLU after a batch norm),
    xhat = (x - mean) * invstd and w = weight (1 without one):
    grad_bias[c] = sum g, grad_weight[c] = sum g * xhat (sums over axes 0 and 2, M values),
    grad_x = w * invstd * (g - grad_bias / M - xhat * grad_weight / M) in training (the
    statistics are functions of x), and grad_x = w * invstd * g in evaluation (they are constants).
    Any of the three gradients may be None (not computed).
    """
    g = _f64(grad_out)
    if activation == "relu":
        pre = _pre_activation(x, mean, invstd, weight, bias).astype(grad_out.dtype)
        g = np.where(pre <= 0, 0.0, g)  # a NaN output passes its gradient, as PyTorch's
    r = _f64(invstd)[None, :, None]
    xhat = (_f64(x) - _f64(mean)[None, :, None]) * r
    sum_g = g.sum(axis=(0, 2))
    sum_gx = (g * xhat).sum(axis=(0, 2))
    if grad_bias is not None:
        _store(grad_bias, sum_g)
    if grad_weight is not None:
        _store(grad_weight, sum_gx)
    if grad_x is None:
        return
    w = r if weight is None else r * _f64(weight)[None, :, None]
    if training:
        count = x.shape[0] * x.shape[2]
        _store(grad_x, w * (g - sum_g[None, :, None] / count - xhat * sum_gx[None, :, None] / count))
    else:
        _store(grad_x, w * g)
