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


def test_train_mlp_example_with_amp_runs_under_autocast_and_a_grad_scaler():
    """--amp on a tiny config (3 epochs): finite losses, a held-out loss near the float32 run's, and
    evidence that float16 was in play (the losses differ from float32's) with a live scaler."""
    example = _load_example()
    with taifuse.use_backend("numba" if "numba" in taifuse.available_backends() else "numpy"):
        full = example.train(epochs=3, quiet=True)
        amp = example.train(epochs=3, quiet=True, amp=True)
        with pytest.raises(ValueError, match="amp needs the adamw"):
            example.train(epochs=1, quiet=True, optimizer="sgd", amp=True)
    assert full.loss_scale is None
    assert all(np.isfinite(v) for v in [*amp.epoch_losses, amp.val_loss, *full.epoch_losses, full.val_loss])
    assert amp.epoch_losses != full.epoch_losses  # autocast changed the arithmetic
    assert amp.val_loss == pytest.approx(full.val_loss, rel=0.05)
    assert amp.epoch_losses[-1] < 0.8 * amp.epoch_losses[0]  # it learns
    # The scale starts at 2**16 and only halves (growth needs 2000 finite steps; this run has 66).
    assert amp.loss_scale in {2.0**k for k in range(17)}


def test_train_mlp_example_writes_the_monitors_log_and_plot(tmp_path):
    """--log and --plot: one CSV row per minibatch step whose losses make up the epoch's printed
    mean, with the lr the step used; the plot is a PNG."""
    import csv

    example = _load_example()
    log, plot = tmp_path / "mlp.csv", tmp_path / "mlp.png"
    with taifuse.use_backend("numba" if "numba" in taifuse.available_backends() else "numpy"):
        result = example.train(epochs=2, quiet=True, log_path=str(log), plot_path=str(plot))
    with open(log, newline="") as f:
        rows = list(csv.DictReader(f))
    split, batch = 1350, 64  # 75% of 3 x 600 points, the default batch size
    per_epoch = -(-split // batch)
    assert [int(r["step"]) for r in rows] == list(range(1, 2 * per_epoch + 1))
    assert sum(int(r["n"]) for r in rows[:per_epoch]) == split
    first_epoch = sum(float(r["loss"]) * int(r["n"]) for r in rows[:per_epoch]) / split
    assert first_epoch == pytest.approx(result.epoch_losses[0], rel=1e-12)
    assert float(rows[0]["lr"]) == example.LEARNING_RATES["adamw"]  # the cosine starts at the peak
    assert float(rows[-1]["lr"]) < float(rows[0]["lr"])
    assert all(float(r["samples_per_s"]) > 0 and int(r["pool_peak_bytes"]) > 0 for r in rows)
    if importlib.util.find_spec("matplotlib") is not None:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------------------- ModuleList


def test_module_list_names_and_list_operations(grad_backend):
    blocks = nn.ModuleList([nn.Linear(2, 3), nn.ReLU()])
    blocks.append(nn.Linear(3, 1, bias=False))
    assert len(blocks) == 3 and isinstance(blocks[-1], nn.Linear) and blocks[-1] is blocks[2]
    assert [name for name, _ in blocks.named_parameters()] == ["0.weight", "0.bias", "2.weight"]
    blocks.insert(1, nn.Tanh())
    assert [type(m).__name__ for m in blocks] == ["Linear", "Tanh", "ReLU", "Linear"]
    assert [name for name, _ in blocks.named_children()] == ["0", "1", "2", "3"]
    blocks.extend([nn.SiLU()])
    blocks += [nn.Sigmoid()]
    del blocks[1]
    assert [type(m).__name__ for m in blocks] == ["Linear", "ReLU", "Linear", "SiLU", "Sigmoid"]
    assert [name for name, _ in blocks.named_parameters()] == ["0.weight", "0.bias", "2.weight"]
    assert isinstance(blocks[1:3], nn.ModuleList) and len(blocks[1:3]) == 2
    blocks[1] = nn.GELU()
    assert isinstance(blocks[1], nn.GELU)

    class Owner(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.LayerNorm(4) for _ in range(2))

    assert list(Owner().state_dict()) == [
        "blocks.0.weight",
        "blocks.0.bias",
        "blocks.1.weight",
        "blocks.1.bias",
    ]


def test_module_list_errors(grad_backend):
    blocks = nn.ModuleList([nn.ReLU()])
    with pytest.raises(IndexError, match="index 1"):
        blocks[1]
    with pytest.raises(TypeError, match="Module"):
        blocks.append(3)
    with pytest.raises(TypeError, match="Module"):
        blocks.extend([nn.ReLU(), "relu"])
    assert len(blocks) == 1  # the failed extend added nothing


# ----------------------------------------------------------------------------- CausalSelfAttention


def _attention_reference(x, w_attn, b_attn, w_proj, b_proj, n_head, grad_out):
    """CausalSelfAttention's forward and backward in float64 NumPy: (out, {name: grad})."""
    x, w_attn, b_attn, w_proj, b_proj, grad_out = (
        np.asarray(a, np.float64) for a in (x, w_attn, b_attn, w_proj, b_proj, grad_out)
    )
    b, t, c = x.shape
    d = c // n_head

    def heads(a):  # (B, T, C) -> (B, H, T, D)
        return a.reshape(b, t, n_head, d).transpose(0, 2, 1, 3)

    def merge(a):  # (B, H, T, D) -> (B, T, C)
        return a.transpose(0, 2, 1, 3).reshape(b, t, c)

    qkv = x @ w_attn.T + b_attn
    q, k, v = (heads(p) for p in np.split(qkv, 3, axis=-1))
    scale = 1.0 / math.sqrt(d)
    scores = q @ k.swapaxes(-1, -2) * scale + np.triu(np.full((t, t), -np.inf), 1)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    y = merge(probs @ v)
    out = y @ w_proj.T + b_proj

    g_y = heads(grad_out @ w_proj)
    g_probs = g_y @ v.swapaxes(-1, -2)
    g_v = probs.swapaxes(-1, -2) @ g_y
    g_scores = probs * (g_probs - (g_probs * probs).sum(-1, keepdims=True)) * scale
    g_q, g_k = g_scores @ k, g_scores.swapaxes(-1, -2) @ q
    g_qkv = np.concatenate([merge(g_q), merge(g_k), merge(g_v)], axis=-1)
    grads = {
        "x": g_qkv @ w_attn,
        "c_attn.weight": g_qkv.reshape(-1, 3 * c).T @ x.reshape(-1, c),
        "c_attn.bias": g_qkv.sum((0, 1)),
        "c_proj.weight": grad_out.reshape(-1, c).T @ y.reshape(-1, c),
        "c_proj.bias": grad_out.sum((0, 1)),
    }
    return out, grads


def _attention_case(b=2, t=7, c=12, n_head=3, seed=0):
    taifuse.manual_seed(seed)
    attn = nn.CausalSelfAttention(c, n_head)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((b, t, c)).astype(np.float32)
    grad_out = rng.standard_normal((b, t, c)).astype(np.float32)
    return attn, x, grad_out


def _run_attention(attn, x, grad_out):
    xt = taifuse.tensor(x, requires_grad=True)
    out = attn(xt)
    (out * taifuse.tensor(grad_out)).sum().backward()
    grads = {name: p.grad.numpy() for name, p in attn.named_parameters()}
    grads["x"] = xt.grad.numpy()
    return out.numpy(), grads


def _assert_close_scaled(got, ref, what, rtol):
    # float32 against a float64 or float32 twin: errors scale with the largest value the sums
    # produce, so the bound is relative to the array's largest magnitude, not to each element.
    bound = rtol * max(float(np.abs(ref).max()), 1e-30)
    err = float(np.abs(np.asarray(got, np.float64) - ref).max())
    assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g} (rtol {rtol} of max |ref|)"


