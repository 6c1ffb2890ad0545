"""Layers: ``Linear`` (fused bias and activation), activations, ``LayerNorm``, ``Dropout``,
``Sequential`` and the losses, as their ``torch.nn`` namesakes."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

import taifuse.functional as F
from taifuse import _array_ops, _random
from taifuse.nn.module import Module, Parameter
from taifuse.tensor import Tensor


def _uniform(shape: tuple[int, ...], bound: float, dtype: Any) -> np.ndarray:
    # One draw from taifuse's generator seeds the layer's values, so manual_seed fixes them.
    rng = np.random.default_rng(_random.next_seed())
    return rng.uniform(-bound, bound, size=shape).astype(dtype)


class Linear(Module):
    """y = activation(x @ weight.T + bias), one fused kernel (``taifuse.functional.linear``).

    Args:
        in_features, out_features: sizes of the last dimension of the input and the output.
        bias: learn an additive bias.
        activation: ``None``, ``'relu'``, ``'gelu'``, ``'gelu_tanh'`` or ``'silu'``, fused.
        dtype: float32 (default), float16 or float64.

    Initialization is PyTorch's: weight and bias ~ U(-1/sqrt(in_features), 1/sqrt(in_features))
    (``kaiming_uniform_(a=sqrt(5))`` for the weight), drawn from taifuse's generator
    (``taifuse.manual_seed``).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        activation: str | None = None,
        dtype: Any = np.float32,
    ) -> None:
        super().__init__()
        for argname, value in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
                raise ValueError(f"Linear: {argname} should be a non-negative int, got {value!r}")
        if activation not in F.ACTIVATIONS:
            raise ValueError(f"Linear: activation should be one of {F.ACTIVATIONS}, got {activation!r}")
        self.in_features, self.out_features, self.activation = int(in_features), int(out_features), activation
        bound = 1.0 / math.sqrt(in_features) if in_features > 0 else 0.0
        self.weight = Parameter(_uniform((out_features, in_features), bound, dtype))
        self.bias = Parameter(_uniform((out_features,), bound, dtype)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias, self.activation)

    def extra_repr(self) -> str:
        act = f", activation={self.activation!r}" if self.activation else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}{act}"


class Sequential(Module):
    """Modules applied in order: ``Sequential(a, b)(x) == b(a(x))``; named ``'0'``, ``'1'``, ..."""

    def __init__(self, *modules: Module) -> None:
        super().__init__()
        for i, module in enumerate(modules):
            if not isinstance(module, Module):
                raise TypeError(f"Sequential: argument {i} should be a Module, got {type(module).__name__}")
            setattr(self, str(i), module)

    def forward(self, x: Any) -> Any:
        for module in self._modules.values():
            x = module(x)
        return x

    def __getitem__(self, index: int) -> Module:
        return list(self._modules.values())[index]

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[Module]:
        return iter(self._modules.values())


class GELU(Module):
    """gelu(x), exact (``approximate='none'``) or tanh-approximated (``'tanh'``)."""

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"GELU: approximate should be 'none' or 'tanh', got {approximate!r}")
        self.approximate = approximate

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(x, self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


class ReLU(Module):
    """max(x, 0)."""

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(x)


class LeakyReLU(Module):
    """x if x > 0 else negative_slope * x."""

    def __init__(self, negative_slope: float = 0.01) -> None:
        super().__init__()
        self.negative_slope = _array_ops.check_finite_number(negative_slope, "LeakyReLU", "negative_slope")

    def forward(self, x: Tensor) -> Tensor:
        return F.leaky_relu(x, self.negative_slope)


class SiLU(Module):
    """x * sigmoid(x)."""

    def forward(self, x: Tensor) -> Tensor:
        return F.silu(x)


class Sigmoid(Module):
    """1 / (1 + exp(-x))."""

    def forward(self, x: Tensor) -> Tensor:
        return F.sigmoid(x)


class Tanh(Module):
    """tanh(x)."""

    def forward(self, x: Tensor) -> Tensor:
        return F.tanh(x)


class LayerNorm(Module):
    """Layer normalization over the trailing ``normalized_shape`` dimensions (weight 1, bias 0 at init)."""

    def __init__(
        self,
        normalized_shape: int | Sequence[int],
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        dtype: Any = np.float32,
    ) -> None:
        super().__init__()
        # F.layer_norm's own check, so the layer accepts exactly what the op does, and says so at once.
        self.normalized_shape, self.eps = _array_ops.layer_norm_args(normalized_shape, eps, "LayerNorm")
        self.weight = Parameter(np.ones(self.normalized_shape, dtype)) if elementwise_affine else None
        self.bias = Parameter(np.zeros(self.normalized_shape, dtype)) if elementwise_affine and bias else None

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}"


