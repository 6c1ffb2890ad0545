"""Convolution and pooling ops: their argument rules, the array path and the autograd Functions.

One module for the family (``conv2d``, ``conv1d``, ``max_pool2d``, ``avg_pool2d``,
``adaptive_avg_pool2d``) so that the other ops' modules stay as they are: the geometry (PyTorch's
output-size rules, ``padding='same'``, ``ceil_mode``) is resolved here, once, into the pairs of
ints the kernels take (NOTE [ Convolution kernel arguments ] in ``backends/reference/conv.py``);
every check runs before anything is allocated or written. ``taifuse.functional`` routes a call
with a Tensor argument to the ``*_tensor`` functions (autograd) and anything else to the array
functions, as for the other ops.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

import numpy as np

from taifuse import _array_ops as A
from taifuse import pool
from taifuse._autograd_ops import Op, constants, new_array
from taifuse._internal import backend, wrap
from taifuse.tensor import Tensor, autocast_args

# Activations whose backward needs the pre-activation kept (as F.linear: NOTE [ Linear saves the
# pre-activation ] in _autograd_ops); relu's output serves, None needs nothing.
_SPLIT_ACTIVATION = frozenset(("gelu", "gelu_tanh", "silu"))


# ----------------------------------------------------------------------------- argument rules


def int_pair(value: Any, op: str, argname: str, minimum: int, n: int = 2) -> tuple[int, ...]:
    """An int or a sequence of ``n`` ints (or of one, repeated), each at least ``minimum``."""
    items = value if isinstance(value, (tuple, list)) else (value,)
    if len(items) == 1:
        items = tuple(items) * n
    if len(items) != n or any(isinstance(v, bool) or not isinstance(v, numbers.Integral) for v in items):
        raise TypeError(f"{op}: {argname} should be an int or a tuple of {n} ints, got {value!r}")
    if any(v < minimum for v in items):
        raise ValueError(f"{op}: {argname} should be at least {minimum}, got {value!r}")
    return tuple(int(v) for v in items)


def _spatial(op: str, shape: tuple[int, ...], ndim: int, what: str) -> None:
    if len(shape) != ndim:
        raise ValueError(f"{op}: input should be {ndim}-D {what}, got shape {tuple(shape)}")


@dataclass(frozen=True)
class ConvGeometry:
    """What the kernels take (NOTE [ Convolution kernel arguments ]) and the output's shape."""

    stride: tuple[int, int]
    padding: tuple[int, int]  # before the first row and column
    dilation: tuple[int, int]
    groups: int
    out_shape: tuple[int, int, int, int]


