"""``F.scaled_dot_product_attention``: every backend against the float64 reference, forward and
backward; finite differences on the reference; PyTorch parity; dropout's mask; bad input; and
the fused kernels' memory."""

from __future__ import annotations

import math
import tracemalloc
from collections import Counter

import numpy as np
import pytest
from helpers import F16, F32, F64

import taifuse
import taifuse.functional as F
from taifuse import _random, pool
from taifuse.backends import reference as R

SDPA = F.scaled_dot_product_attention

# Explicit tolerances, relative to the largest magnitude of the reference result: attention
# sums S products of probabilities and values (a float32 kernel's error grows like eps * sqrt(S)
# times the largest term), and float16 storage rounds inputs and outputs to 2**-11.
TOL = {F16: 4e-3, F32: 3e-5, F64: 1e-10}

# (batch, L, S, E, Ev, causal, mask kind): odd sizes that cut every tile of every backend.
CASES = [
    ((2, 3), 37, 53, 24, 19, False, None),
    ((2, 3), 37, 53, 24, 19, True, None),
    ((2,), 53, 37, 24, 24, True, None),  # L > S under is_causal: top-left alignment
    ((2, 3), 37, 53, 24, 19, False, "bool"),
    ((2, 3), 37, 53, 24, 19, False, "float"),
    ((3,), 70, 70, 16, 8, True, None),  # more than one query block
    ((), 5, 9, 3, 2, False, "bool"),  # no batch dims
]


def _inputs(rng, batch, L, S, E, Ev, dtype, mask_kind=None, mask_batch=None):
    q = rng.standard_normal(batch + (L, E)).astype(dtype)
    k = rng.standard_normal(batch + (S, E)).astype(dtype)
    v = rng.standard_normal(batch + (S, Ev)).astype(dtype)
    mask_shape = (mask_batch if mask_batch is not None else batch[:1] + (1,) * (len(batch) - 1)) + (L, S)
    if mask_kind == "bool":
        mask = rng.random(mask_shape) > 0.3
        mask[..., 1, :] = False  # a fully masked row
    elif mask_kind == "float":
        mask = (rng.standard_normal(mask_shape) * 2).astype(dtype)
    else:
        mask = None
    return q, k, v, mask


def reference_sdpa(q, k, v, mask=None, is_causal=False, scale=None, dropout_p=0.0, seed=0, grad=None):
    """(out, (gq, gk, gv)) of the reference kernels in float64, shaped here independently of the
    array path (leading dims equal, the mask broadcast by NumPy)."""
    batch, (L, E), (S, Ev) = q.shape[:-2], q.shape[-2:], v.shape[-2:]
    bh = math.prod(batch)
    q3, k3, v3 = (np.asarray(a, np.float64).reshape(bh, *a.shape[-2:]) for a in (q, k, v))
    m3 = None
    if mask is not None:
        m = np.broadcast_to(mask, batch + (L, S))
        m3 = np.where(m, 0.0, -np.inf) if m.dtype == bool else np.asarray(m, np.float64)
        m3 = np.ascontiguousarray(m3).reshape(bh, L, S)
    scale = 1.0 / math.sqrt(E) if scale is None else scale
    out, lse = np.empty((bh, L, Ev)), np.empty((bh, L))
    R.attention(q3, k3, v3, m3, is_causal, scale, dropout_p, seed, out, lse)
    grads = None
    if grad is not None:
        grads = tuple(np.empty(a.shape) for a in (q3, k3, v3))
        g3 = np.asarray(grad, np.float64).reshape(bh, L, Ev)
        R.attention_backward(q3, k3, v3, m3, is_causal, scale, dropout_p, seed, out, lse, g3, *grads)
        grads = tuple(gr.reshape(a.shape) for gr, a in zip(grads, (q, k, v)))
    return out.reshape(batch + (L, Ev)), grads


def _close(got, ref, dtype, what):
    got = np.asarray(got, np.float64)
    atol = TOL[np.dtype(dtype)] * max(1.0, float(np.abs(ref).max(initial=0.0)))
    np.testing.assert_allclose(got, ref, rtol=TOL[np.dtype(dtype)], atol=atol, err_msg=what)


def _seeded_call(fn, seed=1234):
    """Run ``fn(drawn seed)`` with the seed the op will draw after ``manual_seed(seed)``."""
    taifuse.manual_seed(seed)
    drawn = _random.next_seed()
    taifuse.manual_seed(seed)
    return fn(drawn)


# ----------------------------------------------------------------------------- every backend vs the reference


@pytest.mark.parametrize("dtype", [F32, F16, F64], ids=["f32", "f16", "f64"])
@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: f"{c[0]}-L{c[1]}-S{c[2]}-E{c[3]}-{'causal' if c[5] else c[6]}"
)
def test_forward_backward_against_reference(backend, case, dtype):
    batch, L, S, E, Ev, causal, mask_kind = case
    backend.activate()
    rng = np.random.default_rng(L * 1000 + S)
    q, k, v, mask = _inputs(rng, batch, L, S, E, Ev, dtype, mask_kind)
    if dtype == F64 and not backend.supports_f64:
        with pytest.raises(TypeError, match="float64"):
            SDPA(q, k, v, attn_mask=mask, is_causal=causal)
        return
    g = rng.standard_normal(batch + (L, Ev)).astype(dtype)
    ref, ref_grads = reference_sdpa(q, k, v, mask, causal, grad=g)
    what = f"{backend.param} {case} {dtype}"

    got = SDPA(q, k, v, attn_mask=mask, is_causal=causal)
    assert isinstance(got, np.ndarray) and got.dtype == dtype and got.shape == ref.shape
    _close(got, ref, dtype, f"forward (arrays) {what}")

    tq, tk, tv = (taifuse.tensor(a, requires_grad=True) for a in (q, k, v))
    out = SDPA(tq, tk, tv, attn_mask=mask, is_causal=causal)
    _close(out.numpy(), ref, dtype, f"forward (tensors) {what}")
    out.backward(taifuse.tensor(g))
    for name, t, r in zip("qkv", (tq, tk, tv), ref_grads):
        _close(t.grad.numpy(), r, dtype, f"grad_{name} {what}")