class RMSNorm(Module):
    """Root-mean-square normalization over the trailing ``normalized_shape`` dimensions
    (``taifuse.functional.rms_norm``), as ``torch.nn.RMSNorm``: weight 1 at init, no bias.

    Args:
        normalized_shape: the trailing dimensions normalized over (an int or a sequence of ints).
        eps: added to the mean square; None is the compute dtype's machine epsilon, as PyTorch's.
        elementwise_affine: learn a per-element ``weight``.
        dtype: float32 (default), float16 or float64.

    Example::

        >>> import numpy as np, taifuse, taifuse.nn as nn
        >>> taifuse.set_backend("numpy")
        >>> norm = nn.RMSNorm(4)
        >>> y = norm(taifuse.tensor(np.full((2, 4), 3.0, np.float32)))
        >>> np.round(y.numpy(), 4)
        array([[1., 1., 1., 1.],
               [1., 1., 1., 1.]], dtype=float32)
    """

    def __init__(
        self,
        normalized_shape: int | Sequence[int],
        eps: float | None = None,
        elementwise_affine: bool = True,
        dtype: Any = np.float32,
    ) -> None:
        super().__init__()
        self.normalized_shape, self.eps = _array_ops.rms_norm_args(normalized_shape, eps, "RMSNorm")
        self.elementwise_affine = bool(elementwise_affine)
        self.weight = Parameter(np.ones(self.normalized_shape, dtype)) if elementwise_affine else None

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, self.normalized_shape, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


class Embedding(Module):
    """A lookup table of ``num_embeddings`` vectors of size ``embedding_dim``
    (``taifuse.functional.embedding``), as ``torch.nn.Embedding``.

    Args:
        num_embeddings: the number of rows (valid indices are ``[0, num_embeddings)``).
        embedding_dim: the size of each vector.
        padding_idx: a row that gets no gradient and starts at zero (negative counts from the end).
        dtype: float32 (default), float16 or float64.

    Initialization is PyTorch's: weight ~ N(0, 1), drawn from taifuse's generator
    (``taifuse.manual_seed``), with the ``padding_idx`` row zeroed.

    Example::

        >>> import numpy as np, taifuse, taifuse.nn as nn
        >>> taifuse.set_backend("numpy")
        >>> taifuse.manual_seed(0)
        >>> emb = nn.Embedding(10, 3, padding_idx=0)
        >>> emb(np.array([[1, 2, 0]])).shape
        (1, 3, 3)
        >>> emb.weight.numpy()[0]
        array([0., 0., 0.], dtype=float32)
    """

    def __init__(
        self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None, dtype: Any = np.float32
    ) -> None:
        super().__init__()
        for argname, value in (("num_embeddings", num_embeddings), ("embedding_dim", embedding_dim)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
                raise ValueError(f"Embedding: {argname} should be a non-negative int, got {value!r}")
        self.num_embeddings, self.embedding_dim = int(num_embeddings), int(embedding_dim)
        pad = _array_ops.embedding_padding_idx(padding_idx, self.num_embeddings, "Embedding")
        self.padding_idx = None if pad < 0 else pad
        rng = np.random.default_rng(_random.next_seed())  # one draw seeds the table, as _uniform
        weight = rng.standard_normal((self.num_embeddings, self.embedding_dim)).astype(dtype)
        if self.padding_idx is not None:
            weight[self.padding_idx] = 0
        self.weight = Parameter(weight)

    def forward(self, input: Any) -> Tensor:
        return F.embedding(input, self.weight, self.padding_idx)

    def extra_repr(self) -> str:
        pad = "" if self.padding_idx is None else f", padding_idx={self.padding_idx}"
        return f"{self.num_embeddings}, {self.embedding_dim}{pad}"


class Dropout(Module):
    """Zero elements with probability ``p`` while training (scaled by 1 / (1 - p)); identity in eval mode."""

    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        p = _array_ops.dropout_p(p, "Dropout")
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        return F.dropout(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"


class MSELoss(Module):
    """``taifuse.functional.mse_loss`` as a module."""

    def __init__(self, reduction: str = "mean") -> None:
        super().__init__()
        self.reduction = reduction

    def forward(self, input: Tensor, target: Any) -> Tensor:
        return F.mse_loss(input, target, self.reduction)


class CrossEntropyLoss(Module):
    """``taifuse.functional.cross_entropy`` (logits and class indices) as a module."""

    def __init__(self, reduction: str = "mean") -> None:
        super().__init__()
        self.reduction = reduction

    def forward(self, logits: Tensor, target: Any) -> Tensor:
        return F.cross_entropy(logits, target, self.reduction)