# float32 against float64: a dozen roundings in sums of 12 to 42 terms, ~1e-6 of the largest value;
# 2e-5 leaves room for the backends' different summation orders.
ATTENTION_RTOL = 2e-5


@pytest.mark.parametrize("b,t,c,n_head", [(2, 7, 12, 3), (1, 1, 8, 2), (3, 16, 8, 1)])
def test_causal_self_attention_matches_the_numpy_reference(backend, b, t, c, n_head):
    backend.activate()
    attn, x, grad_out = _attention_case(b, t, c, n_head)
    out, grads = _run_attention(attn, x, grad_out)
    params = {name: p.numpy() for name, p in attn.named_parameters()}
    ref_out, ref_grads = _attention_reference(
        x,
        params["c_attn.weight"],
        params["c_attn.bias"],
        params["c_proj.weight"],
        params["c_proj.bias"],
        n_head,
        grad_out,
    )
    _assert_close_scaled(out, ref_out, f"output on {backend.param}", ATTENTION_RTOL)
    for name, ref in ref_grads.items():
        _assert_close_scaled(grads[name], ref, f"grad {name} on {backend.param}", ATTENTION_RTOL)


def _torch_attention(torch, params, n_head):
    """The same layer written by hand in PyTorch (nn.MultiheadAttention lays its weights out otherwise)."""

    class TorchCausalSelfAttention(torch.nn.Module):
        def __init__(self, c):
            super().__init__()
            self.c_attn = torch.nn.Linear(c, 3 * c)
            self.c_proj = torch.nn.Linear(c, c)

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = (
                p.view(b, t, n_head, c // n_head).transpose(1, 2) for p in self.c_attn(x).split(c, dim=2)
            )
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))

    model = TorchCausalSelfAttention(params["c_proj.weight"].shape[0])
    model.load_state_dict({name: torch.from_numpy(value) for name, value in params.items()})
    return model