@pytest.mark.parametrize("causal", [False, True])
def test_dropout_against_reference(backend, causal):
    backend.activate()
    rng = np.random.default_rng(5)
    q, k, v, _ = _inputs(rng, (2, 2), 37, 53, 24, 19, F32)
    g = rng.standard_normal((2, 2, 37, 19)).astype(np.float32)
    tq, tk, tv = (taifuse.tensor(a, requires_grad=True) for a in (q, k, v))
    out, (ref, ref_grads) = _seeded_call(
        lambda seed: (
            SDPA(tq, tk, tv, dropout_p=0.3, is_causal=causal),
            reference_sdpa(q, k, v, None, causal, None, 0.3, seed, grad=g),
        )
    )
    _close(out.numpy(), ref, F32, f"dropout forward {backend.param}")
    out.backward(taifuse.tensor(g))
    for name, t, r in zip("qkv", (tq, tk, tv), ref_grads):
        _close(t.grad.numpy(), r, F32, f"dropout grad_{name} {backend.param}")


def test_dropout_mask_is_the_same_on_every_backend(backend):
    # With v the identity (S == Ev) the output is the dropped-out probability matrix itself, so
    # its zeros are exactly the dropped elements: they must be the reference's, bit for bit.
    backend.activate()
    rng = np.random.default_rng(6)
    L = S = 40
    q, k, _, _ = _inputs(rng, (3,), L, S, 8, S, F32)
    v = np.broadcast_to(np.eye(S, dtype=np.float32), (3, S, S)).copy()
    got, ref = _seeded_call(
        lambda seed: (SDPA(q, k, v, dropout_p=0.5), reference_sdpa(q, k, v, dropout_p=0.5, seed=seed)[0])
    )
    np.testing.assert_array_equal(got == 0, ref == 0)
    assert 0.4 < (ref == 0).mean() < 0.6


def test_leading_dims_broadcast(backend):
    backend.activate()
    rng = np.random.default_rng(7)
    q = rng.standard_normal((2, 3, 9, 8)).astype(np.float32)
    k = rng.standard_normal((1, 3, 11, 8)).astype(np.float32)
    v = rng.standard_normal((3, 11, 5)).astype(np.float32)
    mask = rng.random((2, 1, 9, 11)) > 0.2
    tq, tk, tv = (taifuse.tensor(a, requires_grad=True) for a in (q, k, v))
    out = SDPA(tq, tk, tv, attn_mask=mask)
    kb, vb = np.broadcast_to(k, (2, 3, 11, 8)), np.broadcast_to(v, (2, 3, 11, 5))
    g = rng.standard_normal(out.shape).astype(np.float32)
    ref, (gq, gk, gv) = reference_sdpa(q, kb, vb, mask, grad=g)
    _close(out.numpy(), ref, F32, "broadcast forward")
    out.backward(taifuse.tensor(g))
    _close(tq.grad.numpy(), gq, F32, "broadcast grad_q")
    _close(tk.grad.numpy(), gk.sum(axis=0, keepdims=True), F32, "broadcast grad_k (summed over the batch)")
    _close(tv.grad.numpy(), gv.sum(axis=0), F32, "broadcast grad_v (summed over the batch)")


def test_fully_masked_row_gives_zero(backend):
    # PyTorch's CPU kernels (every SDPBackend, math included, in torch 2.13) give 0, not NaN.
    backend.activate()
    rng = np.random.default_rng(8)
    q, k, v, _ = _inputs(rng, (1,), 4, 6, 8, 3, F32)
    mask = np.ones((4, 6), dtype=bool)
    mask[2] = False
    tq, tk, tv = (taifuse.tensor(a, requires_grad=True) for a in (q, k, v))
    out = SDPA(tq, tk, tv, attn_mask=mask)
    assert np.all(out.numpy()[0, 2] == 0)
    assert np.isfinite(out.numpy()).all()
    out.sum().backward()
    assert np.all(tq.grad.numpy()[0, 2] == 0)
    assert all(np.isfinite(t.grad.numpy()).all() for t in (tq, tk, tv))


# ----------------------------------------------------------------------------- the reference itself


@pytest.mark.parametrize(
    "causal, mask_kind, p",
    [(False, None, 0.0), (True, None, 0.0), (False, "float", 0.0), (False, "bool", 0.4), (True, None, 0.4)],
)
def test_reference_gradients_by_finite_differences(causal, mask_kind, p):
    rng = np.random.default_rng(9)
    q, k, v, mask = _inputs(rng, (2,), 4, 5, 3, 2, np.float64, mask_kind)
    g = rng.standard_normal((2, 4, 2))
    _, grads = reference_sdpa(q, k, v, mask, causal, 0.7, p, 77, grad=g)

    def loss(q_, k_, v_):
        return float((reference_sdpa(q_, k_, v_, mask, causal, 0.7, p, 77)[0] * g).sum())

    h = 1e-6
    for which, grad in enumerate(grads):
        args = [q, k, v]
        fd = np.empty_like(args[which])
        for idx in np.ndindex(fd.shape):
            plus = [a.copy() for a in args]
            minus = [a.copy() for a in args]
            plus[which][idx] += h
            minus[which][idx] -= h
            fd[idx] = (loss(*plus) - loss(*minus)) / (2 * h)
        np.testing.assert_allclose(grad, fd, rtol=1e-6, atol=1e-8, err_msg=f"d/d{'qkv'[which]}")


