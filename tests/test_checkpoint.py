"""Gradient checkpointing: the same values and bitwise the same gradients as an unchecked run, a
call counter proving one recomputation per segment, dropout masks replayed, nesting, inputs
without grad, no_grad inside, outputs used twice, exceptions leaving no state behind, and the
activations really freed."""

from __future__ import annotations

import contextlib
import doctest
import gc
import tracemalloc
import weakref
from pathlib import Path

import numpy as np
import pytest
from helpers import TOLERANCES, BackendSpec

import taifuse
import taifuse.functional as F
from taifuse import _random, nn
from taifuse.checkpoint import checkpoint, checkpoint_sequential

HOST_BACKENDS = ("numpy", "numba")

# grad_backend: the fixture in conftest.py (numpy and numba; taichi skips until it has backward kernels).


class Counting(nn.Module):
    """Calls ``module`` and counts the calls (the recomputation shows as a second call)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.module(x)


def _layers(n: int = 6, width: int = 16, dropout: float = 0.25) -> list[nn.Module]:
    layers: list[nn.Module] = []
    for i in range(n):
        layers.append(Counting(nn.Linear(width, width, activation="gelu")))
        if i % 2 == 0:
            layers.append(Counting(nn.Dropout(dropout)))
        if i % 3 == 1:
            layers.append(Counting(nn.LayerNorm(width)))
    return layers


def _data(rows: int = 5, width: int = 16, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, width), dtype=np.float32)


def _run(model: nn.Module, forward, x: np.ndarray, seed: int = 7, x_grad: bool = True):
    """Loss value, input gradient and parameter gradients of one forward + backward."""
    model.zero_grad()
    taifuse.manual_seed(seed)
    xt = taifuse.tensor(x, requires_grad=x_grad)
    out = forward(xt)
    loss = (out * out).mean() + out.sum()
    loss.backward()
    # Keyed by position: a wrapped model names the same parameters differently.
    grads = {i: p.grad.numpy().copy() for i, p in enumerate(model.parameters()) if p.grad is not None}
    return loss.item(), (None if xt.grad is None else xt.grad.numpy().copy()), grads, out.numpy().copy()


def _same(backend: BackendSpec):
    """Bitwise equality on the host backends; float32 tolerance where a GPU's reductions may
    accumulate in a different order from one launch to the next."""
    if backend.name in HOST_BACKENDS:
        return np.testing.assert_array_equal
    tol = TOLERANCES[np.dtype(np.float32)]
    return lambda a, b, err_msg="": np.testing.assert_allclose(a, b, tol.rtol, tol.atol, err_msg=err_msg)


def _assert_identical(a, b, backend: BackendSpec) -> None:
    same = _same(backend)
    loss_a, gx_a, grads_a, out_a = a
    loss_b, gx_b, grads_b, out_b = b
    same(np.float32(loss_a), np.float32(loss_b))
    same(out_a, out_b)
    if gx_a is None:
        assert gx_b is None
    else:
        same(gx_a, gx_b)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name in grads_a:
        same(grads_a[name], grads_b[name], err_msg=f"parameter {name}")


def _calls(model: nn.Module) -> list[int]:
    return [m.calls for m in model.modules() if isinstance(m, Counting)]


# ----------------------------------------------------------------------------- identical results


@pytest.mark.parametrize("segments", [1, 2, 3, "all"])
def test_checkpoint_sequential_matches_unchecked_bitwise(grad_backend, segments):
    taifuse.manual_seed(0)
    model = nn.Sequential(*_layers())
    x = _data()
    plain = _run(model, model, x)
    n = len(model) if segments == "all" else segments
    checked = _run(model, lambda t: checkpoint_sequential(model, n, t), x)
    _assert_identical(plain, checked, grad_backend)


def test_checkpoint_of_a_function_matches_unchecked_bitwise(grad_backend):
    taifuse.manual_seed(0)
    a, b = nn.Linear(16, 16, activation="silu"), nn.Linear(16, 16)
    model = nn.Sequential(a, b)

    def block(x, scale):
        return F.gelu(b(F.dropout(a(x), 0.3)) * scale)

    x = _data()
    plain = _run(model, lambda t: block(t, 0.5), x)
    checked = _run(model, lambda t: checkpoint(block, t, 0.5), x)
    _assert_identical(plain, checked, grad_backend)


def test_nn_checkpoint_module_matches_unchecked_bitwise(grad_backend):
    taifuse.manual_seed(0)
    inner = nn.Sequential(*_layers(4))
    head = nn.Linear(16, 3)
    plain_model = nn.Sequential(inner, head)
    checked_model = nn.Sequential(nn.Checkpoint(inner), head)
    x = _data()
    _assert_identical(_run(plain_model, plain_model, x), _run(checked_model, checked_model, x), grad_backend)
    names = [name for name, _ in checked_model.named_parameters()]
    assert names[0] == "0.module.0.module.weight"
    assert len(names) == len(list(plain_model.parameters()))


def test_retain_graph_recomputes_on_each_backward(grad_backend):
    taifuse.manual_seed(0)
    model = nn.Sequential(*_layers(3))
    x = taifuse.tensor(_data(), requires_grad=True)
    taifuse.manual_seed(1)
    y = checkpoint_sequential(model, 2, x)
    loss = y.sum()
    loss.backward(retain_graph=True)
    first = model[0].module.weight.grad.numpy().copy()
    loss.backward()
    np.testing.assert_array_equal(model[0].module.weight.grad.numpy(), first + first)
    assert _calls(model) == [3] * len(_calls(model))  # forward, then one recomputation per backward


# ----------------------------------------------------------------------------- recomputation count


@pytest.mark.parametrize("segments", [1, 2, 4])
def test_exactly_one_recomputation_per_segment(grad_backend, segments):
    taifuse.manual_seed(0)
    model = nn.Sequential(*_layers(4))
    x = taifuse.tensor(_data(), requires_grad=True)
    y = checkpoint_sequential(model, segments, x)
    assert _calls(model) == [1] * len(model)  # the forward runs each layer once
    (y * y).sum().backward()
    assert _calls(model) == [2] * len(model)  # and the backward recomputes each once


def test_output_used_twice_is_recomputed_once(grad_backend):
    taifuse.manual_seed(0)
    block = Counting(nn.Sequential(*_layers(2)))
    x = _data()
    plain = _run(block, block, x)
    block.calls = 0

    def twice(t):
        h = checkpoint(block, t)
        return h * 2.0 + F.gelu(h)  # h feeds two consumers

    def twice_plain(t):
        h = block(t)
        return h * 2.0 + F.gelu(h)

    block.calls = 0
    plain = _run(block, twice_plain, x)
    block.calls = 0
    checked = _run(block, twice, x)
    assert block.calls == 2
    _assert_identical(plain, checked, grad_backend)


# ----------------------------------------------------------------------------- random state


def test_dropout_mask_is_replayed(grad_backend):
    x = taifuse.tensor(np.ones((64, 32), np.float32), requires_grad=True)
    taifuse.manual_seed(3)
    y = checkpoint(lambda t: F.dropout(t, 0.5), x)
    y.sum().backward()
    # d(sum(dropout(x)))/dx is the mask times the scale, so it must equal the forward's output
    # for x = 1: the recomputation drew the forward's mask.
    np.testing.assert_array_equal(x.grad.numpy(), y.numpy())
    assert 0 < np.count_nonzero(y.numpy()) < y.size


def test_random_stream_continues_as_without_checkpointing(grad_backend):
    taifuse.manual_seed(0)
    model = nn.Sequential(*_layers(3))
    x = _data()
    _run(model, model, x, seed=11)
    after_plain = _random.next_seed()
    _run(model, lambda t: checkpoint_sequential(model, 2, t), x, seed=11)
    assert _random.next_seed() == after_plain


def test_without_preserve_rng_state_the_recomputation_draws_new_masks(grad_backend):
    x = taifuse.tensor(np.ones((64, 32), np.float32), requires_grad=True)
    taifuse.manual_seed(3)
    y = checkpoint(lambda t: F.dropout(t, 0.5), x, preserve_rng_state=False)
    y.sum().backward()
    assert not np.array_equal(x.grad.numpy(), y.numpy())


# ----------------------------------------------------------------------------- nesting, grad modes


def test_nested_checkpoints(grad_backend):
    taifuse.manual_seed(0)
    inner = Counting(nn.Sequential(*_layers(2)))
    outer_layer = nn.Linear(16, 16, activation="gelu")
    model = nn.Sequential(inner, outer_layer)

    def outer(t):
        return outer_layer(checkpoint(inner, t))

    x = _data()
    plain = _run(model, lambda t: outer_layer(inner(t)), x)
    inner.calls = 0
    checked = _run(model, lambda t: checkpoint(outer, t), x)
    # outer forward, outer recomputation (which runs inner's forward again), inner recomputation
    assert inner.calls == 3
    _assert_identical(plain, checked, grad_backend)


def test_input_without_grad_still_trains_the_parameters(grad_backend):
    taifuse.manual_seed(0)
    model = nn.Sequential(*_layers(3))
    x = _data()
    plain = _run(model, model, x, x_grad=False)
    checked = _run(model, lambda t: checkpoint_sequential(model, 3, t), x, x_grad=False)
    _assert_identical(plain, checked, grad_backend)
    assert plain[1] is None


def test_nothing_requiring_grad_gives_a_plain_output(grad_backend):
    layer = nn.Linear(16, 16, activation="gelu")
    for p in layer.parameters():
        p.requires_grad = False
    y = checkpoint(layer, taifuse.tensor(_data()))
    assert not y.requires_grad and y.grad_fn is None


def test_no_grad_inside_fn(grad_backend):
    taifuse.manual_seed(0)
    frozen, trained = nn.Linear(16, 16, activation="gelu"), nn.Linear(16, 16)
    model = nn.Sequential(frozen, trained)

    def block(t):
        with taifuse.no_grad():
            h = frozen(t)
        return trained(h)

    x = _data()
    plain = _run(model, block, x)
    checked = _run(model, lambda t: checkpoint(block, t), x)
    _assert_identical(plain, checked, grad_backend)
    assert frozen.weight.grad is None and checked[1] is None  # no path from the loss to x


def test_under_no_grad_it_is_a_plain_call(grad_backend):
    block = Counting(nn.Linear(16, 16))
    x = taifuse.tensor(_data(), requires_grad=True)
    with taifuse.no_grad():
        y = checkpoint(block, x)
    assert block.calls == 1 and not y.requires_grad
    np.testing.assert_array_equal(y.numpy(), block.module(x).numpy())


# ----------------------------------------------------------------------------- errors leave no state


class Boom(RuntimeError):
    pass


def _raising_block(fail_on_call: int):
    calls = []

    def block(t):
        calls.append(1)
        t = F.dropout(t, 0.5)  # draws from the generator before failing
        if len(calls) == fail_on_call:
            raise Boom("inside fn")
        return F.gelu(t)

    return block


@pytest.mark.parametrize("outer_mode", ["grad", "enable_grad_inside_no_grad"])
def test_exception_in_forward_leaks_no_state(grad_backend, outer_mode):
    x = taifuse.tensor(_data(), requires_grad=True)
    taifuse.manual_seed(5)
    state = _random.get_rng_state()
    with pytest.raises(Boom):
        if outer_mode == "grad":
            checkpoint(_raising_block(1), x)
        else:
            with taifuse.no_grad(), taifuse.enable_grad():
                checkpoint(_raising_block(1), x)
    assert taifuse.is_grad_enabled()
    assert _random.get_rng_state() == state


def test_exception_in_recomputation_leaks_no_state(grad_backend):
    x = taifuse.tensor(_data(), requires_grad=True)
    taifuse.manual_seed(5)
    loss = checkpoint(_raising_block(2), x).sum()
    state = _random.get_rng_state()
    with taifuse.no_grad():  # the backward may be called in either mode; it must leave that mode
        with pytest.raises(Boom):
            loss.backward()
        assert not taifuse.is_grad_enabled()
    assert taifuse.is_grad_enabled()
    assert _random.get_rng_state() == state


def test_non_tensor_output_is_a_type_error(grad_backend):
    x = taifuse.tensor(_data(), requires_grad=True)
    state = _random.get_rng_state()
    with pytest.raises(TypeError, match="one Tensor"):
        checkpoint(lambda t: (t, t), x)
    assert _random.get_rng_state() == state and taifuse.is_grad_enabled()


def test_argument_errors(grad_backend):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    x = taifuse.tensor(np.ones((1, 4), np.float32))
    with pytest.raises(TypeError, match="callable"):
        checkpoint(3, x)
    for bad in (0, 3, 1.5, True):
        with pytest.raises(ValueError, match="segments"):
            checkpoint_sequential(model, bad, x)
    with pytest.raises(ValueError, match="empty"):
        checkpoint_sequential([], 1, x)
    with pytest.raises(TypeError, match=r"functions\[1\]"):
        checkpoint_sequential([model[0], 7], 1, x)
    with pytest.raises(TypeError, match="Module"):
        nn.Checkpoint(lambda t: t)


# ----------------------------------------------------------------------------- memory release


def _pool_bypassed():
    """Fresh allocations only (a buffer pool, where there is one, would hide them from tracemalloc)."""
    try:
        from taifuse.pool import get_pool
    except ImportError:
        return contextlib.nullcontext()
    return get_pool().disabled()


class Recording(nn.Module):
    """A GELU layer that keeps weak references to the tensors it makes."""

    def __init__(self, width: int, made: list) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width, activation="gelu")
        self.made = made

    def forward(self, x):
        y = self.linear(x)
        self.made.append(weakref.ref(y))
        return y


def test_activations_are_freed_after_the_forward_and_after_their_backward(grad_backend):
    made: list = []
    model = nn.Sequential(*[Recording(32, made) for _ in range(6)])
    x = taifuse.tensor(_data(8, 32), requires_grad=True)
    y = checkpoint_sequential(model, 2, x)
    # Nothing keeps the forward's intermediate tensors: refcounting freed them on return.
    assert len(made) == 6 and all(r() is None for r in made)
    made.clear()
    y.sum().backward()
    assert len(made) == 6 and all(r() is None for r in made)
    assert model[0].linear.weight.grad is not None


def test_checkpointed_forward_holds_only_segment_boundaries(grad_backend):
    if grad_backend.name not in HOST_BACKENDS:
        pytest.skip("tracemalloc sees host (NumPy) allocations only")
    width, rows, depth = 256, 64, 8
    activation = rows * width * 4
    taifuse.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width, activation="gelu") for _ in range(depth)])
    x = taifuse.tensor(_data(rows, width), requires_grad=True)
    for p in model.parameters():  # gradients allocated before measuring, as in training
        p.grad = taifuse.tensor(np.zeros(p.shape, p.dtype))

    def held_after_forward(forward) -> int:
        gc.collect()
        with _pool_bypassed():
            return _held_after_forward(forward)

    def _held_after_forward(forward) -> int:
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            y = forward(x)
            held = tracemalloc.get_traced_memory()[0] - before
            y.sum().backward()
        finally:
            tracemalloc.stop()
        return held

    plain = held_after_forward(model)
    checked = held_after_forward(lambda t: checkpoint_sequential(model, depth, t))
    # Unchecked: each layer keeps its output and its pre-activation. Checkpointed: the segment
    # outputs only (one activation per segment), plus small bookkeeping.
    assert plain >= 2 * depth * activation
    assert checked < (depth + 1) * activation


# ----------------------------------------------------------------------------- docs


def test_docs_examples_run():
    """docs/checkpointing.md's examples (tests/test_docs.py runs docstrings and the README only)."""
    from taifuse import backends

    # The examples switch to the numpy backend: hand the next test what it had.
    with backends.preserved_choice():
        result = doctest.testfile(
            str(Path(__file__).resolve().parents[1] / "docs" / "checkpointing.md"),
            module_relative=False,
            optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
        )
    assert result.attempted > 0
    assert result.failed == 0, "an example in docs/checkpointing.md failed (see stdout)"
