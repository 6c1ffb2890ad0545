"""Neural-network ops on NumPy arrays (and the active backend's arrays), PyTorch-style.

Every op validates its arguments (a ``TypeError``/``ValueError`` that names the argument, raised
before anything is written), moves NumPy inputs to the active backend once, allocates the result,
runs one kernel and hands the result back as the type it was given: NumPy in, NumPy out; a backend
array (``taifuse.backends.taichi_gpu.DeviceArray``) in, a backend array out.

``out=`` takes a C-contiguous, writable array of the result's shape and dtype. It may be the input
itself for an in-place update (``F.relu(x, out=x)``: ``x`` of every op but ``linear``, ``a`` and
``b`` of ``add_relu`` and ``mul_relu``); sharing memory with an input in any other way, such as
``linear``'s bias or a shifted view of ``x``, is a ``ValueError`` naming that input
(NOTE [ out= overlap ]).

Example::

    >>> import numpy as np
    >>> import taifuse.functional as F
    >>> F.relu(np.array([-1.0, 2.0], dtype=np.float32))
    array([0., 2.], dtype=float32)
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy as np

from taifuse import _random, backends, pool
from taifuse.tensor import Tensor

__all__ = [
    "add_relu",
    "affine",
    "cross_entropy",
    "dropout",
    "gelu",
    "layer_norm",
    "leaky_relu",
    "linear",
    "log_softmax",
    "mse_loss",
    "mul_relu",
    "relu",
    "sigmoid",
    "silu",
    "softmax",
    "tanh",
]

ACTIVATIONS = (None, "relu", "gelu", "gelu_tanh", "silu")
_APPROXIMATIONS = ("none", "tanh")


# ----------------------------------------------------------------------------- argument handling


class _Call:
    """One op call: converts inputs onto the backend and results back to the caller's type."""

    def __init__(self, op: str) -> None:
        self.op = op
        self.be: ModuleType = backends.active()
        self.host_io = False  # any NumPy input means results go back to NumPy
        self.inputs: list[tuple[str, Any]] = []  # (argname, the caller's array), for out()'s overlap check

    def array(self, value: Any, argname: str, *, dtype: np.dtype | None = None):
        """Validate one array argument and return it as a contiguous backend array."""
        be = self.be
        if isinstance(value, np.ndarray):
            self.host_io = True
            arr = value
        elif be.is_array(value):
            arr = value
        elif _is_foreign_device_array(value):
            raise TypeError(
                f"{self.op}: {argname} lives on another backend ({type(value).__name__}) but the active "
                f"backend is {be.NAME!r}; convert it with .numpy() first"
            )
        else:
            raise TypeError(f"{self.op}: {argname} should be a numpy.ndarray, got {type(value).__name__}")
        self.inputs.append((argname, value))
        if arr.dtype.kind != "f":
            raise TypeError(f"{self.op}: {argname} should be a floating-point array, got dtype {arr.dtype}")
        be.check_dtype(arr.dtype, f"{self.op}: {argname}")
        if dtype is not None and arr.dtype != dtype:
            raise TypeError(f"{self.op}: {argname} has dtype {arr.dtype} but the input has dtype {dtype}")
        if isinstance(arr, np.ndarray):
            return be.from_numpy(arr)
        return arr

    def out(self, out: Any, shape: tuple[int, ...], dtype: np.dtype, *, in_place: tuple[str, ...] = ()):
        """Validate a caller's ``out=`` buffer, or allocate the result.

        ``in_place`` names the inputs that ``out`` may be itself (NOTE [ out= overlap ]); call it
        after every input went through :meth:`array`.
        """
        if out is None:
            return pool.empty(self.be, shape, dtype)
        if not (isinstance(out, np.ndarray) or self.be.is_array(out)):
            raise TypeError(f"{self.op}: out should be a numpy.ndarray, got {type(out).__name__}")
        if tuple(out.shape) != tuple(shape):
            raise ValueError(f"{self.op}: out should have shape {tuple(shape)}, got {tuple(out.shape)}")
        if out.dtype != dtype:
            raise TypeError(f"{self.op}: out should have dtype {dtype}, got {out.dtype}")
        if isinstance(out, np.ndarray) and not out.flags.c_contiguous:
            raise ValueError(f"{self.op}: out should be C-contiguous")
        if isinstance(out, np.ndarray) and not out.flags.writeable:
            raise ValueError(f"{self.op}: out is read-only")
        self._check_overlap(out, in_place)
        if isinstance(out, np.ndarray) and not self.be.is_array(out):
            # A device backend computes into its own buffer; result() copies that into `out`.
            return pool.empty(self.be, shape, dtype)
        return out

    def _check_overlap(self, out: Any, in_place: tuple[str, ...]) -> None:
        # NOTE [ out= overlap ]
        # out= may share memory with an input only by being that input itself (the same memory,
        # shape and strides), and only for the inputs an op reads element by element, or row by
        # row, before writing that element or row: x of the elementwise and row ops, a and b of
        # add_relu and mul_relu. Any other overlap (out overlapping linear's weight or bias,
        # layer_norm's weight or bias, affine's scale or bias, or a shifted view of x) is a
        # ValueError naming the argument, on every backend, as PyTorch rejects partial overlap.
        # Not "compute as if there were no overlap": that needs a hidden copy of the input, and
        # kernels that read a parameter after writing part of out (numba's linear epilogue reads
        # bias for every row) return wrong numbers on one backend and right ones on another.
        for argname, value in self.inputs:
            if not _shares_memory(out, value):
                continue
            if argname in in_place and _same_view(out, value):
                continue
            if argname in in_place:
                raise ValueError(
                    f"{self.op}: out overlaps {argname} without being {argname} itself; out may be "
                    f"{argname} (an in-place update) or share no memory with it"
                )
            raise ValueError(
                f"{self.op}: out must not overlap {argname} (they share memory); give out a buffer of its own"
            )

    def result(self, value: Any, out: Any = None):
        """Hand ``value`` (a backend array) back as the caller's type, into ``out`` if given."""
        if isinstance(out, np.ndarray):
            if value is not out:
                np.copyto(out, self.be.to_numpy(value))
            return out
        if out is not None:
            return out
        return self.be.to_numpy(value) if self.host_io else value


