"""A GPT built from taifuse's layers, with nanoGPT's structure, and its PyTorch twin.

``GPT`` is nanoGPT's model (Karpathy's ``model.py``), module for module: token and position
embeddings (``wte``, ``wpe``) and dropout (``drop``), ``n_layer`` pre-LayerNorm ``Block``s in a
``ModuleList`` (``blocks``), a final LayerNorm (``ln_f``) and the output projection (``lm_head``).
Each block is ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``, the MLP ``fc`` (to 4 x n_embd, GELU
fused into the same kernel) then ``proj`` (back to n_embd) and dropout. The differences from
nanoGPT:

* The top-level modules sit on the model itself (``wte``, ..., ``blocks``), not in a
  ``transformer`` ModuleDict, and a block's norms are ``ln1``/``ln2``: keys read
  ``blocks.0.ln1.weight``.
* ``lm_head`` is NOT tied to ``wte``. nanoGPT shares one matrix between them; here a tied pair
  would be one parameter under two keys, which ``state_dict`` lists once (so a PyTorch twin's
  strict load would miss a key) and which the optimizer would decay as one. The untied head costs
  ``vocab_size * n_embd`` more parameters.

``torch_gpt(config)`` builds the same model in PyTorch (imported lazily) with the same module
names, so ``torch_model.load_state_dict({k: torch.from_numpy(v.numpy()) for k, v in
model.state_dict().items()})`` loads strictly and both compute the same function. The training
example (``examples/train_gpt.py``), the ``transformer`` bench suite and ``tests/test_gpt.py``
share this file.

Example::

    >>> import numpy as np, taifuse
    >>> taifuse.set_backend("numpy")
    >>> taifuse.manual_seed(0)
    >>> model = GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=8))
    >>> idx = np.array([[1, 2, 3, 4]])
    >>> logits, loss = model(idx, targets=np.array([[2, 3, 4, 5]]))
    >>> logits.shape, round(loss.item(), 1)  # about log(11) ~ 2.4 at initialization
    ((1, 4, 11), 2.4)
    >>> model.generate(idx, max_new_tokens=3, top_k=5, seed=0).shape
    (1, 7)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

import taifuse
import taifuse.functional as F
from taifuse import _random, nn
from taifuse.optim import AdamW
from taifuse.tensor import Tensor


@dataclass
class GPTConfig:
    """The model's sizes, as nanoGPT's ``GPTConfig``."""

    vocab_size: int = 96
    block_size: int = 128  # the longest context
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True  # biases in the Linears and LayerNorms


class MLP(nn.Module):
    """fc (n_embd -> 4 n_embd) with a fused exact GELU, proj back to n_embd, dropout."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        # One fused kernel for fc and its GELU; the parameters are still fc.weight and fc.bias,
        # as in the PyTorch twin's separate fc Linear and GELU module.
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias, activation="gelu")
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.proj(self.fc(x)))


class Block(nn.Module):
    """A pre-LayerNorm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = nn.CausalSelfAttention(config.n_embd, config.n_head, config.dropout, bias=config.bias)
        self.ln2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """nanoGPT's GPT on taifuse (see the module docstring for the structure and what differs).

    Initialization is nanoGPT's: every Linear and Embedding weight ~ N(0, 0.02), biases 0,
    LayerNorms 1 and 0, and the two projections back into the residual stream (``attn.c_proj``,
    ``mlp.proj``) ~ N(0, 0.02 / sqrt(2 n_layer)), drawn from taifuse's generator
    (``taifuse.manual_seed`` fixes them).
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(config, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"GPTConfig.{name} should be a positive int, got {value!r}")
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self._init_weights()

    def _init_weights(self) -> None:
        # One draw from taifuse's generator seeds all of it, as taifuse's own layers seed theirs.
        rng = np.random.default_rng(_random.next_seed())
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        values = {}
        for name, p in self.named_parameters():
            if name.endswith(("c_proj.weight", "mlp.proj.weight")):
                values[name] = rng.normal(0.0, residual_std, p.shape)
            elif p.ndim >= 2:  # Linear and Embedding weights
                values[name] = rng.normal(0.0, 0.02, p.shape)
            elif name.endswith("bias"):
                values[name] = np.zeros(p.shape)
            else:  # LayerNorm weights keep their 1
                continue
        self.load_state_dict({k: v.astype(np.float32) for k, v in values.items()}, strict=False)

    def forward(self, idx: Any, targets: Any = None) -> tuple[Tensor, Tensor | None]:
        """Logits for token indices ``idx`` (B, T), and the mean cross entropy against ``targets``.

        With ``targets`` (B, T), the logits are (B, T, vocab_size) and the loss a 0-d Tensor; without
        them, as nanoGPT at inference, only the last position's logits are computed, (B, 1,
        vocab_size), and the loss is None.
        """
        idx = _indices(idx, "idx")
        b, t = idx.shape
        if t > self.config.block_size:
            raise ValueError(f"GPT: idx has {t} positions, more than block_size {self.config.block_size}")
        x = self.drop(self.wte(idx) + self.wpe(np.arange(t)))
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        if targets is None:
            return self.lm_head(x[:, -1:, :]), None
        targets = _indices(targets, "targets")
        if targets.shape != (b, t):
            raise ValueError(f"GPT: targets should have idx's shape {(b, t)}, got {targets.shape}")
        logits = self.lm_head(x)
        loss = F.cross_entropy(logits.view(b * t, self.config.vocab_size), targets.reshape(b * t))
        return logits, loss

    def configure_optimizer(
        self, weight_decay: float, lr: float, betas: tuple[float, float] = (0.9, 0.95)
    ) -> AdamW:
        """AdamW with two parameter groups, as nanoGPT's ``configure_optimizers``: every parameter
        with 2 or more dimensions (the Linear weights and both embedding tables) decays by
        ``weight_decay``; the 1-D ones (biases, LayerNorm weights) do not."""
        decay = [p for p in self.parameters() if p.ndim >= 2]
        no_decay = [p for p in self.parameters() if p.ndim < 2]
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        return AdamW([g for g in groups if g["params"]], lr=lr, betas=betas)

    def generate(
        self,
        idx: Any,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        seed: int | None = None,
    ) -> np.ndarray:
        """Extend ``idx`` (B, T) by ``max_new_tokens`` sampled tokens; returns the int64 (B, T + new) array.

        Each step feeds the last ``block_size`` tokens, divides the last logits by ``temperature``,
        keeps the ``top_k`` largest (all when None) and samples from their softmax with a NumPy
        Generator seeded by ``seed`` (None: a draw from taifuse's generator, so
        ``taifuse.manual_seed`` fixes the sample). Runs under ``taifuse.no_grad()``; call
        ``model.eval()`` first to turn dropout off.
        """
        idx = _indices(idx, "idx")
        idx = (idx.numpy() if isinstance(idx, Tensor) else idx).astype(np.int64)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"generate: max_new_tokens should be a non-negative int, got {max_new_tokens!r}")
        if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
            raise ValueError(f"generate: temperature should be a positive number, got {temperature!r}")
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k <= 0):
            raise ValueError(f"generate: top_k should be None or a positive int, got {top_k!r}")
        rng = np.random.default_rng(_random.next_seed() if seed is None else seed)
        with taifuse.no_grad():
            for _ in range(max_new_tokens):
                logits, _ = self(idx[:, -self.config.block_size :])
                logits = logits.numpy()[:, -1, :].astype(np.float64) / temperature
                if top_k is not None and top_k < logits.shape[-1]:
                    kth = np.sort(logits, axis=-1)[:, -top_k][:, None]
                    logits = np.where(logits < kth, -np.inf, logits)
                probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
                cdf = np.cumsum(probs / probs.sum(axis=-1, keepdims=True), axis=-1)
                draws = rng.random((idx.shape[0], 1))
                nxt = np.minimum((cdf < draws).sum(axis=-1), logits.shape[-1] - 1)
                idx = np.concatenate([idx, nxt[:, None].astype(np.int64)], axis=1)
        return idx


