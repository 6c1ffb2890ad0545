"""Regressions from issue 26 (#2 and part of #9), each against PyTorch on every backend: two losses
sharing a graph node backpropagated one after the other, gradient accumulation inside one autocast
region, ``load_state_dict`` of a PyTorch twin's ``state_dict()``, and ``t[[]]``."""

from __future__ import annotations

import numpy as np
import pytest

import taifuse
import taifuse.functional as F
from taifuse import nn
from taifuse.amp import autocast

torch = pytest.importorskip("torch")

F32 = np.dtype(np.float32)


def _leaf(shape, seed=0):
    rng = np.random.default_rng(seed)
    v = rng.standard_normal(shape).astype(np.float32)
    return taifuse.tensor(v, requires_grad=True), torch.tensor(v, requires_grad=True)


# ----------------------------------------------------------------------------- #2: released nodes
# Reported: y = x.reshape(...); l1 = y.sum(); l2 = (2 * y).sum(); l1.backward(); l2.backward()
# raised "graph a second time" where PyTorch gives x.grad = 3: the first backward released every
# node it walked, the reshape (which saved nothing) and nodes still reachable from l2 included.


def test_two_losses_sharing_a_reshape_backpropagate_one_after_the_other(grad_backend):
    x, tx = _leaf((2, 3))
    for a, lib in ((x, taifuse), (tx, torch)):
        y = a.reshape(6)
        l1, l2 = y.sum(), (2 * y).sum()
        l1.backward()
        l2.backward()
    np.testing.assert_array_equal(x.grad.numpy(), tx.grad.numpy())
    np.testing.assert_array_equal(x.grad.numpy(), np.full((2, 3), 3.0, np.float32))


@pytest.mark.parametrize(
    "shared",
    [
        lambda a: a.reshape(3, 2),
        lambda a: a + a,
        lambda a: a - 1.0,
        lambda a: a[1:],
        lambda a: a.T,
        lambda a: a.sum(0),
        lambda a: a.mean(1, keepdim=True),
        lambda a: a.half().float(),
        lambda a: a.unsqueeze(0).expand(2, 2, 3),
        lambda a: taifuse.cat([a, a]) if isinstance(a, taifuse.Tensor) else torch.cat([a, a]),
    ],
    ids=["reshape", "add", "sub_scalar", "slice", "T", "sum", "mean", "cast", "expand", "cat"],
)
def test_a_node_that_saved_nothing_runs_again_as_in_torch(grad_backend, shared):
    # Each shared node saves shapes or dims only (PyTorch's saves no tensor either); the second
    # loss's own node (a product with a leaf) runs once.
    x, tx = _leaf((2, 3), 1)
    w, tw = _leaf((), 2)
    for a, b in ((x, w), (tx, tw)):
        y = shared(a)
        y.sum().backward()
        (y * b).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), tx.grad.numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(w.grad.numpy(), tw.grad.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "make",
    [
        lambda a: (a * a).sum(),
        lambda a: (a * 2.0).sum(),  # PyTorch saves the scalar operand as a tensor too
        lambda a: a.exp().sum(),
        lambda a: F.gelu(a).sum() if isinstance(a, taifuse.Tensor) else torch.nn.functional.gelu(a).sum(),
        lambda a: F.relu(a).sum() if isinstance(a, taifuse.Tensor) else torch.nn.functional.relu(a).sum(),
    ],
    ids=["mul", "mul_scalar", "exp", "gelu", "relu"],
)
def test_a_second_backward_through_freed_saved_values_still_raises(grad_backend, make):
    x, tx = _leaf((2, 3), 3)
    out, tout = make(x), make(tx)
    out.backward()
    tout.backward()
    with pytest.raises(RuntimeError, match="second time"):
        tout.backward()
    with pytest.raises(RuntimeError, match="second time.*retain_graph=True"):
        out.backward()
    np.testing.assert_allclose(x.grad.numpy(), tx.grad.numpy(), rtol=1e-5, atol=1e-6)


def test_a_shared_node_that_saved_values_raises_only_when_reached_again(grad_backend):
    # z = x * x saves x: after l1's backward freed it, l2's backward needs it (PyTorch raises too),
    # while a third loss that reaches x by another path still works.
    x, tx = _leaf((4,), 4)
    errors = []
    for a in (x, tx):
        z = a * a
        l1, l2 = z.sum(), (3 * z).sum()
        l1.backward()
        try:
            l2.backward()
        except RuntimeError as e:
            errors.append(str(e))
        (a * 5.0).sum().backward()
    assert len(errors) == 2 and all("second time" in e for e in errors)
    np.testing.assert_allclose(x.grad.numpy(), tx.grad.numpy(), rtol=1e-6)


def test_retain_graph_then_a_shared_node_in_a_third_loss(grad_backend):
    x, tx = _leaf((3,), 5)
    for a in (x, tx):
        z = a * a
        l1 = z.sum()
        l1.backward(retain_graph=True)
        (2 * z).sum().backward()  # z's saved x was retained: it runs, then frees it
        with pytest.raises(RuntimeError, match="second time"):
            z.sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), tx.grad.numpy(), rtol=1e-6)


# Under autocast every forward in one region shares the parameters' cached float16 casts; the
# first micro-batch's backward released those cast nodes, so the second one raised.