# ----------------------------------------------------------------------------- PyTorch parity


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-L{c[1]}-S{c[2]}-{'causal' if c[5] else c[6]}")
def test_torch_parity(backend, case):
    torch = pytest.importorskip("torch")
    batch, L, S, E, Ev, causal, mask_kind = case
    backend.activate()
    rng = np.random.default_rng(11)
    q, k, v, mask = _inputs(rng, batch, L, S, E, Ev, F32, mask_kind)
    g = rng.standard_normal(batch + (L, Ev)).astype(np.float32)
    tq, tk, tv = (taifuse.tensor(a, requires_grad=True) for a in (q, k, v))
    out = SDPA(tq, tk, tv, attn_mask=mask, is_causal=causal, scale=0.4)
    out.backward(taifuse.tensor(g))
    pq, pk, pv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    pmask = None if mask is None else torch.tensor(mask)
    pout = torch.nn.functional.scaled_dot_product_attention(
        pq, pk, pv, attn_mask=pmask, is_causal=causal, scale=0.4
    )
    pout.backward(torch.tensor(g))
    scale = float(np.abs(pout.detach().numpy()).max())
    np.testing.assert_allclose(out.numpy(), pout.detach().numpy(), rtol=1e-4, atol=1e-5 * max(1.0, scale))
    for t, p in ((tq, pq), (tk, pk), (tv, pv)):
        ref = p.grad.numpy()
        np.testing.assert_allclose(
            t.grad.numpy(), ref, rtol=1e-4, atol=1e-5 * max(1.0, float(np.abs(ref).max()))
        )


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_float16_gradients_as_accurate_as_torch_float16(backend, causal):
    """NOTE [ Attention backward's D ]: grad_q and grad_k of float16 attention, against the float64
    reference, err no more than 4x PyTorch's own float16 (or 2**-11 of the largest element, where
    PyTorch's error is smaller; the float32 kernels measured up to 3.1x that, numpy's float64 1x).
    On inputs like OpInfo's float16 sample 4 (in [-9, 9], L=3, S=6, E=8: peaked rows, where
    dS = P * (dP - D) cancels) they erred up to 220x that while D came from the float16 ``out``,
    and D = rowsum(P * dP) alone, without dividing by rowsum(P), measured 35-140x on uniform
    inputs from float32's rounding of ``lse``. Multiples of 1/2 make every float16 product exact,
    so that the float16 products of taichi's tiled kernels (NOTE [ float16 products in the
    attention kernels ]) add no error of their own here."""
    torch = pytest.importorskip("torch")
    backend.activate()
    for seed in range(8):
        rng = np.random.default_rng(seed)
        q, k, v, g = (
            (rng.integers(-18, 19, s) / 2).astype(F16) for s in ((4, 3, 8), (4, 6, 8), (4, 6, 8), (4, 3, 8))
        )
        _, ref_grads = reference_sdpa(q, k, v, is_causal=causal, grad=g)
        ours = [taifuse.tensor(a, requires_grad=True) for a in (q, k, v)]
        SDPA(*ours, is_causal=causal).backward(taifuse.tensor(g))
        theirs = [torch.tensor(a, requires_grad=True) for a in (q, k, v)]
        torch.nn.functional.scaled_dot_product_attention(*theirs, is_causal=causal).backward(torch.tensor(g))
        for name, t, p, r in zip("qkv", ours, theirs, ref_grads):
            assert t.grad.dtype == F16
            err, torch_err = (np.abs(a.grad.numpy().astype(np.float64) - r).max() for a in (t, p))
            bound = 4 * max(torch_err, 2.0**-11 * np.abs(r).max())
            assert err <= bound, (f"grad_{name}", seed, err, torch_err)


# ----------------------------------------------------------------------------- bad input


def _bad_calls(q, k, v):
    L, S = q.shape[-2], k.shape[-2]
    return [
        (ValueError, "key", {"query": q, "key": k[..., :5], "value": v}),  # head dims differ
        (ValueError, "value", {"query": q, "key": k, "value": v[..., :3, :]}),  # key/value lengths differ
        (ValueError, "attn_mask", {"query": q, "key": k, "value": v, "attn_mask": np.ones((L, S + 1), bool)}),
        (ValueError, "attn_mask", {"query": q, "key": k, "value": v, "attn_mask": np.ones((4, L, S), bool)}),
        (
            ValueError,
            "is_causal",
            {"query": q, "key": k, "value": v, "attn_mask": np.ones((L, S), bool), "is_causal": True},
        ),
        (TypeError, "attn_mask", {"query": q, "key": k, "value": v, "attn_mask": np.ones((L, S), np.int32)}),
        (
            TypeError,
            "attn_mask",
            {"query": q, "key": k, "value": v, "attn_mask": np.ones((L, S), np.float16)},
        ),
        (ValueError, "dropout_p|p should", {"query": q, "key": k, "value": v, "dropout_p": 1.5}),
        (ValueError, "scale", {"query": q, "key": k, "value": v, "scale": float("nan")}),
        (TypeError, "value", {"query": q, "key": k, "value": v.astype(np.float16)}),
        (ValueError, "query", {"query": q[0, 0, 0], "key": k, "value": v}),
        (
            ValueError,
            "leading dims",
            {"query": q, "key": np.concatenate([k, k]), "value": np.concatenate([v, v])},
        ),
    ]


def test_bad_input_raises_before_anything_is_written(backend):
    backend.activate()
    rng = np.random.default_rng(12)
    q, k, v, _ = _inputs(rng, (2, 3), 6, 7, 8, 4, F32)
    before = [a.copy() for a in (q, k, v)]
    for as_tensor in (False, True):
        for exc, name, kwargs in _bad_calls(q, k, v):
            if as_tensor:
                kwargs = {
                    n: taifuse.tensor(a, requires_grad=True) if n in ("query", "key", "value") else a
                    for n, a in kwargs.items()
                }
            stats = pool.get_pool(taifuse.backends.active()).stats()
            with pytest.raises(exc, match=name):
                SDPA(**kwargs)
            after = pool.get_pool(taifuse.backends.active()).stats()
            assert after.allocations + after.reuses == stats.allocations + stats.reuses, f"{name}: pool used"
    for a, b in zip((q, k, v), before):
        np.testing.assert_array_equal(a, b)


# ----------------------------------------------------------------------------- memory


