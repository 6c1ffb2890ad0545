"""The reference kernels of ``scaled_dot_product_attention``: the specification of every backend's.

Plain float64 ``softmax(q @ k.T * scale + mask) @ v`` and its backward, with the whole score
matrix in memory: written for clarity, never for speed. The fused kernels of the other backends
(``backends/numba/attention.py``, ``backends/taichi/attention.py``) compute the same numbers
without ever holding an ``(L, S)`` matrix.

NOTE [ Attention kernel arguments ]
The array path (``taifuse._array_ops.scaled_dot_product_attention``) flattens the batch dims,
so every backend's kernels see:

* ``q (BH, L, E)``, ``k (BH, S, E)``, ``v (BH, S, Ev)``: C-contiguous, one dtype.
* ``mask``: ``None``, or an additive float mask ``(M, L, S)`` in q's dtype, ``M`` 1 (one mask
  for every batch row) or ``BH``. A boolean mask arrives as 0 (attend) / -inf (masked).
* ``is_causal``: key ``j`` is visible to query ``i`` iff ``j <= i`` (PyTorch's top-left
  alignment, ``torch.ones(L, S).tril()``), also when ``L != S``.
* ``scale``: the factor on ``q @ k.T`` (the array path resolves PyTorch's default ``1/sqrt(E)``).
* ``dropout_p``, ``seed``: dropout on the probabilities. Element ``(b, i, j)`` of the ``(BH, L,
  S)`` probabilities is kept iff ``hash32(((b * L + i) * S + j) mod 2**32 ^ dropout_key(seed))
  >> 8 >= dropout_threshold(dropout_p)`` (NOTE [ Counter-based dropout ] in ``_random.py``), and
  kept ones are scaled by ``dropout_scale(dropout_p)``: the mask ``F.dropout`` would draw on that
  matrix, the same on every backend. ``dropout_p == 0`` draws nothing.
* ``out (BH, L, Ev)`` in q's dtype and ``lse (BH, L)``, the natural log-sum-exp of each row of
  the scaled, masked scores (float32, float64 for float64 inputs): all the backward needs
  besides the inputs.

NOTE [ Attention backward's D ]
The backward's D_i = sum_j P_ij dP_ij equals rowsum(grad_out * out) (FlashAttention-2's form,
cheaper: Ev products instead of S), but only for the exact ``out``. The saved ``out`` is rounded
to q's dtype, and dS = P * (dP - D) subtracts two nearly equal numbers where a row's dP barely
varies, so in float16 the rounding of ``out`` (2**-11 relative) came out in grad_q and grad_k as
up to 3.4% of their largest element (OpInfo's float16 sample 4; PyTorch's float16: 0.02%), on
every backend, the float64 reference included. So the kernels form D from P and dP, in their
compute precision, as sum_j P_ij dP_ij / sum_j P_ij: the same number, since a row of P sums
to 1, except that P is recomputed from the saved ``lse`` (float32 for float16 inputs), and an
error e in ``lse`` scales the row by exp(-e); dividing by the row's sum cancels that scale in
D, where it would otherwise come out as e * P * D in dS (on scores of magnitude 100, float32's
rounding of ``lse`` alone then made grad_q 35-140x PyTorch's float16 error). The reference and
numba's kernels hold a whole row of P and dP and sum it first. taichi's float16 kernels walk the
keys and need D before they have seen the row: the untiled one (one thread per query row) walks
them twice, D first; the tiled one sums P dP K and P K alongside and takes
grad_q = (sum P dP K - D sum P K) * scale at the end, in twice the float32 scratch for grad_q (O(L * E), not saved
between forward and backward). taichi's float32 kernels keep rowsum(grad_out * out): float32's
rounding of ``out`` is below their own error.

A fully masked row (every score -inf) gives an output row of 0, ``lse`` -inf and zero
gradients: what PyTorch's CPU ``F.scaled_dot_product_attention`` gives (torch 2.13, every
SDPBackend on the CPU, its math path included, through its ``_safe_softmax``), not softmax's NaN.
"""

from __future__ import annotations

import numpy as np

from taifuse.backends.reference.forward import (
    _f64,
    _store,
    dropout_key,
    dropout_scale,
    dropout_threshold,
    hash32,
)


