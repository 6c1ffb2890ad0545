"""Fused ``scaled_dot_product_attention`` kernels of the ``taichi`` backend.

Signatures and semantics are the reference's (``backends/reference/attention.py``, NOTE
[ Attention kernel arguments ]).

NOTE [ Taichi attention kernels ]
Two kernel sets, the same numbers (P = exp(s - lse), dS = P * (dP * Z - D), float32 arithmetic,
except the tiled kernels' products on float16 data: NOTE [ float16 products in the attention
kernels ]), and never an (L, S) score matrix:

* Tiled (the GPU archs, ``E`` and ``Ev`` at most ``MAX_HEAD_DIM``): threadgroup-memory tiles, as
  ``linear_act_shared``. Forward, one kernel: a block of ``BLOCK_Q`` threads owns ``BLOCK_Q``
  query rows of one batch-head; it walks the keys in tiles of ``TILE_K`` keys, each tile's K
  (``TILE_K x E``) and V (``TILE_K x Ev``) loaded once, cooperatively and coalesced, into
  threadgroup memory, then a barrier; each thread computes its row's ``TILE_K`` scores into
  registers (its q element read once per tile, the K element a broadcast from threadgroup memory),
  takes the tile's max, rescales its accumulator once per tile (online softmax: running max ``m``
  and sum ``l``) and adds the tile's ``P V``; a second barrier before the next tile overwrites
  the shared arrays. Only ``TILE_K`` scores per thread ever exist. Backward, two kernels, so that
  no two threads ever add into one element (Metal has no float atomics): ``backward_q_tiled``
  (one thread per query row, K/V tiles as the forward: writes grad_q and D, which is
  rowsum(dO * O) in float32 and rowsum(P * dP * Z) / rowsum(P) in float16: NOTE [ Attention
  backward's D ] in ``backends/reference/attention.py``),
  then ``backward_kv_tiled`` (a block of ``BLOCK_KV`` threads owns ``BLOCK_KV`` key rows; it walks
  the queries in tiles of ``TILE_Q``: Q, dO, lse and D loaded into threadgroup memory; each thread
  adds its key row's grad_k and grad_v). Under ``is_causal`` a block stops (forward, grad_q) or
  starts (grad_k/grad_v) at the tile its last (first) row needs; every thread of a block runs the
  same number of tiles, so each reaches every barrier. Threadgroup memory per block:
  ``2 * TILE_K * MAX_HEAD_DIM`` floats (16 KiB), under Metal's 32 KiB; float16 tiles hold float16,
  so the same 16 KiB take head dims up to ``MAX_HEAD_DIM_F16``. The float32 accumulators
  (one row per thread) live in a scratch buffer laid out feature-major (``acc[d * rows + r]``)
  so that a block's threads touch consecutive addresses: O(L * Ev) (O(S * (E + Ev)) for the
  key side), never O(L * S).
* Untiled (``ti.cpu``, which runs no threadgroup memory, as ``linear_act``; and any head dim
  above ``MAX_HEAD_DIM``, whose tile would not fit): one thread per query row walks the keys one
  by one with the same online softmax; the backward is the same two-kernel split, one thread per
  query row then one per key row, with row-major scratch.

On lavapipe (the CPU Vulkan the tests use) the tiled kernels measured slower than the untiled
ones (B=2, H=4, L=S=256, E=64, forward plus backward: ~1.2-1.5x the time, on a loaded 2-core
machine). The staging and the barriers alone cost it there: the same register-tiled forward
reading K and V straight from the buffers, with no threadgroup memory or barrier, ran in about half
the untiled forward's time, and with the staging and barriers back but the arithmetic still reading
the buffers, as slowly as the tiled kernel. The tiles are for Metal's GPUs; lavapipe is their
correctness proxy, not a speed proxy.

NOTE [ float16 products in the attention kernels ]
On float16 Q, K, V the tiled kernels (the GPU archs' path) work as Metal's ``simdgroup_matrix<half>``
with float accumulators does: the tiles stay float16, each product of two float16 operands is formed
in float16 and summed in float32; softmax, its statistics (m, l, lse, D) and dS stay float32.

* Products: Q.K (scores, forward and both backward kernels), P.V (forward), dO.V (dP) and P.dO
  (grad_v). P is rounded to float16 first (it is in [0, 1]); dropout's keep is a select and its
  scale is applied once to the float32 sum. dS.K and dS.Q stay float32: dS is computed float32
  data, and rounding it would add an error for no float16 operand saved.
* Overflow: a float16 product past 65504 is inf (260 * 260; or dO * V under loss scaling, whose
  large dO is what GradScaler provokes). A score or dP sum that comes out non-finite is redone
  with float32 products, so the result is the float32 path's; an inf or NaN input still gives
  what it gives there. P and P.dO cannot overflow (P <= 1).
* Error: against the float64 reference, the float16 products measured 1.1-2.3x the error of the
  float32 kernels rounded to float16 (the largest error; ~2x the mean), well inside the float16
  tolerance; the tests hold it to 4x.
* The untiled kernels (ti.cpu, which has no float16 arithmetic unit, and head dims past the tile
  limit) keep float32 arithmetic.

``launches`` counts the kernels each call ran, by name: the tests read it to prove which path ran.
"""

