"""``batch_norm``: its checks, its array path and its autograd Function, in one module.

The kernels (``batch_norm_stats``, ``batch_norm_update``, ``batch_norm_elemt``,
``batch_norm_backward``; specified in ``backends/reference/batch_norm.py``) are composed here:

* training: the statistics in one pass over ``x``, then ``invstd`` and the running statistics'
  update (in place, with the unbiased variance, as PyTorch), then one normalize pass;
* evaluation: ``invstd`` from ``running_var``, then the normalize pass.

The pass after the statistics (:func:`normalize`) and the backward (:func:`backward_arrays`) take
only ``x`` and the per-channel ``(mean, invstd)``, so a fused block that computes the statistics
another way (a convolution's epilogue) reuses both, and the same :class:`BatchNorm`'s
backward. ``activation='relu'`` fuses the ReLU into the normalize pass; the backward recomputes
its mask from ``x`` and the statistics (nothing more is saved).

NOTE [ Batch norm under autocast ]
PyTorch's CUDA autocast lists batch_norm in neither its float16 nor its float32 list (``aten::
batch_norm`` has no AutocastCUDA kernel: ``torch._C._dispatch_dump('aten::batch_norm')``), so it
runs on the input's dtype: a float16 activation (a convolution's output under autocast) with the
module's float32 weight, bias and running statistics is PyTorch's mixed batch norm, float16 out,
float32 statistics. taifuse does the same: no cast, and float16 input may come with float32
parameters (the kernels compute in float32 either way). Any other mix is a TypeError, as PyTorch's.
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any

import numpy as np

from taifuse import _array_ops, backends, pool
from taifuse._internal import backend, common_backend, wrap
from taifuse._tensor_math import astype, math_for
from taifuse.tensor import Function, Tensor

ACTIVATIONS = (None, "relu")
_OP = "batch_norm"
_F16, _F32, _F64 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)


# ----------------------------------------------------------------------------- checks


def check_args(
    input: Any,
    running_mean: Any,
    running_var: Any,
    weight: Any,
    bias: Any,
    training: bool,
    momentum: Any,
    eps: Any,
    activation: Any,
    op: str = _OP,
    names: tuple[str, str, str] = ("input", "weight", "bias"),
) -> tuple[float, float, np.dtype]:
    """Every check of a batch_norm call, before anything is written: ``(momentum, eps, parameter
    dtype)``. The arrays may be NumPy, backend arrays or Tensors (anything with shape and dtype);
    ``names`` are the caller's names of the input, weight and bias (a fused block's differ)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"{op}: activation should be one of {ACTIVATIONS}, got {activation!r}")
    if momentum is None:
        raise TypeError(
            f"{op}: momentum should be a float, got None (nn.BatchNorm's momentum=None is its own)"
        )
    momentum = _array_ops.check_finite_number(momentum, op, "momentum")
    eps = _array_ops.check_finite_number(eps, op, "eps")
    if eps < 0:
        raise ValueError(f"{op}: eps should be non-negative, got {eps}")
    if not hasattr(input, "shape") or not hasattr(input, "dtype"):
        raise TypeError(f"{op}: input should be an array or a Tensor, got {type(input).__name__}")
    shape = tuple(input.shape)
    if len(shape) < 2:
        raise ValueError(f"{op}: input should have shape (N, C, *) with at least 2 dimensions, got {shape}")
    if input.dtype.kind != "f":
        raise TypeError(f"{op}: input should be a floating-point array, got dtype {input.dtype}")
    channels = shape[1]
    if (running_mean is None) != (running_var is None):
        missing = "running_var" if running_var is None else "running_mean"
        raise ValueError(
            f"{op}: running_mean and running_var should both be given or both be None; {missing} is None"
        )
    if not training and running_mean is None:
        raise ValueError(f"{op}: running_mean and running_var are required in evaluation (training=False)")
    param_dtype = None
    for argname, value in (
        ("running_mean", running_mean),
        ("running_var", running_var),
        (names[1], weight),
        (names[2], bias),
    ):
        if value is None:
            continue
        if not hasattr(value, "shape") or not hasattr(value, "dtype"):
            raise TypeError(f"{op}: {argname} should be an array or a Tensor, got {type(value).__name__}")
        if tuple(value.shape) != (channels,):
            raise ValueError(
                f"{op}: {argname} should have shape ({channels},) for {names[0]} {shape} (C = {channels}), "
                f"got {tuple(value.shape)}"
            )
        if value.dtype.kind != "f":
            raise TypeError(f"{op}: {argname} should be a floating-point array, got dtype {value.dtype}")
        if param_dtype is None:
            param_dtype = value.dtype
            allowed = (input.dtype, _F32) if input.dtype == _F16 else (input.dtype,)
            if value.dtype not in allowed:
                raise TypeError(
                    f"{op}: {argname} has dtype {value.dtype} but {names[0]} has dtype {input.dtype}; parameters "
                    "and running statistics should have the input's dtype (float32 also for float16 input)"
                )
        elif value.dtype != param_dtype:
            raise TypeError(
                f"{op}: {argname} has dtype {value.dtype}, another parameter has dtype {param_dtype}"
            )
    if training and math.prod(shape) and shape[0] * math.prod(shape[2:]) == 1:
        raise ValueError(
            f"{op}: expected more than 1 value per channel when training, got {names[0]} size {shape}"
        )
    return momentum, eps, input.dtype if param_dtype is None else param_dtype