def _shares_memory(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return np.shares_memory(a, b)
    # A device array (taichi_gpu.DeviceArray) is a view of a whole flat storage from its start
    # (reshape is its only view), so two share memory exactly when they share that storage.
    storage = getattr(a, "_storage", None)
    return storage is not None and storage is getattr(b, "_storage", None)


def _same_view(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` (sharing memory) are the same elements in the same places."""
    if isinstance(a, np.ndarray):
        same_start = a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
        return same_start and a.shape == b.shape and a.strides == b.strides and a.dtype == b.dtype
    return tuple(a.shape) == tuple(b.shape) and a.dtype == b.dtype


def _is_foreign_device_array(value: Any) -> bool:
    return hasattr(value, "shape") and hasattr(value, "dtype") and hasattr(value, "numpy")


def _check_finite_number(value: Any, op: str, argname: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{op}: {argname} should be a real number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{op}: {argname} should be finite, got {value}")
    return value


def _normalize_dim(dim: Any, ndim: int, op: str) -> int:
    if isinstance(dim, bool) or not isinstance(dim, numbers.Integral):
        raise TypeError(f"{op}: dim should be an int, got {type(dim).__name__}")
    lo, hi = -max(ndim, 1), max(ndim, 1) - 1
    if not lo <= dim <= hi:
        raise ValueError(f"{op}: dim should be in [{lo}, {hi}] for a {ndim}-D input, got {dim}")
    return int(dim) % max(ndim, 1)


def _has_tensor(*args: Any) -> bool:
    return any(isinstance(a, Tensor) for a in args)


# The array arguments of the ops with a Tensor version, by position in the order their public
# signatures (and so _tensor_op's *args) have them; any op not listed has one, x, first.
_TENSOR_OP_ARRAYS: dict[str, dict[int, str]] = {
    "add_relu": {0: "a", 1: "b"},
    "mul_relu": {0: "a", 1: "b"},
    "affine": {0: "x", 1: "scale", 2: "bias"},
    "linear": {0: "x", 1: "weight", 2: "bias"},
    "layer_norm": {0: "x", 2: "weight", 3: "bias"},
}


def _tensor_op(op: str, out: Any, *args: Any) -> Any:
    """``op`` on Tensor arguments: its differentiable version in ``taifuse._autograd_ops``.

    This is the one place where the NumPy arrays among a Tensor op's arguments are brought to the
    backend, as constant Tensors (as Tensor arithmetic treats a NumPy operand), so that the forward
    and what it saves for the backward hold only backend arrays. On a device backend a NumPy
    argument would otherwise send the forward's result to the host and reach the backward kernels
    as host memory.
    """
    from taifuse import _autograd_ops  # it imports this module

    like = args[0] if isinstance(args[0], Tensor) else None
    names = _TENSOR_OP_ARRAYS.get(op, {0: "x"})
    args = tuple(
        _autograd_ops._tensor_arg(a, op, names[i], like=like) if i in names and isinstance(a, np.ndarray) else a
        for i, a in enumerate(args)
    )
    return _autograd_ops.call(op, out, *args)


def _reshape(arr, shape: tuple[int, ...]):
    return arr.reshape(shape)


# ----------------------------------------------------------------------------- elementwise


def _unary(op: str, x: Any, out: Any, kernel_args: tuple = ()) -> Any:
    call = _Call(op)
    xa = call.array(x, "x")
    o = call.out(out, tuple(xa.shape), xa.dtype, in_place=("x",))
    if xa.size:
        getattr(call.be, op)(xa, o, *kernel_args)
    return call.result(o, out)


def gelu(x: Any, approximate: str = "none", *, out: Any = None) -> Any:
    """Gaussian error linear unit, as ``torch.nn.functional.gelu``.

    ``approximate='none'``: x * Phi(x) = 0.5 * x * (1 + erf(x / sqrt(2))).
    ``approximate='tanh'``: 0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x**3))).

    Example::

        >>> import numpy as np, taifuse.functional as F
        >>> F.gelu(np.array([0.0, 1.0], dtype=np.float32)).round(4)
        array([0.    , 0.8413], dtype=float32)
    """
    if _has_tensor(x):
        return _tensor_op("gelu", out, x, approximate)
    if approximate not in _APPROXIMATIONS:
        raise ValueError(f"gelu: approximate should be one of {_APPROXIMATIONS}, got {approximate!r}")
    return _unary("gelu", x, out, (approximate,))


def relu(x: Any, *, out: Any = None) -> Any:
    """max(x, 0) elementwise."""
    if _has_tensor(x):
        return _tensor_op("relu", out, x)
    return _unary("relu", x, out)


def leaky_relu(x: Any, negative_slope: float = 0.01, *, out: Any = None) -> Any:
    """x if x > 0 else negative_slope * x."""
    if _has_tensor(x):
        return _tensor_op("leaky_relu", out, x, negative_slope)
    slope = _check_finite_number(negative_slope, "leaky_relu", "negative_slope")
    return _unary("leaky_relu", x, out, (slope,))


def silu(x: Any, *, out: Any = None) -> Any:
    """x * sigmoid(x) (also called swish)."""
    if _has_tensor(x):
        return _tensor_op("silu", out, x)
    return _unary("silu", x, out)


def sigmoid(x: Any, *, out: Any = None) -> Any:
    """1 / (1 + exp(-x)), without overflow for large |x|."""
    if _has_tensor(x):
        return _tensor_op("sigmoid", out, x)
    return _unary("sigmoid", x, out)


def tanh(x: Any, *, out: Any = None) -> Any:
    """Hyperbolic tangent elementwise."""
    if _has_tensor(x):
        return _tensor_op("tanh", out, x)
    return _unary("tanh", x, out)


def _binary(op: str, a: Any, b: Any, out: Any) -> Any:
    call = _Call(op)
    aa = call.array(a, "a")
    ba = call.array(b, "b", dtype=aa.dtype)
    try:
        shape = np.broadcast_shapes(tuple(aa.shape), tuple(ba.shape))
    except ValueError:
        raise ValueError(
            f"{op}: shapes of a {tuple(aa.shape)} and b {tuple(ba.shape)} cannot be broadcast together"
        ) from None
    aa, ba = _broadcast(call, aa, shape), _broadcast(call, ba, shape)
    o = call.out(out, shape, aa.dtype, in_place=("a", "b"))
    if math.prod(shape):
        getattr(call.be, op)(aa, ba, o)
    return call.result(o, out)


def _broadcast(call: _Call, arr, shape: tuple[int, ...]):
    if tuple(arr.shape) == tuple(shape):
        return arr
    # NOTE: broadcasting materialises the expanded operand (through the host on device backends);
    # the fused kernels take equal shapes. Per-feature scale/bias is what `affine` is for.
    host = np.ascontiguousarray(np.broadcast_to(call.be.to_numpy(arr), shape))
    return call.be.from_numpy(host)


def add_relu(a: Any, b: Any, *, out: Any = None) -> Any:
    """relu(a + b) in one pass (a and b broadcast as in NumPy)."""
    if _has_tensor(a, b):
        return _tensor_op("add_relu", out, a, b)
    return _binary("add_relu", a, b, out)


def mul_relu(a: Any, b: Any, *, out: Any = None) -> Any:
    """relu(a * b) in one pass (a and b broadcast as in NumPy)."""
    if _has_tensor(a, b):
        return _tensor_op("mul_relu", out, a, b)
    return _binary("mul_relu", a, b, out)


def affine(x: Any, scale: Any, bias: Any, *, out: Any = None) -> Any:
    """x * scale + bias with per-feature ``scale`` and ``bias`` over the last axis.

    ``scale`` and ``bias`` are arrays of shape ``(C,)`` with ``C = x.shape[-1]``, or Python numbers.

    Example::

        >>> import numpy as np, taifuse.functional as F
        >>> F.affine(np.ones((2, 3), np.float32), np.array([1, 2, 3], np.float32), 0.5)
        array([[1.5, 2.5, 3.5],
               [1.5, 2.5, 3.5]], dtype=float32)
    """
    if _has_tensor(x, scale, bias):
        return _tensor_op("affine", out, x, scale, bias)
    call = _Call("affine")
    xa = call.array(x, "x")
    if xa.ndim == 0:
        raise ValueError("affine: x should have at least 1 dimension, got a 0-d array")
    features = xa.shape[-1]
    params = []
    for argname, value in (("scale", scale), ("bias", bias)):
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            # Not call.array: a number is no NumPy input and must not send a device result to the host.
            arr = call.be.from_numpy(np.full((features,), value, dtype=xa.dtype))
        else:
            arr = call.array(value, argname, dtype=xa.dtype)
        if tuple(arr.shape) != (features,):
            raise ValueError(
                f"affine: {argname} should have shape ({features},) to match x.shape[-1], got {tuple(arr.shape)}"
            )
        params.append(arr)
    o = call.out(out, tuple(xa.shape), xa.dtype, in_place=("x",))
    if xa.size:
        rows = xa.size // features
        call.be.affine(_reshape(xa, (rows, features)), params[0], params[1], _reshape(o, (rows, features)))
    return call.result(o, out)


# ----------------------------------------------------------------------------- linear


def linear(x: Any, weight: Any, bias: Any = None, activation: str | None = None, *, out: Any = None) -> Any:
    """activation(x @ weight.T + bias) with the bias and activation fused into one pass.

    Args:
        x: input of shape ``(..., in_features)``.
        weight: ``(out_features, in_features)``, as ``torch.nn.Linear.weight``.
        bias: ``(out_features,)`` or ``None``.
        activation: ``None``, ``'relu'``, ``'gelu'``, ``'gelu_tanh'`` or ``'silu'``.

    Returns an array of shape ``(..., out_features)``.

    Example::

        >>> import numpy as np, taifuse.functional as F
        >>> F.linear(np.ones((1, 2), np.float32), np.ones((3, 2), np.float32), activation="relu")
        array([[2., 2., 2.]], dtype=float32)
    """
    if _has_tensor(x, weight, bias):
        return _tensor_op("linear", out, x, weight, bias, activation)
    call, xa, wa, ba = _linear_args(x, weight, bias, activation)
    o = call.out(out, _linear_shape(xa, wa), xa.dtype)  # no in_place: each output reads a whole row of x
    _linear_kernel(call.be, xa, wa, ba, activation, o)
    return call.result(o, out)


def _linear_keep_pre(x: Any, weight: Any, bias: Any, activation: str | None) -> tuple[Any, Any]:
    """``(activation(pre), pre)`` with ``pre = x @ weight.T + bias``, on backend arrays or NumPy.

    The forward of autograd's linear, which keeps ``pre`` for the backward (NOTE [ Linear saves
    the pre-activation ] in ``_autograd_ops``): one product and one fused pass that writes both,
    with the values of ``linear(x, weight, bias)`` followed by the activation op.
    """
    call, xa, wa, ba = _linear_args(x, weight, bias, activation)
    shape = _linear_shape(xa, wa)
    o, pre = pool.empty(call.be, shape, xa.dtype), pool.empty(call.be, shape, xa.dtype)
    _linear_kernel(call.be, xa, wa, ba, activation, o, pre)
    return call.result(o), call.result(pre)


def _linear_args(x: Any, weight: Any, bias: Any, activation: str | None) -> tuple[_Call, Any, Any, Any]:
    """Validate linear's arguments; the call and x, weight, bias as backend arrays."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"linear: activation should be one of {ACTIVATIONS}, got {activation!r}")
    call = _Call("linear")
    xa = call.array(x, "x")
    wa = call.array(weight, "weight", dtype=xa.dtype)
    if wa.ndim != 2:
        raise ValueError(
            f"linear: weight should be 2-D (out_features, in_features), got shape {tuple(wa.shape)}"
        )
    if xa.ndim == 0:
        raise ValueError("linear: x should have at least 1 dimension, got a 0-d array")
    out_features, in_features = wa.shape
    if xa.shape[-1] != in_features:
        raise ValueError(
            f"linear: x has {xa.shape[-1]} features (x.shape[-1]) but weight expects {in_features} "
            f"(weight.shape[1]); shapes x {tuple(xa.shape)}, weight {tuple(wa.shape)}"
        )
    ba = None
    if bias is not None:
        ba = call.array(bias, "bias", dtype=xa.dtype)
        if tuple(ba.shape) != (out_features,):
            raise ValueError(f"linear: bias should have shape ({out_features},), got {tuple(ba.shape)}")
    return call, xa, wa, ba


def _linear_shape(xa: Any, wa: Any) -> tuple[int, ...]:
    return tuple(xa.shape[:-1]) + (wa.shape[0],)


def _linear_kernel(
    be: ModuleType, xa: Any, wa: Any, ba: Any, activation: str | None, o: Any, pre: Any = None
) -> None:
    out_features, in_features = wa.shape
    rows = math.prod(xa.shape[:-1])
    if rows and out_features:
        be.linear_act(
            _reshape(xa, (rows, in_features)),
            wa,
            ba,
            activation,
            _reshape(o, (rows, out_features)),
            **({} if pre is None else {"pre": _reshape(pre, (rows, out_features))}),
        )


# ----------------------------------------------------------------------------- row reductions


def _softmax_like(op: str, x: Any, dim: int, out: Any) -> Any:
    call = _Call(op)
    xa = call.array(x, "x")
    shape = tuple(xa.shape)
    d = _normalize_dim(dim, len(shape), op)
    o = call.out(out, shape, xa.dtype, in_place=("x",))
    if xa.size:
        full = shape if shape else (1,)
        view = (math.prod(full[:d]), full[d], math.prod(full[d + 1 :]))
        getattr(call.be, op)(_reshape(xa, view), _reshape(o, view))
    return call.result(o, out)


def softmax(x: Any, dim: int = -1, *, out: Any = None) -> Any:
    """exp(x) / sum(exp(x)) along ``dim``, computed stably (max subtracted first).

    Example::

        >>> import numpy as np, taifuse.functional as F
        >>> F.softmax(np.zeros((1, 4), np.float32))
        array([[0.25, 0.25, 0.25, 0.25]], dtype=float32)
    """
    if _has_tensor(x):
        return _tensor_op("softmax", out, x, dim)
    return _softmax_like("softmax", x, dim, out)


def log_softmax(x: Any, dim: int = -1, *, out: Any = None) -> Any:
    """x - logsumexp(x) along ``dim``, computed stably."""
    if _has_tensor(x):
        return _tensor_op("log_softmax", out, x, dim)
    return _softmax_like("log_softmax", x, dim, out)


def _layer_norm_args(normalized_shape: Any, eps: Any, op: str = "layer_norm") -> tuple[tuple[int, ...], float]:
    """Validate layer_norm's ``normalized_shape`` and ``eps``: the one check, for the Tensor path
    and ``nn.LayerNorm`` (which passes its own name as ``op``) too."""
    if isinstance(normalized_shape, numbers.Integral) and not isinstance(normalized_shape, bool):
        normalized_shape = (int(normalized_shape),)
    # NOTE: not int(n) for each n, which would accept "4" and 4.5; PyTorch takes only integers here.
    if (
        not isinstance(normalized_shape, Sequence)
        or isinstance(normalized_shape, (str, bytes))
        or not all(isinstance(n, numbers.Integral) and not isinstance(n, bool) for n in normalized_shape)
    ):
        raise TypeError(f"{op}: normalized_shape should be an int or a sequence of ints, got {normalized_shape!r}")
    eps = _check_finite_number(eps, op, "eps")
    if eps < 0:
        raise ValueError(f"{op}: eps should be non-negative, got {eps}")
    return tuple(int(n) for n in normalized_shape), eps


def layer_norm(
    x: Any,
    normalized_shape: int | Sequence[int],
    weight: Any = None,
    bias: Any = None,
    eps: float = 1e-5,
    *,
    out: Any = None,
) -> Any:
    """Layer normalization over the trailing ``normalized_shape`` dimensions, as ``torch.nn.functional.layer_norm``.

    y = (x - mean) / sqrt(var + eps) * weight + bias, with the biased variance over the last
    ``len(normalized_shape)`` axes.
    """
    if _has_tensor(x, weight, bias):
        return _tensor_op("layer_norm", out, x, normalized_shape, weight, bias, eps)
    norm_shape, eps = _layer_norm_args(normalized_shape, eps)
    call = _Call("layer_norm")
    xa = call.array(x, "x")
    k = len(norm_shape)
    if k == 0 or tuple(xa.shape[xa.ndim - k :]) != norm_shape or xa.ndim < k:
        raise ValueError(
            f"layer_norm: normalized_shape {norm_shape} should match the trailing dimensions of x {tuple(xa.shape)}"
        )
    params = []
    for argname, value in (("weight", weight), ("bias", bias)):
        if value is None:
            params.append(None)
            continue
        arr = call.array(value, argname, dtype=xa.dtype)
        if tuple(arr.shape) != norm_shape:
            raise ValueError(f"layer_norm: {argname} should have shape {norm_shape}, got {tuple(arr.shape)}")
        params.append(_reshape(arr, (math.prod(norm_shape),)))
    o = call.out(out, tuple(xa.shape), xa.dtype, in_place=("x",))
    features = math.prod(norm_shape)
    rows = xa.size // features if features else 0
    if xa.size:
        stats_dtype = np.dtype(np.float64) if xa.dtype == np.float64 else np.dtype(np.float32)
        mean = pool.empty(call.be, (rows,), stats_dtype)
        rstd = pool.empty(call.be, (rows,), stats_dtype)
        call.be.layer_norm(
            _reshape(xa, (rows, features)), params[0], params[1], eps, _reshape(o, (rows, features)), mean, rstd
        )
    return call.result(o, out)


# ----------------------------------------------------------------------------- dropout


def dropout(x: Any, p: float = 0.5, training: bool = True, *, out: Any = None) -> Any:
    """Zero each element with probability ``p`` and scale the rest by ``1 / (1 - p)``.

    The mask comes from a counter-based hash of the element index and a seed drawn from
    taifuse's generator (``taifuse.manual_seed``), so it is reproducible and identical on every
    backend. With ``training=False`` (or ``p == 0``) ``x`` is returned unchanged, as in PyTorch.
    """
    if _has_tensor(x):
        return _tensor_op("dropout", out, x, p, training)
    p = _check_finite_number(p, "dropout", "p")
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout: p should be in [0, 1], got {p}")
    if not training or p == 0.0:
        if out is None:
            _Call("dropout").array(x, "x")  # still validate the input
            return x
        return _unary("dropout", x, out, (0.0, 0))  # p = 0 keeps every element: a copy into out
    seed = _random.next_seed()
    return _unary("dropout", x, out, (p, seed))


# ----------------------------------------------------------------------------- losses


def mse_loss(input: Any, target: Any, reduction: str = "mean") -> Any:
    """Mean squared error, as ``torch.nn.functional.mse_loss``.

    loss = (input - target)^2 elementwise, then its mean (``'mean'``), sum (``'sum'``) or nothing
    (``'none'``). ``input`` and ``target`` have the same shape. NumPy in, NumPy out (a 0-d array
    when reduced); Tensors in, a differentiable Tensor out. For example, input ``[1, 3]`` against
    target ``[0, 0]`` gives 5.0.
    """
    from taifuse import _autograd_ops  # it imports this module

    return _autograd_ops.mse_loss(input, target, reduction)


def cross_entropy(logits: Any, target: Any, reduction: str = "mean") -> Any:
    """Cross entropy of ``logits`` against class indices, as ``torch.nn.functional.cross_entropy``.

    loss[n] = logsumexp(logits[n]) - logits[n, target[n]] for ``logits (N, C)`` and integer
    ``target (N,)`` in ``[0, C)`` (or ``logits (C,)`` with a 0-d target), then its mean, sum or
    nothing (``reduction``). The backward is the fused softmax(logits) - onehot(target). For
    example, all-zero logits over 4 classes give log(4) ~ 1.3863 for any target.
    """
    from taifuse import _autograd_ops  # it imports this module

    return _autograd_ops.cross_entropy(logits, target, reduction)