def test_numba_memory_is_not_quadratic():
    """Forward plus backward at L = S = 2048, one head: what Python allocates beyond the inputs
    stays under a quarter of one float32 (L, S) matrix (a naive softmax(QK^T)V holds several)."""
    pytest.importorskip("numba")
    with taifuse.use_backend("numba"):
        L = S = 2048
        rng = np.random.default_rng(13)
        q, k, v, _ = _inputs(rng, (1,), L, S, 64, 64, F32)
        g = taifuse.tensor(rng.standard_normal((1, L, 64)).astype(np.float32))
        tq, tk, tv = (taifuse.tensor(a, requires_grad=True) for a in (q, k, v))
        SDPA(tq, tk, tv, is_causal=True).backward(g)  # compile and warm up outside the measurement
        tq, tk, tv = (taifuse.tensor(a, requires_grad=True) for a in (q, k, v))
        pool.host_pool().clear()
        tracemalloc.start()
        try:
            SDPA(tq, tk, tv, is_causal=True).backward(g)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        quadratic = L * S * 4
        assert peak < quadratic / 4, f"peak {peak} bytes against {quadratic} for one (L, S) float32 matrix"


# ----------------------------------------------------------------------------- numba threads


def _numba_kernel_run(q, k, v, mask, causal, p, grads):
    """The numba kernels' out, lse and the gradients asked for (a None in ``grads`` is not asked)."""
    from taifuse.backends import numba as NB

    bh, L, _ = q.shape
    out = np.empty((bh, L, v.shape[2]), q.dtype)
    lse = np.empty((bh, L), np.float32 if q.dtype != F64 else F64)
    NB.attention(q, k, v, mask, causal, 0.3, p, 99, out, lse)
    g = np.random.default_rng(3).standard_normal(out.shape).astype(q.dtype)
    gq, gk, gv = (np.full(a.shape, np.nan, a.dtype) if want else None for a, want in zip((q, k, v), grads))
    NB.attention_backward(q, k, v, mask, causal, 0.3, p, 99, out, lse, g, gq, gk, gv)
    return out, lse, gq, gk, gv


@pytest.mark.parametrize("dtype", [F32, F16], ids=["f32", "f16"])
@pytest.mark.parametrize("causal, p", [(True, 0.0), (False, 0.25)])
@pytest.mark.parametrize("heads_per_group", [1, 2, 5])
def test_numba_result_does_not_depend_on_the_thread_count(dtype, causal, p, heads_per_group, monkeypatch):
    """NOTE [ Numba attention threads ]: blocks and groups of heads are shared out between
    threads, each writing rows (forward) or whole heads (backward) no other thread touches, so
    one thread and two give the same bits, and so does any grouping of the heads (5 heads in
    groups of 1, of 2 with a last group of 1, and all in one), which also agrees with the
    reference."""
    numba = pytest.importorskip("numba")
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("needs two Numba threads")
    import importlib

    kernels = importlib.import_module("taifuse.backends.numba.attention")
    rng = np.random.default_rng(5)
    L, S = 70, 83
    q, k, v, mask = _inputs(rng, (5,), L, S, 16, 12, dtype, "float", mask_batch=(5,))
    monkeypatch.setattr(kernels, "_GROUP_SCORES", heads_per_group * kernels._BLOCK_Q * S)
    assert kernels._group(5, kernels._BLOCK_Q, S) == heads_per_group
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = _numba_kernel_run(q, k, v, mask, causal, p, (True, True, True))
        numba.set_num_threads(2)
        two = _numba_kernel_run(q, k, v, mask, causal, p, (True, True, True))
    finally:
        numba.set_num_threads(before)
    for a, b in zip(one, two):
        np.testing.assert_array_equal(a, b)
    out, lse, gq, gk, gv = one
    g = np.random.default_rng(3).standard_normal(out.shape).astype(dtype)
    R_out = np.empty(out.shape, F64)
    R_lse = np.empty(lse.shape, F64)
    m64 = mask.astype(F64)
    R.attention(*(a.astype(F64) for a in (q, k, v)), m64, causal, 0.3, p, 99, R_out, R_lse)
    ref_grads = [np.empty(a.shape, F64) for a in (q, k, v)]
    R.attention_backward(
        *(a.astype(F64) for a in (q, k, v)), m64, causal, 0.3, p, 99, R_out, R_lse, g.astype(F64), *ref_grads
    )
    for got, ref, what in zip((out, gq, gk, gv), (R_out, *ref_grads), ("out", "grad_q", "grad_k", "grad_v")):
        _close(got, ref, dtype, what)


def test_numba_backward_writes_only_the_gradients_asked_for():
    """grad_q, grad_k or grad_v may be None (an input that needs no gradient); the others are
    the same as when all three are asked for."""
    pytest.importorskip("numba")
    rng = np.random.default_rng(6)
    q, k, v, _ = _inputs(rng, (3,), 70, 70, 16, 8, F32)
    full = _numba_kernel_run(q, k, v, None, True, 0.0, (True, True, True))
    for want in ((False, True, True), (True, False, False), (False, False, True)):
        part = _numba_kernel_run(q, k, v, None, True, 0.0, want)
        for got, ref, asked in zip(part[2:], full[2:], want):
            if asked:
                # All three gradients take the jitted items and fewer take the Python items, whose
                # products see k and v in another layout: equal bits on this machine's OpenBLAS
                # kernels, not on every BLAS build, so the check is float32 rounding's.
                np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
            else:
                assert got is None


