"""``conv2d_batch_norm``: the Conv2d -> BatchNorm -> ReLU block as one op (checks, array path, Function).

In training, the block is three kernels over the activation instead of five (NOTE [ The fused
Conv-BN-ReLU block in training ] in ``backends/reference/conv.py``): ``conv2d_stats`` (the
convolution and its output's batch statistics), ``batch_norm_update`` (``invstd`` and the running
statistics, in place) and ``batch_norm_elemt`` (normalize, affine, ReLU: ``_batch_norm_ops.
normalize``); the backward is the one kernel ``conv2d_batch_norm_backward``. In evaluation there
are no batch statistics to fuse: the block is the convolution, then batch norm's normalize pass
with the running statistics and the fused ReLU (``nn.utils.fuse_conv_bn_eval`` folds the batch norm
into the convolution's weights for one kernel).

Every check of both ops (the convolution's geometry, batch norm's shapes, dtypes and its one value
per channel rule, the running statistics' writability) runs before anything is written. Under
autocast the convolution's input, weight and bias are cast as ``F.conv2d``'s and batch norm's
arguments are not (NOTE [ Batch norm under autocast ] in ``_batch_norm_ops``).
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import numpy as np

from taifuse import _array_ops as A
from taifuse import _batch_norm_ops as BN
from taifuse import _conv_ops as C
from taifuse import pool
from taifuse._autograd_ops import Op, constants, new_array
from taifuse._internal import backend
from taifuse._tensor_math import math_for
from taifuse.tensor import Tensor, autocast_args

_OP = "conv2d_batch_norm"


def _stats_dtype(dtype: np.dtype) -> np.dtype:
    """The per-channel statistics' dtype, as batch norm's: float64 for float64 input, else float32."""
    return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)


def _check(x, w, b, running_mean, running_var, bn_weight, bn_bias, stride, padding, dilation, groups,
           training, momentum, eps, activation):  # fmt: skip
    """Every check of a call: ``(geometry, momentum, eps, parameter dtype)``."""
    C.check_conv_input(_OP, tuple(x.shape))
    geom = C.conv_geometry(
        _OP, tuple(x.shape), tuple(w.shape), None if b is None else tuple(b.shape),
        stride, padding, dilation, groups,
    )  # fmt: skip
    y = SimpleNamespace(shape=geom.out_shape, dtype=x.dtype)  # what batch norm will normalize
    momentum, eps, param_dtype = BN.check_args(
        y,
        running_mean,
        running_var,
        bn_weight,
        bn_bias,
        training,
        momentum,
        eps,
        activation,
        _OP,
        ("the convolution's output", "bn_weight", "bn_bias"),
    )
    if training:
        BN.check_writable(running_mean, "running_mean")
        BN.check_writable(running_var, "running_var")
    return geom, momentum, eps, param_dtype


def _forward_training(be, x, w, b, rm, rv, bn_w, bn_b, geom, momentum, eps, activation):
    """``(out, y, mean, invstd)`` of the training-mode block, from the pool."""
    n, oc = geom.out_shape[:2]
    count = n * math.prod(geom.out_shape[2:])
    dtype = _stats_dtype(x.dtype)
    y = pool.empty(be, geom.out_shape, x.dtype)
    mean, var, invstd = (pool.empty(be, (oc,), dtype) for _ in range(3))
    out = pool.empty(be, geom.out_shape, x.dtype)
    if count:
        be.conv2d_stats(x, w, b, geom.stride, geom.padding, geom.dilation, geom.groups, y, mean, var)
        be.batch_norm_update(mean, var, count, eps, momentum, rm, rv, invstd)
        BN.normalize(be, y, mean, invstd, bn_w, bn_b, activation, out)
    return out, y, mean, invstd


def _forward_eval(be, x, w, b, rm, rv, bn_w, bn_b, geom, eps, activation):
    y, _ = C.run_conv(be, x, w, b, geom, None, False)
    mean, invstd = BN.statistics(be, y, rm, rv, False, 0.0, eps)
    out = pool.empty(be, geom.out_shape, x.dtype)
    BN.normalize(be, y, mean, invstd, bn_w, bn_b, activation, out)
    return out


# ----------------------------------------------------------------------------- the array path


def conv2d_batch_norm(
    input: Any, weight: Any, bias: Any = None, running_mean: Any = None, running_var: Any = None,
    bn_weight: Any = None, bn_bias: Any = None, stride: Any = 1, padding: Any = 0, dilation: Any = 1,
    groups: Any = 1, training: bool = False, momentum: float = 0.1, eps: float = 1e-5,
    activation: str | None = None,
) -> Any:  # fmt: skip
    """The array path of ``F.conv2d_batch_norm`` (NumPy in, NumPy out; backend arrays in and out)."""
    training = bool(training)
    call = A.Call(_OP)
    xa = call.array(input, "input")
    wa = call.array(weight, "weight", dtype=xa.dtype, like_name="input")
    ba = None if bias is None else call.array(bias, "bias", dtype=xa.dtype, like_name="input")
    geom, momentum, eps, _ = _check(
        xa, wa, ba, running_mean, running_var, bn_weight, bn_bias, stride, padding, dilation, groups,
        training, momentum, eps, activation,
    )  # fmt: skip
    be = call.be
    bn = {
        name: BN.host_or_backend(be, value, name)
        for name, value in (
            ("running_mean", running_mean), ("running_var", running_var),
            ("bn_weight", bn_weight), ("bn_bias", bn_bias),
        )
    }  # fmt: skip
    rm, rv = bn["running_mean"], bn["running_var"]
    if training:
        out = _forward_training(
            be, xa, wa, ba, rm, rv, bn["bn_weight"], bn["bn_bias"], geom, momentum, eps, activation
        )[0]
        if running_mean is not None:
            BN.write_back(be, running_mean, rm)
            BN.write_back(be, running_var, rv)
    else:
        out = _forward_eval(be, xa, wa, ba, rm, rv, bn["bn_weight"], bn["bn_bias"], geom, eps, activation)
    return call.result(out)


# ----------------------------------------------------------------------------- autograd


class _Conv2dBatchNorm(Op):
    """The training-mode block as one autograd node: saves ``x``, ``w``, the convolution's output
    ``y`` and the per-channel ``(mean, invstd)``; its backward is ``conv2d_batch_norm_backward``."""

    owns_grads = True

    def forward(self, x, w, b, bn_w, bn_b, rm, rv, geom, momentum, eps, activation, param_dtype):
        out, self.y, self.mean, self.invstd = _forward_training(
            self.be, x, w, b, rm, rv, bn_w, bn_b, geom, momentum, eps, activation
        )
        self.x, self.w, self.bn_w, self.bn_b = x, w, bn_w, bn_b
        self.has_bias, self.geom, self.activation, self.param_dtype = (
            b is not None,
            geom,
            activation,
            param_dtype,
        )
        return out

    def backward(self, g: Any) -> tuple[Any, ...]:
        be, x, w, geom = self.be, self.x, self.w, self.geom
        oc = w.shape[0]
        needs = self.needs_grad
        gx = new_array(be, x.shape, x.dtype) if needs[0] else None
        gw = new_array(be, w.shape, w.dtype) if needs[1] else None
        gb = new_array(be, (oc,), w.dtype) if self.has_bias and needs[2] else None
        gbw = new_array(be, (oc,), self.param_dtype) if self.bn_w is not None and needs[3] else None
        gbb = new_array(be, (oc,), self.param_dtype) if self.bn_b is not None and needs[4] else None
        if self.y.size:
            be.conv2d_batch_norm_backward(
                x, w, self.y, g, self.mean, self.invstd, self.bn_w, self.bn_b, self.activation,
                geom.stride, geom.padding, geom.dilation, geom.groups, gx, gw, gb, gbw, gbb,
            )  # fmt: skip
        else:  # an empty batch: zero gradients, as PyTorch's
            for grad in (gx, gw, gb, gbw, gbb):
                if grad is not None:
                    math_for(be).fill_(grad, 0.0)
        return (gx, gw, gb, gbw, gbb) + (None,) * 7


def conv2d_batch_norm_tensor(
    input: Any, weight: Any, bias: Any, running_mean: Any, running_var: Any, bn_weight: Any, bn_bias: Any,
    stride: Any, padding: Any, dilation: Any, groups: Any, training: bool, momentum: float, eps: float,
    activation: str | None,
) -> Tensor:  # fmt: skip
    """The Tensor path of ``F.conv2d_batch_norm``: differentiable in input, weight, bias, bn_weight
    and bn_bias; in evaluation, the convolution's Function and batch norm's."""
    training = bool(training)
    x, w, b = autocast_args("lower", *constants(_OP, ("input", "weight", "bias"), input, weight, bias))
    for name, t in (("input", x), ("weight", w), ("bias", b)):
        if t is not None and not isinstance(t, Tensor):
            raise TypeError(f"{_OP}: {name} should be a Tensor or numpy.ndarray, got {type(t).__name__}")
        if t is not None:
            A.check_float_array(t.dtype, backend(t), _OP, name, like=x.dtype, like_name="input")
    geom, momentum, eps, param_dtype = _check(
        x, w, b, running_mean, running_var, bn_weight, bn_bias, stride, padding, dilation, groups,
        training, momentum, eps, activation,
    )  # fmt: skip
    if not training:
        y = C.conv2d_tensor(x, w, b, geom.stride, geom.padding, geom.dilation, geom.groups, None)
        return BN.batch_norm_tensors(y, running_mean, running_var, bn_weight, bn_bias, False, momentum, eps,
                                     activation)  # fmt: skip
    bn = {
        name: BN.as_tensor(value, x, name)
        for name, value in (
            ("running_mean", running_mean), ("running_var", running_var),
            ("bn_weight", bn_weight), ("bn_bias", bn_bias),
        )
    }  # fmt: skip
    out = _Conv2dBatchNorm.apply(
        x, w, b, bn["bn_weight"], bn["bn_bias"], bn["running_mean"], bn["running_var"], geom, momentum, eps,
        activation, param_dtype,
    )  # fmt: skip
    for name, caller in (("running_mean", running_mean), ("running_var", running_var)):
        if isinstance(caller, np.ndarray):
            np.copyto(caller, bn[name].numpy())
    return out


A.profile_ops(globals(), "_conv_bn_ops")  # NOTE [ Profiler hooks ]