# NOTE: no `from __future__ import annotations` here: Taichi reads kernel annotations as objects.

import functools
from collections import Counter
from types import SimpleNamespace

import numpy as np

from taifuse.backends import reference
from taifuse.backends.taichi._runtime import (
    FLOAT_DTYPES,
    DeviceArray,
    _import_taichi,
    _nd,
    _on_gpu,
    _optional,
)
from taifuse.backends.taichi.tensor_math import _new

# Tiled kernels (NOTE [ Taichi attention kernels ]): BLOCK_Q query rows per block (one thread
# each) walk the keys TILE_K at a time; BLOCK_KV key rows per block walk the queries TILE_Q at a
# time. A shared tile holds TILE rows of at most MAX_HEAD_DIM features (16 KiB for K plus V).
BLOCK_Q = 64
TILE_K = 16
BLOCK_KV = 64
TILE_Q = 16
MAX_HEAD_DIM = 128
# float16 tiles hold their elements as float16 (NOTE [ float16 products in the attention
# kernels ]): the same 16 KiB fit twice the head dim.
MAX_HEAD_DIM_F16 = 2 * MAX_HEAD_DIM


def max_head_dim(dtype: np.dtype) -> int:
    """The largest head dim (E and Ev) the tiled kernels take for storage dtype ``dtype``."""
    return MAX_HEAD_DIM_F16 if np.dtype(dtype) == np.float16 else MAX_HEAD_DIM


# Kernel launches by name since the process started (the tests check which path ran).
launches: Counter = Counter()


# ----------------------------------------------------------------------------- kernels
#
# Two cached factories, one per kernel set (untiled, tiled), over one set of ti.funcs holding the
# math both share (_funcs): scores, the dropout keep, row limits, the softmax row's end, tile
# loads and the float16-product dots with their float32 fallback.


