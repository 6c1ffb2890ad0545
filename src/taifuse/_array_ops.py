"""The array path of the ``taifuse.functional`` ops: what an op does to arrays.

:class:`_Call` converts an op's array arguments onto the active backend, checks ``out=`` (NOTE
[ out= overlap ]) and hands the result back as the caller's type; the validators below are each
op's argument checks, written once for this path, the autograd layer (``taifuse._autograd_ops``,
whose Functions run these functions on the tensors' arrays) and the ``nn`` layers; the per-op
functions allocate from the pool and call the active backend's kernels.

This module never imports ``taifuse.tensor``: a Tensor is routed to its autograd Function by
``taifuse.functional`` before anything here runs.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy as np

from taifuse import _profile_hook, _random, backends, pool
from taifuse._tensor_math import math_for
from taifuse.backends import _spec
from taifuse.backends._spec import ACTIVATIONS

_APPROXIMATIONS = ("none", "tanh")
_REDUCTIONS = ("none", "mean", "sum")


# ----------------------------------------------------------------------------- argument handling


class _Call:
    """One op call: converts inputs onto the backend and results back to the caller's type."""

    def __init__(self, op: str) -> None:
        self.op = op
        self.be: ModuleType = backends.active()
        self.host_io = False  # any NumPy input means results go back to NumPy
        self.inputs: list[tuple[str, Any]] = []  # (argname, the caller's array), for out()'s overlap check

    def array(self, value: Any, argname: str, *, dtype: np.dtype | None = None, like_name: str = "the input"):
        """Validate one array argument and return it as a contiguous backend array (of ``dtype``,
        the dtype of the argument ``like_name``, if given)."""
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
        check_float_array(arr.dtype, be, self.op, argname, like=dtype, like_name=like_name)
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


Call = _Call  # the public name, for the ops' modules beside this one (_conv_ops)


# NOTE [ Checked signatures ]
# An op's argument checks depend on its arguments' types, dtypes and shapes (and its options), not
# on their values; a model calls each op with a few such signatures over and over. So the ops a
# small model repeats most (the unary activations, linear) record the signature of a call that
# passed ``_Call``'s checks (with ``out=None``; the signature holds the active backend) and a
# later call of the same signature skips them, going straight to the pool and the kernel with
# the same conversions (``from_numpy`` makes a NumPy input contiguous as ``_Call.array`` does,
# and a NumPy input gets a NumPy result). A call of any other signature takes the checked path,
# so bad input raises the same error as before, before anything is written. This is the per-op
# fixed cost of the ``step`` bench suite's first rows. The set is bounded: past
# _CHECKED_MAX signatures nothing more is recorded (the checks still run for the others).
_CHECKED_MAX = 4096


class _CheckedSignatures(set):
    def add(self, signature: Any) -> None:
        if len(self) < _CHECKED_MAX:
            super().add(signature)


_CHECKED: set = _CheckedSignatures()


def _hashable(signature: tuple) -> bool:
    try:
        hash(signature)
    except TypeError:
        return False
    return True


def _checked(signature: tuple) -> bool:
    """Whether a call of ``signature`` passed the checks before (an unhashable part: no)."""
    try:
        return signature in _CHECKED
    except TypeError:
        return False


