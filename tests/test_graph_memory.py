"""The autograd graph keeps only what the backward reads (NOTE [ The graph keeps no data ] in
taifuse/_engine.py): an intermediate that no node saved is freed when the forward drops it, under
autocast too, and one that a node saved lives until that node's backward ran."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import taifuse
import taifuse.functional as F
from taifuse import pool
from taifuse.amp import autocast

SHAPE = (64, 96)  # 24 KiB in float32: one pooled block each


def _in_use() -> int:
    gc.collect()  # a lease caught in a reference cycle returns its block only when collected
    return pool.get_pool().stats().bytes_in_use


def _leaf(seed: int, shape: tuple[int, ...] = SHAPE) -> taifuse.Tensor:
    rng = np.random.default_rng(seed)
    return taifuse.tensor(rng.standard_normal(shape, dtype=np.float32), requires_grad=True)


def test_an_intermediate_no_node_saved_is_freed_when_the_forward_drops_it(backend):
    x = _leaf(0)
    h = x + x  # the additions save shapes only
    out = h + x
    nbytes = h.numpy().nbytes
    before = _in_use()
    del h
    # Before the graph kept its edges as Tensors, `out`'s node held `h` and its array to the end.
    assert before - _in_use() >= nbytes
    out.backward(taifuse.tensor(np.ones(SHAPE, np.float32)))
    np.testing.assert_array_equal(x.grad.numpy(), np.full(SHAPE, 3.0, np.float32))


def test_a_saved_intermediate_lives_until_its_backward(backend):
    x = _leaf(1)
    x.grad = taifuse.tensor(np.zeros(SHAPE, np.float32))  # the backward adds into it in place
    h = x + x
    y = F.gelu(h)  # its backward reads h
    h_values = np.array(h.numpy())  # a copy of its own, outside the pool
    nbytes = h_values.nbytes
    before = _in_use()
    del h
    assert before - _in_use() < nbytes
    y.sum().backward()
    assert before - _in_use() >= nbytes  # released by gelu's backward
    h_ref = taifuse.tensor(h_values, requires_grad=True)
    F.gelu(h_ref).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), 2 * h_ref.grad.numpy(), rtol=1e-6, atol=1e-7)


def test_under_autocast_the_float32_input_of_a_cast_is_freed(backend):
    # F.linear under autocast casts h to float16 and keeps that cast for its backward, as
    # PyTorch's autocast keeps the float16 tensors its ops consume: the float32 h is not needed.
    x, w = _leaf(2), _leaf(3, (32, SHAPE[1]))
    grads = []
    for drop in (True, False):
        x.grad = w.grad = None
        with autocast():
            h = x * 0.5
            y = F.linear(h, w)
        nbytes = h.numpy().nbytes
        before = _in_use()
        del h
        freed = before - _in_use()
        if drop:
            assert freed >= nbytes
        y.float().sum().backward()
        grads.append((x.grad.numpy(), w.grad.numpy()))
    for a, b in zip(*grads):
        np.testing.assert_array_equal(a, b)


def test_a_non_leaf_read_by_several_nodes_gets_their_gradients_summed(backend):
    x = _leaf(4)
    h = x * 3.0
    out = h * h + h  # d out / d x = (2 h + 1) * 3
    del h
    out.sum().backward()
    xv = x.numpy()
    np.testing.assert_allclose(x.grad.numpy(), (18 * xv + 3).astype(np.float32), rtol=1e-5, atol=1e-5)


def test_retain_graph_still_backwards_twice_and_a_third_time_refuses(backend):
    x = _leaf(5)
    h = x * 2.0
    out = (h * x).sum()
    del h
    out.backward(retain_graph=True)
    out.backward()
    np.testing.assert_allclose(x.grad.numpy(), 8 * x.numpy(), rtol=1e-5, atol=1e-5)
    try:
        out.backward()
    except RuntimeError as e:
        assert "second time" in str(e)
    else:
        raise AssertionError("a third backward through a freed graph should raise")


def _count_acquired(monkeypatch, shape: tuple[int, ...]) -> list[np.dtype]:
    """The buffers of ``shape`` any pool hands out from now on (their dtypes, one per request)."""
    seen: list[np.dtype] = []
    acquire = pool.BufferPool.acquire

    def counting(self, shp, dtype, *, zero=False):
        if tuple(map(int, shp)) == shape:
            seen.append(np.dtype(dtype))
        return acquire(self, shp, dtype, zero=zero)

    monkeypatch.setattr(pool.BufferPool, "acquire", counting)
    return seen


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_split_gradients_are_summed_into_one_buffer(backend, monkeypatch, dtype):
    # NOTE [ Gradients summed in place ]: CausalSelfAttention's q, k, v = c_attn(x).split(...).
    # Before, each piece's backward scattered into a zeroed array of the input's shape and the
    # engine summed those pairwise: 3 full arrays and 2 sums; now one array takes all three.
    shape = (4, 6, 3 * 8)
    rng = np.random.default_rng(6)
    xv = rng.standard_normal(shape).astype(dtype)
    weights = [rng.standard_normal((4, 6, 8)).astype(dtype) for _ in range(3)]
    x = taifuse.tensor(xv, requires_grad=True)
    h = x * 2.0  # a non-leaf: its gradient is summed by the engine before its node's backward
    q, k, v = h.split(8, dim=2)
    out = sum((p * taifuse.tensor(wv)).sum() for p, wv in zip((q, k, v), weights))
    del h, q, k, v
    seen = _count_acquired(monkeypatch, shape)
    out.backward()
    # One for the three pieces' gradients, one for h's backward (2 * g) and the leaf's copy of
    # it (mul does not own its gradients); 7 before (3 zeroed arrays and 2 sums in place of 1).
    assert len(seen) == 3, seen
    want = 2.0 * np.concatenate([w.astype(np.float32) for w in weights], axis=2)
    np.testing.assert_array_equal(x.grad.numpy().astype(np.float32), want.astype(dtype).astype(np.float32))


def test_a_piece_and_the_whole_read_together_get_their_gradients_summed(backend):
    # The in-place sum must add to what other readers contributed, in either order.
    x = _leaf(7, (6, 8))
    h = x * 1.0
    a, b = h.split([3, 5], dim=1)
    out = (h * 2.0).sum() + (a * 3.0).sum() + (h * h).sum() + (b * 5.0).sum()
    del h, a, b
    out.backward()
    xv = x.numpy()
    want = 2.0 + 2 * xv + np.concatenate([np.full((6, 3), 3.0), np.full((6, 5), 5.0)], axis=1)
    np.testing.assert_allclose(x.grad.numpy(), want.astype(np.float32), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("activation", [None, "gelu"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_linear_backward_takes_grad_pre_scratch_only_where_its_kernel_writes_it(
    grad_backend, monkeypatch, dtype, activation
):
    # The autograd op passes grad_pre=None; before it handed every backend an (N, M) array that
    # numba leaves unwritten without an activation and on its float16 path (the GPT step's
    # c_attn: 3 MiB in float32). The gradients are those of the kernels given the scratch.
    rows, k, m = 48, 16, 40
    rng = np.random.default_rng(8)
    x = taifuse.tensor(rng.standard_normal((rows, k)).astype(dtype), requires_grad=True)
    w = taifuse.tensor((rng.standard_normal((m, k)) / 4).astype(dtype), requires_grad=True)
    b = taifuse.tensor(rng.standard_normal(m).astype(dtype), requires_grad=True)
    g = taifuse.tensor(rng.standard_normal((rows, m)).astype(dtype))
    y = F.linear(x, w, b, activation=activation)
    seen = _count_acquired(monkeypatch, (rows, m))
    y.backward(g)
    seen = [d for d in seen if d == np.dtype(dtype)]  # numba's float16 blocks are float32 scratch
    writes = grad_backend.param.startswith("taichi") or (
        grad_backend.param == "numba" and activation is not None and dtype == np.float32
    )
    assert len(seen) == int(writes), seen
    from taifuse.backends import reference as ref

    wide = [a.numpy().astype(np.float64) for a in (x, w, b, g)]
    pre = wide[0] @ wide[1].T + wide[2]
    want = [np.empty((rows, k)), np.empty((m, k)), np.empty(m)]
    ref.linear_act_backward(wide[0], wide[1], pre, wide[3], activation, None, *want)
    tol = 1e-5 if dtype == np.float32 else 2e-2
    for got, expect in zip((x.grad, w.grad, b.grad), want):
        np.testing.assert_allclose(got.numpy().astype(np.float64), expect, rtol=tol, atol=tol)