def test_causal_self_attention_matches_torch(backend):
    torch = pytest.importorskip("torch")
    backend.activate()
    attn, x, grad_out = _attention_case(2, 9, 16, 4)
    out, grads = _run_attention(attn, x, grad_out)
    model = _torch_attention(torch, {name: p.numpy() for name, p in attn.named_parameters()}, 4)
    xt = torch.tensor(x, requires_grad=True)
    ref = model(xt)
    (ref * torch.from_numpy(grad_out)).sum().backward()
    # float32 on both sides, two summation orders: twice the float64 reference's tolerance.
    _assert_close_scaled(
        out, ref.detach().numpy().astype(np.float64), f"output on {backend.param}", 2 * ATTENTION_RTOL
    )
    ref_grads = {name: p.grad.numpy() for name, p in model.named_parameters()}
    ref_grads["x"] = xt.grad.numpy()
    for name, value in ref_grads.items():
        _assert_close_scaled(
            grads[name], value.astype(np.float64), f"grad {name} on {backend.param}", 2 * ATTENTION_RTOL
        )


def test_causal_self_attention_is_causal(grad_backend):
    attn, x, _ = _attention_case(1, 6, 8, 2)
    before = attn(taifuse.tensor(x)).numpy()
    x[:, 4:] += 10.0  # later tokens change: the earlier outputs may not
    after = attn(taifuse.tensor(x)).numpy()
    np.testing.assert_array_equal(before[:, :4], after[:, :4])
    assert not np.allclose(before[:, 4:], after[:, 4:])


def test_causal_self_attention_dropout_only_while_training(grad_backend):
    taifuse.manual_seed(1)
    attn = nn.CausalSelfAttention(8, 2, dropout=0.5)
    plain = nn.CausalSelfAttention(8, 2)
    plain.load_state_dict(attn.state_dict())
    x = taifuse.tensor(np.random.default_rng(1).standard_normal((2, 5, 8)).astype(np.float32))
    assert not np.allclose(attn(x).numpy(), plain(x).numpy())
    attn.eval()
    np.testing.assert_array_equal(attn(x).numpy(), plain(x).numpy())


def test_causal_self_attention_names_repr_and_bias(grad_backend):
    attn = nn.CausalSelfAttention(8, 2, bias=False)
    assert [name for name, _ in attn.named_parameters()] == ["c_attn.weight", "c_proj.weight"]
    assert attn.c_attn.weight.shape == (24, 8)
    assert repr(attn).splitlines() == [
        "CausalSelfAttention(",
        "  d_model=8, n_head=2, dropout=0.0",
        "  (c_attn): Linear(in_features=8, out_features=24, bias=False)",
        "  (c_proj): Linear(in_features=8, out_features=8, bias=False)",
        "  (resid_dropout): Dropout(p=0.0)",
        ")",
    ]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"d_model": 10, "n_head": 4}, "n_head"),
        ({"d_model": 8, "n_head": 0}, "n_head"),
        ({"d_model": 0, "n_head": 1}, "d_model"),
        ({"d_model": 8, "n_head": 2, "dropout": 1.5}, "dropout|p"),
    ],
)
def test_causal_self_attention_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        nn.CausalSelfAttention(**kwargs)


@pytest.mark.parametrize("shape", [(2, 5, 6), (5, 8), (1, 2, 5, 8)])
def test_causal_self_attention_bad_input(grad_backend, shape):
    attn = nn.CausalSelfAttention(8, 2)
    with pytest.raises(ValueError, match="input"):
        attn(taifuse.tensor(np.zeros(shape, np.float32)))
