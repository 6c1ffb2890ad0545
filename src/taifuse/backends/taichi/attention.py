"""``scaled_dot_product_attention`` on the taichi backend.

NOTE: a stand-in until the fused threadgroup-memory kernels land: it runs the reference kernels
on host copies (every call copies its inputs and results across).
"""

from __future__ import annotations

import numpy as np

from taifuse.backends import reference
from taifuse.backends.taichi._runtime import DeviceArray, _nd, to_numpy


def _host(a: DeviceArray | None) -> np.ndarray | None:
    return None if a is None else to_numpy(a)


def _store(out: DeviceArray | None, value: np.ndarray) -> None:
    if out is not None:
        _nd(out).from_numpy(np.ascontiguousarray(value, dtype=out.dtype).reshape(-1))


def attention(q, k, v, mask, is_causal, scale, dropout_p, seed, out, lse) -> None:
    """As ``reference.attention`` (see its docstring)."""
    o, l_ = np.empty(out.shape, out.dtype), np.empty(lse.shape, lse.dtype)
    reference.attention(_host(q), _host(k), _host(v), _host(mask), is_causal, scale, dropout_p, seed, o, l_)
    _store(out, o)
    _store(lse, l_)


def attention_backward(
    q, k, v, mask, is_causal, scale, dropout_p, seed, out, lse, grad_out, grad_q, grad_k, grad_v
) -> None:
    """As ``reference.attention_backward`` (see its docstring)."""
    grads = [None if g is None else np.empty(g.shape, g.dtype) for g in (grad_q, grad_k, grad_v)]
    reference.attention_backward(
        _host(q),
        _host(k),
        _host(v),
        _host(mask),
        is_causal,
        scale,
        dropout_p,
        seed,
        _host(out),
        _host(lse),
        _host(grad_out),
        *grads,
    )
    for dst, src in zip((grad_q, grad_k, grad_v), grads):
        if dst is not None:
            _store(dst, src)