def _stats_dtype(dtype: np.dtype) -> np.dtype:
    return _F64 if dtype == _F64 else _F32


def _view3(x: Any) -> Any:
    n, c = x.shape[0], x.shape[1]
    return x.reshape((n, c, math.prod(x.shape[2:])))


# ----------------------------------------------------------------------------- array code


def statistics(
    be: ModuleType, x: Any, running_mean: Any, running_var: Any, training: bool, momentum: float, eps: float
) -> tuple[Any, Any]:
    """The per-channel ``(mean, invstd)`` the normalize pass and the backward use, from the pool.

    Training: the batch statistics of ``x`` (one pass), with the running statistics (if given)
    updated in place. Evaluation: copies of ``running_mean`` and ``1 / sqrt(running_var + eps)``.
    """
    channels = x.shape[1]
    dtype = _stats_dtype(x.dtype)
    invstd = pool.empty(be, (channels,), dtype)
    if training:
        x3 = _view3(x)
        count = x3.shape[0] * x3.shape[2]
        mean, var = pool.empty(be, (channels,), dtype), pool.empty(be, (channels,), dtype)
        if count:
            be.batch_norm_stats(x3, mean, var)
            be.batch_norm_update(mean, var, count, eps, momentum, running_mean, running_var, invstd)
        return mean, invstd
    m = math_for(be)
    mean = m.copy(running_mean) if running_mean.dtype == dtype else astype(m, running_mean, dtype)
    var = running_var if running_var.dtype == dtype else astype(m, running_var, dtype)
    if channels:
        be.batch_norm_update(mean, var, 1, eps, 0.0, None, None, invstd)
    return mean, invstd


def normalize(
    be: ModuleType, x: Any, mean: Any, invstd: Any, weight: Any, bias: Any, activation: str | None, out: Any
) -> None:
    """out = act((x - mean) * invstd * weight + bias) per channel (the pass a fused block reuses)."""
    if x.size:
        be.batch_norm_elemt(_view3(x), mean, invstd, weight, bias, activation, _view3(out))


def backward_arrays(
    be: ModuleType,
    x: Any,
    grad_out: Any,
    mean: Any,
    invstd: Any,
    weight: Any,
    bias: Any,
    activation: str | None,
    training: bool,
    needs: tuple[bool, bool, bool],
    param_dtype: np.dtype,
) -> tuple[Any, Any, Any]:
    """``(grad_input, grad_weight, grad_bias)`` from the saved statistics (None where ``needs``
    says no): one reduction pass and one gradient pass over ``x`` and ``grad_out``."""
    channels = x.shape[1]
    gx = pool.empty(be, tuple(x.shape), x.dtype) if needs[0] else None
    gw = pool.empty(be, (channels,), param_dtype) if needs[1] and weight is not None else None
    gb = pool.empty(be, (channels,), param_dtype) if needs[2] and bias is not None else None
    if x.size:
        be.batch_norm_backward(
            _view3(x),
            _view3(grad_out),
            mean,
            invstd,
            weight,
            bias,
            activation,
            training,
            None if gx is None else _view3(gx),
            gw,
            gb,
        )
    else:  # nothing to sum: zero parameter gradients, as PyTorch's
        for g in (gw, gb):
            if g is not None:
                math_for(be).fill_(g, 0.0)
    return gx, gw, gb


def host_or_backend(be: ModuleType, value: Any, argname: str) -> Any:
    """An array argument on ``be``: a NumPy array converted, a backend array as is."""
    if value is None:
        return None
    if isinstance(value, np.ndarray):
        _array_ops.check_float_array(value.dtype, be, _OP, argname)
        return be.from_numpy(value)
    if be.is_array(value):
        _array_ops.check_float_array(value.dtype, be, _OP, argname)
        return value
    raise TypeError(f"{_OP}: {argname} should be a numpy.ndarray, got {type(value).__name__}")


def check_writable(value: Any, argname: str) -> None:
    if isinstance(value, np.ndarray) and not value.flags.writeable:
        raise ValueError(f"{_OP}: {argname} is read-only; batch_norm updates it in place in training")


def write_back(be: ModuleType, caller: Any, used: Any) -> None:
    """Copy a running statistic the kernels updated into the caller's array, where they differ
    (a NumPy array on a device backend, or a non-contiguous one)."""
    if isinstance(caller, np.ndarray) and used is not caller:
        np.copyto(caller, be.to_numpy(used))