def _indices(value: Any, name: str) -> Any:
    """A (B, T) integer NumPy array from an array or list; an integer Tensor is checked and kept
    (a data loader's batch on a device backend stays there)."""
    array = value if isinstance(value, Tensor) else np.asarray(value)
    if array.dtype.kind not in "iu":
        raise TypeError(f"GPT: {name} should hold integer token indices, got dtype {array.dtype}")
    if array.ndim != 2:
        raise ValueError(f"GPT: {name} should have shape (batch, time), got {array.shape}")
    return array


def torch_gpt(config: GPTConfig) -> Any:
    """The same GPT in PyTorch: the same module names and parameter shapes, the same forward.

    Its parameters are PyTorch's default initialization; load a taifuse model's ``state_dict``
    into it to compare the two.
    """
    import torch
    from torch import nn as tnn
    from torch.nn import functional as tF

    class CausalSelfAttention(tnn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.n_head, self.dropout = config.n_head, config.dropout
            self.c_attn = tnn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
            self.c_proj = tnn.Linear(config.n_embd, config.n_embd, bias=config.bias)
            self.resid_dropout = tnn.Dropout(config.dropout)

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = (
                p.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
                for p in self.c_attn(x).split(c, dim=2)
            )
            dropout = self.dropout if self.training else 0.0
            y = tF.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
            return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c)))

    class MLP(tnn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = tnn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
            self.gelu = tnn.GELU()
            self.proj = tnn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
            self.dropout = tnn.Dropout(config.dropout)

        def forward(self, x):
            return self.dropout(self.proj(self.gelu(self.fc(x))))

    class Block(tnn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1 = tnn.LayerNorm(config.n_embd, bias=config.bias)
            self.attn = CausalSelfAttention()
            self.ln2 = tnn.LayerNorm(config.n_embd, bias=config.bias)
            self.mlp = MLP()

        def forward(self, x):
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))

    class TorchGPT(tnn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = config
            self.wte = tnn.Embedding(config.vocab_size, config.n_embd)
            self.wpe = tnn.Embedding(config.block_size, config.n_embd)
            self.drop = tnn.Dropout(config.dropout)
            self.blocks = tnn.ModuleList(Block() for _ in range(config.n_layer))
            self.ln_f = tnn.LayerNorm(config.n_embd, bias=config.bias)
            self.lm_head = tnn.Linear(config.n_embd, config.vocab_size, bias=False)

        def forward(self, idx, targets=None):
            b, t = idx.shape
            pos = torch.arange(t, device=idx.device)
            x = self.drop(self.wte(idx) + self.wpe(pos))
            for block in self.blocks:
                x = block(x)
            x = self.ln_f(x)
            if targets is None:
                return self.lm_head(x[:, -1:, :]), None
            logits = self.lm_head(x)
            return logits, tF.cross_entropy(logits.view(b * t, -1), targets.reshape(b * t))

        def configure_optimizer(self, weight_decay, lr, betas=(0.9, 0.95)):
            decay = [p for p in self.parameters() if p.dim() >= 2]
            no_decay = [p for p in self.parameters() if p.dim() < 2]
            groups = [
                {"params": decay, "weight_decay": weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ]
            return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=betas)

    return TorchGPT()