def _twins(seed: int):
    taifuse.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))  # torch's parameter names
    twin = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    with torch.no_grad():
        for (name, p), (tname, tp) in zip(model.named_parameters(), twin.named_parameters()):
            assert name == tname
            tp.copy_(torch.from_numpy(p.numpy()))
    return model, twin


def test_gradient_accumulation_inside_one_autocast_region_matches_torch(grad_backend):
    model, twin = _twins(7)
    rng = np.random.default_rng(8)
    batches = [rng.standard_normal((5, 8)).astype(np.float32) for _ in range(3)]
    with autocast():
        for mb in batches:
            model(taifuse.tensor(mb)).float().sum().backward()
    with torch.autocast("cpu", dtype=torch.float16):
        for mb in batches:
            twin(torch.from_numpy(mb)).float().sum().backward()
    # Float16 forward and backward on both sides (NOTE [ Autocast gradient tolerance ] in
    # test_autocast.py): 1e-2 of each parameter's largest gradient.
    for (name, p), (_, tp) in zip(model.named_parameters(), twin.named_parameters()):
        assert p.grad.dtype == F32
        ref = tp.grad.numpy()
        err = float(np.abs(p.grad.numpy() - ref).max())
        assert err <= 1e-2 * float(np.abs(ref).max()), f"{name}: max error {err:.3g}"


def test_gradient_accumulation_inside_one_autocast_region_sums_the_micro_batches(grad_backend):
    # The same micro-batches, each in a region of its own (which worked before): the same sums.
    rng = np.random.default_rng(9)
    batches = [rng.standard_normal((5, 8)).astype(np.float32) for _ in range(3)]
    grads = []
    for one_region in (True, False):
        model, _ = _twins(10)
        if one_region:
            with autocast():
                for mb in batches:
                    model(taifuse.tensor(mb)).float().sum().backward()
        else:
            for mb in batches:
                with autocast():
                    loss = model(taifuse.tensor(mb)).float().sum()
                loss.backward()
        grads.append([p.grad.numpy().copy() for p in model.parameters()])
    for a, b in zip(*grads):
        np.testing.assert_array_equal(a, b)


# ----------------------------------------------------------------------------- #9: load_state_dict
# Reported: load_state_dict(torch_module.state_dict()) said "should be a Tensor or numpy.ndarray,
# got Tensor".


def test_load_state_dict_takes_a_torch_twins_state_dict(grad_backend):
    model, _ = _twins(11)
    torch.manual_seed(0)
    twin = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    model.load_state_dict(twin.state_dict())  # names match: 0.weight, 0.bias, 2.weight, 2.bias
    for (name, p), (_, tp) in zip(model.named_parameters(), twin.named_parameters()):
        assert p.dtype == F32
        np.testing.assert_array_equal(p.numpy(), tp.detach().numpy(), err_msg=name)
    x = np.random.default_rng(12).standard_normal((3, 8)).astype(np.float32)
    np.testing.assert_allclose(
        model(taifuse.tensor(x)).numpy(), twin(torch.from_numpy(x)).detach().numpy(), rtol=1e-5, atol=1e-6
    )


def test_load_state_dict_takes_parameters_that_require_grad(grad_backend):
    # torch Parameters (requires_grad, so .numpy() alone refuses) are detached first.
    model, twin = _twins(13)
    with torch.no_grad():
        for tp in twin.parameters():
            tp.mul_(2.0)
    model.load_state_dict(dict(twin.named_parameters()))
    for p, tp in zip(model.parameters(), twin.parameters()):
        np.testing.assert_array_equal(p.numpy(), tp.detach().numpy())


def test_load_state_dict_names_a_foreign_type_with_its_module(grad_backend):
    model, _ = _twins(14)
    before = [p.numpy().copy() for p in model.parameters()]
    state = {name: p.numpy() for name, p in model.named_parameters()}
    state["0.weight"] = [[0.0] * 8] * 16
    with pytest.raises(TypeError, match=r"'0.weight' should be a Tensor, a numpy.ndarray .* got list"):
        model.load_state_dict(state)
    state["0.weight"] = torch.zeros((16, 8), dtype=torch.bfloat16)  # NumPy has no bfloat16
    with pytest.raises(TypeError, match=r"'0.weight' \(torch.Tensor\) could not be converted"):
        model.load_state_dict(state)
    for p, b in zip(model.parameters(), before):
        np.testing.assert_array_equal(p.numpy(), b)  # nothing written


# ----------------------------------------------------------------------------- #9: t[[]]
# Reported: t[[]] was refused as "float64" (np.asarray([]) is float64); torch returns (0, *rest).


@pytest.mark.parametrize(
    "index",
    [[], (slice(None), []), (0, []), (Ellipsis, [])],
    ids=["[]", "[:, []]", "[0, []]", "[..., []]"],
)
def test_indexing_with_an_empty_list_returns_an_empty_result_as_torch(grad_backend, index):
    x, tx = _leaf((2, 3), 15)
    y, ty = x[index], tx[index]
    assert y.shape == tuple(ty.shape)
    assert y.size == 0
    (y * 2).sum().backward()
    (ty * 2).sum().backward()
    assert x.grad.shape == (2, 3)
    np.testing.assert_array_equal(x.grad.numpy(), tx.grad.numpy())


def test_an_empty_float_array_index_is_still_refused(grad_backend):
    x = taifuse.tensor(np.zeros((2, 3), np.float32))
    with pytest.raises(TypeError, match="should hold integers"):
        x[np.array([])]