@functools.cache
def _funcs(dtype: np.dtype) -> SimpleNamespace:
    """The ti.funcs the untiled and tiled kernels share, for storage dtype ``dtype``."""
    ti = _import_taichi()
    from taifuse.backends.taichi import _math as M

    IS16 = np.dtype(dtype) == np.float16
    T = ti.f16 if IS16 else ti.f32

    @ti.func
    def dot32(a: ti.template(), ao, b: ti.template(), bo, n):
        # sum over d < n of a[ao + d] * b[bo + d] with float32 products: the untiled kernels' dots,
        # and the fallback for a sum whose float16 products overflowed (NOTE [ float16 products in
        # the attention kernels ]).
        t = 0.0
        for d in range(n):
            t += ti.cast(a[ao + d], ti.f32) * ti.cast(b[bo + d], ti.f32)
        return t

    @ti.func
    def score(q: ti.template(), k: ti.template(), mask: ti.template(), qo, ko, mo, E, scale, has_mask):
        s = dot32(q, qo, k, ko, E) * scale
        if has_mask != 0:
            s += ti.cast(mask[mo], ti.f32)
        return s

    @ti.func
    def visible(qi, S, causal):
        # The keys [0, visible) query row qi sees.
        lim = S
        if causal != 0:
            lim = ti.min(qi + 1, S)
        return lim

    @ti.func
    def mask_row(b, qi, L, S, mask_rows):
        # The offset of query row qi's mask row (one mask for every batch-head when mask_rows is 1).
        return ((b if mask_rows > 1 else 0) * L + qi) * S

    @ti.func
    def finish_row(lse: ti.template(), r, m, total):
        # Writes row r's log-sum-exp (-inf on a row that saw no key) and returns 1 / its sum.
        inv = 0.0
        lse[r] = -ti.math.inf
        if total > 0.0:
            inv = 1.0 / total
            lse[r] = m + ti.log(total)
        return inv

    @ti.func
    def keep_scale(r, L, S, j, key, threshold, dscale, drop):
        z = 1.0
        if drop != 0:
            idx = ti.cast(r, ti.u32) * ti.cast(S, ti.u32) + ti.cast(j, ti.u32)
            keep = ti.bit_shr(M.hash32(idx ^ key), 8) >= threshold
            z = ti.select(keep, dscale, 0.0)
        return z

    @ti.func
    def load_tile(src: ti.template(), dst: ti.template(), base, n, size, tid, threads: ti.template()):
        # The block's threads copy src[base : base + n] to dst[0 : n] in the storage type,
        # consecutive threads reading consecutive elements, and zero dst[n : size].
        for it in range((size + threads - 1) // threads):
            e = tid + it * threads
            if e < size:
                x = ti.cast(0.0, T)
                if e < n:
                    x = src[base + e]
                dst[e] = x

    @ti.func
    def finite(x: ti.f32) -> ti.i32:
        # An exponent test: fast math may fold comparisons with inf and NaN.
        return ti.cast((ti.bit_cast(x, ti.i32) & 0x7F800000) != 0x7F800000, ti.i32)

    @ti.func
    def tile_dots(a: ti.template(), ao, tile: ti.template(), n, width: ti.template()):
        # dots[j] = sum over d < n of a[ao + d] * tile[j * n + d], j < width: products in the
        # storage type, summed in float32; a float16 sum that overflowed (or met an input that is
        # not finite) is redone with float32 products (NOTE [ float16 products in the attention
        # kernels ]).
        dots = ti.Vector.zero(ti.f32, width)
        for d in range(n):
            ad = a[ao + d]
            for j in ti.static(range(width)):
                dots[j] += ti.cast(ad * tile[j * n + d], ti.f32)
        if ti.static(IS16):
            for j in ti.static(range(width)):
                if not finite(dots[j]):
                    dots[j] = dot32(a, ao, tile, j * n, n)
        return dots

    @ti.func
    def tile_scores(q: ti.template(), ks: ti.template(), mask: ti.template(), qo, mo, E, scale, has_mask, n):
        # The scaled, masked scores of one query row against a K tile: -inf past the n visible keys.
        s = tile_dots(q, qo, ks, E, TILE_K)
        for j in ti.static(range(TILE_K)):
            x = -ti.math.inf
            if j < n:
                x = s[j] * scale
                if has_mask != 0:
                    x += ti.cast(mask[mo + j], ti.f32)
            s[j] = x
        return s

    @ti.func
    def block_keys(q0, L, S, causal):
        # The most keys any row of the query block starting at q0 sees.
        lim = S
        if causal != 0:
            lim = ti.min(ti.min(q0 + BLOCK_Q, L), S)
        return lim

    @ti.func
    def load_kv(
        k: ti.template(), v: ti.template(), ks: ti.template(), vs: ti.template(), b, S, j0, E, EV, tid
    ):
        # The block's K and V tiles of keys [j0, j0 + TILE_K), then a barrier.
        nk = ti.min(TILE_K, S - j0)
        load_tile(k, ks, (b * S + j0) * E, nk * E, TILE_K * E, tid, BLOCK_Q)
        load_tile(v, vs, (b * S + j0) * EV, nk * EV, TILE_K * EV, tid, BLOCK_Q)
        ti.simt.block.sync()

    return SimpleNamespace(
        dot32=dot32,
        finite=finite,
        score=score,
        visible=visible,
        mask_row=mask_row,
        finish_row=finish_row,
        keep_scale=keep_scale,
        load_tile=load_tile,
        tile_dots=tile_dots,
        tile_scores=tile_scores,
        block_keys=block_keys,
        load_kv=load_kv,
    )


@functools.cache
def untiled_kernels_for(dtype: np.dtype) -> SimpleNamespace:
    """The untiled attention kernels (one thread per row) for storage dtype ``dtype``."""
    ti = _import_taichi()
    F = _funcs(dtype)
    IS16 = np.dtype(dtype) == np.float16
    T = ti.f16 if IS16 else ti.f32
    X = ti.types.ndarray(dtype=T, ndim=1)
    F32 = ti.types.ndarray(dtype=ti.f32, ndim=1)

    @ti.kernel
    def forward(
        q: X, k: X, v: X, mask: X, out: X, lse: F32, acc: F32,
        bh_n: ti.i32, L: ti.i32, S: ti.i32, E: ti.i32, EV: ti.i32,
        mask_rows: ti.i32, causal: ti.i32, scale: ti.f32, key: ti.u32, threshold: ti.u32, dscale: ti.f32,
    ):  # fmt: skip
        for r in range(bh_n * L):
            b = r // L
            qi = r % L
            lim = F.visible(qi, S, causal)
            mrow = F.mask_row(b, qi, L, S, mask_rows)
            ao = r * EV
            for d in range(EV):
                acc[ao + d] = 0.0
            m = -ti.math.inf
            total = 0.0
            for j in range(lim):
                s = F.score(q, k, mask, r * E, (b * S + j) * E, mrow + j, E, scale, mask_rows)
                if s > -ti.math.inf:
                    m_new = ti.max(m, s)
                    c = ti.exp(m - m_new)
                    p = ti.exp(s - m_new)
                    total = total * c + p
                    pz = p * F.keep_scale(r, L, S, j, key, threshold, dscale, dscale != 1.0)
                    vo = (b * S + j) * EV
                    for d in range(EV):
                        acc[ao + d] = acc[ao + d] * c + pz * ti.cast(v[vo + d], ti.f32)
                    m = m_new
            inv = F.finish_row(lse, r, m, total)
            for d in range(EV):
                out[ao + d] = ti.cast(acc[ao + d] * inv, T)

    @ti.kernel
    def backward_q(
        q: X, k: X, v: X, mask: X, out: X, lse: F32, g: X, gq: X, dsum: F32, acc: F32,
        bh_n: ti.i32, L: ti.i32, S: ti.i32, E: ti.i32, EV: ti.i32,
        mask_rows: ti.i32, causal: ti.i32, scale: ti.f32, key: ti.u32, threshold: ti.u32, dscale: ti.f32,
        write_q: ti.i32,
    ):  # fmt: skip
        # D first, then acc[r * E + d] sums grad_q. float32: D = rowsum(dO * O). float16 (NOTE
        # [ Attention backward's D ] in backends/reference/attention.py): D = rowsum(P * dP * Z) /
        # rowsum(P), a pass over the keys of its own (summing P dP K and P K alongside instead, as
        # the tiled kernel does, took the backward 1.5x as long here: twice the scratch traffic).
        for r in range(bh_n * L):
            b = r // L
            qi = r % L
            go = r * EV
            lim = F.visible(qi, S, causal)
            if lse[r] == -ti.math.inf:
                lim = 0
            mrow = F.mask_row(b, qi, L, S, mask_rows)
            di = 0.0
            if ti.static(IS16):
                psum = 0.0
                for j in range(lim):
                    s = F.score(q, k, mask, r * E, (b * S + j) * E, mrow + j, E, scale, mask_rows)
                    p = ti.exp(s - lse[r])
                    dp = F.dot32(g, go, v, (b * S + j) * EV, EV)
                    di += p * dp * F.keep_scale(r, L, S, j, key, threshold, dscale, dscale != 1.0)
                    psum += p
                if psum > 0.0:  # 0 on a fully masked row
                    di /= psum
            else:
                di = F.dot32(g, go, out, go, EV)
            dsum[r] = di
            if write_q != 0:
                ao = r * E
                for d in range(E):
                    acc[ao + d] = 0.0
                for j in range(lim):
                    s = F.score(q, k, mask, r * E, (b * S + j) * E, mrow + j, E, scale, mask_rows)
                    p = ti.exp(s - lse[r])
                    dp = F.dot32(g, go, v, (b * S + j) * EV, EV)
                    z = F.keep_scale(r, L, S, j, key, threshold, dscale, dscale != 1.0)
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
                    mo = F.mask_row(b, qi, L, S, mask_rows) + j
                    s = F.score(q, k, mask, r * E, ko, mo, E, scale, mask_rows)
                    p = ti.exp(s - lse[r])
                    z = F.keep_scale(r, L, S, j, key, threshold, dscale, dscale != 1.0)
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


@functools.cache
def tiled_kernels_for(dtype: np.dtype) -> SimpleNamespace:
    """The tiled attention kernels (threadgroup memory, the GPU archs) for storage dtype ``dtype``."""
    ti = _import_taichi()
    F = _funcs(dtype)
    IS16 = np.dtype(dtype) == np.float16
    T = ti.f16 if IS16 else ti.f32
    X = ti.types.ndarray(dtype=T, ndim=1)
    F32 = ti.types.ndarray(dtype=ti.f32, ndim=1)
    HEAD = max_head_dim(dtype)  # a shared tile row's capacity

    @ti.kernel
    def forward_tiled(
        q: X, k: X, v: X, mask: X, out: X, lse: F32, acc: F32,
        bh_n: ti.i32, L: ti.i32, S: ti.i32, E: ti.i32, EV: ti.i32,
        mask_rows: ti.i32, causal: ti.i32, scale: ti.f32, key: ti.u32, threshold: ti.u32, dscale: ti.f32,
    ):  # fmt: skip
        # Loop index g = block * BLOCK_Q + thread; a block's rows belong to one batch-head b.
        # acc is feature-major: acc[d * nr + r].
        qblocks = (L + BLOCK_Q - 1) // BLOCK_Q
        nr = bh_n * L
        ti.loop_config(block_dim=BLOCK_Q)
        for g in range(bh_n * qblocks * BLOCK_Q):
            tid = g % BLOCK_Q
            blk = g // BLOCK_Q
            b = blk // qblocks
            q0 = (blk % qblocks) * BLOCK_Q
            qi = q0 + tid
            live = qi < L
            r = b * L + ti.min(qi, L - 1)
            ks = ti.simt.block.SharedArray((TILE_K * HEAD,), T)
            vs = ti.simt.block.SharedArray((TILE_K * HEAD,), T)
            lim = 0  # keys [0, lim) are visible to this row
            if live:
                lim = F.visible(qi, S, causal)
                for d in range(EV):
                    acc[d * nr + r] = 0.0
            block_lim = F.block_keys(q0, L, S, causal)
            mrow = F.mask_row(b, ti.min(qi, L - 1), L, S, mask_rows)
            drop = dscale != 1.0
            m = -ti.math.inf
            total = 0.0
            for t in range((block_lim + TILE_K - 1) // TILE_K):
                j0 = t * TILE_K
                F.load_kv(k, v, ks, vs, b, S, j0, E, EV, tid)
                if j0 < lim:
                    s = F.tile_scores(q, ks, mask, r * E, mrow + j0, E, scale, mask_rows, lim - j0)
                    mt = -ti.math.inf
                    for j in ti.static(range(TILE_K)):
                        mt = ti.max(mt, s[j])
                    if mt > -ti.math.inf:
                        m_new = ti.max(m, mt)
                        c = ti.exp(m - m_new)
                        # float16: P rounded to float16 (in [0, 1]: no overflow), dropout's
                        # scale applied once at the end; float32: pz = P * keep * dscale.
                        pz = ti.Vector.zero(T, TILE_K)
                        psum = 0.0
                        for j in ti.static(range(TILE_K)):
                            p = ti.exp(s[j] - m_new)
                            psum += p
                            z = F.keep_scale(r, L, S, j0 + j, key, threshold, 1.0 if IS16 else dscale, drop)
                            pz[j] = ti.cast(p * z, T)
                        total = total * c + psum
                        for d in range(EV):
                            a = acc[d * nr + r] * c
                            for j in ti.static(range(TILE_K)):
                                a += ti.cast(pz[j] * vs[j * EV + d], ti.f32)
                            acc[d * nr + r] = a
                        m = m_new
                ti.simt.block.sync()  # the next tile overwrites ks/vs
            if live:
                inv = F.finish_row(lse, r, m, total)
                if ti.static(IS16):
                    inv *= dscale  # 1.0 without dropout
                for d in range(EV):
                    out[r * EV + d] = ti.cast(acc[d * nr + r] * inv, T)

    @ti.kernel
    def backward_q_tiled(
        q: X, k: X, v: X, mask: X, out: X, lse: F32, g: X, gq: X, dsum: F32, acc: F32,
        bh_n: ti.i32, L: ti.i32, S: ti.i32, E: ti.i32, EV: ti.i32,
        mask_rows: ti.i32, causal: ti.i32, scale: ti.f32, key: ti.u32, threshold: ti.u32, dscale: ti.f32,
        write_q: ti.i32,
    ):  # fmt: skip
        # The forward's blocks and K/V tiles; acc[d * nr + r] sums grad_q's row r. float16 (NOTE
        # [ Attention backward's D ] in backends/reference/attention.py): D = rowsum(P * dP * Z) /
        # rowsum(P) over the tiles, acc sums P * dP * Z * K (d * nr + r) and P * K
        # ((E + d) * nr + r), whatever write_q.
        qblocks = (L + BLOCK_Q - 1) // BLOCK_Q
        nr = bh_n * L
        ti.loop_config(block_dim=BLOCK_Q)
        for gi in range(bh_n * qblocks * BLOCK_Q):
            tid = gi % BLOCK_Q
            blk = gi // BLOCK_Q
            b = blk // qblocks
            q0 = (blk % qblocks) * BLOCK_Q
            qi = q0 + tid
            live = qi < L
            r = b * L + ti.min(qi, L - 1)
            ks = ti.simt.block.SharedArray((TILE_K * HEAD,), T)
            vs = ti.simt.block.SharedArray((TILE_K * HEAD,), T)
            go = r * EV
            di = 0.0
            psum = 0.0
            lr = -ti.math.inf
            lim = 0
            walk = write_q != 0 or ti.static(IS16)
            if live:
                if ti.static(not IS16):
                    di = F.dot32(g, go, out, go, EV)
                lr = lse[r]
                if walk:
                    for d in range(E):
                        acc[d * nr + r] = 0.0
                        if ti.static(IS16):
                            acc[(E + d) * nr + r] = 0.0
                    if lr > -ti.math.inf:  # a fully masked row has no gradient
                        lim = F.visible(qi, S, causal)
            block_lim = 0
            if walk:
                block_lim = F.block_keys(q0, L, S, causal)
            mrow = F.mask_row(b, ti.min(qi, L - 1), L, S, mask_rows)
            drop = dscale != 1.0
            for t in range((block_lim + TILE_K - 1) // TILE_K):
                j0 = t * TILE_K
                F.load_kv(k, v, ks, vs, b, S, j0, E, EV, tid)
                if j0 < lim:
                    s = F.tile_scores(q, ks, mask, r * E, mrow + j0, E, scale, mask_rows, lim - j0)
                    dp = F.tile_dots(g, go, vs, EV, TILE_K)  # loss scaling makes large dO likely
                    if ti.static(IS16):
                        p = ti.Vector.zero(ti.f32, TILE_K)
                        pdp = ti.Vector.zero(ti.f32, TILE_K)
                        for j in ti.static(range(TILE_K)):
                            p[j] = ti.exp(s[j] - lr)
                            pdp[j] = (
                                p[j] * dp[j] * F.keep_scale(r, L, S, j0 + j, key, threshold, dscale, drop)
                            )
                            di += pdp[j]
                            psum += p[j]
                        for d in range(E):
                            a = acc[d * nr + r]
                            c = acc[(E + d) * nr + r]
                            for j in ti.static(range(TILE_K)):
                                kd = ti.cast(ks[j * E + d], ti.f32)  # P and P dP are float32 data
                                a += pdp[j] * kd
                                c += p[j] * kd
                            acc[d * nr + r] = a
                            acc[(E + d) * nr + r] = c
                    else:
                        ds = ti.Vector.zero(ti.f32, TILE_K)
                        for j in ti.static(range(TILE_K)):
                            p = ti.exp(s[j] - lr)
                            z = F.keep_scale(r, L, S, j0 + j, key, threshold, dscale, drop)
                            ds[j] = p * (dp[j] * z - di)
                        for d in range(E):
                            a = acc[d * nr + r]
                            for j in ti.static(range(TILE_K)):
                                a += ds[j] * ti.cast(ks[j * E + d], ti.f32)  # dS is float32 data
                            acc[d * nr + r] = a
                ti.simt.block.sync()  # the next tile overwrites ks/vs
            if live:
                if psum > 0.0:  # float16 only (float32 sums no psum); 0 on a fully masked row
                    di /= psum
                dsum[r] = di
                if write_q != 0:
                    for d in range(E):
                        a = acc[d * nr + r]
                        if ti.static(IS16):
                            a -= di * acc[(E + d) * nr + r]
                        gq[r * E + d] = ti.cast(a * scale, T)

    @ti.kernel
    def backward_kv_tiled(
        q: X, k: X, v: X, mask: X, lse: F32, g: X, gk: X, gv: X, dsum: F32, acc: F32,
        bh_n: ti.i32, L: ti.i32, S: ti.i32, E: ti.i32, EV: ti.i32,
        mask_rows: ti.i32, causal: ti.i32, scale: ti.f32, key: ti.u32, threshold: ti.u32, dscale: ti.f32,
    ):  # fmt: skip
        # One thread per key row t = b * S + j, BLOCK_KV rows of one batch-head per block, walking
        # the queries TILE_Q at a time. acc[d * nk + t] sums grad_k (d < E) then grad_v.
        kblocks = (S + BLOCK_KV - 1) // BLOCK_KV
        nk = bh_n * S
        ti.loop_config(block_dim=BLOCK_KV)
        for gi in range(bh_n * kblocks * BLOCK_KV):
            tid = gi % BLOCK_KV
            blk = gi // BLOCK_KV
            b = blk // kblocks
            j0 = (blk % kblocks) * BLOCK_KV
            j = j0 + tid
            live = j < S
            t = b * S + ti.min(j, S - 1)
            qs = ti.simt.block.SharedArray((TILE_Q * HEAD,), T)
            gs = ti.simt.block.SharedArray((TILE_Q * HEAD,), T)
            ls = ti.simt.block.SharedArray((TILE_Q,), ti.f32)
            dl = ti.simt.block.SharedArray((TILE_Q,), ti.f32)
            if live:
                for d in range(E + EV):
                    acc[d * nk + t] = 0.0
            first = 0  # queries i >= j see key j: the block's first tile is its first key's
            if causal != 0:
                first = ti.min(j0, L) // TILE_Q
            mbase = (b if mask_rows > 1 else 0) * L * S + ti.min(j, S - 1)
            drop = dscale != 1.0
            for tt in range(first, (L + TILE_Q - 1) // TILE_Q):
                i0 = tt * TILE_Q
                nq = ti.min(TILE_Q, L - i0)
                F.load_tile(q, qs, (b * L + i0) * E, nq * E, TILE_Q * E, tid, BLOCK_KV)
                F.load_tile(g, gs, (b * L + i0) * EV, nq * EV, TILE_Q * EV, tid, BLOCK_KV)
                if tid < TILE_Q:
                    lv = -ti.math.inf
                    dv = 0.0
                    if tid < nq:
                        lv = lse[b * L + i0 + tid]
                        dv = dsum[b * L + i0 + tid]
                    ls[tid] = lv
                    dl[tid] = dv
                ti.simt.block.sync()
                if live and (causal == 0 or i0 + nq - 1 >= j):
                    s = F.tile_dots(k, t * E, qs, E, TILE_Q)  # a product commutes: as Q.K
                    p = ti.Vector.zero(ti.f32, TILE_Q)
                    z = ti.Vector.zero(ti.f32, TILE_Q)
                    for i in ti.static(range(TILE_Q)):
                        qi = i0 + i
                        if qi < L and (causal == 0 or qi >= j) and ls[i] > -ti.math.inf:
                            x = s[i] * scale
                            if mask_rows != 0:
                                x += ti.cast(mask[mbase + qi * S], ti.f32)
                            p[i] = ti.exp(x - ls[i])
                            z[i] = F.keep_scale(b * L + qi, L, S, j, key, threshold, dscale, drop)
                    # grad_v's P (times keep) in the storage type; float16 applies dscale at the end.
                    pz = ti.Vector.zero(T, TILE_Q)
                    for i in ti.static(range(TILE_Q)):
                        if ti.static(IS16):
                            pz[i] = ti.cast(ti.select(z[i] != 0.0, p[i], 0.0), T)
                        else:
                            pz[i] = p[i] * z[i]
                    dp = ti.Vector.zero(ti.f32, TILE_Q)
                    for d in range(EV):
                        vd = v[t * EV + d]
                        a = acc[(E + d) * nk + t]
                        for i in ti.static(range(TILE_Q)):
                            gd = gs[i * EV + d]
                            dp[i] += ti.cast(gd * vd, ti.f32)
                            a += ti.cast(pz[i] * gd, ti.f32)
                        acc[(E + d) * nk + t] = a
                    if ti.static(IS16):
                        for i in ti.static(range(TILE_Q)):
                            if not F.finite(dp[i]):
                                dp[i] = F.dot32(gs, i * EV, v, t * EV, EV)
                    ds = ti.Vector.zero(ti.f32, TILE_Q)
                    for i in ti.static(range(TILE_Q)):
                        ds[i] = p[i] * (dp[i] * z[i] - dl[i])
                    for d in range(E):
                        a = acc[d * nk + t]
                        for i in ti.static(range(TILE_Q)):
                            a += ds[i] * ti.cast(qs[i * E + d], ti.f32)  # dS is float32 data
                        acc[d * nk + t] = a
                ti.simt.block.sync()  # the next tile overwrites qs/gs/ls/dl
            if live:
                for d in range(E):
                    gk[t * E + d] = ti.cast(acc[d * nk + t] * scale, T)
                vscale = 1.0
                if ti.static(IS16):
                    vscale = dscale  # 1.0 without dropout
                for d in range(EV):
                    gv[t * EV + d] = ti.cast(acc[(E + d) * nk + t] * vscale, T)

    return SimpleNamespace(
        forward_tiled=forward_tiled, backward_q_tiled=backward_q_tiled, backward_kv_tiled=backward_kv_tiled
    )


def all_kernels() -> list[tuple[str, object]]:
    """Every (name, kernel) pair the attention wrappers may launch, per storage dtype."""
    return [
        (f"attention_{name}_{dtype.name}", kernel)
        for dtype in FLOAT_DTYPES
        for family in (untiled_kernels_for, tiled_kernels_for)
        for name, kernel in vars(family(dtype)).items()
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


def _tiled(E: int, ev: int, dtype: np.dtype) -> bool:
    """Whether the threadgroup-memory kernels run: on the GPU archs, when a tile row fits."""
    return _on_gpu() and max(E, ev) <= max_head_dim(dtype)


def _arg(arr: DeviceArray):
    """The ndarray of an array argument, or a 1-element stand-in when it is empty: q, k and their
    gradients at head dim 0, which Taichi cannot allocate and the kernels then never index (their
    loops over the head dim are empty, so every score is 0 and the output is the mean of v)."""
    return _nd(arr) if arr.size else _optional(None, arr.dtype)


def _launch(ks: SimpleNamespace, name: str, *args) -> None:
    launches[name] += 1
    getattr(ks, name)(*args)


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
    tiled = _tiled(E, ev, q.dtype)
    _launch(
        (tiled_kernels_for if tiled else untiled_kernels_for)(q.dtype), "forward_tiled" if tiled else "forward",
        _arg(q), _arg(k), _nd(v), _optional(mask, q.dtype), _nd(out), _nd(lse), _nd(acc),
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
    suffix = "_tiled" if _tiled(E, ev, q.dtype) else ""
    ks = (tiled_kernels_for if suffix else untiled_kernels_for)(q.dtype)
    dsum = _new((bh * L,), np.float32)
    # The tiled float16 kernel sums two float32 rows per query (NOTE [ Attention backward's D ]).
    rows = 2 if suffix and q.dtype == np.float16 else 1
    acc_q = _new((max(bh * L * E * rows, 1),), np.float32)
    _launch(
        ks, "backward_q" + suffix,
        _arg(q), _arg(k), _nd(v), _optional(mask, q.dtype), _nd(out), _nd(lse), _nd(grad_out),
        _optional(None, q.dtype) if grad_q is None else _arg(grad_q), _nd(dsum), _nd(acc_q),
        bh, L, S, E, ev, mask_rows, int(is_causal), float(scale), *drop, int(grad_q is not None),
    )  # fmt: skip
    if grad_k is None and grad_v is None:
        return
    gk = grad_k if grad_k is not None else _new(k.shape, k.dtype)
    gv = grad_v if grad_v is not None else _new(v.shape, v.dtype)
    acc_kv = _new((bh * S * (E + ev),), np.float32)
    _launch(
        ks, "backward_kv" + suffix,
        _arg(q), _arg(k), _nd(v), _optional(mask, q.dtype), _nd(lse), _nd(grad_out), _arg(gk), _nd(gv),
        _nd(dsum), _nd(acc_kv), bh, L, S, E, ev, mask_rows, int(is_causal), float(scale), *drop,
    )  # fmt: skip
