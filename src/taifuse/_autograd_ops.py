"""Differentiable versions of the ``taifuse.functional`` ops, for Tensor arguments.

Each op is a :class:`taifuse.tensor.Function`: its forward runs the functional op (or, where the
backward needs more than the output, the forward kernel directly) on the tensors' arrays and keeps
what the backward needs; its backward calls the backend's hand-written backward kernel (the
``*_backward`` kernels, specified in ``taifuse.backends.reference``). ``taifuse.functional``
sends a call here when any argument is a Tensor.

The losses :func:`mse_loss` and :func:`cross_entropy` live here for NumPy arguments too (the
functional module forwards them), since their kernels are autograd-layer kernels.
"""

from __future__ import annotations

import math
import numbers
from types import ModuleType
from typing import Any

import numpy as np

from taifuse import _random, backends, pool
from taifuse import functional as F
from taifuse._tensor_math import sum_to_shape
from taifuse.tensor import Function, Tensor, _common_backend

# ----------------------------------------------------------------------------- plumbing


def kernels(be: ModuleType) -> ModuleType:
    """The module holding ``be``'s backward and loss kernels (``BACKWARD_KERNEL_NAMES``)."""
    if hasattr(be, "linear_act_backward"):
        return be
    raise NotImplementedError(f"the {be.NAME!r} backend has no backward kernels yet")


def _check_active(be: ModuleType, op: str) -> None:
    """Functional ops compute on the active backend: the tensors must live there."""
    active = backends.active()
    if active is not be:
        raise TypeError(
            f"{op}: the tensors live on backend {be.NAME!r} but the active backend is {active.NAME!r}; "
            "create them under the active backend (taifuse.tensor(t.numpy()))"
        )


def _empty(be: ModuleType, shape: tuple[int, ...], dtype: np.dtype) -> Any:
    # Intermediates and gradients come from the pool; see NOTE [ Buffer ownership ] in taifuse/pool.py.
    return pool.empty(be, tuple(shape), np.dtype(dtype))


def _stats_dtype(dtype: np.dtype) -> np.dtype:
    return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)


class _Op(Function):
    """A Function whose forward runs on the active backend (checked against the tensors')."""

    @classmethod
    def apply(cls, *args: Any, **kwargs: Any) -> Tensor:
        be = _common_backend([a for a in args if isinstance(a, Tensor)], cls.__name__)
        _check_active(be, cls.__name__.lstrip("_").lower())
        return super().apply(*args, **kwargs)

    def needs_any(self) -> bool:
        return any(self.needs_grad)


# ----------------------------------------------------------------------------- elementwise


class _FromInput(_Op):
    """Activations whose backward reads the forward input ``x``."""

    op = ""

    def forward(self, x: Any, *params: Any) -> Any:
        self.x, self.params = x, params
        return getattr(F, self.op)(x, *params)

    def backward(self, g: Any) -> tuple[Any, ...]:
        gi = _empty(self.be, self.x.shape, self.x.dtype)
        if self.x.size:
            getattr(kernels(self.be), self.op + "_backward")(self.x, g, gi, *self.params)
        return (gi,) + (None,) * len(self.params)


class _Gelu(_FromInput):
    op = "gelu"


class _Relu(_FromInput):
    op = "relu"


class _LeakyRelu(_FromInput):
    op = "leaky_relu"


class _Silu(_FromInput):
    op = "silu"


class _FromOutput(_Op):
    """Activations whose backward reads the forward output ``y`` (sigmoid, tanh)."""

    op = ""

    def forward(self, x: Any) -> Any:
        self.y = getattr(F, self.op)(x)
        return self.y

    def backward(self, g: Any) -> tuple[Any, ...]:
        gi = _empty(self.be, self.y.shape, self.y.dtype)
        if self.y.size:
            getattr(kernels(self.be), self.op + "_backward")(self.y, g, gi)
        return (gi,)


class _Sigmoid(_FromOutput):
    op = "sigmoid"


class _Tanh(_FromOutput):
    op = "tanh"


class _AddRelu(_Op):
    def forward(self, a: Any, b: Any) -> Any:
        self.y = F.add_relu(a, b)
        self.shapes = (tuple(a.shape), tuple(b.shape))
        return self.y

    def backward(self, g: Any) -> tuple[Any, ...]:
        gi = _empty(self.be, self.y.shape, self.y.dtype)
        if self.y.size:
            kernels(self.be).add_relu_backward(self.y, g, gi)
        return tuple(sum_to_shape(self.m, gi, s) if n else None for s, n in zip(self.shapes, self.needs_grad))