def _shares_memory(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return np.shares_memory(a, b)
    # A device array (the taichi backend's DeviceArray) is a view of a whole flat storage from its start
    # (reshape is its only view), so two share memory exactly when they share that storage.
    storage = getattr(a, "storage", None)
    return storage is not None and storage is getattr(b, "storage", None)


def _same_view(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` (sharing memory) are the same elements in the same places."""
    if isinstance(a, np.ndarray):
        same_start = a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
        return same_start and a.shape == b.shape and a.strides == b.strides and a.dtype == b.dtype
    return tuple(a.shape) == tuple(b.shape) and a.dtype == b.dtype


def _is_foreign_device_array(value: Any) -> bool:
    return hasattr(value, "shape") and hasattr(value, "dtype") and hasattr(value, "numpy")


def _reshape(arr, shape: tuple[int, ...]):
    return arr.reshape(shape)


def _stats_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype of the per-row statistics (layer_norm's mean and rstd, cross_entropy's lse)."""
    return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)


# ----------------------------------------------------------------------------- validators


def check_float_array(
    dtype: np.dtype,
    be: ModuleType,
    op: str,
    argname: str,
    like: np.dtype | None = None,
    like_name: str = "the input",
) -> None:
    """An array argument's dtype: floating-point, one ``be`` computes in, and ``like`` (the dtype
    of the argument ``like_name``) if given."""
    if dtype.kind != "f":
        raise TypeError(f"{op}: {argname} should be a floating-point array, got dtype {dtype}")
    # Checked here, so that a refused dtype is named as this argument, not as from_numpy's.
    be.check_dtype(dtype, f"{op}: {argname}")
    if like is not None and dtype != like:
        raise TypeError(f"{op}: {argname} has dtype {dtype} but {like_name} has dtype {like}")


def check_finite_number(value: Any, op: str, argname: str) -> float:
    """A real, finite number argument as a float (``op`` is the op's or the layer's name)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{op}: {argname} should be a real number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{op}: {argname} should be finite, got {value}")
    return value


def normalize_dim(dim: Any, ndim: int, op: str) -> int:
    if isinstance(dim, bool) or not isinstance(dim, numbers.Integral):
        raise TypeError(f"{op}: dim should be an int, got {type(dim).__name__}")
    lo, hi = -max(ndim, 1), max(ndim, 1) - 1
    if not lo <= dim <= hi:
        raise ValueError(f"{op}: dim should be in [{lo}, {hi}] for a {ndim}-D input, got {dim}")
    return int(dim) % max(ndim, 1)


def check_approximate(approximate: Any) -> None:
    if approximate not in _APPROXIMATIONS:
        raise ValueError(f"gelu: approximate should be one of {_APPROXIMATIONS}, got {approximate!r}")


def check_activation(activation: Any) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"linear: activation should be one of {ACTIVATIONS}, got {activation!r}")


def layer_norm_args(normalized_shape: Any, eps: Any, op: str = "layer_norm") -> tuple[tuple[int, ...], float]:
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
        raise TypeError(
            f"{op}: normalized_shape should be an int or a sequence of ints, got {normalized_shape!r}"
        )
    eps = check_finite_number(eps, op, "eps")
    if eps < 0:
        raise ValueError(f"{op}: eps should be non-negative, got {eps}")
    return tuple(int(n) for n in normalized_shape), eps


def check_layer_norm_input(
    shape: tuple[int, ...], norm_shape: tuple[int, ...], op: str = "layer_norm", xname: str = "x"
) -> None:
    """``normalized_shape`` must be the trailing dimensions of x (rms_norm's ``input``)."""
    k = len(norm_shape)
    if k == 0 or len(shape) < k or tuple(shape[len(shape) - k :]) != norm_shape:
        raise ValueError(
            f"{op}: normalized_shape {norm_shape} should match the trailing dimensions of {xname} {shape}"
        )


def check_layer_norm_param(
    argname: str, shape: tuple[int, ...], norm_shape: tuple[int, ...], op: str = "layer_norm"
) -> None:
    if shape != norm_shape:
        raise ValueError(f"{op}: {argname} should have shape {norm_shape}, got {shape}")


def rms_norm_args(
    normalized_shape: Any, eps: Any, op: str = "rms_norm"
) -> tuple[tuple[int, ...], float | None]:
    """Validate rms_norm's ``normalized_shape`` and ``eps`` (None stays None: :func:`rms_norm_eps`)."""
    norm_shape, _ = layer_norm_args(normalized_shape, 0.0, op)
    if eps is not None:
        _, eps = layer_norm_args(norm_shape, eps, op)
    return norm_shape, eps


def rms_norm_eps(eps: float | None, dtype: np.dtype) -> float:
    """rms_norm's ``eps``, where None is the machine epsilon of the compute dtype, as PyTorch's
    (``torch.finfo(input.dtype).eps``, except that float16 computes, and takes its eps, in float32)."""
    if eps is not None:
        return eps
    return float(np.finfo(np.float64 if dtype == np.float64 else np.float32).eps)


def embedding_padding_idx(padding_idx: Any, num_embeddings: int, op: str = "embedding") -> int:
    """``padding_idx`` as a row in ``[0, num_embeddings)``, negative counted from the end as in
    PyTorch; -1 (the kernels' "none") for None."""
    if padding_idx is None:
        return -1
    if isinstance(padding_idx, bool) or not isinstance(padding_idx, numbers.Integral):
        raise TypeError(f"{op}: padding_idx should be an int or None, got {type(padding_idx).__name__}")
    if not -num_embeddings <= padding_idx < num_embeddings:
        raise ValueError(
            f"{op}: padding_idx should be within num_embeddings {num_embeddings} "
            f"(in [{-num_embeddings}, {num_embeddings})), got {padding_idx}"
        )
    return int(padding_idx) % num_embeddings


def check_embedding_options(max_norm: Any, norm_type: Any, scale_grad_by_freq: Any, sparse: Any) -> None:
    """PyTorch's extra ``F.embedding`` arguments, accepted at their defaults only."""
    if max_norm is not None or norm_type != 2.0 or scale_grad_by_freq or sparse:
        raise NotImplementedError(
            "embedding: max_norm, norm_type, scale_grad_by_freq and sparse are not supported "
            f"(got max_norm={max_norm!r}, norm_type={norm_type!r}, scale_grad_by_freq={scale_grad_by_freq!r}, "
            f"sparse={sparse!r})"
        )


def check_embedding_weight(shape: tuple[int, ...]) -> None:
    if len(shape) != 2:
        raise ValueError(
            f"embedding: weight should be 2-D (num_embeddings, embedding_dim), got shape {shape}"
        )


def check_index_dtype(dtype: np.dtype, op: str = "embedding") -> None:
    if dtype.kind not in "iu":
        raise TypeError(f"{op}: input should hold integer indices, got dtype {dtype}")


def embedding_indices(value: Any, num_embeddings: int, be: ModuleType) -> tuple[Any, tuple[int, ...], bool]:
    """embedding's ``input`` as ``be``'s flat integer indices, checked before anything is written:
    ``(indices (N,), the input's shape, whether it came from the host)``.

    Host data is range-checked (``IndexError`` naming the index, as PyTorch's). Indices already on
    a device backend are not: that check would copy them back on every call (NOTE [ Class indices
    on the device ] in ``backends/taichi/backward.py``); an index out of range there gives a NaN
    row in the forward and adds nothing in the backward.
    """
    if be.is_array(value) and not isinstance(value, np.ndarray):
        check_index_dtype(np.dtype(value.dtype))
        return value.reshape((value.size,)), tuple(value.shape), False
    if isinstance(value, (np.ndarray, list, tuple, numbers.Integral)):
        host = np.asarray(value)
    else:
        raise TypeError(f"embedding: input should be an integer numpy.ndarray, got {type(value).__name__}")
    check_index_dtype(host.dtype)
    if host.size and (host.min() < 0 or host.max() >= num_embeddings):
        bad = host[(host < 0) | (host >= num_embeddings)].flat[0]
        raise IndexError(
            f"embedding: input holds index {bad}, outside [0, {num_embeddings}) (num_embeddings)"
        )
    flat = be.from_numpy(np.ascontiguousarray(host, dtype=np.int64).reshape(-1))
    return flat, tuple(host.shape), True


def dropout_p(p: Any, op: str = "dropout", argname: str = "p") -> float:
    """A dropout probability: a number in [0, 1] (``nn.Dropout`` passes its own name as ``op``,
    attention its argument's name, ``dropout_p``, as ``argname``)."""
    p = check_finite_number(p, op, argname)
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"{op}: {argname} should be in [0, 1], got {p}")
    return p


def check_reduction(reduction: Any, op: str) -> str:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{op}: reduction should be one of {_REDUCTIONS}, got {reduction!r}")
    return reduction


def check_class_indices(dtype: np.dtype, shape: tuple[int, ...], rows: int | None) -> None:
    """cross_entropy's ``target``: integers, ``(rows,)``, or ``()`` for a vector of logits (``rows`` None)."""
    if dtype.kind not in "iu":
        raise TypeError(f"cross_entropy: target should hold integer class indices, got dtype {dtype}")
    expected = () if rows is None else (rows,)
    if shape != expected:
        raise ValueError(f"cross_entropy: target should have shape {expected}, got {shape}")


def class_indices(host: np.ndarray, rows: int | None, classes: int, be: ModuleType) -> Any:
    """cross_entropy's ``target`` (host data), checked, as ``be``'s int64 class indices."""
    check_class_indices(host.dtype, host.shape, rows)
    if host.size and (host.min() < 0 or host.max() >= classes):
        bad = host[(host < 0) | (host >= classes)].flat[0]
        raise ValueError(f"cross_entropy: target holds class index {bad}, outside [0, {classes})")
    return be.from_numpy(np.ascontiguousarray(host, dtype=np.int64))


# ----------------------------------------------------------------------------- elementwise


def _unary(op: str, x: Any, out: Any, kernel_args: tuple = ()) -> Any:
    if out is None:
        be = backends.active()
        if (op, be, type(x), getattr(x, "dtype", None)) in _CHECKED:  # NOTE [ Checked signatures ]
            xa = be.from_numpy(x) if isinstance(x, np.ndarray) else x
            o = pool.empty(be, xa.shape, xa.dtype)
            if xa.size:
                getattr(be, op)(xa, o, *kernel_args)
            return be.to_numpy(o) if isinstance(x, np.ndarray) else o
    call = _Call(op)
    xa = call.array(x, "x")
    o = call.out(out, tuple(xa.shape), xa.dtype, in_place=("x",))
    if out is None:
        _CHECKED.add((op, call.be, type(x), x.dtype))
    if xa.size:
        getattr(call.be, op)(xa, o, *kernel_args)
    return call.result(o, out)


def unary(op: str, be: ModuleType, x: Any) -> Any:
    """Unary op ``op`` (one without parameters: relu, silu, sigmoid, tanh) of a Tensor's array
    ``x`` on the active backend ``be``, into a new array: the autograd forwards' call, without the
    public op's wrapper (the profiler records the autograd op itself). The checks run once per
    signature (NOTE [ Checked signatures ]). ``x`` is an array of ``be`` already (a Tensor's, made
    C-contiguous where a kernel needs it by ``Function.apply``): no conversion."""
    if (op, be, type(x), x.dtype) not in _CHECKED:
        return _unary(op, x, None)
    o = pool.empty(be, x.shape, x.dtype)
    if x.size:
        getattr(be, op)(x, o)
    return o


def gelu(x: Any, approximate: str = "none", out: Any = None) -> Any:
    check_approximate(approximate)
    return _unary("gelu", x, out, (approximate,))


def relu(x: Any, out: Any = None) -> Any:
    return _unary("relu", x, out)


def leaky_relu(x: Any, negative_slope: float = 0.01, out: Any = None) -> Any:
    slope = check_finite_number(negative_slope, "leaky_relu", "negative_slope")
    return _unary("leaky_relu", x, out, (slope,))


def silu(x: Any, out: Any = None) -> Any:
    return _unary("silu", x, out)


def sigmoid(x: Any, out: Any = None) -> Any:
    return _unary("sigmoid", x, out)


def tanh(x: Any, out: Any = None) -> Any:
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


def add_relu(a: Any, b: Any, out: Any = None) -> Any:
    return _binary("add_relu", a, b, out)


def mul_relu(a: Any, b: Any, out: Any = None) -> Any:
    return _binary("mul_relu", a, b, out)


def affine(x: Any, scale: Any, bias: Any, out: Any = None) -> Any:
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


def linear(x: Any, weight: Any, bias: Any = None, activation: str | None = None, out: Any = None) -> Any:
    if out is None:
        be = backends.active()
        if _checked(_linear_signature(be, x, weight, bias, activation)):  # NOTE [ Checked signatures ]
            host = isinstance(x, np.ndarray)
            xa, wa = (be.from_numpy(x), be.from_numpy(weight)) if host else (x, weight)
            ba = be.from_numpy(bias) if host and bias is not None else bias
            o = pool.empty(be, _linear_shape(xa, wa), xa.dtype)
            _linear_kernel(be, xa, wa, ba, activation, o)
            return be.to_numpy(o) if host else o
    call, xa, wa, ba = _linear_args(x, weight, bias, activation)
    if out is None and _hashable(signature := _linear_signature(call.be, x, weight, bias, activation)):
        _CHECKED.add(signature)
    o = call.out(out, _linear_shape(xa, wa), xa.dtype)  # no in_place: each output reads a whole row of x
    _linear_kernel(call.be, xa, wa, ba, activation, o)
    return call.result(o, out)


def linear_arrays(be: ModuleType, x: Any, weight: Any, bias: Any, activation: str | None) -> Any:
    """:func:`linear` of Tensors' arrays ``x``, ``weight``, ``bias`` on the active backend ``be``
    into a new array: the autograd forward's call, without the public op's wrapper (the profiler
    records the autograd op itself). The checks run once per signature (NOTE [ Checked
    signatures ]); the arrays are ``be``'s already (C-contiguous where a kernel needs them, by
    ``Function.apply``): no conversion."""
    # Keyed by what the checks depend on for a backend's own arrays (their dtypes and shapes):
    # the output's shape, or None where the kernel call needs _linear_kernel's reshapes.
    key = (
        be, activation, x.dtype, x.shape, weight.dtype, weight.shape,
        None if bias is None else (bias.dtype, bias.shape),
    )  # fmt: skip
    try:
        plan = _LINEAR_PLANS[key]
    except KeyError:
        o = linear(x, weight, bias, activation)  # the checked path
        if len(_LINEAR_PLANS) < _CHECKED_MAX:
            shape = _linear_shape(x, weight)
            _LINEAR_PLANS[key] = shape if x.ndim == 2 and x.shape[0] and shape[1] else None
        return o
    except TypeError:  # an unhashable shape: no plan
        return linear(x, weight, bias, activation)
    if plan is None:
        o = pool.empty(be, _linear_shape(x, weight), x.dtype)
        _linear_kernel(be, x, weight, bias, activation, o)
    else:  # a non-empty 2-D product: the kernel's arguments as they are
        o = pool.empty(be, plan, x.dtype)
        be.linear_act(x, weight, bias, activation, o)
    return o


# linear_arrays's signatures that passed the checks: (backend, activation, x's dtype and shape,
# the weight's, the bias's or None) -> the output's shape, or None where the call takes
# _linear_kernel's reshapes (NOTE [ Checked signatures ]).
_LINEAR_PLANS: dict[tuple, tuple[int, ...] | None] = {}


def linear_keep_pre(x: Any, weight: Any, bias: Any, activation: str | None) -> tuple[Any, Any]:
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


def _linear_signature(be: ModuleType, x: Any, weight: Any, bias: Any, activation: Any) -> tuple:
    """What linear's checks (``_linear_args``) depend on: NOTE [ Checked signatures ]."""
    if bias is None:
        b = None
    else:
        b = (type(bias), getattr(bias, "dtype", None), getattr(bias, "shape", None))
    return (
        "linear",
        be,
        activation,
        type(x),
        getattr(x, "dtype", None),
        getattr(x, "shape", None),
        type(weight),
        getattr(weight, "dtype", None),
        getattr(weight, "shape", None),
        b,
    )


def _linear_args(x: Any, weight: Any, bias: Any, activation: str | None) -> tuple[_Call, Any, Any, Any]:
    """Validate linear's arguments; the call and x, weight, bias as backend arrays."""
    check_activation(activation)
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
    if not (rows and out_features):
        return
    if xa.ndim != 2:  # the kernels take (rows, features); a 2-D x is that already
        xa, o = _reshape(xa, (rows, in_features)), _reshape(o, (rows, out_features))
        pre = None if pre is None else _reshape(pre, (rows, out_features))
    if pre is None:
        be.linear_act(xa, wa, ba, activation, o)
    else:
        be.linear_act(xa, wa, ba, activation, o, pre=pre)


# ----------------------------------------------------------------------------- row reductions


def _softmax_like(op: str, x: Any, dim: int, out: Any) -> Any:
    call = _Call(op)
    xa = call.array(x, "x")
    shape = tuple(xa.shape)
    d = normalize_dim(dim, len(shape), op)
    o = call.out(out, shape, xa.dtype, in_place=("x",))
    if xa.size:
        view = softmax_view(shape, d)
        getattr(call.be, op)(_reshape(xa, view), _reshape(o, view))
    return call.result(o, out)


def softmax_view(shape: tuple[int, ...], dim: int) -> tuple[int, int, int]:
    """The (before, along, after) 3-D view the softmax kernels take for a reduction over ``dim``."""
    full = shape if shape else (1,)
    d = dim % len(full)
    return math.prod(full[:d]), full[d], math.prod(full[d + 1 :])


def softmax(x: Any, dim: int = -1, out: Any = None) -> Any:
    return _softmax_like("softmax", x, dim, out)


def log_softmax(x: Any, dim: int = -1, out: Any = None) -> Any:
    return _softmax_like("log_softmax", x, dim, out)


def layer_norm(
    x: Any, normalized_shape: Any, weight: Any = None, bias: Any = None, eps: float = 1e-5, out: Any = None
) -> Any:
    norm_shape, eps = layer_norm_args(normalized_shape, eps)
    call = _Call("layer_norm")
    xa = call.array(x, "x")
    check_layer_norm_input(tuple(xa.shape), norm_shape)
    params = []
    for argname, value in (("weight", weight), ("bias", bias)):
        if value is None:
            params.append(None)
            continue
        arr = call.array(value, argname, dtype=xa.dtype)
        check_layer_norm_param(argname, tuple(arr.shape), norm_shape)
        params.append(arr)
    o = call.out(out, tuple(xa.shape), xa.dtype, in_place=("x",))
    layer_norm_rows(call.be, xa, params[0], params[1], norm_shape, eps, o)
    return call.result(o, out)


def layer_norm_rows(
    be: ModuleType, x: Any, weight: Any, bias: Any, norm_shape: tuple[int, ...], eps: float, out: Any
) -> tuple[Any, Any]:
    """The layer_norm kernel on validated backend arrays, over rows of ``prod(norm_shape)``
    features; returns the per-row ``(mean, rstd)`` it wrote, which autograd keeps."""
    features = math.prod(norm_shape)
    rows = x.size // features if features else 0
    stats_dtype = _stats_dtype(x.dtype)
    mean, rstd = pool.empty(be, (rows,), stats_dtype), pool.empty(be, (rows,), stats_dtype)
    if x.size:
        be.layer_norm(
            _reshape(x, (rows, features)),
            None if weight is None else _reshape(weight, (features,)),
            None if bias is None else _reshape(bias, (features,)),
            eps,
            _reshape(out, (rows, features)),
            mean,
            rstd,
        )
    return mean, rstd


def rms_norm(
    input: Any, normalized_shape: Any, weight: Any = None, eps: float | None = None, out: Any = None
) -> Any:
    norm_shape, eps = rms_norm_args(normalized_shape, eps)
    call = _Call("rms_norm")
    xa = call.array(input, "input")
    check_layer_norm_input(tuple(xa.shape), norm_shape, "rms_norm", "input")
    wa = None
    if weight is not None:
        wa = call.array(weight, "weight", dtype=xa.dtype)
        check_layer_norm_param("weight", tuple(wa.shape), norm_shape, "rms_norm")
    o = call.out(out, tuple(xa.shape), xa.dtype, in_place=("input",))
    rms_norm_rows(call.be, xa, wa, norm_shape, rms_norm_eps(eps, xa.dtype), o)
    return call.result(o, out)


def rms_norm_rows(
    be: ModuleType, x: Any, weight: Any, norm_shape: tuple[int, ...], eps: float, out: Any
) -> Any:
    """The rms_norm kernel on validated backend arrays, over rows of ``prod(norm_shape)`` features;
    returns the per-row ``rstd`` it wrote, which autograd keeps."""
    features = math.prod(norm_shape)
    rows = x.size // features if features else 0
    rstd = pool.empty(be, (rows,), _stats_dtype(x.dtype))
    if x.size:
        be.rms_norm(
            _reshape(x, (rows, features)),
            None if weight is None else _reshape(weight, (features,)),
            eps,
            _reshape(out, (rows, features)),
            rstd,
        )
    return rstd


# ----------------------------------------------------------------------------- embedding


def embedding(input: Any, weight: Any, padding_idx: int | None = None) -> Any:
    call = _Call("embedding")
    wa = call.array(weight, "weight")
    check_embedding_weight(tuple(wa.shape))
    embedding_padding_idx(padding_idx, wa.shape[0])  # checked; it changes only the backward
    indices, shape, host = embedding_indices(input, wa.shape[0], call.be)
    call.host_io = call.host_io or host
    out = embedding_forward(call.be, indices, wa)
    return call.result(_reshape(out, shape + (wa.shape[1],)))


def embedding_forward(be: ModuleType, indices: Any, weight: Any) -> Any:
    """The embedding kernel on validated backend arrays: ``(N, D)`` rows of ``weight``."""
    out = pool.empty(be, (indices.size, weight.shape[1]), weight.dtype)
    if out.size:
        be.embedding(indices, weight, out)
    return out


# ----------------------------------------------------------------------------- dropout


def dropout(x: Any, p: float = 0.5, training: bool = True, out: Any = None) -> Any:
    p = dropout_p(p)
    if not training or p == 0.0:
        if out is None:
            _Call("dropout").array(x, "x")  # still validate the input
            return x
        return _unary("dropout", x, out, (0.0, 0))  # p = 0 keeps every element: a copy into out
    seed = _random.next_seed()
    return _unary("dropout", x, out, (p, seed))


# ----------------------------------------------------------------------------- attention
# NOTE [ Attention kernel arguments ] in backends/reference/attention.py says what the kernels take.

_SDPA = "scaled_dot_product_attention"


def attention_shapes(
    q: tuple[int, ...], k: tuple[int, ...], v: tuple[int, ...]
) -> tuple[tuple[int, ...], int, int, int, int]:
    """Check query ``(..., L, E)``, key ``(..., S, E)`` and value ``(..., S, Ev)``; returns
    ``(batch, L, S, E, Ev)`` with ``batch`` the broadcast of their leading dims."""
    for argname, shape in (("query", q), ("key", k), ("value", v)):
        if len(shape) < 2:
            raise ValueError(
                f"{_SDPA}: {argname} should have at least 2 dimensions (..., L, E), got shape {shape}"
            )
    if k[-1] != q[-1]:
        raise ValueError(
            f"{_SDPA}: key has head dim {k[-1]} but query has {q[-1]} (their last dims should match); "
            f"shapes query {q}, key {k}"
        )
    if v[-2] != k[-2]:
        raise ValueError(
            f"{_SDPA}: value has {v[-2]} positions but key has {k[-2]} (their dim -2 should match); "
            f"shapes key {k}, value {v}"
        )
    try:
        batch = np.broadcast_shapes(q[:-2], k[:-2], v[:-2])
    except ValueError:
        raise ValueError(
            f"{_SDPA}: the leading dims of query {q[:-2]}, key {k[:-2]} and value {v[:-2]} cannot be broadcast together"
        ) from None
    return tuple(batch), q[-2], k[-2], q[-1], v[-1]


def attention_options(
    p: Any, is_causal: Any, scale: Any, has_mask: bool, head_dim: int
) -> tuple[float, bool, float]:
    """Check ``dropout_p`` (``p``), ``is_causal`` and ``scale``; returns them with PyTorch's
    default scale ``1 / sqrt(E)`` resolved."""
    p = dropout_p(p, _SDPA, "dropout_p")
    if not isinstance(is_causal, (bool, np.bool_)):
        raise TypeError(f"{_SDPA}: is_causal should be a bool, got {type(is_causal).__name__}")
    if is_causal and has_mask:
        raise ValueError(f"{_SDPA}: attn_mask should be None when is_causal=True (PyTorch refuses both)")
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim) if head_dim else 1.0
    else:
        scale = check_finite_number(scale, _SDPA, "scale")
    return p, bool(is_causal), scale


def attention_mask(be: ModuleType, mask: Any, dtype: np.dtype, batch: tuple[int, ...], L: int, S: int) -> Any:
    """``attn_mask`` (a NumPy or ``be`` array) as the kernels' additive ``(M, L, S)`` mask in
    ``dtype`` on ``be``: M is 1 when the mask's leading dims are all 1, else the batch size (the
    mask is then expanded over the batch; PyTorch broadcasts it without a copy). A boolean mask
    becomes 0 where True (attend) and -inf where False. None stays None."""
    if mask is None:
        return None
    if isinstance(mask, np.ndarray):
        host = mask
    elif be.is_array(mask):
        host = be.to_numpy(mask)
    else:
        raise TypeError(f"{_SDPA}: attn_mask should be a numpy.ndarray or None, got {type(mask).__name__}")
    if host.dtype != np.bool_ and host.dtype != dtype:
        raise TypeError(
            f"{_SDPA}: attn_mask should be bool or have the query's dtype {dtype}, got {host.dtype}"
        )
    full = batch + (L, S)
    try:
        fits = np.broadcast_shapes(host.shape, full) == full
    except ValueError:
        fits = False
    if not fits:
        raise ValueError(
            f"{_SDPA}: attn_mask of shape {host.shape} cannot be broadcast to {full} (batch, L, S)"
        )
    if all(n == 1 for n in host.shape[:-2]):
        rows = 1
        host = np.broadcast_to(host.reshape(host.shape[-2:]) if host.ndim > 2 else host, (L, S))
    else:
        rows = math.prod(batch)
        host = np.broadcast_to(host, full)
    if host.dtype == np.bool_:
        host = np.where(host, 0.0, -np.inf).astype(dtype)
    return be.from_numpy(np.ascontiguousarray(host, dtype=dtype).reshape(rows, L, S))


def attention_broadcast(be: ModuleType, arr: Any, batch: tuple[int, ...]) -> Any:
    """``arr (..., n, d)`` broadcast over ``batch`` and flattened to ``(prod(batch), n, d)``.

    Leading dims that differ from ``batch`` are materialised (through the host on a device
    backend); equal ones cost nothing.
    """
    shape = batch + tuple(arr.shape[-2:])
    if tuple(arr.shape) != shape:
        arr = be.from_numpy(np.ascontiguousarray(np.broadcast_to(be.to_numpy(arr), shape)))
    return _reshape(arr, (math.prod(batch),) + shape[-2:])


def attention_forward(
    be: ModuleType,
    q: Any,
    k: Any,
    v: Any,
    mask: Any,
    is_causal: bool,
    scale: float,
    p: float,
    heads_last: bool = False,
) -> tuple[Any, Any, int]:
    """The attention kernel on validated ``(BH, L, E)``, ``(BH, S, E)``, ``(BH, S, Ev)`` backend
    arrays: ``(out (BH, L, Ev), lse (BH, L), dropout seed)``. With ``heads_last`` (a backend that
    takes views: ``_autograd_ops._Attention``) q, k, v are ``(B, H, n, d)`` arrays of any row
    strides and ``out`` is made ``(B, L, H, Ev)``, the kernel writing it through a transposed view."""
    bh, L = math.prod(q.shape[:-2]), q.shape[-2]
    S, ev = k.shape[-2], v.shape[-1]
    shape = (q.shape[0], L, q.shape[1], ev) if heads_last else (bh, L, ev)
    seed = _random.next_seed() if p > 0.0 else 0
    lse = pool.empty(be, (bh, L), _stats_dtype(q.dtype))
    if bh * L * ev == 0 or S == 0:
        # Nothing to compute, or no key at all: every row is fully masked, and PyTorch gives 0
        # (NOTE [ Attention kernel arguments ]). The backward of such a call is all zeros.
        m = math_for(be)
        return m.full(shape, 0.0, q.dtype), m.full((bh, L), -math.inf, lse.dtype), seed
    out = pool.empty(be, shape, q.dtype)
    be.attention(
        q, k, v, mask, is_causal, scale, p, seed, out.transpose(0, 2, 1, 3) if heads_last else out, lse
    )
    return out, lse, seed


def scaled_dot_product_attention(
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
) -> Any:
    call = _Call(_SDPA)
    qa = call.array(query, "query")
    ka = call.array(key, "key", dtype=qa.dtype, like_name="query")
    va = call.array(value, "value", dtype=qa.dtype, like_name="query")
    batch, L, S, E, ev = attention_shapes(tuple(qa.shape), tuple(ka.shape), tuple(va.shape))
    p, causal, scale = attention_options(dropout_p, is_causal, scale, attn_mask is not None, E)
    if isinstance(attn_mask, np.ndarray):
        call.host_io = True
    mask = attention_mask(call.be, attn_mask, qa.dtype, batch, L, S)
    q, k, v = (attention_broadcast(call.be, a, batch) for a in (qa, ka, va))
    out, _, _ = attention_forward(call.be, q, k, v, mask, causal, scale, p)
    return call.result(_reshape(out, batch + (L, ev)))


# ----------------------------------------------------------------------------- losses
# The losses take NumPy arrays here (NumPy in, NumPy out); Tensors, and a NumPy array beside a
# Tensor, go to their autograd Functions.


def _loss_array(call: _Call, value: Any, argname: str, *, dtype: np.dtype | None = None) -> Any:
    if not isinstance(value, np.ndarray):
        raise TypeError(
            f"{call.op}: {argname} should be a Tensor or numpy.ndarray, got {type(value).__name__}"
        )
    return call.array(value, argname, dtype=dtype)


def mse_loss(input: Any, target: Any, reduction: str = "mean") -> Any:
    reduction = check_reduction(reduction, "mse_loss")
    call = _Call("mse_loss")
    x = _loss_array(call, input, "input")
    t = _loss_array(call, target, "target", dtype=x.dtype)
    if tuple(x.shape) != tuple(t.shape):
        raise ValueError(
            f"mse_loss: input {tuple(x.shape)} and target {tuple(t.shape)} should have the same shape"
        )
    out = mse_loss_forward(call.be, x, t, reduction)
    return call.result(out if reduction == "none" else _reshape(out, ()))


def mse_loss_forward(be: ModuleType, x: Any, t: Any, reduction: str) -> Any:
    """The mse_loss kernel on validated backend arrays: the loss, of shape ``(1,)`` when reduced."""
    if not x.size and reduction != "none":
        return _reduction_of_nothing(be, reduction, x.dtype)
    out = pool.empty(be, tuple(x.shape) if reduction == "none" else (1,), x.dtype)
    if x.size:
        be.mse_loss(x, t, out, reduction)
    return out


def cross_entropy(logits: Any, target: Any, reduction: str = "mean") -> Any:
    reduction = check_reduction(reduction, "cross_entropy")
    call = _Call("cross_entropy")
    x = _loss_array(call, logits, "logits")
    if x.ndim not in (1, 2):
        raise ValueError(f"cross_entropy: logits should be (N, C) or (C,), got shape {tuple(x.shape)}")
    rows = None if x.ndim == 1 else x.shape[0]
    classes = x.shape[-1]
    t = class_indices(np.asarray(target), rows, classes, call.be)
    rows = 1 if rows is None else rows
    out, _ = cross_entropy_forward(call.be, _reshape(x, (rows, classes)), _reshape(t, (rows,)), reduction)
    return call.result(_reshape(out, ()) if reduction != "none" or x.ndim == 1 else out)


def cross_entropy_forward(be: ModuleType, logits: Any, target: Any, reduction: str) -> tuple[Any, Any]:
    """The cross_entropy kernel on validated backend arrays, logits ``(N, C)`` and target ``(N,)``:
    the loss (``(N,)`` for ``'none'``, else ``(1,)``) and the per-row logsumexp the backward reads."""
    rows = logits.shape[0]
    lse = pool.empty(be, (rows,), _stats_dtype(logits.dtype))
    if not rows and reduction != "none":
        return _reduction_of_nothing(be, reduction, logits.dtype), lse
    out = pool.empty(be, (rows,) if reduction == "none" else (1,), logits.dtype)
    if rows:
        be.cross_entropy(logits, target, out, reduction, lse)
    return out, lse


def _reduction_of_nothing(be: ModuleType, reduction: str, dtype: np.dtype) -> Any:
    # PyTorch: the mean of nothing is nan, the sum 0.
    return math_for(be).full((1,), math.nan if reduction == "mean" else 0.0, dtype)


# ----------------------------------------------------------------------------- profiler hook

# The public ops, as taifuse.functional calls them on arrays: the functions that launch a kernel
# of backends/_spec.py's table (its ``array_op``), as (module, name) pairs. NOTE [ Profiler hooks ]
# in taifuse/_profile_hook.py: an autograd forward that calls one of them is already being
# recorded, and the recorder does not record the nested call twice.
PROFILED_OPS = tuple(
    dict.fromkeys((k.array_module, k.array_op) for k in _spec.KERNELS if k.array_op is not None)
)


def _profiled(name: str, fn: Any) -> Any:
    @functools.wraps(fn)
    def op(*args: Any, **kwargs: Any) -> Any:
        rec = _profile_hook.ACTIVE  # NOTE [ Profiler hooks ]
        return fn(*args, **kwargs) if rec is None else rec.array_op(name, fn, args, kwargs)

    return op


def profile_ops(namespace: dict[str, Any], module: str) -> None:
    """Wrap, in ``namespace`` (a module's ``globals()``), the ops ``PROFILED_OPS`` says ``module``
    (``"_conv_ops"``) defines, so that the profiler records their array-path calls.

    Each op module calls this at its end for its own ops: this module cannot wrap them, because
    they import it (a circle). A listed op the module lacks is an ImportError naming it.
    """
    for owner, name in PROFILED_OPS:
        if owner != module:
            continue
        if name not in namespace:
            raise ImportError(f"backends/_spec.py names {module}.{name} as a kernel's op, and there is none")
        namespace[name] = _profiled(name, namespace[name])


profile_ops(globals(), "_array_ops")
