"""Fused ``scaled_dot_product_attention`` kernels of the ``taichi`` backend.

Signatures and semantics are the reference's (``backends/reference/attention.py``, NOTE
[ Attention kernel arguments ]).

NOTE [ Taichi attention kernels ]
Forward, one kernel: one thread per query row walks the keys with an online softmax (running
max ``m`` and sum ``l``, the accumulator rescaled by exp(m_old - m_new) when the max grows) and
writes the output row and its log-sum-exp. The accumulator is a float32 row of a ``(BH, L, Ev)``
scratch buffer: O(L) per head, never O(L * S).
Backward, two kernels, so that no two threads ever add into the same element (Metal has no float
atomics): one thread per query row recomputes its probabilities and writes grad_q (and
D = rowsum(grad_out * out)); then one thread per key row walks the queries that see it and
writes grad_k and grad_v. Each recomputes P = exp(s - lse), dS = P * (dP * Z - D).
float16 is storage only (float32 arithmetic). These kernels use no threadgroup memory yet (the
``linear_act_shared`` style tiling of K and V is the next step), so they run unchanged on
``ti.cpu`` and the GPU archs.
"""

# NOTE: no `from __future__ import annotations` here: Taichi reads kernel annotations as objects.

import functools
from types import SimpleNamespace

import numpy as np

from taifuse.backends import reference
from taifuse.backends.taichi._runtime import FLOAT_DTYPES, DeviceArray, _import_taichi, _nd, _optional
from taifuse.backends.taichi.tensor_math import _new