class _MulRelu(_Op):
    def forward(self, a: Any, b: Any) -> Any:
        out = F.mul_relu(a, b)  # validates, and broadcasts a copy for its own kernel
        self.shapes = (tuple(a.shape), tuple(b.shape))
        self.a = self.m.broadcast_to(a, tuple(out.shape))
        self.b = self.m.broadcast_to(b, tuple(out.shape))
        return out

    def backward(self, g: Any) -> tuple[Any, ...]:
        be, shape, dtype = self.be, tuple(self.a.shape), self.a.dtype
        ga = _empty(be, shape, dtype) if self.needs_grad[0] else None
        gb = _empty(be, shape, dtype) if self.needs_grad[1] else None
        if math.prod(shape):
            kernels(be).mul_relu_backward(self.a, self.b, g, ga, gb)
        return (
            None if ga is None else sum_to_shape(self.m, ga, self.shapes[0]),
            None if gb is None else sum_to_shape(self.m, gb, self.shapes[1]),
        )


class _Affine(_Op):
    def forward(self, x: Any, scale: Any, bias: Any) -> Any:
        out = F.affine(x, scale, bias)
        self.x = x
        features = x.shape[-1]
        self.scale = (
            scale if not isinstance(scale, numbers.Real) else self.m.full((features,), scale, x.dtype)
        )
        return out

    def backward(self, g: Any) -> tuple[Any, ...]:
        be, x = self.be, self.x
        features = x.shape[-1]
        rows = x.size // features if features else 0
        gx = _empty(be, x.shape, x.dtype) if self.needs_grad[0] else None
        gs = _empty(be, (features,), x.dtype) if self.needs_grad[1] else None
        gb = _empty(be, (features,), x.dtype) if self.needs_grad[2] else None
        if x.size:
            kernels(be).affine_backward(
                x.reshape(rows, features),
                self.scale,
                g.reshape(rows, features),
                None if gx is None else gx.reshape(rows, features),
                gs,
                gb,
            )
        else:
            gs = None if gs is None else self.m.full((features,), 0.0, x.dtype)
            gb = None if gb is None else self.m.full((features,), 0.0, x.dtype)
        return gx, gs, gb


# ----------------------------------------------------------------------------- linear

_SPLIT_ACTIVATION = frozenset(("gelu", "gelu_tanh", "silu"))


class _Linear(_Op):
    """``activation(x @ w.T + b)``.

    NOTE [ Linear saves the pre-activation ]
    The fused backward needs activation'(pre). For None nothing is needed and for 'relu' the
    output serves (relu(pre) > 0 exactly where pre > 0), so those keep the one fused forward
    kernel. For 'gelu', 'gelu_tanh' and 'silu', when a gradient will be needed, the forward's one
    epilogue pass writes both ``pre`` (x @ w.T + b) and the activation of it (``linear_act`` with
    ``pre``), and ``pre`` is kept: the memory PyTorch keeps for its activation's input, and no
    recomputed matrix product in the backward. The values are bitwise those of a linear without
    activation followed by the activation op.
    """

    owns_grads = True  # gx, gw and gb are new arrays, one per input

    def forward(self, x: Any, w: Any, b: Any, activation: str | None) -> Any:
        self.x, self.w, self.activation, self.has_bias = x, w, activation, b is not None
        if activation in _SPLIT_ACTIVATION and self.needs_any():
            out, self.pre = F._linear_keep_pre(x, w, b, activation)
            return out
        out = F.linear(x, w, b, activation)
        self.pre = out if activation == "relu" else None
        return out

    def backward(self, g: Any) -> tuple[Any, ...]:
        be, m, x, w = self.be, self.m, self.x, self.w
        out_features, in_features = w.shape
        rows = math.prod(x.shape[:-1])
        if not (rows and out_features):  # an empty product: every gradient is an empty or zero sum
            gx = m.full(tuple(x.shape), 0.0, x.dtype) if self.needs_grad[0] else None
            gw = m.full(tuple(w.shape), 0.0, w.dtype) if self.needs_grad[1] else None
            gb = m.full((out_features,), 0.0, w.dtype) if self.has_bias and self.needs_grad[2] else None
            return gx, gw, gb, None
        gx = _empty(be, x.shape, x.dtype) if self.needs_grad[0] else None
        gw = _empty(be, w.shape, w.dtype) if self.needs_grad[1] else None
        gb = _empty(be, (out_features,), w.dtype) if self.has_bias and self.needs_grad[2] else None
        kernels(be).linear_act_backward(
            x.reshape(rows, in_features),
            w,
            None if self.pre is None else self.pre.reshape(rows, out_features),
            g.reshape(rows, out_features),
            self.activation,
            _empty(be, (rows, out_features), x.dtype),
            None if gx is None else gx.reshape(rows, in_features),
            gw,
            gb,
        )
        return gx, gw, gb, None