@pytest.mark.parametrize("whole", [True, False], ids=["whole-scores", "block-sums"])
@pytest.mark.parametrize(
    "L, S, causal, mask_kind, p, big",
    [
        (130, 130, True, None, 0.0, False),  # three query blocks, the last one short
        (150, 100, True, None, 0.25, False),  # L > S: the last rows see every key
        (100, 150, True, "bool", 0.0, False),  # L < S: keys 100 .. 150 seen by no row get 0
        (70, 83, False, "float", 0.25, True),  # large logits: |s| in the hundreds
    ],
)
def test_numba_backward_key_sums_either_way(whole, L, S, causal, mask_kind, p, big, monkeypatch):
    """NOTE [ Numba attention blocks ]: the backward's grad_k and grad_v are one product per block
    of keys over a group's whole (L, S) scores (small heads), or sums over the query blocks through
    scratch (large ones); both give the float64 reference's output and gradients, with several
    query blocks, L > S and L < S under is_causal, a fully masked row (-inf everywhere: 0 out and
    0 gradients), dropout and logits far past exp's float32 range before the max is taken off."""
    pytest.importorskip("numba")
    import importlib

    kernels = importlib.import_module("taifuse.backends.numba.attention")
    monkeypatch.setattr(kernels, "_WHOLE_SCORES", 1 << 30 if whole else 0)
    rng = np.random.default_rng(L + S)
    q, k, v, mask = _inputs(rng, (3,), L, S, 24, 20, F32, mask_kind, mask_batch=(3,))
    if big:
        q *= 40.0
    if mask is not None and mask.dtype == bool:
        mask = np.where(mask, 0.0, -np.inf).astype(F32)
    out, lse, gq, gk, gv = _numba_kernel_run(q, k, v, mask, causal, p, (True, True, True))
    g = np.random.default_rng(3).standard_normal(out.shape)  # _numba_kernel_run's, in float64
    R_out, R_lse = np.empty(out.shape, F64), np.empty(lse.shape, F64)
    m64 = None if mask is None else mask.astype(F64)
    q64, k64, v64 = (a.astype(F64) for a in (q, k, v))
    R.attention(q64, k64, v64, m64, causal, 0.3, p, 99, R_out, R_lse)
    ref_grads = [np.empty(a.shape, F64) for a in (q, k, v)]
    R.attention_backward(
        q64, k64, v64, m64, causal, 0.3, p, 99, R_out, R_lse, g.astype(F32).astype(F64), *ref_grads
    )
    for got, ref, what in zip((out, gq, gk, gv), (R_out, *ref_grads), ("out", "grad_q", "grad_k", "grad_v")):
        _close(got, ref, F32, what)
    if mask_kind == "bool":
        assert np.all(out[:, 1] == 0) and np.all(gq[:, 1] == 0)  # the fully masked row
    if causal and S > L:
        assert np.all(gk[:, L:] == 0) and np.all(gv[:, L:] == 0)


def _heads_of_c_attn(rng, B, T, H, D, dtype):
    """q, k, v as CausalSelfAttention hands them to the kernels: (B, H, T, D) views of one (B, T,
    3C) array, and an empty (B, H, T, D) view of a (B, T, H, D) array (for out and the gradients)."""
    c = H * D
    x = rng.standard_normal((B, T, 3 * c)).astype(dtype)
    q, k, v = (x[..., i * c : (i + 1) * c].reshape(B, T, H, D).transpose(0, 2, 1, 3) for i in range(3))
    return q, k, v, lambda: np.full((B, T, H, D), np.nan, dtype).transpose(0, 2, 1, 3)


@pytest.mark.parametrize(
    "views, L, S, causal, mask_kind, p, dtype",
    [
        (3, 70, 70, True, None, 0.0, F32),  # the GPT's case: c_attn's heads, two query blocks
        # One head: out and the gradients, (B, T, 1, D) transposed, are C-contiguous and reach the
        # kernels as (B, 1, n, d); the views' split must index them (it once wrote past them).
        (1, 16, 16, True, None, 0.0, F32),
        (0, 70, 53, True, "bool", 0.25, F32),  # L > S, a fully masked row, dropout
        (0, 37, 83, False, "float", 0.0, F64),  # L < S, float64 (dgemm)
    ],
)
def test_numba_jitted_items_match_the_python_items(views, L, S, causal, mask_kind, p, dtype, monkeypatch):
    """NOTE [ BLAS from Numba threads in attention ]: where the library's ?gemm address is found,
    the forward and the whole-scores backward run as jitted items that call it themselves (on the
    transposed scores, NOTE [ Attention scores by columns ]); where it is not, the Python items run. Both give the float64
    reference's out, lse and gradients, and each other's within float32's (float64's) tolerance,
    on one thread and two (the same bits). ``views``: that many heads of c_attn's output (NOTE
    [ Numba attention views ]), or 0 for (BH, n, d) arrays."""
    numba = pytest.importorskip("numba")
    import importlib

    from taifuse.backends import numba as NB
    from taifuse.backends.numba import _blas

    kernels = importlib.import_module("taifuse.backends.numba.attention")
    if _blas.address(dtype) is None:
        pytest.skip("no OpenBLAS ?gemm address: only the Python items exist here")
    rng = np.random.default_rng(L * S)
    if views:
        q, k, v, empty = _heads_of_c_attn(rng, 2, L, views, 16, dtype)
        mask = None
    else:
        q, k, v, mask = _inputs(rng, (3,), L, S, 16, 12, dtype, mask_kind, mask_batch=(3,))
        empty = None
    if mask is not None and mask.dtype == bool:
        mask = np.where(mask, 0.0, -np.inf).astype(dtype)
    bh = math.prod(q.shape[:-2])
    g = np.random.default_rng(3).standard_normal(q.shape[:-1] + (v.shape[-1],)).astype(dtype)
    calls = Counter()
    for name in ("_forward_items", "_backward_items"):
        real = getattr(kernels, name)
        monkeypatch.setattr(
            kernels, name, lambda *a, name=name, real=real: (calls.update([name]), real(*a))[1]
        )

    def run():
        out = empty() if views else np.full(q.shape[:-1] + v.shape[-1:], np.nan, dtype)
        lse = np.empty((bh, L), dtype)
        NB.attention(q, k, v, mask, causal, 0.3, p, 99, out, lse)
        grads = [empty() if views else np.full(a.shape, np.nan, dtype) for a in (q, k, v)]
        NB.attention_backward(q, k, v, mask, causal, 0.3, p, 99, out, lse, g, *grads)
        return [np.array(a) for a in (out, lse, *grads)]

    before = numba.get_num_threads()
    runs = {}
    try:
        for hidden in (False, True):
            if hidden:  # the jitted items ran (once per worker); from here they must not
                assert calls["_forward_items"] >= 2 and calls["_backward_items"] >= 2, calls
                seen = calls.copy()
                monkeypatch.setattr(_blas, "address", lambda dtype: None)
            for threads in (1, 2) if numba.config.NUMBA_NUM_THREADS >= 2 else (1,):
                numba.set_num_threads(threads)
                runs[hidden, threads] = run()
    finally:
        numba.set_num_threads(before)
    assert calls == seen
    n = len(runs) // 2
    for a, b in zip(runs[False, 1], runs[False, n]):
        np.testing.assert_array_equal(a, b)
    g4 = g.reshape((bh,) + g.shape[-2:]).astype(F64)
    q3, k3, v3 = (np.asarray(a, F64).reshape((bh,) + a.shape[-2:]) for a in (q, k, v))
    ref = [np.empty(a, F64) for a in ((bh, L, v.shape[-1]), (bh, L), q3.shape, k3.shape, v3.shape)]
    m64 = None if mask is None else mask.astype(F64)
    R.attention(q3, k3, v3, m64, causal, 0.3, p, 99, ref[0], ref[1])
    R.attention_backward(q3, k3, v3, m64, causal, 0.3, p, 99, ref[0], ref[1], g4, *ref[2:])
    whats = ("out", "lse", "grad_q", "grad_k", "grad_v")
    for jitted, python, r, what in zip(runs[False, 1], runs[True, 1], ref, whats):
        jitted, python = (np.asarray(a, F64).reshape(r.shape) for a in (jitted, python))
        masked = np.isneginf(r)  # a fully masked row's lse: -inf on every path
        for got in (jitted, python):
            np.testing.assert_array_equal(np.isneginf(got), masked, err_msg=what)
            _close(np.where(masked, 0.0, got), np.where(masked, 0.0, r), dtype, what)
        _close(
            np.where(masked, 0.0, jitted), np.where(masked, 0.0, python), dtype, what + " vs the Python items"
        )