def conv_geometry(
    op: str,
    x_shape: tuple[int, ...],
    w_shape: tuple[int, ...],
    bias_shape: tuple[int, ...] | None,
    stride: Any,
    padding: Any,
    dilation: Any,
    groups: Any,
) -> ConvGeometry:
    """Check conv2d's arguments (shapes as 4-D NCHW) and resolve them, as PyTorch does."""
    stride = int_pair(stride, op, "stride", 1)
    dilation = int_pair(dilation, op, "dilation", 1)
    if isinstance(groups, bool) or not isinstance(groups, numbers.Integral):
        raise TypeError(f"{op}: groups should be an int, got {type(groups).__name__}")
    if groups < 1:
        raise ValueError(f"{op}: groups should be positive, got {groups}")
    groups = int(groups)
    if len(w_shape) != 4:
        raise ValueError(
            f"{op}: weight should be 4-D (out_channels, in_channels / groups, kH, kW), got {tuple(w_shape)}"
        )
    n, c, h, w = x_shape
    oc, cg, kh, kw = w_shape
    if min(c, cg, kh, kw) < 1:
        raise ValueError(
            f"{op}: input and weight should have at least one channel and tap; "
            f"shapes input {tuple(x_shape)}, weight {tuple(w_shape)}"
        )
    if h < 1 or w < 1:  # PyTorch: non-zero size for the non-batch dimensions
        raise ValueError(f"{op}: input should have a non-empty height and width, got shape {tuple(x_shape)}")
    if c % groups:
        raise ValueError(f"{op}: groups={groups} should divide the input's {c} channels (input.shape[1])")
    if oc % groups:
        raise ValueError(
            f"{op}: groups={groups} should divide weight's {oc} output channels (weight.shape[0])"
        )
    if cg * groups != c:
        raise ValueError(
            f"{op}: input has {c} channels (input.shape[1]) but weight expects {cg * groups} "
            f"(weight.shape[1] * groups = {cg} * {groups}); shapes input {tuple(x_shape)}, weight {tuple(w_shape)}"
        )
    if bias_shape is not None and tuple(bias_shape) != (oc,):
        raise ValueError(f"{op}: bias should have shape ({oc},), got {tuple(bias_shape)}")
    span = (dilation[0] * (kh - 1) + 1, dilation[1] * (kw - 1) + 1)
    if isinstance(padding, str):
        if padding == "valid":
            before = after = (0, 0)
        elif padding == "same":
            if stride != (1, 1):
                raise ValueError(f"{op}: padding='same' needs stride 1, got stride={stride}")
            before = ((span[0] - 1) // 2, (span[1] - 1) // 2)
            after = (span[0] - 1 - before[0], span[1] - 1 - before[1])
        else:
            raise ValueError(f"{op}: padding should be an int, a pair, 'same' or 'valid', got {padding!r}")
    else:
        before = after = int_pair(padding, op, "padding", 0)
    padded = (h + before[0] + after[0], w + before[1] + after[1])
    if padded[0] < span[0] or padded[1] < span[1]:
        raise ValueError(
            f"{op}: the kernel ({kh} x {kw}, dilation {dilation}: {span[0]} x {span[1]}) is larger than "
            f"the padded input ({padded[0]} x {padded[1]}); shapes input {tuple(x_shape)}, weight {tuple(w_shape)}"
        )
    out = ((padded[0] - span[0]) // stride[0] + 1, (padded[1] - span[1]) // stride[1] + 1)
    return ConvGeometry(stride, before, dilation, groups, (n, oc) + out)


@dataclass(frozen=True)
class PoolGeometry:
    kernel_size: tuple[int, int]
    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int]
    out_shape: tuple[int, int, int, int]


def _pool_size(size: int, k: int, s: int, p: int, d: int, ceil_mode: bool) -> int:
    num = size + 2 * p - d * (k - 1) - 1
    out = (-(-num // s) if ceil_mode else num // s) + 1
    if (
        ceil_mode and (out - 1) * s >= size + p
    ):  # the last window must start inside the input or its left padding
        out -= 1
    return out


def pool_geometry(
    op: str,
    shape: tuple[int, ...],
    kernel_size: Any,
    stride: Any,
    padding: Any,
    dilation: Any,
    ceil_mode: Any,
) -> PoolGeometry:
    """Check a pooling's arguments (``shape`` 4-D) and resolve them, as PyTorch does."""
    kernel = int_pair(kernel_size, op, "kernel_size", 1)
    stride = (
        kernel
        if stride is None or (isinstance(stride, (tuple, list)) and not stride)
        else int_pair(stride, op, "stride", 1)
    )
    padding = int_pair(padding, op, "padding", 0)
    dilation = int_pair(dilation, op, "dilation", 1)
    if not isinstance(ceil_mode, (bool, np.bool_)):
        raise TypeError(f"{op}: ceil_mode should be a bool, got {type(ceil_mode).__name__}")
    if padding[0] > kernel[0] // 2 or padding[1] > kernel[1] // 2:
        raise ValueError(
            f"{op}: padding should be at most half of kernel_size, got padding={padding}, kernel_size={kernel}"
        )
    n, c, h, w = shape
    out = tuple(
        _pool_size(size, k, s, p, d, bool(ceil_mode))
        for size, k, s, p, d in zip((h, w), kernel, stride, padding, dilation)
    )
    if out[0] < 1 or out[1] < 1:
        raise ValueError(
            f"{op}: the output would be {out[0]} x {out[1]} for an input of {h} x {w} with kernel_size={kernel}, "
            f"stride={stride}, padding={padding}, dilation={dilation}: too small"
        )
    return PoolGeometry(kernel, stride, padding, dilation, (n, c) + out)


def adaptive_shape(shape: tuple[int, ...], output_size: Any) -> tuple[int, int, int, int]:
    items = output_size if isinstance(output_size, (tuple, list)) else (output_size, output_size)
    if len(items) != 2:
        raise TypeError(f"adaptive_avg_pool2d: output_size should be an int or a pair, got {output_size!r}")
    sizes = []
    for v, full in zip(items, shape[2:]):
        if v is None:
            v = full
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise TypeError(f"adaptive_avg_pool2d: output_size should hold ints or None, got {output_size!r}")
        if v < 0 or (v == 0 and shape[0] * shape[1] and full):
            raise ValueError(f"adaptive_avg_pool2d: output_size should be positive, got {output_size!r}")
        sizes.append(int(v))
    if min(shape[2:]) == 0 and shape[0] * shape[1]:
        raise ValueError(f"adaptive_avg_pool2d: input has an empty spatial dimension, shape {tuple(shape)}")
    return tuple(shape[:2]) + tuple(sizes)


def _batched(op: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A pooling input's shape as 4-D: (C, H, W) is one image, as PyTorch takes it."""
    if len(shape) == 3:
        return (1,) + tuple(shape)
    if len(shape) != 4:
        raise ValueError(f"{op}: input should be 3-D (C, H, W) or 4-D (N, C, H, W), got shape {tuple(shape)}")
    if shape[1] == 0 or shape[2] * shape[3] == 0:
        raise ValueError(
            f"{op}: input should have non-zero channels and spatial size, got shape {tuple(shape)}"
        )
    return tuple(shape)


def check_conv_input(op: str, shape: tuple[int, ...]) -> None:
    if len(shape) != 4:
        raise ValueError(
            f"{op}: input should be 4-D (N, C, H, W), got shape {tuple(shape)}"
            + (
                "; add the batch dimension with input[None] (taifuse takes no unbatched input)"
                if len(shape) == 3
                else ""
            )
        )


# ----------------------------------------------------------------------------- the array path


def run_conv(be, xa, wa, ba, geom: ConvGeometry, activation: str | None, keep_pre: bool):
    o = pool.empty(be, geom.out_shape, xa.dtype)
    pre = pool.empty(be, geom.out_shape, xa.dtype) if keep_pre else None
    if o.size:
        be.conv2d(
            xa, wa, ba, geom.stride, geom.padding, geom.dilation, geom.groups, activation, o,
            **({} if pre is None else {"pre": pre}),
        )  # fmt: skip
    return o, pre


def conv2d(
    input: Any, weight: Any, bias: Any = None, stride: Any = 1, padding: Any = 0, dilation: Any = 1,
    groups: Any = 1, activation: str | None = None,
) -> Any:  # fmt: skip
    A.check_activation(activation)
    call = A.Call("conv2d")
    xa = call.array(input, "input")
    check_conv_input("conv2d", tuple(xa.shape))
    wa = call.array(weight, "weight", dtype=xa.dtype, like_name="input")
    ba = None if bias is None else call.array(bias, "bias", dtype=xa.dtype, like_name="input")
    geom = conv_geometry(
        "conv2d", tuple(xa.shape), tuple(wa.shape), None if ba is None else tuple(ba.shape),
        stride, padding, dilation, groups,
    )  # fmt: skip
    o, _ = run_conv(call.be, xa, wa, ba, geom, activation, False)
    return call.result(o)


def max_pool2d(
    input: Any, kernel_size: Any, stride: Any = None, padding: Any = 0, dilation: Any = 1,
    ceil_mode: bool = False, return_indices: bool = False,
) -> Any:  # fmt: skip
    call = A.Call("max_pool2d")
    xa = call.array(input, "input")
    shape = _batched("max_pool2d", tuple(xa.shape))
    geom = pool_geometry("max_pool2d", shape, kernel_size, stride, padding, dilation, ceil_mode)
    out, idx = _max_pool(call.be, xa.reshape(shape), geom)
    out_shape = geom.out_shape if xa.ndim == 4 else geom.out_shape[1:]
    out, idx = call.result(out.reshape(out_shape)), idx.reshape(out_shape)
    if not return_indices:
        return out
    return out, (call.be.to_numpy(idx) if call.host_io else idx)


def _max_pool(be, xa, geom: PoolGeometry):
    out = pool.empty(be, geom.out_shape, xa.dtype)
    idx = pool.empty(be, geom.out_shape, _index_dtype(be))
    be.max_pool2d(xa, geom.kernel_size, geom.stride, geom.padding, geom.dilation, out, idx)
    return out, idx


def _index_dtype(be) -> np.dtype:
    return np.dtype(getattr(be, "INDEX_DTYPE", np.int64))


def _avg_args(ceil_mode: Any, count_include_pad: Any, divisor_override: Any) -> int:
    if not isinstance(count_include_pad, (bool, np.bool_)):
        raise TypeError(
            f"avg_pool2d: count_include_pad should be a bool, got {type(count_include_pad).__name__}"
        )
    if divisor_override is None:
        return 0
    if isinstance(divisor_override, bool) or not isinstance(divisor_override, numbers.Integral):
        raise TypeError(f"avg_pool2d: divisor_override should be an int or None, got {divisor_override!r}")
    if divisor_override == 0:
        raise ValueError("avg_pool2d: divisor_override should not be zero")
    return int(divisor_override)


def avg_pool2d(
    input: Any, kernel_size: Any, stride: Any = None, padding: Any = 0, ceil_mode: bool = False,
    count_include_pad: bool = True, divisor_override: int | None = None,
) -> Any:  # fmt: skip
    divisor = _avg_args(ceil_mode, count_include_pad, divisor_override)
    call = A.Call("avg_pool2d")
    xa = call.array(input, "input")
    shape = _batched("avg_pool2d", tuple(xa.shape))
    geom = pool_geometry("avg_pool2d", shape, kernel_size, stride, padding, 1, ceil_mode)
    out = pool.empty(call.be, geom.out_shape, xa.dtype)
    call.be.avg_pool2d(
        xa.reshape(shape), geom.kernel_size, geom.stride, geom.padding, bool(count_include_pad), divisor, out
    )
    return call.result(out.reshape(geom.out_shape if xa.ndim == 4 else geom.out_shape[1:]))


def adaptive_avg_pool2d(input: Any, output_size: Any) -> Any:
    call = A.Call("adaptive_avg_pool2d")
    xa = call.array(input, "input")
    if xa.ndim not in (3, 4):
        raise ValueError(f"adaptive_avg_pool2d: input should be 3-D or 4-D, got shape {tuple(xa.shape)}")
    shape = (1,) * (4 - xa.ndim) + tuple(xa.shape)
    out_shape = adaptive_shape(shape, output_size)
    out = pool.empty(call.be, out_shape, xa.dtype)
    if out.size:
        call.be.adaptive_avg_pool2d(xa.reshape(shape), out)
    return call.result(out.reshape(out_shape if xa.ndim == 4 else out_shape[1:]))


# ----------------------------------------------------------------------------- autograd


class _Conv2d(Op):
    """``activation(conv2d(x, w) + b)``; keeps ``pre`` as ``_Linear`` does (NOTE [ Linear saves the
    pre-activation ] in ``_autograd_ops``): for 'gelu', 'gelu_tanh' and 'silu' with a gradient to
    come, the forward's one epilogue pass writes both; 'relu' reads its output; None nothing."""

    owns_grads = True

    def forward(self, x: Any, w: Any, b: Any, geom: ConvGeometry, activation: str | None) -> Any:
        self.x, self.w, self.geom, self.activation, self.has_bias = x, w, geom, activation, b is not None
        keep = activation in _SPLIT_ACTIVATION and self.needs_any()
        out, pre = run_conv(self.be, x, w, b, geom, activation, keep)
        self.pre = pre if keep else (out if activation == "relu" else None)
        return out

    def backward(self, g: Any) -> tuple[Any, ...]:
        be, m, x, w, geom = self.be, self.m, self.x, self.w, self.geom
        oc = w.shape[0]
        if not x.size:  # an empty batch: zero gradients (the input's spatial size is never 0)
            gx = m.full(tuple(x.shape), 0.0, x.dtype) if self.needs_grad[0] else None
            gw = m.full(tuple(w.shape), 0.0, w.dtype) if self.needs_grad[1] else None
            gb = m.full((oc,), 0.0, w.dtype) if self.has_bias and self.needs_grad[2] else None
            return gx, gw, gb, None, None
        gx = new_array(be, x.shape, x.dtype) if self.needs_grad[0] else None
        gw = new_array(be, w.shape, w.dtype) if self.needs_grad[1] else None
        gb = new_array(be, (oc,), w.dtype) if self.has_bias and self.needs_grad[2] else None
        be.conv2d_backward(
            x,
            w,
            self.pre,
            g,
            geom.stride,
            geom.padding,
            geom.dilation,
            geom.groups,
            self.activation,
            gx,
            gw,
            gb,
        )
        return gx, gw, gb, None, None


def conv2d_tensor(
    input: Any,
    weight: Any,
    bias: Any,
    stride: Any,
    padding: Any,
    dilation: Any,
    groups: Any,
    activation: str | None,
) -> Tensor:
    A.check_activation(activation)
    x, w, b = autocast_args("lower", *constants("conv2d", ("input", "weight", "bias"), input, weight, bias))
    for name, t in (("input", x), ("weight", w), ("bias", b)):
        if t is not None and not isinstance(t, Tensor):
            raise TypeError(f"conv2d: {name} should be a Tensor or numpy.ndarray, got {type(t).__name__}")
        if t is not None:
            A.check_float_array(t.dtype, backend(t), "conv2d", name, like=x.dtype, like_name="input")
    check_conv_input("conv2d", tuple(x.shape))
    geom = conv_geometry(
        "conv2d", tuple(x.shape), tuple(w.shape), None if b is None else tuple(b.shape),
        stride, padding, dilation, groups,
    )  # fmt: skip
    return _Conv2d.apply(x, w, b, geom, activation)


class _MaxPool2d(Op):
    """Max pooling into ``out`` and ``idx`` (allocated by the caller, which returns the indices);
    the indices route the gradient. The kernel runs here, inside the op, where the profiler times it."""

    owns_grads = True

    def forward(self, x: Any, geom: PoolGeometry, out: Any, idx: Any) -> Any:
        self.be.max_pool2d(x, geom.kernel_size, geom.stride, geom.padding, geom.dilation, out, idx)
        self.x_shape, self.x_dtype, self.geom, self.idx = tuple(x.shape), x.dtype, geom, idx
        return out

    def backward(self, g: Any) -> tuple[Any, ...]:
        gx = new_array(self.be, self.x_shape, self.x_dtype)
        gm = self.geom
        self.be.max_pool2d_backward(self.idx, g, gm.kernel_size, gm.stride, gm.padding, gm.dilation, gx)
        return gx, None, None, None


class _AvgPool2d(Op):
    owns_grads = True

    def forward(self, x: Any, geom: PoolGeometry | None, count_include_pad: bool, divisor: int) -> Any:
        self.x_shape, self.x_dtype, self.geom = tuple(x.shape), x.dtype, geom
        self.count_include_pad, self.divisor = count_include_pad, divisor
        out = pool.empty(self.be, geom.out_shape, x.dtype)
        self.be.avg_pool2d(x, geom.kernel_size, geom.stride, geom.padding, count_include_pad, divisor, out)
        return out

    def backward(self, g: Any) -> tuple[Any, ...]:
        gx = new_array(self.be, self.x_shape, self.x_dtype)
        gm = self.geom
        self.be.avg_pool2d_backward(
            g, gm.kernel_size, gm.stride, gm.padding, self.count_include_pad, self.divisor, gx
        )
        return gx, None, None, None


class _AdaptiveAvgPool2d(Op):
    owns_grads = True

    def forward(self, x: Any, out_shape: tuple[int, ...]) -> Any:
        self.x_shape, self.x_dtype = tuple(x.shape), x.dtype
        out = pool.empty(self.be, out_shape, x.dtype)
        if out.size:
            self.be.adaptive_avg_pool2d(x, out)
        return out

    def backward(self, g: Any) -> tuple[Any, ...]:
        if not g.size:
            return self.m.full(self.x_shape, 0.0, self.x_dtype), None
        gx = new_array(self.be, self.x_shape, self.x_dtype)
        self.be.adaptive_avg_pool2d_backward(g, gx)
        return gx, None


def _tensor_input(op: str, input: Any) -> Tensor:
    (x,) = constants(op, ("input",), input)
    if not isinstance(x, Tensor):
        raise TypeError(f"{op}: input should be a Tensor or numpy.ndarray, got {type(x).__name__}")
    A.check_float_array(x.dtype, backend(x), op, "input")
    return x


def _as_4d(x: Tensor, shape: tuple[int, ...]) -> Tensor:
    return x if x.ndim == 4 else x.reshape(shape)


def max_pool2d_tensor(
    input: Any,
    kernel_size: Any,
    stride: Any,
    padding: Any,
    dilation: Any,
    ceil_mode: bool,
    return_indices: bool,
) -> Any:
    x = _tensor_input("max_pool2d", input)
    shape = _batched("max_pool2d", tuple(x.shape))
    geom = pool_geometry("max_pool2d", shape, kernel_size, stride, padding, dilation, ceil_mode)
    x4 = _as_4d(x, shape)
    be = backend(x4)
    out, idx = pool.empty(be, geom.out_shape, x4.dtype), pool.empty(be, geom.out_shape, _index_dtype(be))
    y = _MaxPool2d.apply(x4, geom, out, idx)
    if x.ndim == 3:
        y, idx = y.reshape(geom.out_shape[1:]), idx.reshape(geom.out_shape[1:])
    if not return_indices:
        return y
    return y, wrap(idx, backend(x))


def avg_pool2d_tensor(
    input: Any, kernel_size: Any, stride: Any, padding: Any, ceil_mode: bool, count_include_pad: bool,
    divisor_override: int | None,
) -> Tensor:  # fmt: skip
    divisor = _avg_args(ceil_mode, count_include_pad, divisor_override)
    x = _tensor_input("avg_pool2d", input)
    shape = _batched("avg_pool2d", tuple(x.shape))
    geom = pool_geometry("avg_pool2d", shape, kernel_size, stride, padding, 1, ceil_mode)
    y = _AvgPool2d.apply(_as_4d(x, shape), geom, bool(count_include_pad), divisor)
    return y if x.ndim == 4 else y.reshape(geom.out_shape[1:])


def adaptive_avg_pool2d_tensor(input: Any, output_size: Any) -> Tensor:
    x = _tensor_input("adaptive_avg_pool2d", input)
    if x.ndim not in (3, 4):
        raise ValueError(f"adaptive_avg_pool2d: input should be 3-D or 4-D, got shape {tuple(x.shape)}")
    shape = (1,) * (4 - x.ndim) + tuple(x.shape)
    out_shape = adaptive_shape(shape, output_size)
    y = _AdaptiveAvgPool2d.apply(_as_4d(x, shape), out_shape)
    return y if x.ndim == 4 else y.reshape(out_shape[1:])


A.profile_ops(globals(), "_conv_ops")  # NOTE [ Profiler hooks ]
