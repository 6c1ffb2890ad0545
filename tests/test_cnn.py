"""A CNN end to end: ``nn.utils.fuse_conv_bn_eval``, a small CNN against its PyTorch twin over a
dozen AdamW steps, and examples/train_cnn.py.

* ``fuse_conv_bn_eval``: the folded convolution's evaluation output equals conv -> batch norm in
  evaluation, and its weight and bias equal ``torch.nn.utils.fusion.fuse_conv_bn_eval``'s, on
  numpy, numba and the GPU param; a training-mode module and blocks that cannot fold are refused.
* The twin: Conv2d -> BatchNorm2d -> ReLU -> MaxPool2d -> Conv2d -> BatchNorm2d -> ReLU ->
  AdaptiveAvgPool2d -> Flatten -> Linear from taifuse's modules, loaded with the state_dict of the
  same network in torch: per-step losses and running statistics over 12 AdamW steps in training
  mode, then the evaluation output, on numba and the GPU param (the kernels' own tests cover the
  other backends).
* The example, run for one epoch in a subprocess: it reports a test accuracy.

Tolerances: float32 throughout; the fold is computed in float64 and rounded once, so its weights
match torch's (float32 arithmetic) to a few ulps (rtol 1e-6); outputs are sums of 36-72 products
(atol 1e-5 at unit scale). Over the 12 AdamW steps differences of float32 rounding grow through
the updates, which is what rtol 1e-4 on the losses and statistics allows for.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import taifuse
import taifuse.functional as F
import taifuse.optim
from taifuse import nn

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_cnn.py"


def _only(backend, params: tuple[str, ...]) -> None:
    if backend.param not in params:
        pytest.skip(f"runs on {', '.join(params)} (the kernels' own tests cover the others)")
    backend.activate()


def _twin_block(rng, cin: int, cout: int, bias: bool) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A torch Conv2d and BatchNorm2d in evaluation mode with nontrivial affine and running stats."""
    conv = torch.nn.Conv2d(cin, cout, 3, stride=2, padding=1, bias=bias)
    bn = torch.nn.BatchNorm2d(cout, eps=1e-3)
    with torch.no_grad():
        bn.weight.copy_(torch.tensor(rng.uniform(0.5, 2.0, cout), dtype=torch.float32))
        bn.bias.copy_(torch.tensor(rng.standard_normal(cout), dtype=torch.float32))
        bn.running_mean.copy_(torch.tensor(rng.standard_normal(cout), dtype=torch.float32))
        bn.running_var.copy_(torch.tensor(rng.uniform(0.1, 3.0, cout), dtype=torch.float32))
    return conv.eval(), bn.eval()


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("activation", [None, "relu"])
def test_fuse_conv_bn_eval_matches_conv_then_bn_and_torch(backend, bias, activation):
    _only(backend, ("numpy", "numba", "taichi-vulkan", "taichi-metal", "taichi-cuda"))
    torch.manual_seed(0)
    rng = np.random.default_rng(1)
    tconv, tbn = _twin_block(rng, 3, 5, bias)
    conv = nn.Conv2d(3, 5, 3, stride=2, padding=1, bias=bias)
    bn = nn.BatchNorm2d(5, eps=1e-3, activation=activation)
    conv.load_state_dict(tconv.state_dict())
    bn.load_state_dict(tbn.state_dict())
    conv.eval(), bn.eval()
    fused = nn.utils.fuse_conv_bn_eval(conv, bn)
    tfused = torch.nn.utils.fusion.fuse_conv_bn_eval(tconv, tbn)
    assert isinstance(fused, nn.Conv2d) and not fused.training and fused.activation == activation
    assert list(fused.state_dict()) == ["weight", "bias"]
    for name in ("weight", "bias"):
        ours, theirs = getattr(fused, name), getattr(tfused, name)
        assert ours.dtype == np.float32 and ours.requires_grad == theirs.requires_grad, name
        np.testing.assert_allclose(ours.numpy(), theirs.detach().numpy(), rtol=1e-6, atol=1e-7, err_msg=name)
    x = rng.standard_normal((2, 3, 7, 6)).astype(np.float32)
    with taifuse.no_grad():
        unfused = bn(conv(taifuse.tensor(x))).numpy()
        folded = fused(taifuse.tensor(x)).numpy()
    np.testing.assert_allclose(folded, unfused, rtol=1e-5, atol=1e-5)
    expected = tbn(tconv(torch.tensor(x)))
    expected = torch.relu(expected) if activation else expected
    np.testing.assert_allclose(folded, expected.detach().numpy(), rtol=1e-5, atol=1e-5)
    # The inputs are untouched: conv keeps its weight and bias, bn its statistics.
    np.testing.assert_array_equal(conv.weight.numpy(), tconv.weight.detach().numpy())
    np.testing.assert_array_equal(bn.running_var.numpy(), tbn.running_var.numpy())


