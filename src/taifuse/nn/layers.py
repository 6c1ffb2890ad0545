"""Layers: ``Linear`` (fused bias and activation), activations, ``LayerNorm``, ``Dropout``,
``Sequential`` and the losses, as their ``torch.nn`` namesakes."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

import taifuse.functional as F
from taifuse import _array_ops, _random
from taifuse.nn.module import Module, Parameter
from taifuse.tensor import Tensor

if TYPE_CHECKING:  # annotations only: typing.Self is Python 3.11+
    from typing_extensions import Self


def uniform_init(shape: tuple[int, ...], bound: float, dtype: Any) -> np.ndarray:
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
        self.weight = Parameter(uniform_init((out_features, in_features), bound, dtype))
        self.bias = Parameter(uniform_init((out_features,), bound, dtype)) if bias else None

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


class ModuleList(Module):
    """A list of modules, registered as children named ``'0'``, ``'1'``, ... as ``torch.nn.ModuleList``,
    so a model's parameters read ``blocks.0.ln1.weight``. It has no ``forward``: the owner loops over it.

    Example::

        >>> import taifuse.nn as nn
        >>> layers = nn.ModuleList([nn.Linear(2, 2) for _ in range(2)])
        >>> layers.append(nn.Linear(2, 1, bias=False))
        ModuleList(
          (0): Linear(in_features=2, out_features=2, bias=True)
          (1): Linear(in_features=2, out_features=2, bias=True)
          (2): Linear(in_features=2, out_features=1, bias=False)
        )
        >>> len(layers), [name for name, _ in layers.named_parameters()][-1]
        (3, '2.weight')
    """

    def __init__(self, modules: Iterable[Module] | None = None) -> None:
        super().__init__()
        if modules is not None:
            self.extend(modules)

    @staticmethod
    def _checked(module: Any, where: str) -> Module:
        if not isinstance(module, Module):
            raise TypeError(f"ModuleList.{where}: module should be a Module, got {type(module).__name__}")
        return module

    def _index(self, idx: Any) -> int:
        if isinstance(idx, bool) or not isinstance(idx, numbers.Integral):
            raise TypeError(f"ModuleList indices should be integers or slices, got {type(idx).__name__}")
        n = len(self._modules)
        if not -n <= idx < n:
            raise IndexError(f"ModuleList: index {idx} is out of range for {n} modules")
        return int(idx) % n

    def _renumber(self, modules: list[Module]) -> None:
        self._modules.clear()
        for i, module in enumerate(modules):
            self._modules[str(i)] = module

    def __getitem__(self, idx: int | slice) -> Any:
        if isinstance(idx, slice):
            return ModuleList(list(self._modules.values())[idx])
        return self._modules[str(self._index(idx))]

    def __setitem__(self, idx: int, module: Module) -> None:
        self._modules[str(self._index(idx))] = self._checked(module, "__setitem__")

    def __delitem__(self, idx: int | slice) -> None:
        modules = list(self._modules.values())
        if isinstance(idx, slice):
            del modules[idx]
        else:
            del modules[self._index(idx)]
        self._renumber(modules)  # torch renumbers too, so the names stay '0'..'n-1'

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[Module]:
        return iter(list(self._modules.values()))

    def __iadd__(self, modules: Iterable[Module]) -> Self:
        return self.extend(modules)

    def append(self, module: Module) -> ModuleList:
        """Add ``module`` at the end; returns self."""
        self._modules[str(len(self._modules))] = self._checked(module, "append")
        return self

    def extend(self, modules: Iterable[Module]) -> ModuleList:
        """Append every module of an iterable; returns self."""
        if isinstance(modules, Module) and not isinstance(modules, ModuleList):
            raise TypeError(
                f"ModuleList.extend should be called with an iterable of Modules, got {type(modules).__name__}"
            )
        checked = [self._checked(m, "extend") for m in modules]  # all checked before any is added
        for module in checked:
            self.append(module)
        return self

    def insert(self, index: int, module: Module) -> None:
        """Insert ``module`` before ``index`` (as ``list.insert``: any int, clamped to the ends)."""
        if isinstance(index, bool) or not isinstance(index, numbers.Integral):
            raise TypeError(f"ModuleList.insert: index should be an int, got {type(index).__name__}")
        modules = list(self._modules.values())
        modules.insert(int(index), self._checked(module, "insert"))
        self._renumber(modules)


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
        rng = np.random.default_rng(_random.next_seed())  # one draw seeds the table, as uniform_init
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


class CausalSelfAttention(Module):
    """Multi-head causal self-attention as nanoGPT's: one fused projection to queries, keys and
    values, ``taifuse.functional.scaled_dot_product_attention`` with ``is_causal=True`` per head, the
    heads merged and projected back, then residual dropout.

    For ``x`` of shape ``(B, T, d_model)``::

        q, k, v = c_attn(x).split(d_model, dim=2)          # each viewed as (B, n_head, T, d_model // n_head)
        y = scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout if training else 0)
        out = resid_dropout(c_proj(y.transpose(1, 2).reshape(B, T, d_model)))

    Args:
        d_model: the embedding size; a multiple of ``n_head``.
        n_head: the number of heads (each of size ``d_model // n_head``).
        dropout: the dropout probability on the attention weights and on the output, while training.
        bias: learn biases in ``c_attn`` and ``c_proj``.
        dtype: float32 (default), float16 or float64.

    Parameters are named as nanoGPT's ``CausalSelfAttention`` (``c_attn.weight`` of shape
    ``(3 * d_model, d_model)``, its rows the query, key and value projections in that order;
    ``c_proj.weight``), so its PyTorch twin loads this module's ``state_dict`` unchanged.

    Example::

        >>> import numpy as np, taifuse, taifuse.nn as nn
        >>> taifuse.set_backend("numpy")
        >>> taifuse.manual_seed(0)
        >>> attn = nn.CausalSelfAttention(8, n_head=2)
        >>> attn
        CausalSelfAttention(
          d_model=8, n_head=2, dropout=0.0
          (c_attn): Linear(in_features=8, out_features=24, bias=True)
          (c_proj): Linear(in_features=8, out_features=8, bias=True)
          (resid_dropout): Dropout(p=0.0)
        )
        >>> x = taifuse.tensor(np.ones((3, 5, 8), np.float32))
        >>> attn(x).shape
        (3, 5, 8)
    """

    def __init__(
        self, d_model: int, n_head: int, dropout: float = 0.0, bias: bool = True, dtype: Any = np.float32
    ) -> None:
        super().__init__()
        for argname, value in (("d_model", d_model), ("n_head", n_head)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
                raise ValueError(f"CausalSelfAttention: {argname} should be a positive int, got {value!r}")
        if d_model % n_head:
            raise ValueError(
                f"CausalSelfAttention: d_model ({d_model}) should be a multiple of n_head, got n_head={n_head}"
            )
        self.d_model, self.n_head = int(d_model), int(n_head)
        self.dropout = _array_ops.dropout_p(dropout, "CausalSelfAttention")
        self.c_attn = Linear(d_model, 3 * d_model, bias=bias, dtype=dtype)
        self.c_proj = Linear(d_model, d_model, bias=bias, dtype=dtype)
        self.resid_dropout = Dropout(self.dropout)

    def forward(self, x: Tensor) -> Tensor:
        if not isinstance(x, Tensor):
            x = Tensor(x)
        if x.ndim != 3 or x.shape[-1] != self.d_model:
            raise ValueError(
                f"CausalSelfAttention: input should have shape (batch, time, {self.d_model}), got {x.shape}"
            )
        b, t, c = x.shape
        h = self.n_head
        q, k, v = (
            part.view(b, t, h, c // h).transpose(1, 2) for part in self.c_attn(x).split(self.d_model, dim=2)
        )
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(b, t, c)))

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, n_head={self.n_head}, dropout={self.dropout}"


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
