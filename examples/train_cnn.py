"""Train a small CNN on scikit-learn's handwritten digits with taifuse.optim.AdamW and a cosine schedule.

The data is ``sklearn.datasets.load_digits`` (1,797 grey 8 x 8 images of the digits 0-9, values 0
to 16, shipped inside scikit-learn: nothing is downloaded; ``pip install 'taifuse[examples]'``),
scaled to [0, 1], with a fixed 25% of the images (a permutation from seed 0) held out as the test
split. The model is two Conv-BN-ReLU blocks with pooling and a linear head:

    Conv2d(1, 16, 3, padding=1, bias=False) -> BatchNorm2d(16, activation='relu') -> MaxPool2d(2)
    -> Conv2d(16, 32, 3, padding=1, bias=False) -> BatchNorm2d(32, activation='relu')
    -> AdaptiveAvgPool2d(1) -> Flatten -> Linear(32, 10)

(the ReLU fused into the batch norm's normalize pass; the convolutions have no bias, which the
batch norm would cancel). It trains with minibatches from a ``taifuse.data.DataLoader`` under
``taifuse.optim.AdamW`` and ``CosineAnnealingLR`` (stepped once per minibatch, down to zero at the
end), watched by a ``taifuse.monitor.TrainingMonitor`` (progress bar; ``--log run.csv`` or
``.jsonl`` writes every step's loss, lr, throughput and memory). ``--amp`` runs the forward and the
loss under ``taifuse.amp.autocast()`` (the convolutions and the Linear in float16, batch norm's
statistics in float32) with a ``GradScaler``.

At the end the model is evaluated in evaluation mode (the running statistics), then each
Conv-BN pair is folded with ``taifuse.nn.utils.fuse_conv_bn_eval`` into one convolution (with the
ReLU as its fused activation) and evaluated again: the same predictions from one kernel per block.
The model, optimizer and GradScaler state go to a checkpoint with ``taifuse.save`` (``--out``,
safetensors). The script states its result and checks it: test accuracy of at least
TARGET_ACCURACY after the default EPOCHS epochs (exit status 1 below it); a run of other
``--epochs`` prints its result without a verdict and exits 0. Every flag is checked before the
training (a bad one is a usage error, status 2).

    python examples/train_cnn.py                  # on the active backend (numba on Linux)
    python examples/train_cnn.py --amp --backend taichi-vulkan
    python examples/train_cnn.py --epochs 2 --log cnn.csv --out /tmp/cnn.safetensors
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

import taifuse
import taifuse.functional as F
from taifuse import nn, optim
from taifuse.amp import GradScaler, autocast
from taifuse.data import DataLoader, TensorDataset
from taifuse.monitor import TrainingMonitor

TARGET_ACCURACY = 0.97  # EPOCHS epochs, seed 0: reached 0.9933 numba, 0.9911 --amp, 0.9889 taichi-vulkan
EPOCHS = 15
BATCH_SIZE = 32
LEARNING_RATE = 0.01
CLASSES = 10


def load_data(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The digits as float32 (N, 1, 8, 8) images in [0, 1] and int64 labels, split 75/25 by a
    permutation from ``seed``: x_train, y_train, x_test, y_test."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[:, None]
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(y))
    x, y = x[order], y[order]
    split = len(y) * 3 // 4
    return x[:split], y[:split], x[split:], y[split:]


def build_model() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1, bias=False),
        nn.BatchNorm2d(16, activation="relu"),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1, bias=False),
        nn.BatchNorm2d(32, activation="relu"),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, CLASSES),
    )


def fold(model: nn.Sequential) -> nn.Sequential:
    """``model`` (in evaluation mode) with each Conv2d -> BatchNorm2d pair folded into one Conv2d."""
    layers, modules = [], list(model)
    i = 0
    while i < len(modules):
        if (
            i + 1 < len(modules)
            and isinstance(modules[i], nn.Conv2d)
            and isinstance(modules[i + 1], nn.BatchNorm2d)
        ):
            layers.append(nn.utils.fuse_conv_bn_eval(modules[i], modules[i + 1]))
            i += 2
        else:
            layers.append(modules[i])
            i += 1
    return nn.Sequential(*layers).eval()


def evaluate(model: nn.Module, x: np.ndarray, y: np.ndarray, amp: bool = False) -> tuple[float, float]:
    """Mean cross entropy and accuracy of ``model`` on ``(x, y)``, without a graph (under autocast
    when ``amp``)."""
    with taifuse.no_grad(), autocast(enabled=amp):
        logits = model(taifuse.tensor(x))
        loss = F.cross_entropy(logits, y).item()
    return float(loss), float((logits.numpy().argmax(axis=1) == y).mean())


class Result(NamedTuple):
    """What a run reached: test accuracy and loss, the folded model's accuracy, each epoch's mean
    training loss, and whether the target applies (the default epochs)."""

    accuracy: float
    test_loss: float
    folded_accuracy: float
    epoch_losses: list[float]
    target_applies: bool


def save_checkpoint(path: Path, model: nn.Module, opt: Any, scaler: GradScaler, epoch: int) -> None:
    """Model, optimizer and GradScaler state and the epoch, with ``taifuse.save`` (safetensors: no
    pickle, so loading it runs no code; written to a temporary file and renamed)."""
    state = {
        "model": {name: t.numpy() for name, t in model.state_dict().items()},
        "optimizer": opt.state_dict(),
        "scaler": scaler.state_dict(),
        "epoch": epoch,
    }
    taifuse.save(state, path)


def train(
    epochs: int = EPOCHS,
    seed: int = 0,
    amp: bool = False,
    quiet: bool = False,
    log_path: str | None = None,
    out: Path | None = None,
) -> Result:
    """Train, evaluate (unfolded and folded) and save the checkpoint to ``out`` (None: no file)."""
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise ValueError(f"epochs should be a positive int, got {epochs!r}")
    taifuse.manual_seed(seed)
    x_train, y_train, x_test, y_test = load_data(seed)
    model = build_model()
    steps_per_epoch = -(-len(y_train) // BATCH_SIZE)
    opt = optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=1e-4)
    sched = optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs * steps_per_epoch)
    scaler = GradScaler(enabled=amp)
    loader = DataLoader(
        TensorDataset(x_train, y_train),
        batch_size=BATCH_SIZE,
        shuffle=True,
        generator=np.random.default_rng(seed + 1),
    )
    monitor = TrainingMonitor(epochs * steps_per_epoch, log_path=log_path, desc="steps", disable=quiet)
    epoch_losses = []
    for epoch in range(1, epochs + 1):
        model.train()
        total = 0.0
        for xb, yb in loader:
            step_lr = opt.param_groups[0]["lr"]
            opt.zero_grad()
            with autocast(enabled=amp):
                loss = F.cross_entropy(model(xb), yb)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            value = loss.item()
            total += value * len(yb)
            monitor.step(value, n=len(yb), lr=step_lr)
        epoch_losses.append(total / len(y_train))
        if not quiet:
            monitor.write(f"epoch {epoch:3d}  loss {epoch_losses[-1]:.4f}")
    monitor.close()
    model.eval()
    test_loss, acc = evaluate(model, x_test, y_test, amp)
    _, folded_acc = evaluate(fold(model), x_test, y_test, amp)
    if out is not None:
        save_checkpoint(out, model, opt, scaler, epochs)
    target_applies = epochs == EPOCHS and seed == 0
    if not quiet:
        target = (
            f"target {TARGET_ACCURACY:.2f}"
            if target_applies
            else f"no verdict: the {TARGET_ACCURACY:.2f} target is stated for the default {EPOCHS} epochs"
        )
        print(
            f"test loss {test_loss:.4f}, test accuracy {acc:.4f} on {len(y_test)} images ({target}); "
            f"folded Conv-BN accuracy {folded_acc:.4f}; {'amp, ' if amp else ''}backend {taifuse.get_backend()}"
            + (f"; checkpoint {out}" if out is not None else "")
        )
    return Result(acc, test_loss, folded_acc, epoch_losses, target_applies)


def _positive_int(text: str) -> int:
    """argparse's ``type=`` for a count: a clean usage error for anything but an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"should be an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"should be an integer >= 1, got {value}")
    return value


