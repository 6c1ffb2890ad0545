"""The lean dispatch path (issue 32): an op's checks run once per signature (NOTE [ Checked
signatures ] in taifuse/_array_ops.py), and bad input after a cached call still raises the checked
path's error before anything is written; small host buffers skip the pool (NOTE [ Small host
buffers ] in taifuse/pool.py); autocast's and grad mode's switches are attribute reads."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import taifuse
import taifuse.functional as F
from taifuse import _array_ops, _autocast_state, pool
from taifuse.amp import autocast


def _count_checks(monkeypatch) -> list[str]:
    seen: list[str] = []
    original = _array_ops.check_float_array

    def counting(dtype, be, op, argname, *args, **kwargs):
        seen.append(f"{op}:{argname}")
        return original(dtype, be, op, argname, *args, **kwargs)

    monkeypatch.setattr(_array_ops, "check_float_array", counting)
    return seen


def test_a_repeated_signature_skips_the_checks(backend, monkeypatch):
    rng = np.random.default_rng(0)
    x = taifuse.tensor(rng.standard_normal((8, 16)).astype(np.float32), requires_grad=True)
    w = taifuse.tensor(rng.standard_normal((4, 16)).astype(np.float32), requires_grad=True)
    b = taifuse.tensor(rng.standard_normal(4).astype(np.float32), requires_grad=True)
    F.relu(x), F.linear(x, w, b)  # the signatures recorded (or already known)
    seen = _count_checks(monkeypatch)
    for _ in range(3):
        y = F.linear(F.relu(x), w, b)
    assert seen == []
    # The results are still the checked path's.
    ref = np.maximum(x.numpy(), 0) @ w.numpy().T + b.numpy()
    np.testing.assert_allclose(y.numpy(), ref, rtol=1e-5, atol=1e-5)


def test_another_signature_takes_the_checked_path(backend, monkeypatch):
    # The signatures are process-wide: start from none, so that an earlier test's float64 relu
    # (test_autograd_ops runs several) does not make the float64 call below a known signature.
    monkeypatch.setattr(_array_ops, "_CHECKED", _array_ops._CheckedSignatures())
    x = taifuse.tensor(np.ones((3, 5), np.float32))
    F.relu(x)
    seen = _count_checks(monkeypatch)
    F.relu(taifuse.tensor(np.ones((3, 5), np.float32)))  # the same signature
    assert seen == []
    if backend.supports_f64:
        F.relu(taifuse.tensor(np.ones((3, 5), np.float64)))
        assert seen == ["relu:x"]


def test_bad_input_after_a_cached_call_raises_the_same_errors(backend):
    rng = np.random.default_rng(1)
    x = taifuse.tensor(rng.standard_normal((8, 16)).astype(np.float32))
    w = taifuse.tensor(rng.standard_normal((4, 16)).astype(np.float32))
    b = taifuse.tensor(np.zeros(4, np.float32))
    F.relu(x), F.linear(x, w, b), F.relu(x.numpy())  # cached
    with pytest.raises(TypeError, match="relu: x should be a floating-point array"):
        F.relu(np.ones((8, 16), np.int32))
    with pytest.raises(TypeError, match="relu: x should be a numpy.ndarray, got list"):
        F.relu([1.0, 2.0])
    with pytest.raises(ValueError, match="linear: bias should have shape \\(4,\\)"):
        F.linear(x, w, taifuse.tensor(np.zeros(5, np.float32)))
    with pytest.raises(ValueError, match="linear: x has 15 features"):
        F.linear(taifuse.tensor(np.ones((8, 15), np.float32)), w, b)
    with pytest.raises(ValueError, match="linear: weight should be 2-D"):
        F.linear(x.numpy(), np.ones(16, np.float32))
    out = np.full((8, 16), 7.0, np.float32)
    with pytest.raises(ValueError, match="relu: out should have shape"):
        F.relu(x.numpy(), out=np.empty((2, 2), np.float32))
    F.relu(x.numpy(), out=out)  # out= is always checked, and still written
    np.testing.assert_array_equal(out, np.maximum(x.numpy(), 0))


def test_a_numpy_input_gets_a_numpy_result_from_the_cached_path(backend):
    a = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    first, second = F.relu(a), F.relu(a)
    assert isinstance(second, np.ndarray) and type(second) is type(first)
    np.testing.assert_array_equal(second, np.maximum(a, 0))
    # A non-contiguous input is made contiguous as the checked path does.
    np.testing.assert_array_equal(F.relu(a.T), np.maximum(a.T, 0))


def test_small_host_buffers_skip_the_pool():
    with taifuse.use_backend("numpy"):
        be = taifuse.backends.active()
        host = pool.host_pool()
        before = host.stats()
        small = [pool.empty(be, (16, 16), np.float32) for _ in range(4)]  # 1 KiB each
        after = host.stats()
        assert (after.allocations, after.reuses) == (before.allocations, before.reuses)
        assert all(a.shape == (16, 16) and a.dtype == np.float32 for a in small)
        large = pool.empty(be, (16, 17), np.float32)  # 1088 B: pooled
        assert host.stats().allocations + host.stats().reuses == before.allocations + before.reuses + 1
        del large
        np.testing.assert_array_equal(pool.zeros(be, (3, 5), np.float64), np.zeros((3, 5)))
        host.fill_on_reuse = np.nan
        try:
            assert np.isnan(pool.empty(be, (2, 3), np.float32)).all()
        finally:
            host.fill_on_reuse = None


def test_autocast_switch_is_one_attribute_read():
    assert _autocast_state.current.active is None
    with autocast():
        assert _autocast_state.current.active is _autocast_state.state()
        with autocast(enabled=False):
            assert _autocast_state.current.active is None
        assert _autocast_state.current.active is not None
        seen = []
        t = threading.Thread(target=lambda: seen.append(_autocast_state.current.active))
        t.start()
        t.join()
        assert seen == [None]  # per thread
    assert _autocast_state.current.active is None


def test_grad_mode_is_per_thread():
    seen = []
    with taifuse.no_grad():
        t = threading.Thread(target=lambda: seen.append(taifuse.is_grad_enabled()))
        t.start()
        t.join()
        assert not taifuse.is_grad_enabled()
    assert seen == [True] and taifuse.is_grad_enabled()


def test_a_released_checkpoint_node_keeps_nodes_not_argument_tensors():
    # NOTE [ Released nodes ]: a checkpoint's parents are its argument Tensors; once its backward
    # ran it keeps what graph_node makes of them (a non-leaf's creator, None for a constant), so
    # their arrays can go. A leaf that requires grad stays itself.
    from taifuse.checkpoint import checkpoint

    with taifuse.use_backend("numpy"):
        w = taifuse.tensor(np.full((4, 3), 2.0, np.float32), requires_grad=True)
        x = taifuse.tensor(np.ones((4, 3), np.float32))
        h = w * 3.0
        y = checkpoint(lambda a, b, c: (a * b * c).sum(), h, x, w)
        ctx = y.grad_fn
        y.backward()
        assert ctx.released
        assert ctx.parents[0] is h.grad_fn and ctx.parents[1] is None and ctx.parents[2] is w
        # d/dw of sum(3w * x * w) = 6 w x
        np.testing.assert_allclose(w.grad.numpy(), np.full((4, 3), 12.0, np.float32), rtol=1e-6)


def test_a_small_sums_gradient_is_made_whole_a_large_ones_stays_a_view():
    # Sum's backward expands its gradient with copy_small (_tensor_math.expanded): at most
    # pool.SMALL_HOST_BYTES a contiguous copy (the kernel after it needs one anyway), above that
    # the read-only broadcast view that allocates nothing.
    from taifuse._tensor_math import HOST_MATH, expanded

    g = np.full((1, 1), 2.0, np.float32)
    small = expanded(HOST_MATH, g, (8, 16), copy_small=True)  # 512 B
    assert small.flags.c_contiguous and small.shape == (8, 16)
    np.testing.assert_array_equal(small, np.full((8, 16), 2.0, np.float32))
    large = expanded(HOST_MATH, g, (64, 64), copy_small=True)  # 16 KiB
    assert large.strides == (0, 0) and not large.flags.writeable
    assert expanded(HOST_MATH, g, (8, 16)).strides == (0, 0)  # without copy_small: the view
    with taifuse.use_backend("numpy"):
        for shape in ((8, 16), (64, 64)):
            x = taifuse.tensor(np.arange(np.prod(shape), dtype=np.float32).reshape(shape), requires_grad=True)
            w = taifuse.tensor(np.ones((5, shape[1]), np.float32), requires_grad=True)
            taifuse.functional.linear(x, w).sum().backward()
            np.testing.assert_array_equal(x.grad.numpy(), np.full(shape, 5.0, np.float32))
            np.testing.assert_array_equal(w.grad.numpy(), np.broadcast_to(x.numpy().sum(0), (5, shape[1])))