def test_fuse_conv_bn_eval_refuses_what_cannot_fold():
    taifuse.set_backend("numpy")
    conv, bn = nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3)
    with pytest.raises(ValueError, match=r"fusion only for eval: conv and bn in training mode"):
        nn.utils.fuse_conv_bn_eval(conv, bn)
    conv.eval()
    with pytest.raises(ValueError, match=r"fusion only for eval: bn in training mode"):
        nn.utils.fuse_conv_bn_eval(conv, bn)
    bn.eval()
    with pytest.raises(ValueError, match=r"bn.num_features \(4\) should equal conv.out_channels \(3\)"):
        nn.utils.fuse_conv_bn_eval(conv, nn.BatchNorm2d(4).eval())
    with pytest.raises(ValueError, match="no running statistics"):
        nn.utils.fuse_conv_bn_eval(conv, nn.BatchNorm2d(3, track_running_stats=False).eval())
    with pytest.raises(ValueError, match="activation='relu' before the batch norm"):
        nn.utils.fuse_conv_bn_eval(nn.Conv2d(2, 3, 3, activation="relu").eval(), bn)
    with pytest.raises(TypeError, match="conv should be a taifuse.nn.Conv2d, got Linear"):
        nn.utils.fuse_conv_bn_eval(nn.Linear(2, 3).eval(), bn)
    with pytest.raises(TypeError, match="bn should be a taifuse.nn.BatchNorm1d or BatchNorm2d, got ReLU"):
        nn.utils.fuse_conv_bn_eval(conv, nn.ReLU())


# ----------------------------------------------------------------------------- the CNN twin


def _cnn(lib, classes: int = 10):
    """The test's CNN in ``lib`` (``taifuse.nn`` or ``torch.nn``): the same layers and state_dict keys.

    The convolutions have no bias, as usual before a batch norm: such a bias's gradient is zero up
    to rounding (the batch norm subtracts the mean), and AdamW's first step, g / sqrt(g^2), turns
    that rounding noise into a full +-lr step whose sign differs between two libraries (measured:
    the running means apart by 1.5% after one step)."""
    return lib.Sequential(
        lib.Conv2d(1, 4, 3, padding=1, bias=False),
        lib.BatchNorm2d(4),
        lib.ReLU(),
        lib.MaxPool2d(2),
        lib.Conv2d(4, 8, 3, padding=1, bias=False),
        lib.BatchNorm2d(8),
        lib.ReLU(),
        lib.AdaptiveAvgPool2d(1),
        lib.Flatten(),
        lib.Linear(8, classes),
    )


STATS = ("1.running_mean", "1.running_var", "5.running_mean", "5.running_var")


