"""A small MLP block's forward pass with taifuse's fused ops, checked against plain NumPy.

Run: ``python examples/quickstart.py`` (pick a backend with ``TAIFUSE_BACKEND=numpy|numba|taichi``).
"""

from __future__ import annotations

import math

import numpy as np

import taifuse
import taifuse.functional as F


def mlp_block(x, w1, b1, w2, b2, gamma, beta, p_drop=0.1):
    """LayerNorm -> Linear+GELU (fused) -> Dropout -> Linear, as in a transformer's MLP."""
    h = F.layer_norm(x, x.shape[-1], gamma, beta)
    h = F.linear(h, w1, b1, activation="gelu_tanh")  # bias and GELU fused into the matmul's epilogue
    h = F.dropout(h, p_drop)
    return F.linear(h, w2, b2)


def numpy_mlp_block(x, w1, b1, w2, b2, gamma, beta):
    """The same block in plain float64 NumPy, without dropout (for the eval-mode check)."""
    x = x.astype(np.float64)
    mu = x.mean(-1, keepdims=True)
    h = (x - mu) / np.sqrt(x.var(-1, keepdims=True) + 1e-5) * gamma + beta
    h = h @ w1.T + b1
    h = 0.5 * h * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * h**3)))
    return h @ w2.T + b2


def main() -> None:
    taifuse.manual_seed(0)
    rng = np.random.default_rng(0)
    d, hidden = 64, 256
    x = rng.standard_normal((8, 16, d)).astype(np.float32)  # (batch, tokens, features)
    w1 = (rng.standard_normal((hidden, d)) / math.sqrt(d)).astype(np.float32)  # (out, in), as in PyTorch
    b1 = np.zeros(hidden, np.float32)
    w2 = (rng.standard_normal((d, hidden)) / math.sqrt(hidden)).astype(np.float32)
    b2 = np.zeros(d, np.float32)
    gamma, beta = np.ones(d, np.float32), np.zeros(d, np.float32)

    y = mlp_block(x, w1, b1, w2, b2, gamma, beta)
    print(f"backend: {taifuse.get_backend()} (installed: {', '.join(taifuse.available_backends())})")
    print(f"output: shape {y.shape}, dtype {y.dtype}, mean {y.mean():+.4f}, std {y.std():.4f}")

    # Without dropout the block is deterministic: compare with the NumPy float64 version.
    y_eval = mlp_block(x, w1, b1, w2, b2, gamma, beta, p_drop=0.0)
    err = np.abs(y_eval - numpy_mlp_block(x, w1, b1, w2, b2, gamma, beta)).max()
    print(f"max |taifuse - numpy float64| = {err:.2e}")
    assert err < 1e-4, err

    probs = F.softmax(y_eval[0, 0], dim=-1)
    print(f"softmax of the first token sums to {probs.sum():.6f}")


if __name__ == "__main__":
    main()