# ----------------------------------------------------------------------------- row reductions


def _view3(shape: tuple[int, ...], dim: int) -> tuple[int, int, int]:
    full = shape if shape else (1,)
    d = dim % len(full)
    return math.prod(full[:d]), full[d], math.prod(full[d + 1 :])


class _SoftmaxLike(_Op):
    op = ""

    def forward(self, x: Any, dim: int) -> Any:
        self.y = getattr(F, self.op)(x, dim)
        self.view = _view3(tuple(x.shape), dim)
        return self.y

    def backward(self, g: Any) -> tuple[Any, ...]:
        gi = _empty(self.be, self.y.shape, self.y.dtype)
        if self.y.size:
            getattr(kernels(self.be), self.op + "_backward")(
                self.y.reshape(self.view), g.reshape(self.view), gi.reshape(self.view)
            )
        return gi, None


class _Softmax(_SoftmaxLike):
    op = "softmax"


class _LogSoftmax(_SoftmaxLike):
    op = "log_softmax"


class _LayerNorm(_Op):
    def forward(self, x: Any, weight: Any, bias: Any, norm_shape: tuple[int, ...], eps: float) -> Any:
        be = self.be
        features = math.prod(norm_shape)
        rows = x.size // features if features else 0
        self.x2 = x.reshape(rows, features)
        self.w = None if weight is None else weight.reshape(features)
        self.has_bias = bias is not None
        out = _empty(be, x.shape, x.dtype)
        self.mean = _empty(be, (rows,), _stats_dtype(x.dtype))
        self.rstd = _empty(be, (rows,), _stats_dtype(x.dtype))
        self.param_shape = norm_shape
        if x.size:
            b = None if bias is None else bias.reshape(features)
            be.layer_norm(self.x2, self.w, b, eps, out.reshape(rows, features), self.mean, self.rstd)
        return out

    def backward(self, g: Any) -> tuple[Any, ...]:
        be, x2 = self.be, self.x2
        rows, features = x2.shape
        gx = _empty(be, x2.shape, x2.dtype) if self.needs_grad[0] else None
        gw = _empty(be, (features,), x2.dtype) if self.w is not None and self.needs_grad[1] else None
        gb = _empty(be, (features,), x2.dtype) if self.has_bias and self.needs_grad[2] else None
        if rows and features:
            kernels(be).layer_norm_backward(
                x2, self.w, self.mean, self.rstd, g.reshape(rows, features), gx, gw, gb
            )
        else:
            gw = None if gw is None else self.m.full((features,), 0.0, x2.dtype)
            gb = None if gb is None else self.m.full((features,), 0.0, x2.dtype)
        shape = self.param_shape
        return (
            None if gx is None else gx.reshape(g.shape),
            None if gw is None else gw.reshape(shape),
            None if gb is None else gb.reshape(shape),
            None,
            None,
        )


def _layer_norm(x: Any, normalized_shape: Any, weight: Any, bias: Any, eps: float) -> Tensor:
    norm_shape, eps = F._layer_norm_args(normalized_shape, eps)
    x = _tensor_arg(x, "layer_norm", "x")
    k = len(norm_shape)
    if k == 0 or x.ndim < k or x.shape[x.ndim - k :] != norm_shape:
        raise ValueError(
            f"layer_norm: normalized_shape {norm_shape} should match the trailing dimensions of x {x.shape}"
        )
    params = []
    for argname, value in (("weight", weight), ("bias", bias)):
        if value is not None:
            value = _tensor_arg(value, "layer_norm", argname, like=x)
            if value.shape != norm_shape:
                raise ValueError(f"layer_norm: {argname} should have shape {norm_shape}, got {value.shape}")
        params.append(value)
    return _LayerNorm.apply(x, params[0], params[1], norm_shape, eps)


# ----------------------------------------------------------------------------- dropout