def _batch_norm_arrays(input, running_mean, running_var, weight, bias, training, momentum, eps, activation):
    be = backends.active()
    training = bool(training)
    momentum, eps, _ = check_args(
        input, running_mean, running_var, weight, bias, training, momentum, eps, activation
    )
    if training:
        check_writable(running_mean, "running_mean")
        check_writable(running_var, "running_var")
    arrays = {
        name: host_or_backend(be, value, name)
        for name, value in (
            ("input", input),
            ("running_mean", running_mean),
            ("running_var", running_var),
            ("weight", weight),
            ("bias", bias),
        )
    }
    x = arrays["input"]
    mean, invstd = statistics(be, x, arrays["running_mean"], arrays["running_var"], training, momentum, eps)
    out = pool.empty(be, tuple(x.shape), x.dtype)
    normalize(be, x, mean, invstd, arrays["weight"], arrays["bias"], activation, out)
    if training and running_mean is not None:
        write_back(be, running_mean, arrays["running_mean"])
        write_back(be, running_var, arrays["running_var"])
    return be.to_numpy(out) if isinstance(input, np.ndarray) else out


def batch_norm(
    input: Any,
    running_mean: Any,
    running_var: Any,
    weight: Any = None,
    bias: Any = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
    activation: str | None = None,
) -> Any:
    """The array path of ``F.batch_norm`` (NumPy in, NumPy out; backend arrays in, backend arrays out)."""
    return _batch_norm_arrays(
        input, running_mean, running_var, weight, bias, training, momentum, eps, activation
    )


# ----------------------------------------------------------------------------- autograd


class BatchNorm(Function):
    """batch_norm as one autograd node: saves ``x``, the per-channel ``(mean, invstd)``, the
    parameters and the mode; its backward is :func:`backward_arrays`."""

    @classmethod
    def apply(cls, *args: Any, **kwargs: Any) -> Tensor:
        be = common_backend([a for a in args if isinstance(a, Tensor)], "batch_norm")
        active = backends.active()
        if active is not be:
            raise TypeError(
                f"{_OP}: the tensors live on backend {be.NAME!r} but the active backend is {active.NAME!r}; "
                "create them under the active backend (taifuse.tensor(t.numpy()))"
            )
        return super().apply(*args, **kwargs)

    def forward(
        self,
        x: Any,
        weight: Any,
        bias: Any,
        running_mean: Any,
        running_var: Any,
        training: bool,
        momentum: float,
        eps: float,
        activation: str | None,
        param_dtype: np.dtype,
    ) -> Any:
        be = self.be
        self.mean, self.invstd = statistics(be, x, running_mean, running_var, training, momentum, eps)
        out = pool.empty(be, tuple(x.shape), x.dtype)
        normalize(be, x, self.mean, self.invstd, weight, bias, activation, out)
        self.x, self.weight, self.bias = x, weight, bias
        self.activation, self.training, self.param_dtype = activation, training, param_dtype
        return out

    def backward(self, g: Any) -> tuple[Any, ...]:
        gx, gw, gb = backward_arrays(
            self.be,
            self.x,
            g,
            self.mean,
            self.invstd,
            self.weight,
            self.bias,
            self.activation,
            self.training,
            self.needs_grad[:3],
            self.param_dtype,
        )
        return (gx, gw, gb) + (None,) * 7


def as_tensor(value: Any, like: Tensor, argname: str) -> Any:
    """A NumPy argument of a Tensor call as a constant Tensor on ``like``'s backend."""
    if value is None or isinstance(value, Tensor):
        return value
    if isinstance(value, np.ndarray):
        _array_ops.check_float_array(value.dtype, backend(like), _OP, argname)
        return wrap(backend(like).from_numpy(np.asarray(value, order="C")), backend(like))
    raise TypeError(f"{_OP}: {argname} should be an array or a Tensor, got {type(value).__name__}")


def batch_norm_tensors(
    input: Any,
    running_mean: Any,
    running_var: Any,
    weight: Any = None,
    bias: Any = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
    activation: str | None = None,
) -> Tensor:
    """The Tensor path of ``F.batch_norm``: differentiable in input, weight and bias."""
    training = bool(training)
    if not isinstance(input, Tensor):
        like = next(v for v in (running_mean, running_var, weight, bias) if isinstance(v, Tensor))
        input = as_tensor(input, like, "input")
    momentum, eps, param_dtype = check_args(
        input, running_mean, running_var, weight, bias, training, momentum, eps, activation
    )
    if training:
        check_writable(running_mean, "running_mean")
        check_writable(running_var, "running_var")
    backend(input).check_dtype(input.dtype, f"{_OP}: input")
    args = {
        name: as_tensor(value, input, name)
        for name, value in (
            ("running_mean", running_mean),
            ("running_var", running_var),
            ("weight", weight),
            ("bias", bias),
        )
    }
    out = BatchNorm.apply(
        input,
        args["weight"],
        args["bias"],
        args["running_mean"],
        args["running_var"],
        training,
        momentum,
        eps,
        activation,
        param_dtype,
    )
    if training:
        for name, caller in (("running_mean", running_mean), ("running_var", running_var)):
            if isinstance(caller, np.ndarray):
                np.copyto(caller, args[name].numpy())
    return out


_array_ops.profile_ops(globals(), "_batch_norm_ops")  # NOTE [ Profiler hooks ]