def test_cnn_matches_its_torch_twin_over_adamw_steps(backend):
    _only(backend, ("numba", "taichi-vulkan", "taichi-metal", "taichi-cuda"))
    torch.manual_seed(0)
    theirs = _cnn(torch.nn)
    ours = _cnn(nn)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    ours.load_state_dict(theirs.state_dict())
    opt = taifuse.optim.AdamW(list(ours.parameters()), lr=1e-2, weight_decay=1e-2)
    topt = torch.optim.AdamW(theirs.parameters(), lr=1e-2, weight_decay=1e-2)
    rng = np.random.default_rng(2)
    for step in range(12):
        x = rng.standard_normal((16, 1, 8, 8)).astype(np.float32)
        y = rng.integers(0, 10, 16)
        loss = F.cross_entropy(ours(taifuse.tensor(x)), y)
        tloss = torch.nn.functional.cross_entropy(theirs(torch.tensor(x)), torch.tensor(y))
        opt.zero_grad(), topt.zero_grad()
        loss.backward(), tloss.backward()
        opt.step(), topt.step()
        np.testing.assert_allclose(loss.item(), tloss.item(), rtol=1e-4, err_msg=f"loss, step {step}")
        state, tstate = ours.state_dict(), theirs.state_dict()
        for key in STATS:
            np.testing.assert_allclose(state[key].numpy(), tstate[key].numpy(), rtol=1e-4, atol=1e-5,
                                       err_msg=f"{key}, step {step}")  # fmt: skip
        assert int(state["1.num_batches_tracked"].item()) == step + 1
    for key, value in theirs.state_dict().items():  # the parameters after the dozen steps
        np.testing.assert_allclose(ours.state_dict()[key].numpy(), value.numpy(), rtol=1e-4, atol=1e-5,
                                   err_msg=key)  # fmt: skip
    ours.eval(), theirs.eval()
    x = rng.standard_normal((16, 1, 8, 8)).astype(np.float32)
    with taifuse.no_grad():
        out = ours(taifuse.tensor(x)).numpy()
    np.testing.assert_allclose(out, theirs(torch.tensor(x)).detach().numpy(), rtol=1e-4, atol=1e-4)
    # Folding each Conv-BN pair gives the unfused evaluation output.
    folded = nn.Sequential(
        nn.utils.fuse_conv_bn_eval(ours[0], ours[1]), ours[2], ours[3],
        nn.utils.fuse_conv_bn_eval(ours[4], ours[5]), *list(ours)[6:],
    )  # fmt: skip
    with taifuse.no_grad():
        np.testing.assert_allclose(folded(taifuse.tensor(x)).numpy(), out, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- examples/train_cnn.py


def _example(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run([sys.executable, str(SCRIPT), *argv], check=False, capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=300)  # fmt: skip


def test_train_cnn_example_reports_an_accuracy_and_saves_a_checkpoint(tmp_path):
    # One epoch on the numpy backend (about 3 s): no verdict, an accuracy well above chance (0.69
    # measured), the folded model's equal to it, and a checkpoint that loads with the model's keys.
    out = tmp_path / "cnn.safetensors"
    run = _example("--backend", "numpy", "--epochs", "1", "--out", str(out), "--log", str(tmp_path / "cnn.csv"),
                   cwd=tmp_path)  # fmt: skip
    assert run.returncode == 0, run.stderr
    found = re.search(r"test accuracy (\d\.\d+) on 450 images \(no verdict.*folded Conv-BN accuracy (\d\.\d+)",
                      run.stdout)  # fmt: skip
    assert found is not None, run.stdout
    accuracy, folded = float(found.group(1)), float(found.group(2))
    assert 0.4 < accuracy <= 1.0 and abs(folded - accuracy) <= 1 / 450, run.stdout
    spec = importlib.util.spec_from_file_location("train_cnn", SCRIPT)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    state = taifuse.load(out)
    assert list(state["model"]) == list(example.build_model().state_dict())
    assert state["epoch"] == 1 and "state" in state["optimizer"]
    assert (tmp_path / "cnn.csv").read_text().count("\n") == 1 + 43  # a header and 43 steps of 32


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--epochs", "0"], "argument --epochs: should be an integer >= 1, got 0"),
        (["--epochs", "x"], "argument --epochs: should be an integer, got 'x'"),
        (["--log", "run.txt"], "--log should end in .csv or .jsonl, got 'run.txt'"),
        (["--out", "{tmp}"], "--out '{tmp}' is a directory"),
        (["--out", "{tmp}/missing/a.safetensors"], "the directory '{tmp}/missing' does not exist"),
        (["--log", "{tmp}/a.csv", "--out", "{tmp}/a.csv"], "--log and --out name the same file"),
    ],
)
def test_train_cnn_example_refuses_bad_flags(tmp_path, argv, message):
    run = _example(*(a.replace("{tmp}", str(tmp_path)) for a in argv), cwd=tmp_path)
    assert run.returncode == 2 and message.replace("{tmp}", str(tmp_path)) in run.stderr, run.stderr
    assert "Traceback" not in run.stderr and not list(tmp_path.iterdir())