def _scores(
    q: np.ndarray, k: np.ndarray, mask: np.ndarray | None, is_causal: bool, scale: float
) -> np.ndarray:
    """The scaled, masked scores ``(BH, L, S)`` in float64, -inf where a key is not visible."""
    s = (_f64(q) @ _f64(k).transpose(0, 2, 1)) * scale
    if mask is not None:
        s = s + _f64(mask)
    if is_causal:
        L, S = s.shape[1:]
        s = np.where(np.tril(np.ones((L, S), dtype=bool)), s, -np.inf)
    return s


def _keep_scale(shape: tuple[int, int, int], dropout_p: float, seed: int) -> np.ndarray | float:
    """The dropout factor of each probability: ``dropout_scale`` where kept, 0 where dropped."""
    if dropout_p == 0.0:
        return 1.0
    idx = np.arange(int(np.prod(shape)), dtype=np.uint64).astype(np.uint32)
    keep = (hash32(idx ^ np.uint32(dropout_key(seed))) >> 8) >= dropout_threshold(dropout_p)
    return np.where(keep.reshape(shape), dropout_scale(dropout_p), 0.0)


def _probabilities(s: np.ndarray, lse: np.ndarray) -> np.ndarray:
    """exp(s - lse), 0 on fully masked rows (lse = -inf)."""
    finite = np.isfinite(lse)[..., None]
    with np.errstate(invalid="ignore"):
        return np.where(finite, np.exp(s - np.where(finite, lse[..., None], 0.0)), 0.0)


def _lse(s: np.ndarray) -> np.ndarray:
    m = s.max(axis=-1)
    finite = np.isfinite(m)
    m0 = np.where(finite, m, 0.0)
    with np.errstate(divide="ignore"):
        return np.where(finite, m0 + np.log(np.exp(s - m0[..., None]).sum(axis=-1)), -np.inf)


def attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    mask: np.ndarray | None,
    is_causal: bool,
    scale: float,
    dropout_p: float,
    seed: int,
    out: np.ndarray,
    lse: np.ndarray,
) -> None:
    """out = dropout(softmax(q @ k.T * scale + mask)) @ v per batch row; lse = logsumexp of the scores.

    Arguments as in NOTE [ Attention kernel arguments ]: ``q (BH, L, E)``, ``k (BH, S, E)``,
    ``v (BH, S, Ev)``, ``mask`` None or ``(M, L, S)`` additive (M 1 or BH), ``out (BH, L, Ev)``,
    ``lse (BH, L)``.
    """
    s = _scores(q, k, mask, is_causal, scale)
    row_lse = _lse(s)
    p = _probabilities(s, row_lse) * _keep_scale(s.shape, dropout_p, seed)
    _store(out, p @ _f64(v))
    _store(lse, row_lse)


def attention_backward(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    mask: np.ndarray | None,
    is_causal: bool,
    scale: float,
    dropout_p: float,
    seed: int,
    out: np.ndarray,
    lse: np.ndarray,
    grad_out: np.ndarray,
    grad_q: np.ndarray | None,
    grad_k: np.ndarray | None,
    grad_v: np.ndarray | None,
) -> None:
    """The gradients of :func:`attention` from its saved ``out`` and ``lse``.

    With P = exp(s - lse) (the probabilities, recomputed), Z the dropout factors and
    D = rowsum(P * dP) / rowsum(P): grad_v = (P * Z).T @ grad_out, dP = (grad_out @ v.T) * Z,
    dS = P * (dP - D), grad_q = dS @ k * scale, grad_k = dS.T @ q * scale. A gradient output
    passed as ``None`` is not computed. The mask gets no gradient. ``out`` is not read: see
    NOTE [ Attention backward's D ].
    """
    s = _scores(q, k, mask, is_causal, scale)
    p = _probabilities(s, _f64(lse))
    z = _keep_scale(s.shape, dropout_p, seed)
    g = _f64(grad_out)
    if grad_v is not None:
        _store(grad_v, (p * z).transpose(0, 2, 1) @ g)
    dp = (g @ _f64(v).transpose(0, 2, 1)) * z
    psum = p.sum(axis=-1, keepdims=True)  # 0 on a fully masked row
    d = np.divide((p * dp).sum(axis=-1, keepdims=True), psum, out=np.zeros_like(psum), where=psum > 0)
    ds = p * (dp - d)
    if grad_q is not None:
        _store(grad_q, (ds @ _f64(k)) * scale)
    if grad_k is not None:
        _store(grad_k, (ds.transpose(0, 2, 1) @ _f64(q)) * scale)
