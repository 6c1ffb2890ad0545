"""The autograd graph keeps only what the backward reads (NOTE [ The graph keeps no data ] in
taifuse/tensor.py): an intermediate that no node saved is freed when the forward drops it, under
autocast too, and one that a node saved lives until that node's backward ran."""

from __future__ import annotations

import gc

import numpy as np

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
