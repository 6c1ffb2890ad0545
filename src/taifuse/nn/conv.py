"""Convolution, pooling and flatten layers, named, initialized and keyed as in ``torch.nn``."""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

import taifuse.functional as F
from taifuse import _conv_ops
from taifuse.nn.layers import uniform_init
from taifuse.nn.module import Module, Parameter
from taifuse.tensor import Tensor


def _positive(name: str, argname: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name}: {argname} should be a positive int, got {value!r}")
    return int(value)


class Conv2d(Module):
    """y = activation(conv2d(x, weight) + bias) over NCHW input, one fused kernel (``F.conv2d``).

    Args:
        in_channels, out_channels: channels of the input and the output.
        kernel_size, stride, padding, dilation: an int or a pair; ``padding`` also ``'same'`` or ``'valid'``.
        groups: split the channels into groups (``groups == in_channels``: depthwise).
        bias: learn an additive bias per output channel.
        padding_mode: ``'zeros'`` only.
        activation: ``None``, ``'relu'``, ``'gelu'``, ``'gelu_tanh'`` or ``'silu'``, fused (a taifuse extra).
        dtype: float32 (default), float16 or float64.

    ``weight`` has shape ``(out_channels, in_channels // groups, kH, kW)``. Initialization is
    PyTorch's: weight and bias ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)) with fan_in = in_channels /
    groups * kH * kW (``kaiming_uniform_(a=sqrt(5))`` for the weight), from taifuse's generator.

    Example::

        >>> import numpy as np, taifuse, taifuse.nn as nn
        >>> taifuse.set_backend("numpy")
        >>> conv = nn.Conv2d(3, 8, 3, padding=1)
        >>> conv(taifuse.tensor(np.ones((2, 3, 5, 5), np.float32))).shape
        (2, 8, 5, 5)
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, int],
        stride: int | tuple[int, int] = 1,
        padding: int | tuple[int, int] | str = 0,
        dilation: int | tuple[int, int] = 1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        activation: str | None = None,
        dtype: Any = np.float32,
    ) -> None:
        super().__init__()
        in_channels = _positive("Conv2d", "in_channels", in_channels)
        out_channels = _positive("Conv2d", "out_channels", out_channels)
        groups = _positive("Conv2d", "groups", groups)
        if in_channels % groups:
            raise ValueError(f"Conv2d: groups={groups} should divide in_channels={in_channels}")
        if out_channels % groups:
            raise ValueError(f"Conv2d: groups={groups} should divide out_channels={out_channels}")
        if padding_mode != "zeros":
            raise ValueError(
                f"Conv2d: padding_mode should be 'zeros' (the only one taifuse has), got {padding_mode!r}"
            )
        if activation not in F.ACTIVATIONS:
            raise ValueError(f"Conv2d: activation should be one of {F.ACTIVATIONS}, got {activation!r}")
        kernel = _conv_ops.int_pair(kernel_size, "Conv2d", "kernel_size", 1)
        self.stride = _conv_ops.int_pair(stride, "Conv2d", "stride", 1)
        self.dilation = _conv_ops.int_pair(dilation, "Conv2d", "dilation", 1)
        if isinstance(padding, str):
            if padding not in ("same", "valid"):
                raise ValueError(
                    f"Conv2d: padding should be an int, a pair, 'same' or 'valid', got {padding!r}"
                )
            if padding == "same" and self.stride != (1, 1):
                raise ValueError(f"Conv2d: padding='same' needs stride 1, got stride={self.stride}")
            self.padding: Any = padding
        else:
            self.padding = _conv_ops.int_pair(padding, "Conv2d", "padding", 0)
        self.in_channels, self.out_channels, self.kernel_size = in_channels, out_channels, kernel
        self.groups, self.padding_mode, self.activation = groups, padding_mode, activation
        fan_in = in_channels // groups * kernel[0] * kernel[1]
        bound = 1.0 / math.sqrt(fan_in)
        self.weight = Parameter(uniform_init((out_channels, in_channels // groups) + kernel, bound, dtype))
        self.bias = Parameter(uniform_init((out_channels,), bound, dtype)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        return F.conv2d(
            x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups, self.activation
        )

    def extra_repr(self) -> str:
        s = f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}"
        if self.padding != (0, 0):
            s += f", padding={self.padding!r}"
        if self.dilation != (1, 1):
            s += f", dilation={self.dilation}"
        if self.groups != 1:
            s += f", groups={self.groups}"
        if self.bias is None:
            s += ", bias=False"
        return s + (f", activation={self.activation!r}" if self.activation else "")


class MaxPool2d(Module):
    """``F.max_pool2d`` as a layer (``torch.nn.MaxPool2d``'s arguments and defaults)."""

    def __init__(
        self,
        kernel_size: int | tuple[int, int],
        stride: int | tuple[int, int] | None = None,
        padding: int | tuple[int, int] = 0,
        dilation: int | tuple[int, int] = 1,
        return_indices: bool = False,
        ceil_mode: bool = False,
    ) -> None:
        super().__init__()
        self.kernel_size = _conv_ops.int_pair(kernel_size, "MaxPool2d", "kernel_size", 1)
        self.stride = (
            self.kernel_size if stride is None else _conv_ops.int_pair(stride, "MaxPool2d", "stride", 1)
        )
        self.padding = _conv_ops.int_pair(padding, "MaxPool2d", "padding", 0)
        self.dilation = _conv_ops.int_pair(dilation, "MaxPool2d", "dilation", 1)
        self.return_indices, self.ceil_mode = bool(return_indices), bool(ceil_mode)

    def forward(self, x: Tensor) -> Any:
        return F.max_pool2d(
            x, self.kernel_size, self.stride, self.padding, self.dilation, self.ceil_mode, self.return_indices
        )

    def extra_repr(self) -> str:
        return (
            f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}, "
            f"dilation={self.dilation}, ceil_mode={self.ceil_mode}"
        )


