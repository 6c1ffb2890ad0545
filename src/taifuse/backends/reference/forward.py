"""The NumPy reference backend's forward kernels: the living specification of every op.

Written for clarity, never for speed: every kernel computes in float64 and rounds once into
``out``. Every other backend is tested against these.

Kernel conventions (shared by all backends, see ``taifuse.backends.KERNEL_NAMES``):

* Inputs are C-contiguous arrays of the backend's array type; ``out`` is preallocated by the
  caller with the right shape and dtype and is the only thing written. Kernels never allocate
  results and know nothing of autograd.
* Elementwise kernels take arrays of any shape; ``a``/``b`` of binary ops have equal shapes
  (``taifuse.functional`` broadcasts before calling).
* ``softmax`` / ``log_softmax`` take 3-D views ``(A, C, B)`` and reduce over axis 1, so any
  ``dim`` is handled without a transpose (``dim=-1`` is ``B == 1``).
* ``layer_norm`` and ``rms_norm`` take ``x (R, D)`` and normalize rows; ``affine`` takes ``x (R, C)``.
* ``embedding`` takes flat integer ``indices (N,)`` (int64 on the host backends, int32 on taichi).
* ``linear_act`` takes 2-D ``x (N, K)``, ``w (M, K)`` (PyTorch's ``(out, in)``), ``b (M,)`` or
  ``None`` and writes ``out (N, M)``.
"""

from __future__ import annotations

import math

import numpy as np

from taifuse.backends._spec import ACTIVATIONS

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_erf = np.vectorize(math.erf, otypes=[np.float64])


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


def rms_norm(x: np.ndarray, weight: np.ndarray | None, eps: float, out: np.ndarray, rstd: np.ndarray) -> None:
    """Root-mean-square normalize each row of ``x (R, D)`` over its last axis.

    out = x * rstd * weight, rstd = 1 / sqrt(mean_d(x^2) + eps) (no centring, no bias, as
    ``torch.nn.functional.rms_norm``). ``rstd`` (shape ``(R,)``) is written for the backward pass.
    """
    x = _f64(x)
    r = 1.0 / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)
    y = x * r
    if weight is not None:
        y = y * _f64(weight)
    _store(out, y)
    _store(rstd, r.reshape(rstd.shape))


# ----------------------------------------------------------------------------- embedding


def embedding(indices: np.ndarray, weight: np.ndarray, out: np.ndarray) -> None:
    """out[n, :] = weight[indices[n], :] for ``indices (N,)`` integers, ``weight (V, D)``, ``out (N, D)``.

    The caller checks that every index is in ``[0, V)`` (``padding_idx`` changes only the backward).
    """
    _store(out, _f64(weight)[np.asarray(indices, dtype=np.int64)])


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
    return math.ceil(p * (1 << 24))


def dropout_scale(p: float) -> float:
    return 0.0 if p >= 1.0 else 1.0 / (1.0 - p)


def dropout(x: np.ndarray, out: np.ndarray, p: float, seed: int) -> None:
    """out = x * (keep / (1 - p)), keep drawn from the counter hash of (element index, seed).

    A dropped NaN stays NaN (x * 0), as in PyTorch.
    """
    idx = np.arange(x.size, dtype=np.uint64).astype(np.uint32)
    keep = (hash32(idx ^ np.uint32(dropout_key(seed))) >> 8) >= dropout_threshold(p)
    _store(out, _f64(x) * np.where(keep.reshape(x.shape), dropout_scale(p), 0.0))