class _Dropout(_Op):
    def forward(self, x: Any, p: float) -> Any:
        self.p, self.seed = p, _random.next_seed()
        out = _empty(self.be, x.shape, x.dtype)
        if x.size:
            self.be.dropout(x, out, p, self.seed)
        return out

    def backward(self, g: Any) -> tuple[Any, ...]:
        gi = _empty(self.be, g.shape, g.dtype)
        if g.size:
            kernels(self.be).dropout_backward(g, gi, self.p, self.seed)
        return gi, None


def _dropout(x: Any, p: float, training: bool) -> Tensor:
    p = F._check_finite_number(p, "dropout", "p")
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout: p should be in [0, 1], got {p}")
    x = _tensor_arg(x, "dropout", "x")
    if not training or p == 0.0:
        return x
    return _Dropout.apply(x, p)


# ----------------------------------------------------------------------------- losses

_REDUCTIONS = ("none", "mean", "sum")


def _check_reduction(reduction: Any, op: str) -> str:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{op}: reduction should be one of {_REDUCTIONS}, got {reduction!r}")
    return reduction


def _tensor_arg(value: Any, op: str, argname: str, like: Tensor | None = None) -> Tensor:
    """A floating-point Tensor argument (a NumPy array becomes a constant Tensor)."""
    if isinstance(value, np.ndarray):
        be = backends.active() if like is None else like._be
        arr = value
        if arr.dtype.kind != "f":
            raise TypeError(f"{op}: {argname} should be a floating-point array, got dtype {arr.dtype}")
        # Checked here, so that a refused dtype is named as this argument, not as from_numpy's.
        be.check_dtype(arr.dtype, f"{op}: {argname}")
        # NOTE: not np.ascontiguousarray, which turns a 0-d array into shape (1,).
        value = Tensor._wrap(be.from_numpy(np.asarray(arr, order="C")), be)
    if not isinstance(value, Tensor):
        raise TypeError(f"{op}: {argname} should be a Tensor or numpy.ndarray, got {type(value).__name__}")
    if value.dtype.kind != "f":
        raise TypeError(f"{op}: {argname} should be floating-point, got dtype {value.dtype}")
    value._be.check_dtype(value.dtype, f"{op}: {argname}")
    if like is not None and value.dtype != like.dtype:
        raise TypeError(f"{op}: {argname} has dtype {value.dtype} but the input has dtype {like.dtype}")
    return value


class _MseLoss(_Op):
    def forward(self, x: Any, t: Any, reduction: str) -> Any:
        self.x, self.t, self.reduction = x, t, reduction
        out = _empty(self.be, x.shape if reduction == "none" else (1,), x.dtype)
        if x.size:
            kernels(self.be).mse_loss(x, t, out, reduction)
        elif reduction != "none":  # PyTorch: the mean of nothing is nan, the sum 0
            out = self.m.full((1,), math.nan if reduction == "mean" else 0.0, x.dtype)
        return out if reduction == "none" else out.reshape(())

    def backward(self, g: Any) -> tuple[Any, ...]:
        gi = _empty(self.be, self.x.shape, self.x.dtype)
        if self.x.size:
            g = g if self.reduction == "none" else g.reshape(1)
            kernels(self.be).mse_loss_backward(self.x, self.t, g, gi, self.reduction)
        gt = self.m.neg(gi) if self.needs_grad[1] else None
        return (gi if self.needs_grad[0] else None), gt, None


def mse_loss(input: Any, target: Any, reduction: str = "mean") -> Any:
    """Mean squared error; see ``taifuse.functional.mse_loss``."""
    reduction = _check_reduction(reduction, "mse_loss")
    host = not isinstance(input, Tensor) and not isinstance(target, Tensor)
    x = _tensor_arg(input, "mse_loss", "input")
    t = _tensor_arg(target, "mse_loss", "target", like=x)
    if x.shape != t.shape:
        raise ValueError(f"mse_loss: input {x.shape} and target {t.shape} should have the same shape")
    out = _MseLoss.apply(x, t, reduction)
    return out.numpy() if host else out