def _split_heads(x, heads):
    """CausalSelfAttention's q, k, v: c_attn's (B, T, 3C) output split and viewed as (B, H, T, D)."""
    b, t, c3 = x.shape
    c = c3 // 3
    return [part.view(b, t, heads, c // heads).transpose(1, 2) for part in x.split(c, dim=2)]


@pytest.mark.parametrize("dtype", [F32, F16], ids=["f32", "f16"])
@pytest.mark.parametrize("causal, p", [(True, 0.0), (False, 0.0), (True, 0.25)])
@pytest.mark.parametrize("heads_per_group", [1, 3, 6, 12])
def test_numba_takes_the_heads_of_c_attn_as_views(dtype, causal, p, heads_per_group, monkeypatch):
    """NOTE [ Numba attention views ]: q, k, v split from a (B, T, 3C) array reach the kernels as
    strided (B, H, T, D) views (not copied), the output and the gradients are made in (B, T, H, D)
    layout, so the heads' merge and the backward through it and the split copy nothing; groups of 1 head, of 3 (cut to 2, a part of a batch row), 6 (cut to 4, one
    whole row) and all 12 give the float64 reference's forward and gradient of the (B, T, 3C)
    input, the same bits on one thread and two."""
    numba = pytest.importorskip("numba")
    import importlib

    kernels = importlib.import_module("taifuse.backends.numba.attention")
    NB = importlib.import_module("taifuse.backends.numba")
    B, T, H, D = 3, 37, 4, 12  # an odd T: a causal block's edge is not a vector's
    C = H * D
    rng = np.random.default_rng(8)
    base = rng.standard_normal((B, T, 3 * C)).astype(dtype)
    g = rng.standard_normal((B, T, C)).astype(dtype)
    monkeypatch.setattr(kernels, "_GROUP_SCORES", heads_per_group * T * T)
    seen = []
    real = NB.attention

    def spy(q, k, v, *rest):
        seen.append((q.shape, q.flags.c_contiguous, np.shares_memory(q, base_arr[0])))
        return real(q, k, v, *rest)

    monkeypatch.setattr(NB, "attention", spy)
    from taifuse import _tensor_math

    copies = []
    for name in ("reshape", "contiguous"):
        method = getattr(_tensor_math.HostMath, name)

        def counted(a, *rest, _m=method, _n=name):
            r = _m(a, *rest)
            if not np.shares_memory(r, a):
                copies.append(_n)
            return r

        monkeypatch.setattr(_tensor_math.HostMath, name, staticmethod(counted))
    runs = []
    with taifuse.use_backend("numba"):
        for threads in (1, 2) if numba.config.NUMBA_NUM_THREADS >= 2 else (1,):
            before = numba.get_num_threads()
            numba.set_num_threads(threads)
            try:
                taifuse.manual_seed(3)
                seed = _random.next_seed()
                taifuse.manual_seed(3)
                x = taifuse.tensor(base.copy(), requires_grad=True)
                base_arr = [x.detach().numpy()]
                q, k, v = _split_heads(x, H)
                y = SDPA(q, k, v, is_causal=causal, dropout_p=p)
                y.transpose(1, 2).reshape(B, T, C).backward(taifuse.tensor(g))
                runs.append((y.numpy(), x.grad.numpy()))
            finally:
                numba.set_num_threads(before)
    assert seen and all(s == ((B, H, T, D), False, True) for s in seen), seen
    assert copies == [], copies  # the heads' merge and every backward step are views too
    for a, b in zip(runs[0], runs[-1]):
        np.testing.assert_array_equal(a, b)
    qr, kr, vr = (base[..., i * C : (i + 1) * C].reshape(B, T, H, D).transpose(0, 2, 1, 3) for i in range(3))
    ref, ref_grads = reference_sdpa(
        qr, kr, vr, None, causal, dropout_p=p, seed=seed, grad=g.reshape(B, T, H, D).transpose(0, 2, 1, 3)
    )
    out, grad = runs[0]
    _close(out, ref, dtype, "out")
    ref_grad = np.concatenate([r.transpose(0, 2, 1, 3).reshape(B, T, C) for r in ref_grads], axis=2)
    _close(grad, ref_grad, dtype, "grad of c_attn's output")


def test_numba_one_worker_holds_blas_to_one_thread(monkeypatch):
    """NOTE [ Numba attention threads ]: one worker (one Numba thread, or a single block) runs its
    products with BLAS on one thread, as two workers do: OpenBLAS's team on these small products
    cost several times their work. Fails where the lone worker left BLAS threaded. The Python
    items, whose row kernels are called from Python (the ?gemm address hidden: NOTE [ BLAS from
    Numba threads in attention ])."""
    numba = pytest.importorskip("numba")
    threadpoolctl = pytest.importorskip("threadpoolctl")
    import importlib

    from taifuse.backends.numba import _blas

    kernels = importlib.import_module("taifuse.backends.numba.attention")
    monkeypatch.setattr(_blas, "address", lambda dtype: None)
    blas_threads = []
    real = kernels._softmax_rows

    def spy(*args):
        info = threadpoolctl.threadpool_info()
        # NumPy's BLAS, which np.matmul calls (SciPy's, loaded along the way, is not the kernels').
        blas_threads.extend(
            i["num_threads"] for i in info if i["user_api"] == "blas" and "numpy" in i["filepath"]
        )
        return real(*args)

    monkeypatch.setattr(kernels, "_softmax_rows", spy)
    rng = np.random.default_rng(9)
    q, k, v, _ = _inputs(rng, (2,), 128, 128, 64, 64, F32)  # 64 x 128 x 64 products: OpenBLAS threads them
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        with threadpoolctl.threadpool_limits(2, user_api="blas"):
            if not any(
                i["user_api"] == "blas" and "numpy" in i["filepath"] and i["num_threads"] == 2
                for i in threadpoolctl.threadpool_info()
            ):
                pytest.skip("no BLAS that threadpoolctl can set to two threads")
            out, _, gq, gk, gv = _numba_kernel_run(q, k, v, None, True, 0.0, (True, True, True))
    finally:
        numba.set_num_threads(before)
    assert blas_threads and set(blas_threads) == {1}, blas_threads
    g = np.random.default_rng(3).standard_normal(out.shape).astype(F32)  # _numba_kernel_run's
    ref, ref_grads = reference_sdpa(q, k, v, None, True, scale=0.3, grad=g)
    for got, r, what in zip((out, gq, gk, gv), (ref, *ref_grads), ("out", "grad_q", "grad_k", "grad_v")):
        _close(got, r, F32, what)


# ----------------------------------------------------------------------------- Taichi's tiled kernels


def _taichi_attention_module():
    import importlib

    return importlib.import_module("taifuse.backends.taichi.attention")


# (batch, L, S, E, Ev, causal, mask kind, dropout_p): sizes that cut the tiles of the threadgroup
# kernels (BLOCK_Q = BLOCK_KV = 64 rows per block, TILE_K = TILE_Q = 16), the largest head dim
# they take, and head dims past it (the untiled fallback). float16 tiles take twice the head dim
# (max_head_dim), so the cases past MAX_HEAD_DIM run tiled in float16.
TAICHI_CASES = [
    ((2,), 130, 150, 128, 128, True, None, 0.0),  # E = Ev = MAX_HEAD_DIM, three query blocks
    ((2, 2), 65, 17, 33, 7, False, "float", 0.2),  # one row / one key past a block and a tile
    ((1,), 16, 64, 5, 16, False, "bool", 0.0),  # exactly one tile of queries, one block of keys
    ((2,), 20, 33, 160, 8, False, "float", 0.0),  # E past MAX_HEAD_DIM: untiled in float32
    ((2,), 21, 18, 8, 129, True, None, 0.3),  # Ev past MAX_HEAD_DIM: untiled in float32
    ((1,), 9, 12, 8, 257, False, None, 0.2),  # Ev past MAX_HEAD_DIM_F16: untiled in both
]


@pytest.mark.parametrize("dtype", [F32, F16], ids=["f32", "f16"])
@pytest.mark.parametrize("arch", ["cpu", pytest.param("vulkan", marks=pytest.mark.vulkan)])
@pytest.mark.parametrize("case", TAICHI_CASES, ids=lambda c: f"L{c[1]}-S{c[2]}-E{c[3]}-Ev{c[4]}")
def test_taichi_tiled_and_untiled_kernels(arch, case, dtype):
    """Against the reference, forward and backward; and the path that ran: the threadgroup-memory
    kernels on the GPU archs for head dims up to MAX_HEAD_DIM, the untiled ones on ti.cpu and past
    it (so a GPU run cannot fall back silently)."""
    pytest.importorskip("taichi")
    batch, L, S, E, Ev, causal, mask_kind, p = case
    A = _taichi_attention_module()
    try:
        taifuse.set_backend("taichi", arch=arch)
    except RuntimeError as exc:
        pytest.skip(f"taichi-{arch} unavailable: {exc}")
    try:
        rng = np.random.default_rng(L * 100 + E)
        q, k, v, mask = _inputs(rng, batch, L, S, E, Ev, dtype, mask_kind)
        g = rng.standard_normal(batch + (L, Ev)).astype(dtype)
        tq, tk, tv = (taifuse.tensor(a, requires_grad=True) for a in (q, k, v))
        before = A.launches.copy()
        out, (ref, ref_grads) = _seeded_call(
            lambda seed: (
                SDPA(tq, tk, tv, attn_mask=mask, is_causal=causal, dropout_p=p),
                reference_sdpa(q, k, v, mask, causal, None, p, seed, grad=g),
            )
        )
        out.backward(taifuse.tensor(g))
        what = f"taichi-{arch} {case} {dtype}"
        _close(out.numpy(), ref, dtype, f"forward {what}")
        for name, t, r in zip("qkv", (tq, tk, tv), ref_grads):
            _close(t.grad.numpy(), r, dtype, f"grad_{name} {what}")
        tiled = arch != "cpu" and max(E, Ev) <= A.max_head_dim(dtype)
        suffix = "_tiled" if tiled else ""
        ran = A.launches - before
        assert ran == Counter({f"{n}{suffix}": 1 for n in ("forward", "backward_q", "backward_kv")}), ran
    finally:
        taifuse.set_backend("numpy")


def _taichi_or_skip(arch):
    pytest.importorskip("taichi")
    try:
        taifuse.set_backend("taichi", arch=arch)
    except RuntimeError as exc:
        pytest.skip(f"taichi-{arch} unavailable: {exc}")


def _sdpa_with_grads(q, k, v, g, dropout_p=0.0, seed=7):
    tq, tk, tv = (taifuse.tensor(a, requires_grad=True) for a in (q, k, v))
    taifuse.manual_seed(seed)
    out = SDPA(tq, tk, tv, dropout_p=dropout_p)
    out.backward(taifuse.tensor(g))
    return [out.numpy()] + [t.grad.numpy() for t in (tq, tk, tv)]


@pytest.mark.parametrize("arch", ["cpu", pytest.param("vulkan", marks=pytest.mark.vulkan)])
@pytest.mark.parametrize("p", [0.0, 0.25])
def test_taichi_float16_products_err_as_little_as_float32_math_rounded(arch, p):
    """NOTE [ float16 products in the attention kernels ]: on float16 data the tiled kernels form
    their products in float16 and sum them in float32. Against the float64 reference, their error
    must be of the order of the float32 kernels' on the same inputs, rounded to float16: measured
    1.1-2.3x in the largest error and ~2x in the mean (vulkan, this shape); the bound is 4x, and
    summing the scores in float16 instead measured 17x. On ti.cpu both run float32 arithmetic."""
    _taichi_or_skip(arch)
    try:
        rng = np.random.default_rng(17)
        B, L, S, E, Ev = 2, 70, 150, 64, 64
        q, k, v = (rng.standard_normal((B, n, d)).astype(F16) for n, d in ((L, E), (S, E), (S, Ev)))
        g = rng.standard_normal((B, L, Ev)).astype(F16)
        taifuse.manual_seed(7)
        seed = _random.next_seed()
        ref, ref_grads = reference_sdpa(q, k, v, dropout_p=p, seed=seed, grad=g)
        got16 = _sdpa_with_grads(q, k, v, g, p)
        got32 = [a.astype(F16) for a in _sdpa_with_grads(*(a.astype(F32) for a in (q, k, v, g)), p)]
        for name, a16, a32, r in zip(("out", "grad_q", "grad_k", "grad_v"), got16, got32, [ref, *ref_grads]):
            assert a16.dtype == F16
            e16, e32 = (np.abs(a.astype(np.float64) - r) for a in (a16, a32))
            _close(a16, r, F16, name)
            assert e16.max() <= 4 * e32.max(), (name, e16.max(), e32.max())
            assert e16.mean() <= 4 * e32.mean(), (name, e16.mean(), e32.mean())
    finally:
        taifuse.set_backend("numpy")


@pytest.mark.parametrize("arch", ["cpu", pytest.param("vulkan", marks=pytest.mark.vulkan)])
@pytest.mark.parametrize("big", ["q_k", "grad_v"])
def test_taichi_float16_products_that_overflow_are_redone_in_float32(arch, big):
    """A float16 product past 65504 (260 * 260; or dO * V, which loss scaling makes large) would
    make a score or dP infinite; the kernels redo that sum with float32 products."""
    _taichi_or_skip(arch)
    try:
        rng = np.random.default_rng(18)
        B, L, S, E, Ev = 2, 40, 50, 16, 12
        q, k, v, g = (rng.standard_normal(s) for s in ((B, L, E), (B, S, E), (B, S, Ev), (B, L, Ev)))
        if big == "q_k":
            q[..., 0] = k[..., 0] = 260.0  # the same shift in every score: softmax ignores it
        else:
            g[..., 0] = 300.0
            v[..., 0] = 230.0 * np.sign(rng.standard_normal((B, S)))
        q, k, v, g = (a.astype(F16) for a in (q, k, v, g))
        ref, ref_grads = reference_sdpa(q, k, v, grad=g)
        got = _sdpa_with_grads(q, k, v, g)
        names = ("out", "grad_q", "grad_k", "grad_v")
        for name, a, r in zip(names, got, [ref, *ref_grads]):
            assert np.isfinite(a).all(), name
            # grad_q of the q_k case depends on scores of magnitude 65536 / 4, whose float32
            # rounding moves it by 3-5% on every backend's float32 arithmetic: finite is the claim.
            if not (big == "q_k" and name == "grad_q"):
                _close(a, r, F16, f"{name} ({big} products past float16's range)")
    finally:
        taifuse.set_backend("numpy")


def test_the_calling_thread_is_a_worker_and_every_item_runs_once():
    """NOTE [ The caller is a worker ]: with two workers the calling thread takes items itself
    (one pool thread is handed the rest), every item runs exactly once, and an error on the caller's
    side is raised only after the pool thread has finished."""
    import importlib
    import threading
    import time

    NA = importlib.import_module("taifuse.backends.numba.attention")  # the package's name is the kernel

    seen: dict[int, int] = {}
    ran = Counter()
    lock = threading.Lock()

    def task(w, item):
        with lock:
            seen[item] = threading.get_ident()
            ran[item] += 1
        time.sleep(0.002)  # the GIL is released, as in a jitted item: the threads share the items

    NA._run(task, list(range(16)), 2, False)
    assert sorted(ran) == list(range(16)) and set(ran.values()) == {1}
    assert threading.get_ident() in set(seen.values())

    done = []

    def failing(w, item):
        if threading.get_ident() == threading.main_thread().ident:
            raise RuntimeError("caller's item failed")
        done.append(item)

    with pytest.raises(RuntimeError, match="caller's item failed"):
        NA._run(failing, list(range(8)), 2, False)
