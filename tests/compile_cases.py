"""The training steps tests/test_compile.py compiles: the MLP, GPT and CNN examples' steps."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

import taifuse
import taifuse.functional as F
from taifuse import nn, optim
from taifuse.amp import GradScaler, autocast
from taifuse.optim import clip_grad_norm_

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))

import gpt as gpt_example
import train_cnn
import train_mlp


def mlp_step(dropout: float = 0.0, amp: bool = False, clip: float | None = 1.0, seed: int = 0):
    """(parameters, step(x, y) -> loss) of examples/train_mlp.py's model and AdamW under a cosine
    schedule stepped in the step, seeded."""
    taifuse.manual_seed(seed)
    model = train_mlp.build_model()
    if dropout:
        layers = list(model.children())
        model = nn.Sequential(layers[0], nn.Dropout(dropout), *layers[1:])
    opt = optim.AdamW(model.parameters(), lr=0.01, weight_decay=1e-4)
    scaler = GradScaler(enabled=amp, init_scale=2.0**10, growth_interval=3)
    sched = optim.lr_scheduler.CosineAnnealingLR(opt, T_max=8)

    def step(x, y):
        opt.zero_grad()
        with autocast(enabled=amp):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        if clip is not None:
            scaler.unscale_(opt)
            clip_grad_norm_(model.parameters(), clip)
        scaler.step(opt)
        scaler.update()
        sched.step()
        return loss

    return list(model.parameters()), step


def mlp_batches(n: int, batch: int = 64, seed: int = 1):
    rng = np.random.default_rng(seed)
    return [
        (rng.standard_normal((batch, 2)).astype(np.float32), rng.integers(0, train_mlp.CLASSES, batch))
        for _ in range(n)
    ]


def gpt_step(dropout: float = 0.1, seed: int = 0, clip: float = 1.0):
    taifuse.manual_seed(seed)
    config = gpt_example.GPTConfig(
        vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=dropout
    )
    model = gpt_example.GPT(config)
    opt = model.configure_optimizer(weight_decay=0.1, lr=1e-3)

    def step(idx, targets):
        opt.zero_grad()
        _, loss = model(idx, targets)
        loss.backward()
        clip_grad_norm_(model.parameters(), clip)
        opt.step()
        return loss

    return list(model.parameters()), step


def gpt_batches(n: int, batch: int = 4, time: int = 16, seed: int = 1):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, 32, (batch, time)), rng.integers(0, 32, (batch, time))) for _ in range(n)]


def cnn_step(seed: int = 0, amp: bool = False):
    taifuse.manual_seed(seed)
    model = train_cnn.build_model()
    opt = optim.AdamW(model.parameters(), lr=train_cnn.LEARNING_RATE, weight_decay=1e-4)
    scaler = GradScaler(enabled=amp)

    def step(x, y):
        opt.zero_grad()
        with autocast(enabled=amp):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss

    return list(model.parameters()) + list(model.buffers()), step


def cnn_batches(n: int, batch: int = 16, seed: int = 1):
    rng = np.random.default_rng(seed)
    return [
        (rng.standard_normal((batch, 1, 8, 8)).astype(np.float32), rng.integers(0, train_cnn.CLASSES, batch))
        for _ in range(n)
    ]


def run(make, batches, compiled: bool, **kwargs):
    """Losses and final parameters of ``len(batches)`` steps, eager or under taifuse.compile."""
    params, step = make(**kwargs)
    fn = taifuse.compile(step) if compiled else step
    losses = []
    for x, y in batches:
        loss = fn(taifuse.tensor(x), taifuse.tensor(y))
        losses.append(loss.numpy().copy())
    return losses, [p.numpy().copy() for p in params], fn
