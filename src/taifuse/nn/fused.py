"""``ConvBn2d`` and ``ConvBnReLU2d``: a Conv2d -> BatchNorm2d (-> ReLU) block that trains as one op.

The names and the layout are ``torch.ao.nn.intrinsic``'s: a ``Sequential`` of the modules it was
built from, so its ``state_dict`` keys (``0.weight``, ``1.running_mean``, ...) are those of
``nn.Sequential(conv, bn, relu)`` and a checkpoint moves between the two. Its forward runs
``F.conv2d_batch_norm``: in training the fused block (docs/cnn.md, "The fused block"), in
evaluation the convolution and one normalize-ReLU pass (``nn.utils.fuse_conv_bn_eval`` folds the
pair into one convolution for inference).

Example::

    >>> import numpy as np, taifuse, taifuse.nn as nn
    >>> taifuse.set_backend("numpy")
    >>> block = nn.ConvBnReLU2d(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
    >>> list(block.state_dict())
    ['0.weight', '1.weight', '1.bias', '1.running_mean', '1.running_var', '1.num_batches_tracked']
    >>> y = block(taifuse.tensor(np.ones((2, 3, 5, 5), np.float32)))
    >>> y.shape, int(block[1].num_batches_tracked.item())
    ((2, 8, 5, 5), 1)
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import taifuse.functional as F
from taifuse import _conv_ops
from taifuse.nn.batchnorm import BatchNorm2d
from taifuse.nn.conv import Conv2d
from taifuse.nn.layers import ReLU, Sequential
from taifuse.tensor import Tensor


class ConvBn2d(Sequential):
    """``Conv2d`` then ``BatchNorm2d`` as one op (``torch.ao.nn.intrinsic.ConvBn2d``).

    Args:
        conv: a ``Conv2d`` without an activation (the batch norm must follow the convolution).
        bn: a ``BatchNorm2d`` of ``conv.out_channels`` features without a fused activation.
    """

    _activation: str | None = None

    def __init__(self, conv: Conv2d, bn: BatchNorm2d, *rest: Any) -> None:
        name = type(self).__name__
        if not isinstance(conv, Conv2d):
            raise TypeError(f"{name}: conv should be a taifuse.nn.Conv2d, got {type(conv).__name__}")
        if not isinstance(bn, BatchNorm2d):
            raise TypeError(f"{name}: bn should be a taifuse.nn.BatchNorm2d, got {type(bn).__name__}")
        if conv.activation is not None:
            raise ValueError(
                f"{name}: conv applies activation={conv.activation!r}; the batch norm must follow it"
            )
        if bn.activation is not None:
            raise ValueError(f"{name}: bn has activation={bn.activation!r}; the block applies its own")
        if bn.num_features != conv.out_channels:
            raise ValueError(
                f"{name}: bn.num_features ({bn.num_features}) should equal conv.out_channels ({conv.out_channels})"
            )
        super().__init__(conv, bn, *rest)

    def forward(self, x: Tensor) -> Tensor:
        conv, bn = self[0], self[1]
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{type(self).__name__}: input should be a Tensor, got {type(x).__name__}")
        # The convolution's checks first, then batch norm's on its output's shape (which counts
        # the batch): nothing is counted or written for a bad input.
        _conv_ops.check_conv_input(type(self).__name__, tuple(x.shape))
        geom = _conv_ops.conv_geometry(
            type(self).__name__, tuple(x.shape), tuple(conv.weight.shape),
            None if conv.bias is None else tuple(conv.bias.shape),
            conv.stride, conv.padding, conv.dilation, conv.groups,
        )  # fmt: skip
        y = SimpleNamespace(shape=geom.out_shape, dtype=x.dtype)
        running_mean, running_var, use_batch, factor = bn.functional_args(y)
        return F.conv2d_batch_norm(
            x, conv.weight, conv.bias, running_mean, running_var, bn.weight, bn.bias, conv.stride,
            conv.padding, conv.dilation, conv.groups, use_batch, factor, bn.eps, activation=self._activation,
        )  # fmt: skip


class ConvBnReLU2d(ConvBn2d):
    """``Conv2d``, ``BatchNorm2d`` and ``ReLU`` as one op (``torch.ao.nn.intrinsic.ConvBnReLU2d``).

    Args:
        conv, bn: as :class:`ConvBn2d`.
        relu: a ``ReLU`` (a new one if None), kept as the third module, as torch's.
    """

    _activation = "relu"

    def __init__(self, conv: Conv2d, bn: BatchNorm2d, relu: ReLU | None = None) -> None:
        relu = ReLU() if relu is None else relu
        if not isinstance(relu, ReLU):
            raise TypeError(f"ConvBnReLU2d: relu should be a taifuse.nn.ReLU, got {type(relu).__name__}")
        super().__init__(conv, bn, relu)