@functools.cache
def kernels_for(dtype: np.dtype) -> SimpleNamespace:
    """The attention kernels for storage dtype ``dtype`` (float32 or float16)."""
    ti = _import_taichi()
    from taifuse.backends.taichi import _math as M

    T = ti.f16 if np.dtype(dtype) == np.float16 else ti.f32
    X = ti.types.ndarray(dtype=T, ndim=1)
    F32 = ti.types.ndarray(dtype=ti.f32, ndim=1)

    @ti.func
    def score(q: ti.template(), k: ti.template(), mask: ti.template(), qo, ko, mo, E, scale, has_mask):
        s = 0.0
        for d in range(E):
            s += ti.cast(q[qo + d], ti.f32) * ti.cast(k[ko + d], ti.f32)
        s *= scale
        if has_mask != 0:
            s += ti.cast(mask[mo], ti.f32)
        return s

    @ti.func
    def keep_scale(r, L, S, j, key, threshold, dscale, drop):
        z = 1.0
        if drop != 0:
            idx = ti.cast(r, ti.u32) * ti.cast(S, ti.u32) + ti.cast(j, ti.u32)
            keep = ti.bit_shr(M.hash32(idx ^ key), 8) >= threshold
            z = ti.select(keep, dscale, 0.0)
        return z

    @ti.kernel
    def forward(
        q: X, k: X, v: X, mask: X, out: X, lse: F32, acc: F32,
        bh_n: ti.i32, L: ti.i32, S: ti.i32, E: ti.i32, EV: ti.i32,
        mask_rows: ti.i32, causal: ti.i32, scale: ti.f32, key: ti.u32, threshold: ti.u32, dscale: ti.f32,
    ):  # fmt: skip
        for r in range(bh_n * L):
            b = r // L
            qi = r % L
            lim = S
            if causal != 0:
                lim = ti.min(qi + 1, S)
            mrow = ((b if mask_rows > 1 else 0) * L + qi) * S
            ao = r * EV
            for d in range(EV):
                acc[ao + d] = 0.0
            m = -ti.math.inf
            total = 0.0
            for j in range(lim):
                s = score(q, k, mask, r * E, (b * S + j) * E, mrow + j, E, scale, mask_rows)
                if s > -ti.math.inf:
                    m_new = ti.max(m, s)
                    c = ti.exp(m - m_new)
                    p = ti.exp(s - m_new)
                    total = total * c + p
                    pz = p * keep_scale(r, L, S, j, key, threshold, dscale, dscale != 1.0)
                    vo = (b * S + j) * EV
                    for d in range(EV):
                        acc[ao + d] = acc[ao + d] * c + pz * ti.cast(v[vo + d], ti.f32)
                    m = m_new
            inv = 0.0
            lse[r] = -ti.math.inf
            if total > 0.0:
                inv = 1.0 / total
                lse[r] = m + ti.log(total)
            for d in range(EV):
                out[ao + d] = ti.cast(acc[ao + d] * inv, T)

    @ti.kernel
    def backward_q(
        q: X, k: X, v: X, mask: X, out: X, lse: F32, g: X, gq: X, dsum: F32, acc: F32,
        bh_n: ti.i32, L: ti.i32, S: ti.i32, E: ti.i32, EV: ti.i32,
        mask_rows: ti.i32, causal: ti.i32, scale: ti.f32, key: ti.u32, threshold: ti.u32, dscale: ti.f32,
        write_q: ti.i32,
    ):  # fmt: skip
        for r in range(bh_n * L):
            b = r // L
            qi = r % L
            go = r * EV
            di = 0.0
            for d in range(EV):
                di += ti.cast(g[go + d], ti.f32) * ti.cast(out[go + d], ti.f32)
            dsum[r] = di
            if write_q != 0:
                lim = S
                if causal != 0:
                    lim = ti.min(qi + 1, S)
                if lse[r] == -ti.math.inf:
                    lim = 0
                mrow = ((b if mask_rows > 1 else 0) * L + qi) * S
                ao = r * E
                for d in range(E):
                    acc[ao + d] = 0.0
                for j in range(lim):
                    s = score(q, k, mask, r * E, (b * S + j) * E, mrow + j, E, scale, mask_rows)
                    p = ti.exp(s - lse[r])
                    vo = (b * S + j) * EV
                    dp = 0.0
                    for d in range(EV):
                        dp += ti.cast(g[go + d], ti.f32) * ti.cast(v[vo + d], ti.f32)
                    z = keep_scale(r, L, S, j, key, threshold, dscale, dscale != 1.0)
                    ds = p * (dp * z - di)
                    ko = (b * S + j) * E
                    for d in range(E):
                        acc[ao + d] += ds * ti.cast(k[ko + d], ti.f32)
                for d in range(E):
                    gq[ao + d] = ti.cast(acc[ao + d] * scale, T)

    @ti.kernel
    def backward_kv(
        q: X, k: X, v: X, mask: X, lse: F32, g: X, gk: X, gv: X, dsum: F32, acc: F32,
        bh_n: ti.i32, L: ti.i32, S: ti.i32, E: ti.i32, EV: ti.i32,
        mask_rows: ti.i32, causal: ti.i32, scale: ti.f32, key: ti.u32, threshold: ti.u32, dscale: ti.f32,
    ):  # fmt: skip
        # acc holds E + EV float32 per key row: grad_k's sum, then grad_v's.
        for t in range(bh_n * S):
            b = t // S
            j = t % S
            ao = t * (E + EV)
            for d in range(E + EV):
                acc[ao + d] = 0.0
            first = 0
            if causal != 0:
                first = j  # queries i >= j see key j
            ko = t * E
            vo = t * EV
            for qi in range(first, L):
                r = b * L + qi
                if lse[r] > -ti.math.inf:
                    mo = ((b if mask_rows > 1 else 0) * L + qi) * S + j
                    s = score(q, k, mask, r * E, ko, mo, E, scale, mask_rows)
                    p = ti.exp(s - lse[r])
                    z = keep_scale(r, L, S, j, key, threshold, dscale, dscale != 1.0)
                    go = r * EV
                    dp = 0.0
                    for d in range(EV):
                        gd = ti.cast(g[go + d], ti.f32)
                        dp += gd * ti.cast(v[vo + d], ti.f32)
                        acc[ao + E + d] += p * z * gd
                    ds = p * (dp * z - dsum[r])
                    for d in range(E):
                        acc[ao + d] += ds * ti.cast(q[r * E + d], ti.f32)
            for d in range(E):
                gk[ko + d] = ti.cast(acc[ao + d] * scale, T)
            for d in range(EV):
                gv[vo + d] = ti.cast(acc[ao + E + d], T)

    return SimpleNamespace(forward=forward, backward_q=backward_q, backward_kv=backward_kv)


