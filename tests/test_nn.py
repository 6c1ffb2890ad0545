"""taifuse.nn: module bookkeeping, state dicts and .npz files, initialization, layers, and the
training example reaching its stated accuracy."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest

import taifuse
import taifuse.functional as F
from taifuse import nn

ROOT = Path(__file__).resolve().parents[1]
# grad_backend: the fixture in conftest.py (numpy and numba; taichi skips until it has backward kernels).


def _model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(4, 8, activation="gelu"),
        nn.LayerNorm(8),
        nn.Dropout(0.2),
        nn.Linear(8, 3, bias=False),
    )


# ----------------------------------------------------------------------------- bookkeeping


def test_parameters_and_names(grad_backend):
    model = _model()
    names = [name for name, _ in model.named_parameters()]
    assert names == ["0.weight", "0.bias", "1.weight", "1.bias", "3.weight"]
    assert sum(p.size for p in model.parameters()) == 8 * 4 + 8 + 8 + 8 + 3 * 8
    assert all(p.requires_grad for p in model.parameters())
    assert [type(m).__name__ for m in model.children()] == ["Linear", "LayerNorm", "Dropout", "Linear"]
    assert isinstance(model[0], nn.Linear) and len(model) == 4
    assert "Linear(in_features=4, out_features=8, bias=True, activation='gelu')" in repr(model)


def test_shared_parameter_listed_once(grad_backend):
    layer = nn.Linear(3, 3)
    model = nn.Sequential(layer, nn.ReLU(), layer)
    assert len(list(model.parameters())) == 2


def test_train_eval_toggles_dropout(grad_backend):
    model = _model()
    x = taifuse.tensor(np.ones((2, 4), np.float32))
    model.eval()
    assert not any(m.training for m in model.modules())
    np.testing.assert_array_equal(model(x).numpy(), model(x).numpy())
    model.train()
    assert all(m.training for m in model.modules())


def test_zero_grad(grad_backend):
    model = _model()
    loss = F.cross_entropy(model(taifuse.tensor(np.ones((2, 4), np.float32))), np.array([0, 2]))
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    model.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.numpy().any() for p in model.parameters())
    model.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_layers_match_functional(grad_backend):
    x = taifuse.tensor(np.linspace(-3, 3, 12, dtype=np.float32).reshape(3, 4))
    pairs = [
        (nn.GELU(), F.gelu(x)),
        (nn.GELU("tanh"), F.gelu(x, "tanh")),
        (nn.ReLU(), F.relu(x)),
        (nn.LeakyReLU(0.1), F.leaky_relu(x, 0.1)),
        (nn.SiLU(), F.silu(x)),
        (nn.Sigmoid(), F.sigmoid(x)),
        (nn.Tanh(), F.tanh(x)),
        (nn.LayerNorm(4), F.layer_norm(x, 4)),
    ]
    for module, expected in pairs:
        np.testing.assert_array_equal(module(x).numpy(), expected.numpy(), err_msg=type(module).__name__)
    t = taifuse.tensor(np.zeros((3, 4), np.float32))
    assert nn.MSELoss("sum")(x, t).item() == pytest.approx(
        float((x.numpy().astype(np.float64) ** 2).sum()), rel=1e-6
    )
    ce = nn.CrossEntropyLoss()(x, np.array([0, 1, 3]))
    assert ce.item() == pytest.approx(F.cross_entropy(x.numpy(), np.array([0, 1, 3])).item())


def test_module_errors(grad_backend):
    with pytest.raises(ValueError, match="activation"):
        nn.Linear(2, 2, activation="tanh")
    with pytest.raises(ValueError, match="in_features"):
        nn.Linear(-1, 2)
    with pytest.raises(ValueError, match="p should be"):
        nn.Dropout(1.5)
    with pytest.raises(TypeError, match="Module"):
        nn.Sequential(nn.ReLU(), "relu")
    with pytest.raises(AttributeError, match="nothing"):
        _ = nn.ReLU().nothing


@pytest.mark.parametrize(
    "kwargs, exc_type, match",
    [
        ({"normalized_shape": 3, "eps": -1}, ValueError, r"\beps\b.*-1"),
        ({"normalized_shape": 3, "eps": float("nan")}, ValueError, r"\beps\b.*nan"),
        # Reported: "12" was iterated into normalized_shape (1, 2).
        ({"normalized_shape": "12"}, TypeError, r"normalized_shape.*'12'"),
        ({"normalized_shape": (4.0,)}, TypeError, r"normalized_shape.*4\.0"),
    ],
    ids=["eps-negative", "eps-nan", "shape-str", "shape-float"],
)
def test_layer_norm_validates_as_functional(kwargs, exc_type, match):
    """nn.LayerNorm rejects in __init__ what F.layer_norm would reject at the first call."""
    with pytest.raises(exc_type, match=match):
        nn.LayerNorm(**kwargs)


# ----------------------------------------------------------------------------- state


def test_module_zero_grad_without_set_to_none_is_in_place_like_torch(grad_backend):
    # torch.nn.Module.zero_grad(set_to_none=False) zeroes each existing .grad in place (a held
    # gradient sees the zeros) and leaves a parameter without one without one.
    model = _model()
    loss = F.cross_entropy(model(taifuse.tensor(np.ones((2, 4), np.float32))), np.array([0, 2]))
    loss.backward()
    held = model[0].weight.grad
    model[0].bias.grad = None
    model.zero_grad(set_to_none=False)
    assert model[0].weight.grad is held and not held.numpy().any()
    assert model[0].bias.grad is None


def test_load_state_dict_copies_in_place(grad_backend):
    # As torch: the parameter objects and their storage stay, so an optimizer that placed them in
    # its flat buffer keeps stepping the loaded values.
    taifuse.manual_seed(1)
    a = _model()
    taifuse.manual_seed(2)
    b = _model()
    opt = taifuse.optim.SGD(b.parameters(), lr=0.5)
    x = taifuse.tensor(np.ones((2, 4), np.float32))
    F.cross_entropy(b(x), np.array([0, 2])).backward()
    opt.step()
    before = [p._data for p in b.parameters()]
    b.load_state_dict(a.state_dict())
    assert all(p._data is d for p, d in zip(b.parameters(), before))
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        np.testing.assert_array_equal(pa.numpy(), pb.numpy(), err_msg=name)
    opt.zero_grad()
    F.cross_entropy(b(x), np.array([0, 2])).backward()
    grads = {name: p.grad.numpy().copy() for name, p in b.named_parameters()}
    opt.step()
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        np.testing.assert_allclose(pb.numpy(), pa.numpy() - 0.5 * grads[name], rtol=1e-6, atol=1e-6, err_msg=name)


def test_state_dict_round_trip(grad_backend):
    taifuse.manual_seed(1)
    a = _model()
    taifuse.manual_seed(2)
    b = _model()
    state = a.state_dict()
    assert list(state) == [name for name, _ in a.named_parameters()]
    assert not any(t.requires_grad for t in state.values())
    result = b.load_state_dict(state)
    assert result.missing_keys == [] and result.unexpected_keys == []
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        np.testing.assert_array_equal(pa.numpy(), pb.numpy(), err_msg=name)
    # NumPy arrays load too, and the loaded values are copies.
    arrays = {name: t.numpy() * 0 + 1 for name, t in state.items()}
    b.load_state_dict(arrays)
    arrays["0.bias"][:] = 5
    assert (b[0].bias.numpy() == 1).all()


def test_load_state_dict_errors_leave_the_module_unchanged(grad_backend):
    model = _model()
    before = {name: p.numpy().copy() for name, p in model.named_parameters()}
    good = {name: np.zeros_like(v) for name, v in before.items()}
    missing = dict(good)
    del missing["1.bias"]
    with pytest.raises(ValueError, match=r"missing keys \['1.bias'\]"):
        model.load_state_dict(missing)
    with pytest.raises(ValueError, match=r"unexpected keys \['extra'\]"):
        model.load_state_dict({**good, "extra": np.zeros(1)})
    bad_shape = {**good, "3.weight": np.zeros((8, 3), np.float32)}
    with pytest.raises(
        ValueError, match=r"'3.weight' has shape \(8, 3\) but the parameter has shape \(3, 8\)"
    ):
        model.load_state_dict(bad_shape)
    for name, p in model.named_parameters():
        np.testing.assert_array_equal(p.numpy(), before[name], err_msg=f"{name} changed by a failed load")
    result = model.load_state_dict(missing, strict=False)
    assert result.missing_keys == ["1.bias"]
    np.testing.assert_array_equal(model[1].bias.numpy(), before["1.bias"])
    assert not model[0].weight.numpy().any()


@pytest.mark.parametrize("name", ["model", "model.npz", "model.ckpt"])
@pytest.mark.parametrize("as_path", [False, True], ids=["str", "Path"])
def test_save_and_load_agree_on_the_path(tmp_path, name, as_path):
    # Reported: save("x") wrote x.npz (np.savez adds the suffix) and load("x") could not find it.
    taifuse.manual_seed(5)
    a = _model()
    path = tmp_path / name if as_path else str(tmp_path / name)
    a.save(path)
    written = [p.name for p in tmp_path.iterdir()]
    assert written == [name if name.endswith(".npz") else name + ".npz"]
    taifuse.manual_seed(6)
    b = _model()
    b.load(path)
    for (n, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        np.testing.assert_array_equal(pa.numpy(), pb.numpy(), err_msg=n)


def test_load_reads_an_npz_under_any_name(tmp_path):
    """A file load did not write, without the suffix, loads by its own name."""
    model = _model()
    path = tmp_path / "weights"
    with open(path, "wb") as f:
        np.savez(f, **{n: np.zeros(p.shape, np.float32) for n, p in model.named_parameters()})
    model.load(path)
    assert not any(p.numpy().any() for p in model.parameters())
    with pytest.raises(FileNotFoundError, match=r"missing\.npz"):
        model.load(tmp_path / "missing")


def test_save_and_load_npz(grad_backend, tmp_path):
    taifuse.manual_seed(3)
    a = _model()
    path = tmp_path / "model.npz"
    a.save(path)
    with np.load(path) as data:
        assert sorted(data.files) == sorted(name for name, _ in a.named_parameters())
    taifuse.manual_seed(4)
    b = _model()
    b.load(path)
    x = taifuse.tensor(np.ones((2, 4), np.float32))
    a.eval(), b.eval()
    np.testing.assert_array_equal(a(x).numpy(), b(x).numpy())


# ----------------------------------------------------------------------------- initialization


def test_linear_init_matches_pytorch_distribution(grad_backend):
    taifuse.manual_seed(0)
    fan_in = 400
    layer = nn.Linear(fan_in, 300)
    bound = 1 / math.sqrt(fan_in)
    w, b = layer.weight.numpy(), layer.bias.numpy()
    assert w.shape == (300, fan_in) and b.shape == (300,) and w.dtype == np.float32
    assert np.abs(w).max() <= bound and np.abs(b).max() <= bound
    # U(-bound, bound): mean 0, variance bound^2 / 3. With n = 120000 samples the sample mean's
    # standard error is bound / sqrt(3 n) ~ 0.0017 bound; allow 5 of them. The variance's relative
    # standard error is sqrt(0.8 / n) ~ 0.0026; allow 2%.
    assert abs(w.mean()) < 5 * bound / math.sqrt(3 * w.size)
    assert w.var() == pytest.approx(bound**2 / 3, rel=0.02)
    assert abs(w).max() > 0.99 * bound  # the whole interval is used


def test_manual_seed_makes_init_reproducible(grad_backend):
    taifuse.manual_seed(7)
    a = nn.Linear(5, 5)
    taifuse.manual_seed(7)
    b = nn.Linear(5, 5)
    c = nn.Linear(5, 5)
    np.testing.assert_array_equal(a.weight.numpy(), b.weight.numpy())
    assert not np.array_equal(b.weight.numpy(), c.weight.numpy())


# ----------------------------------------------------------------------------- training


def test_sgd_step_lowers_the_loss(grad_backend):
    taifuse.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 16, activation="silu"), nn.Linear(16, 1))
    rng = np.random.default_rng(0)
    x = taifuse.tensor(rng.standard_normal((64, 3)).astype(np.float32))
    y = taifuse.tensor((rng.standard_normal((64, 1)) > 0).astype(np.float32))
    losses = []
    for _ in range(20):
        loss = F.mse_loss(model(x), y)
        model.zero_grad()
        loss.backward()
        with taifuse.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses


def test_in_place_update_needs_no_grad(grad_backend):
    p = nn.Parameter(np.ones(2, np.float32))
    with pytest.raises(RuntimeError, match="no_grad"):
        p -= 1.0
    with taifuse.no_grad():
        p -= 1.0
    assert not p.numpy().any()


def _load_example():
    spec = importlib.util.spec_from_file_location("train_mlp", ROOT / "examples" / "train_mlp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_train_mlp_example_reaches_its_stated_accuracy():
    """The example as shipped (default epochs and seed) on the default backend."""
    example = _load_example()
    with taifuse.use_backend("numba" if "numba" in taifuse.available_backends() else "numpy"):
        accuracy = example.main(quiet=True)
    assert accuracy >= example.TARGET_ACCURACY, f"accuracy {accuracy} < stated {example.TARGET_ACCURACY}"
