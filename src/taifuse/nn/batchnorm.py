"""``BatchNorm1d`` and ``BatchNorm2d``: ``taifuse.functional.batch_norm`` with its state, as ``torch.nn``.

Example::

    >>> import numpy as np, taifuse, taifuse.nn as nn
    >>> taifuse.set_backend("numpy")
    >>> bn = nn.BatchNorm2d(3)
    >>> list(bn.state_dict())
    ['weight', 'bias', 'running_mean', 'running_var', 'num_batches_tracked']
    >>> x = taifuse.tensor(np.arange(24, dtype=np.float32).reshape(2, 3, 2, 2))
    >>> y = bn(x)  # training: batch statistics; the running ones move by momentum 0.1
    >>> np.round(bn.running_mean.numpy(), 3), int(bn.num_batches_tracked.item())
    (array([0.75, 1.15, 1.55], dtype=float32), 1)
    >>> _ = bn.eval()  # evaluation: the running statistics
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

import taifuse.functional as F
from taifuse import _array_ops, _batch_norm_ops
from taifuse.nn.module import Module, Parameter
from taifuse.tensor import Tensor


class _BatchNorm(Module):
    """The state and forward shared by ``BatchNorm1d`` and ``BatchNorm2d`` (PyTorch's ``_BatchNorm``).

    Args:
        num_features: C, the channel dimension of the ``(N, C, ...)`` input.
        eps: added to the variance.
        momentum: the running statistics' update factor; None for a cumulative average
            (``1 / num_batches_tracked``), as PyTorch.
        affine: learn a per-channel ``weight`` (ones at init) and ``bias`` (zeros).
        track_running_stats: keep ``running_mean`` (zeros), ``running_var`` (ones) and
            ``num_batches_tracked`` as buffers and use them in evaluation; without them the batch
            statistics are used in both modes.
        activation: None or ``'relu'``, fused into the normalize pass (taifuse's extension, as
            ``nn.Linear``'s).
        dtype: of the parameters and running statistics (float32 default).
    """

    _ndims: tuple[int, ...] = ()
    _expected = ""

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        activation: str | None = None,
        dtype: Any = np.float32,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        if (
            isinstance(num_features, bool)
            or not isinstance(num_features, numbers.Integral)
            or num_features < 1
        ):
            raise ValueError(f"{name}: num_features should be a positive int, got {num_features!r}")
        eps = _array_ops.check_finite_number(eps, name, "eps")
        if eps < 0:
            raise ValueError(f"{name}: eps should be non-negative, got {eps}")
        if momentum is not None:
            momentum = _array_ops.check_finite_number(momentum, name, "momentum")
        if activation not in _batch_norm_ops.ACTIVATIONS:
            raise ValueError(
                f"{name}: activation should be one of {_batch_norm_ops.ACTIVATIONS}, got {activation!r}"
            )
        self.num_features = int(num_features)
        self.eps, self.momentum = eps, momentum
        self.affine, self.track_running_stats = bool(affine), bool(track_running_stats)
        self.activation = activation
        dtype = np.dtype(dtype)
        c = self.num_features
        self.weight = Parameter(np.ones(c, dtype)) if affine else None
        self.bias = Parameter(np.zeros(c, dtype)) if affine else None
        if self.track_running_stats:
            self.register_buffer("running_mean", Tensor(np.zeros(c, dtype)))
            self.register_buffer("running_var", Tensor(np.ones(c, dtype)))
            self.register_buffer("num_batches_tracked", Tensor(np.array(0, np.int64)))
        else:
            self.register_buffer("running_mean", None)
            self.register_buffer("running_var", None)
            self.register_buffer("num_batches_tracked", None)
        self._counted: tuple[Any, int] = (None, 0)  # NOTE [ num_batches_tracked ]

    # NOTE [ num_batches_tracked ]
    # The count lives in the buffer (an int64 Tensor, int32 on the taichi backend), which state_dict
    # saves and load_state_dict replaces. Integer Tensors on the taichi backend have no arithmetic,
    # so each training step replaces the buffer with a new Tensor of count + 1; the count itself is
    # remembered beside the buffer object it was read from, so that a step never reads the device
    # (the buffer is read once after a load_state_dict or an assignment replaced it).

    def _batches_tracked(self) -> int:
        buf = self.num_batches_tracked
        seen, count = self._counted
        if buf is not seen:
            count = int(buf.item())
        return count

    def count_batch(self) -> int:
        """Count one training batch in ``num_batches_tracked``; returns the new count. Host state:
        a compiled step re-runs it at every replay (NOTE [ What a compiled step records ] in
        taifuse/compiler.py)."""
        count = self._batches_tracked() + 1
        self.num_batches_tracked = Tensor(np.array(count, np.int64))
        self._counted = (self.num_batches_tracked, count)
        return count

    def reset_running_stats(self) -> None:
        """Running mean 0, running variance 1, no batches tracked (as PyTorch's)."""
        if not self.track_running_stats:
            return
        c, dtype = self.num_features, self.running_mean.dtype
        self.running_mean.copy_(np.zeros(c, dtype))
        self.running_var.copy_(np.ones(c, dtype))
        self.num_batches_tracked = Tensor(np.array(0, np.int64))

    def reset_parameters(self) -> None:
        """The running statistics reset, weight 1 and bias 0."""
        self.reset_running_stats()
        if self.affine:
            self.weight.copy_(np.ones(self.num_features, self.weight.dtype))
            self.bias.copy_(np.zeros(self.num_features, self.bias.dtype))

    def _check_input_dim(self, x: Any) -> None:
        if len(x.shape) not in self._ndims:
            raise ValueError(
                f"{type(self).__name__}: expected {self._expected} input, got {len(x.shape)}D input"
            )

    def functional_args(self, x: Any) -> tuple[Any, Any, bool, float]:
        """``(running_mean, running_var, training, momentum)`` for ``F.batch_norm`` on ``x`` (or on
        anything with x's shape and dtype), counting the batch in training: the one place the mode
        rules live, for :meth:`forward` and for the fused ``nn.ConvBnReLU2d``. ``x`` is checked
        first, so that a bad input does not count a batch."""
        self._check_input_dim(x)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            _batch_norm_ops.check_args(
                x, self.running_mean, self.running_var, self.weight, self.bias, True, factor, self.eps,
                self.activation, type(self).__name__,
            )  # fmt: skip
            count = self.count_batch()
            if self.momentum is None:
                factor = 1.0 / count
        # Batch statistics in training, and in evaluation without running statistics (PyTorch's rule).
        use_batch = self.training or self.running_mean is None
        track = not self.training or self.track_running_stats
        return (
            (self.running_mean if track else None),
            (self.running_var if track else None),
            use_batch,
            factor,
        )

    def forward(self, x: Tensor) -> Tensor:
        running_mean, running_var, use_batch, factor = self.functional_args(x)
        return F.batch_norm(
            x, running_mean, running_var, self.weight, self.bias, use_batch, factor, self.eps,
            activation=self.activation,
        )  # fmt: skip

    def extra_repr(self) -> str:
        text = (
            f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, affine={self.affine}, "
            f"track_running_stats={self.track_running_stats}"
        )
        return text if self.activation is None else f"{text}, activation={self.activation!r}"


class BatchNorm1d(_BatchNorm):
    """Batch normalization of ``(N, C)`` or ``(N, C, L)`` input over every axis but C, as
    ``torch.nn.BatchNorm1d`` (arguments: :class:`_BatchNorm`)."""

    _ndims = (2, 3)
    _expected = "2D or 3D"


class BatchNorm2d(_BatchNorm):
    """Batch normalization of ``(N, C, H, W)`` input over N, H and W, as ``torch.nn.BatchNorm2d``
    (arguments: :class:`_BatchNorm`)."""

    _ndims = (4,)
    _expected = "4D"