class _CrossEntropy(_Op):
    def forward(self, logits: Any, target: Any, reduction: str) -> Any:
        be = self.be
        self.vector = logits.ndim == 1
        rows, classes = (1, logits.shape[0]) if self.vector else logits.shape
        self.logits = logits.reshape(rows, classes)
        self.target = target.reshape(rows)
        self.reduction = reduction
        self.lse = _empty(be, (rows,), _stats_dtype(logits.dtype))
        out = _empty(be, (rows,) if reduction == "none" else (1,), logits.dtype)
        if rows:
            kernels(be).cross_entropy(self.logits, self.target, out, reduction, self.lse)
        elif reduction != "none":
            out = self.m.full((1,), math.nan if reduction == "mean" else 0.0, logits.dtype)
        return out.reshape(()) if reduction != "none" or self.vector else out

    def backward(self, g: Any) -> tuple[Any, ...]:
        gi = _empty(self.be, self.logits.shape, self.logits.dtype)
        if self.logits.shape[0]:
            g = g.reshape(self.logits.shape[0]) if self.reduction == "none" else g.reshape(1)
            kernels(self.be).cross_entropy_backward(self.logits, self.target, self.lse, g, gi, self.reduction)
        return (gi.reshape(self.logits.shape[1]) if self.vector else gi), None, None


def _class_indices(target: Any, rows: int | None, classes: int, be: ModuleType) -> Any:
    if isinstance(target, Tensor):
        if target._be is not be:
            raise TypeError(
                f"cross_entropy: target lives on backend {target.backend!r}, logits on {be.NAME!r}"
            )
        if not isinstance(target._data, np.ndarray):
            # A device-resident target is used as is: a host range check would copy it back every
            # step (NOTE [ Class indices on the device ] in backends/_taichi_backward.py).
            if target.dtype.kind not in "iu":
                raise TypeError(
                    f"cross_entropy: target should hold integer class indices, got dtype {target.dtype}"
                )
            if target.shape != (() if rows is None else (rows,)):
                raise ValueError(
                    f"cross_entropy: target should have shape {() if rows is None else (rows,)}, got {target.shape}"
                )
            return target._data
        host = target.numpy()
    else:
        host = np.asarray(target)
    if host.dtype.kind not in "iu":
        raise TypeError(f"cross_entropy: target should hold integer class indices, got dtype {host.dtype}")
    expected = () if rows is None else (rows,)
    if host.shape != expected:
        raise ValueError(f"cross_entropy: target should have shape {expected}, got {host.shape}")
    if host.size and (host.min() < 0 or host.max() >= classes):
        bad = host[(host < 0) | (host >= classes)].flat[0]
        raise ValueError(f"cross_entropy: target holds class index {bad}, outside [0, {classes})")
    return be.from_numpy(np.ascontiguousarray(host, dtype=np.int64))


def cross_entropy(logits: Any, target: Any, reduction: str = "mean") -> Any:
    """Cross entropy from logits and class indices; see ``taifuse.functional.cross_entropy``."""
    reduction = _check_reduction(reduction, "cross_entropy")
    host = not isinstance(logits, Tensor)
    x = _tensor_arg(logits, "cross_entropy", "logits")
    if x.ndim not in (1, 2):
        raise ValueError(f"cross_entropy: logits should be (N, C) or (C,), got shape {x.shape}")
    rows = None if x.ndim == 1 else x.shape[0]
    t = _class_indices(target, rows, x.shape[-1], x._be)
    out = _CrossEntropy.apply(x, t, reduction)
    return out.numpy() if host else out


# ----------------------------------------------------------------------------- dispatch

_SIMPLE = {
    "gelu": _Gelu,
    "relu": _Relu,
    "leaky_relu": _LeakyRelu,
    "silu": _Silu,
    "sigmoid": _Sigmoid,
    "tanh": _Tanh,
    "add_relu": _AddRelu,
    "mul_relu": _MulRelu,
    "affine": _Affine,
    "softmax": _Softmax,
    "log_softmax": _LogSoftmax,
}


def _linear(x: Any, weight: Any, bias: Any = None, activation: str | None = None) -> Tensor:
    if activation not in F.ACTIVATIONS:
        raise ValueError(f"linear: activation should be one of {F.ACTIVATIONS}, got {activation!r}")
    return _Linear.apply(x, weight, bias, activation)


def call(op: str, out: Any, *args: Any, **kwargs: Any) -> Tensor:
    """Run functional op ``op`` with Tensor arguments, recording it for autograd."""
    if out is not None:
        raise TypeError(f"{op}: out= is not supported with Tensor arguments")
    if op in _SIMPLE:
        return _SIMPLE[op].apply(*args, **kwargs)
    if op == "linear":
        return _linear(*args, **kwargs)
    if op == "layer_norm":
        return _layer_norm(*args, **kwargs)
    if op == "dropout":
        return _dropout(*args, **kwargs)
    raise NotImplementedError(f"{op} has no autograd version")
