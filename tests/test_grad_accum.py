"""Gradient accumulation (issue 29): N micro-batches of B/N, each loss divided by N and backward,
then one step, give the gradients and the parameters of one batch of B, on every backend, with
and without autocast (the GradScaler recipe PyTorch documents: ``scaler.scale(loss / N)``
backward N times, then ``step`` and ``update`` once).

# NOTE [ Accumulation tolerances ]
# float32: the two differ only in the order the weight gradients' sums over the batch are added
# (one sum of B rows against N sums of B/N rows added into .grad): a few float32 ulps of the
# largest gradient, so rtol 1e-5 against the largest gradient element. Under autocast each
# micro-batch's weight gradient is a float16 product rounded before it is added, so the bound is
# float16's: 2e-3 of the largest gradient element (float16's epsilon is 9.8e-4). The step is SGD,
# so a parameter moves by lr times its gradient and inherits the same bound times lr.
"""

from __future__ import annotations

import numpy as np
import pytest

import taifuse
import taifuse.functional as F
from taifuse import nn, optim
from taifuse.amp import GradScaler, autocast

B, N, LR = 16, 4, 0.1
RTOL = {False: 1e-5, True: 2e-3}  # NOTE [ Accumulation tolerances ]


def _model():
    taifuse.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(6, 32, activation="gelu"), nn.Linear(32, 32, activation="relu"), nn.Linear(32, 5)
    )
    rng = np.random.default_rng(1)
    model.load_state_dict(
        {k: rng.normal(0, 0.3, v.shape).astype(np.float32) for k, v in model.state_dict().items()}
    )
    return model


def _train_step(x, y, micro_batches: int, amp: bool):
    model = _model()
    opt = optim.SGD(model.parameters(), lr=LR)
    scaler = GradScaler(enabled=amp)
    opt.zero_grad()
    size = len(y) // micro_batches
    for k in range(micro_batches):
        xb, yb = taifuse.tensor(x[k * size : (k + 1) * size]), taifuse.tensor(y[k * size : (k + 1) * size])
        with autocast(enabled=amp):
            loss = F.cross_entropy(model(xb), yb)
        scaler.scale(loss / micro_batches).backward()
    scaler.unscale_(opt)
    grads = [p.grad.numpy().copy() for p in model.parameters()]
    scaler.step(opt)
    scaler.update()
    return grads, [p.numpy().copy() for p in model.parameters()]


@pytest.mark.parametrize("amp", [False, True], ids=["float32", "autocast"])
def test_micro_batches_give_the_step_of_one_batch(backend, amp):
    backend.activate()
    rng = np.random.default_rng(2)
    x = rng.standard_normal((B, 6)).astype(np.float32)
    y = rng.integers(0, 5, B)
    full_grads, full_params = _train_step(x, y, 1, amp)
    acc_grads, acc_params = _train_step(x, y, N, amp)
    scale = max(float(np.abs(g).max()) for g in full_grads)
    tol = RTOL[amp] * scale
    for g_full, g_acc in zip(full_grads, acc_grads):
        np.testing.assert_allclose(g_acc, g_full, rtol=0, atol=tol)
    for p_full, p_acc in zip(full_params, acc_params):
        np.testing.assert_allclose(p_acc, p_full, rtol=0, atol=LR * tol)
    # and the step moved the parameters (the comparison is not of two untouched models)
    start = [p.numpy() for p in _model().parameters()]
    assert max(float(np.abs(a - b).max()) for a, b in zip(full_params, start)) > 100 * LR * tol


def test_the_mlp_example_accumulates():
    """examples/train_mlp.py --grad-accum 2 and the plain run see the same samples: the first
    epoch's mean loss agrees (the steps differ only by the epoch's last, shorter micro-batch).
    One backend: the accumulation itself is checked on every backend above."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "train_mlp.py"
    spec = importlib.util.spec_from_file_location("train_mlp_accum", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with taifuse.backends.preserved_choice():
        taifuse.set_backend("numpy")
        plain = module.train(epochs=1, quiet=True)
        accumulated = module.train(epochs=1, quiet=True, grad_accum=2, workers=1)
    assert accumulated.epoch_losses[0] == pytest.approx(plain.epoch_losses[0], rel=1e-4)


def test_the_examples_in_docs_training_run():
    """docs/training.md's examples (tests/test_docs.py runs docstrings and the README only)."""
    import doctest
    from pathlib import Path

    with taifuse.backends.preserved_choice():
        result = doctest.testfile(
            str(Path(__file__).resolve().parents[1] / "docs" / "training.md"),
            module_relative=False,
            optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
        )
    assert result.attempted > 0 and result.failed == 0, "an example in docs/training.md failed (see stdout)"