def _check_output(parser: argparse.ArgumentParser, flag: str, path: str | Path) -> None:
    """Refuse an output path that cannot be written, before the training (not after it)."""
    path = Path(path)
    if path.is_dir():
        parser.error(f"{flag} {str(path)!r} is a directory; give a file name")
    if not path.parent.is_dir():
        parser.error(f"{flag} {str(path)!r}: the directory {str(path.parent)!r} does not exist")
    if not os.access(path.parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        parser.error(f"{flag} {str(path)!r} cannot be written (permission denied)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, every flag checked (a bad one exits with a usage error, status 2)."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog=(
            f"The run states its result against a target: test accuracy of at least {TARGET_ACCURACY:.2f} "
            f"after the default {EPOCHS} epochs (with or without --amp); only such a run gets a verdict "
            "(exit status 1 below the target)."
        ),
    )
    parser.add_argument(
        "--backend", choices=taifuse.backends.BACKENDS, default=None, help="None keeps the active one"
    )
    parser.add_argument("--epochs", type=_positive_int, default=EPOCHS, help="passes over the training split")
    parser.add_argument("--amp", action="store_true", help="float16 autocast with a GradScaler")
    parser.add_argument("--log", default=None, help="write every step's figures to this .csv or .jsonl file")
    parser.add_argument(
        "--out", type=Path, default=Path("train_cnn.safetensors"), help="checkpoint file (taifuse.save)"
    )
    args = parser.parse_args(argv)
    if importlib.util.find_spec("sklearn") is None:
        parser.error("the digits come from scikit-learn: pip install 'taifuse[examples]'")
    if importlib.util.find_spec("safetensors") is None:
        parser.error("the checkpoint needs safetensors: pip install 'taifuse[safetensors]'")
    if args.log is not None and Path(args.log).suffix.lower() not in (".csv", ".jsonl"):
        parser.error(f"--log should end in .csv or .jsonl, got {args.log!r}")
    for flag, path in (("--log", args.log), ("--out", args.out)):
        if path is not None:
            _check_output(parser, flag, path)
    if args.log is not None and Path(args.log).resolve() == args.out.resolve():
        parser.error(f"--log and --out name the same file {args.log!r}")
    return args


if __name__ == "__main__":
    args = parse_args()
    if args.backend:
        taifuse.set_backend(args.backend)
    result = train(epochs=args.epochs, amp=args.amp, log_path=args.log, out=args.out)
    if result.target_applies and result.accuracy < TARGET_ACCURACY:
        print(
            f"FAILED: test accuracy {result.accuracy:.4f} is below the stated {TARGET_ACCURACY:.2f} "
            f"(the target for {EPOCHS} epochs, which this run trained)",
            file=sys.stderr,
        )
        sys.exit(1)