class AvgPool2d(Module):
    """``F.avg_pool2d`` as a layer (``torch.nn.AvgPool2d``'s arguments and defaults)."""

    def __init__(
        self,
        kernel_size: int | tuple[int, int],
        stride: int | tuple[int, int] | None = None,
        padding: int | tuple[int, int] = 0,
        ceil_mode: bool = False,
        count_include_pad: bool = True,
        divisor_override: int | None = None,
    ) -> None:
        super().__init__()
        self.kernel_size = _conv_ops.int_pair(kernel_size, "AvgPool2d", "kernel_size", 1)
        self.stride = (
            self.kernel_size if stride is None else _conv_ops.int_pair(stride, "AvgPool2d", "stride", 1)
        )
        self.padding = _conv_ops.int_pair(padding, "AvgPool2d", "padding", 0)
        self.ceil_mode, self.count_include_pad = bool(ceil_mode), bool(count_include_pad)
        self.divisor_override = divisor_override

    def forward(self, x: Tensor) -> Tensor:
        return F.avg_pool2d(
            x, self.kernel_size, self.stride, self.padding, self.ceil_mode, self.count_include_pad,
            self.divisor_override,
        )  # fmt: skip

    def extra_repr(self) -> str:
        return f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}"


class AdaptiveAvgPool2d(Module):
    """``F.adaptive_avg_pool2d`` as a layer: ``AdaptiveAvgPool2d(1)`` is global average pooling."""

    def __init__(self, output_size: int | tuple[int | None, int | None]) -> None:
        super().__init__()
        self.output_size = output_size

    def forward(self, x: Tensor) -> Tensor:
        return F.adaptive_avg_pool2d(x, self.output_size)

    def extra_repr(self) -> str:
        return f"output_size={self.output_size}"


class Flatten(Module):
    """``x.flatten(start_dim, end_dim)``; by default every dimension but the batch one, as ``torch.nn.Flatten``."""

    def __init__(self, start_dim: int = 1, end_dim: int = -1) -> None:
        super().__init__()
        self.start_dim, self.end_dim = start_dim, end_dim

    def forward(self, x: Tensor) -> Tensor:
        return x.flatten(self.start_dim, self.end_dim)

    def extra_repr(self) -> str:
        return f"start_dim={self.start_dim}, end_dim={self.end_dim}"
