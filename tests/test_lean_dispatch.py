"""The lean dispatch path (issue 32): an op's checks run once per signature (NOTE [ Checked
signatures ] in taifuse/_array_ops.py), and bad input after a cached call still raises the checked
path's error before anything is written; small host buffers skip the pool (NOTE [ Small host
buffers ] in taifuse/pool.py); autocast's and grad mode's switches are attribute reads."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from helpers import SUBSET

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


@pytest.mark.parametrize("op", ["relu", "silu", "sigmoid", "tanh"])
def test_one_argument_apply_takes_applys_steps(backend, op):
    # Function.apply_one (the unary activations' call, NOTE [ The lean apply ]): a strided view
    # reaches the kernel as a contiguous copy, the gradient flows to the view's base, nothing is
    # recorded under no_grad or for a tensor that does not require grad, and a change in place of
    # the saved input after the forward raises at the backward, as through Function.apply.
    ref = {"relu": lambda v: np.maximum(v, 0), "silu": lambda v: v / (1 + np.exp(-v)),
           "sigmoid": lambda v: 1 / (1 + np.exp(-v)), "tanh": np.tanh}[op]  # fmt: skip
    rng = np.random.default_rng(3)
    base = rng.standard_normal((6, 4)).astype(np.float32)
    w = taifuse.tensor(base, requires_grad=True)
    y = getattr(F, op)(w.T)  # a strided view
    assert y.requires_grad and y.grad_fn is not None and y.shape == (4, 6)
    np.testing.assert_allclose(y.numpy(), ref(base.T.astype(np.float64)), rtol=1e-5, atol=1e-6)
    y.sum().backward()
    eps = 1e-3  # a central difference of the float64 reference
    numeric = (ref(base.astype(np.float64) + eps) - ref(base.astype(np.float64) - eps)) / (2 * eps)
    np.testing.assert_allclose(w.grad.numpy(), numeric, rtol=1e-3, atol=1e-3)
    with taifuse.no_grad():
        assert getattr(F, op)(w).grad_fn is None
    const = getattr(F, op)(taifuse.tensor(base))
    assert not const.requires_grad and const.grad_fn is None
    if op in ("relu", "silu"):  # these keep their input for the backward
        x = taifuse.tensor(base.copy(), requires_grad=True)
        h = x * 1.0
        out = getattr(F, op)(h)
        h.detach().add_(1.0)  # detach() shares h's memory and version counter
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.sum().backward()


@pytest.mark.parametrize("dims", [None, (0,), (1, 0)])
@pytest.mark.parametrize("mean", [False, True])
def test_one_tensor_apply_with_more_arguments_makes_applys_node(backend, dims, mean):
    # Tensor.sum and mean call Function.apply_one with their dims and flags after the Tensor:
    # the node, its needs_grad and parents, the result and the gradient are Function.apply's.
    from taifuse._tensor_functions import Sum

    rng = np.random.default_rng(4)
    base = rng.standard_normal((3, 5)).astype(np.float32)
    results = []
    for apply in (Sum.apply, Sum.apply_one):
        x = taifuse.tensor(base, requires_grad=True)
        h = x * 2.0
        y = apply(h, dims, False, mean)
        assert y.grad_fn.needs_grad == (True, False, False, False)
        assert y.grad_fn.parents == (h.grad_fn, None, None, None)
        y.sum().backward()
        with taifuse.no_grad():
            assert apply(h, dims, False, mean).grad_fn is None
        const = apply(taifuse.tensor(base), dims, True, mean)
        assert const.grad_fn is None and not const.requires_grad
        results.append((y.numpy(), x.grad.numpy(), const.numpy()))
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)
    axis = None if dims is None else tuple(dims)
    ref = (base * 2.0).astype(np.float64)
    ref = ref.mean(axis=axis) if mean else ref.sum(axis=axis)
    np.testing.assert_allclose(results[1][0], ref, rtol=1e-5, atol=1e-5)


def test_one_argument_apply_refuses_tensors_of_another_backend(backend):
    if backend.param == "numpy":
        pytest.skip(SUBSET + "needs a second backend: the numpy one is the other")
    with taifuse.use_backend("numpy"):
        x = taifuse.tensor(np.ones((2, 3), np.float32), requires_grad=True)
    with pytest.raises(TypeError, match="relu: the tensors live on backend 'numpy'"):
        F.relu(x)


def test_released_node_drops_data_keeps_metadata():
    # Function.release tests the exact types first (NOTE [ Released nodes ]): arrays and floats
    # go, ints, flags, strings, None, dtypes, shapes and the fields apply sets stay.
    from taifuse._engine import Function

    node = Function()
    node.be, node.m, node.needs_grad, node.parents = taifuse.backends.active(), object(), (True,), (None,)
    node.x, node.s, node.n, node.flag, node.name, node.none = np.ones(3), 0.5, 3, True, "a", None
    node.shape, node.dtype, node.arrays, node.fn = (2, 3), np.dtype(np.float32), (np.ones(2),), len
    node.np_int = np.int64(4)
    node.release()
    kept = set(vars(node)) - {"_freed", "released"}
    assert kept == {
        "be",
        "m",
        "needs_grad",
        "parents",
        "n",
        "flag",
        "name",
        "none",
        "shape",
        "dtype",
        "np_int",
    }
    assert node._freed == {"x", "s", "arrays", "fn"}
    with pytest.raises(RuntimeError, match="second time"):
        node.x  # noqa: B018


def test_host_math_full_copy_and_broadcast():
    # HostMath's copies by assignment and fill (no np.copyto dispatch): the same values, dtypes and errors.
    from taifuse._tensor_math import HOST_MATH

    for dtype in (np.float16, np.float32, np.float64, np.int64, np.bool_):
        for value in (1.0, 0.0, 3, True):
            got = HOST_MATH.full((2, 3), value, dtype)
            expected = np.full((2, 3), value, dtype)
            assert got.dtype == expected.dtype
            np.testing.assert_array_equal(got, expected)
    assert HOST_MATH.full((), -np.inf, np.float32) == np.float32(-np.inf)
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    c = HOST_MATH.copy(a.T)
    assert c.flags.c_contiguous and not np.shares_memory(c, a)
    np.testing.assert_array_equal(c, a.T)
    np.testing.assert_array_equal(HOST_MATH.broadcast_to(a[:1], (4, 3)), np.broadcast_to(a[:1], (4, 3)))
    np.testing.assert_array_equal(HOST_MATH.broadcast_to(np.float32(2.0), (2,)), [2.0, 2.0])
    with pytest.raises(ValueError, match="broadcast"):
        HOST_MATH.broadcast_to(a, (3, 3))


@pytest.mark.parametrize("keepdim", [False, True])
def test_a_sum_of_every_element_has_the_gradient_of_ones(backend, keepdim):
    # _Sum's backward broadcasts a whole sum's gradient as it is (0-d, or 1s with keepdim).
    rng = np.random.default_rng(4)
    for shape in ((), (5,), (3, 4), (2, 3, 4)):
        x = taifuse.tensor(rng.standard_normal(shape).astype(np.float32), requires_grad=True)
        s = x.sum(keepdim=keepdim) if shape else x.sum()
        (s * 3.0).sum().backward()
        np.testing.assert_array_equal(x.grad.numpy(), np.full(shape, 3.0, np.float32))
        x.grad = None
        x.mean(keepdim=keepdim).backward() if shape else x.mean().backward()
        np.testing.assert_allclose(
            x.grad.numpy(), np.full(shape, 1.0 / max(1, int(np.prod(shape)))), rtol=1e-6
        )
        if len(shape) >= 2:  # a sum over some dimensions keeps the reshape before the broadcast
            x.grad = None
            x.sum(dim=0, keepdim=keepdim).sum().backward()
            np.testing.assert_array_equal(x.grad.numpy(), np.ones(shape, np.float32))


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_numba_linear_into_its_own_input(dtype):
    # numba's linear_act leaves the overlap of x and out to np.matmul (float32, float64) and
    # copies x only for its float16 blocks: out may be x itself.
    pytest.importorskip("numba")
    with taifuse.use_backend("numba"):
        be = taifuse.backends.active()
        rng = np.random.default_rng(5)
        x = rng.standard_normal((16, 16)).astype(dtype)
        w = (rng.standard_normal((16, 16)) / 4).astype(dtype)
        b = rng.standard_normal(16).astype(dtype)
        wide = x.astype(np.float64)
        for activation, act in ((None, lambda v: v), ("relu", lambda v: np.maximum(v, 0))):
            out = x.copy()
            be.linear_act(out, w, b, activation, out)
            ref = act(wide @ w.astype(np.float64).T + b)
            tol = 2e-2 if dtype == np.float16 else 1e-5
            np.testing.assert_allclose(out.astype(np.float64), ref, rtol=tol, atol=tol)


def _scanned_release(node) -> set[str]:
    """The fields the value-based release (NOTE [ Released nodes ]) would drop of ``node``."""
    from taifuse._engine import Function

    twin = Function()
    twin.__dict__.update(node.__dict__)
    twin.release()
    return set(twin._freed)


@pytest.mark.parametrize("activation", [None, "relu", "gelu"])
def test_declared_saved_fields_are_what_the_scan_would_free(backend, activation):
    # A Function that declares ``saved`` is released without the scan of its fields: the
    # declaration must name every field the scan would drop (else its data outlives the backward),
    # and the second backward still raises where, and only where, a dropped field is read again.
    x = taifuse.tensor(np.ones((8, 16), np.float32), requires_grad=True)
    w = taifuse.tensor(np.full((4, 16), 0.5, np.float32), requires_grad=True)
    b = taifuse.tensor(np.ones(4, np.float32), requires_grad=True)
    y = F.linear(x, w, b, activation)
    loss = y.sum()
    for node in (y.grad_fn, loss.grad_fn):
        assert type(node).saved is not None
        assert _scanned_release(node) <= set(type(node).saved)
    lin = y.grad_fn
    loss.backward()
    assert lin.released and not set(type(lin).saved) & set(vars(lin))
    np.testing.assert_allclose(w.grad.numpy(), np.full((4, 16), 8.0, np.float32), rtol=1e-6)
    with pytest.raises(RuntimeError, match="second time"):
        loss.backward()
    with pytest.raises(RuntimeError, match="second time"):
        lin.x  # noqa: B018
    with pytest.raises(AttributeError):
        lin.not_a_field  # noqa: B018
    # A sum saved no data: its node runs again, as PyTorch's (a leaf's sum backpropagates twice).
    s = x.sum()
    s.backward()
    s.backward()
    np.testing.assert_array_equal(x.grad.numpy()[0], np.full(16, 2.0 + 4 * 0.5, np.float32))


def test_graph_order_of_a_chain_and_of_a_branching_graph():
    # _graph_order takes a chain (one creator per node) as it is and searches any other graph:
    # both give every node after the nodes that computed its inputs, each node once.
    from taifuse._engine import _graph_order

    with taifuse.use_backend("numpy"):
        x = taifuse.tensor(np.ones((2, 3), np.float32), requires_grad=True)
        a = x * 2.0
        b = a.sum(0)
        c = b * 3.0
        chain = _graph_order(c.grad_fn)
        assert chain == [a.grad_fn, b.grad_fn, c.grad_fn]
        d = a * a + b.sum()  # a reaches d twice, and b's sum joins it
        order = _graph_order(d.grad_fn)
        assert len(order) == len({id(n) for n in order}) == 5  # 2x, a * a, a.sum(0), b.sum(), +
        position = {id(n): i for i, n in enumerate(order)}
        for n in order:
            for p in n.parents:
                if p is not None and not isinstance(p, taifuse.Tensor):
                    assert position[id(p)] < position[id(n)]
        d.sum().backward()
        # sum(d) = sum(4 x^2) + 6 * sum(2 x): its gradient 8 x + 12
        np.testing.assert_allclose(x.grad.numpy(), np.full((2, 3), 8.0 + 12.0, np.float32), rtol=1e-6)


def test_linear_of_tensors_repeats_the_checked_result_for_every_shape(backend):
    # The autograd linear's forward keeps a plan per signature (_array_ops.linear_arrays): the
    # 2-D product goes straight to the kernel, a batched or empty input takes the reshapes; every
    # call, first or repeated, gives the reference's values, and a bad signature after a cached
    # one still raises the checked path's error.
    rng = np.random.default_rng(6)
    w = taifuse.tensor(rng.standard_normal((4, 16)).astype(np.float32), requires_grad=True)
    b = taifuse.tensor(rng.standard_normal(4).astype(np.float32), requires_grad=True)
    for shape in ((8, 16), (2, 3, 16), (0, 16), (1, 16)):
        xa = rng.standard_normal(shape).astype(np.float32)
        ref = xa.astype(np.float64) @ w.numpy().T.astype(np.float64) + b.numpy()
        for _ in range(2):
            y = F.linear(taifuse.tensor(xa), w, b)
            assert y.shape == shape[:-1] + (4,)
            np.testing.assert_allclose(y.numpy(), ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="linear: x has 15 features"):
        F.linear(taifuse.tensor(np.ones((8, 15), np.float32)), w, b)
    if backend.supports_f64:
        with pytest.raises(TypeError, match="linear"):
            F.linear(taifuse.tensor(np.ones((8, 16), np.float64)), w, b)