def all_kernels() -> list[tuple[str, object]]:
    """Every (name, kernel) pair the attention wrappers may launch, per storage dtype."""
    return [
        (f"attention_{name}_{dtype.name}", kernel)
        for dtype in FLOAT_DTYPES
        for name, kernel in vars(kernels_for(dtype)).items()
    ]


def _common(
    q: DeviceArray, k: DeviceArray, v: DeviceArray, mask: DeviceArray | None, dropout_p: float, seed: int
):
    bh, L, E = q.shape
    S, ev = k.shape[1], v.shape[2]
    drop = dropout_p > 0.0
    # dscale == 1.0 tells the kernels there is no dropout (dropout_scale(p) > 1 for any p > 0).
    dscale = reference.dropout_scale(dropout_p) if drop else 1.0
    key = reference.dropout_key(seed) if drop else 0
    mask_rows = 0 if mask is None else mask.shape[0]
    return (bh, L, S, E, ev, mask_rows), (key, reference.dropout_threshold(dropout_p), dscale)


def attention(
    q: DeviceArray,
    k: DeviceArray,
    v: DeviceArray,
    mask: DeviceArray | None,
    is_causal: bool,
    scale: float,
    dropout_p: float,
    seed: int,
    out: DeviceArray,
    lse: DeviceArray,
) -> None:
    """As ``reference.attention``, fused (NOTE [ Taichi attention kernels ])."""
    (bh, L, S, E, ev, mask_rows), drop = _common(q, k, v, mask, dropout_p, seed)
    acc = _new((bh * L * ev,), np.float32)
    kernels_for(q.dtype).forward(
        _nd(q), _nd(k), _nd(v), _optional(mask, q.dtype), _nd(out), _nd(lse), _nd(acc),
        bh, L, S, E, ev, mask_rows, int(is_causal), float(scale), *drop,
    )  # fmt: skip


def attention_backward(
    q: DeviceArray,
    k: DeviceArray,
    v: DeviceArray,
    mask: DeviceArray | None,
    is_causal: bool,
    scale: float,
    dropout_p: float,
    seed: int,
    out: DeviceArray,
    lse: DeviceArray,
    grad_out: DeviceArray,
    grad_q: DeviceArray | None,
    grad_k: DeviceArray | None,
    grad_v: DeviceArray | None,
) -> None:
    """As ``reference.attention_backward``: two kernels (NOTE [ Taichi attention kernels ])."""
    (bh, L, S, E, ev, mask_rows), drop = _common(q, k, v, mask, dropout_p, seed)
    ks = kernels_for(q.dtype)
    dsum = _new((bh * L,), np.float32)
    acc_q = _new((max(bh * L * E, 1),), np.float32)
    ks.backward_q(
        _nd(q), _nd(k), _nd(v), _optional(mask, q.dtype), _nd(out), _nd(lse), _nd(grad_out),
        _optional(grad_q, q.dtype), _nd(dsum), _nd(acc_q),
        bh, L, S, E, ev, mask_rows, int(is_causal), float(scale), *drop, int(grad_q is not None),
    )  # fmt: skip
    if grad_k is None and grad_v is None:
        return
    gk = grad_k if grad_k is not None else _new(k.shape, k.dtype)
    gv = grad_v if grad_v is not None else _new(v.shape, v.dtype)
    acc_kv = _new((bh * S * (E + ev),), np.float32)
    ks.backward_kv(
        _nd(q), _nd(k), _nd(v), _optional(mask, q.dtype), _nd(lse), _nd(grad_out), _nd(gk), _nd(gv),
        _nd(dsum), _nd(acc_kv), bh, L, S, E, ev, mask_rows, int(is_causal), float(scale), *drop,
    )  # fmt: skip
