"""Differentiable versions of the ``taifuse.functional`` ops, for Tensor arguments.

Each op is a :class:`taifuse._engine.Function`: its forward runs the array path
(``taifuse._array_ops``) on the tensors' arrays and keeps what the backward needs; its backward
calls the backend's hand-written backward kernel (the ``*_backward`` kernels, specified in
``taifuse.backends.reference``). ``taifuse.functional`` sends a call here when any array argument
is a Tensor, through the function named after the op, which takes the op's public arguments.
"""

from __future__ import annotations

import math
import numbers
from types import ModuleType
from typing import Any

import numpy as np

from taifuse import _array_ops as A
from taifuse import _autocast_state, _random, backends, pool
from taifuse._engine import Function
from taifuse._internal import backend, data, wrap
from taifuse._tensor_functions import autocast_args
from taifuse._tensor_math import sum_to_shape
from taifuse.tensor import Tensor

# ----------------------------------------------------------------------------- plumbing


def kernels(be: ModuleType) -> ModuleType:
    """The table holding ``be``'s backward and loss kernels (``BACKWARD_KERNEL_NAMES``): the
    backend's own, as for its forward kernels (the kernel-table test checks every backend's)."""
    return be


def _check_active(be: ModuleType, op: str) -> None:
    """Functional ops compute on the active backend: the tensors must live there."""
    active = backends.active()
    if active is not be:
        raise TypeError(
            f"{op}: the tensors live on backend {be.NAME!r} but the active backend is {active.NAME!r}; "
            "create them under the active backend (taifuse.tensor(t.numpy()))"
        )


def new_array(be: ModuleType, shape: tuple[int, ...], dtype: np.dtype) -> Any:
    # Intermediates and gradients come from the pool; see NOTE [ Buffer ownership ] in taifuse/pool.py.
    return pool.empty(be, tuple(shape), np.dtype(dtype))


def _tensor_arg(
    value: Any, op: str, argname: str, like: Tensor | None = None, like_name: str = "the input"
) -> Tensor:
    """A floating-point Tensor argument (a NumPy array becomes a constant Tensor), of the dtype of
    ``like`` (the argument ``like_name``) if given."""
    if isinstance(value, np.ndarray):
        be = backends.active() if like is None else backend(like)
        A.check_float_array(value.dtype, be, op, argname)
        # NOTE: not np.ascontiguousarray, which turns a 0-d array into shape (1,).
        value = wrap(be.from_numpy(np.asarray(value, order="C")), be)
    if not isinstance(value, Tensor):
        raise TypeError(f"{op}: {argname} should be a Tensor or numpy.ndarray, got {type(value).__name__}")
    if value.dtype.kind != "f":
        raise TypeError(f"{op}: {argname} should be floating-point, got dtype {value.dtype}")
    backend(value).check_dtype(value.dtype, f"{op}: {argname}")
    if like is not None and value.dtype != like.dtype:
        raise TypeError(f"{op}: {argname} has dtype {value.dtype} but {like_name} has dtype {like.dtype}")
    return value


def constants(op: str, names: tuple[str, ...], *values: Any) -> tuple[Any, ...]:
    """The NumPy arrays among a Tensor op's array arguments (``names``, in the order of its public
    signature) as constant Tensors, on the first argument's backend when it is a Tensor.

    This is the one place where they are brought to the backend, as Tensor arithmetic treats a
    NumPy operand, so that the forward and what it saves for the backward hold only backend
    arrays. On a device backend a NumPy argument would otherwise send the forward's result to the
    host and reach the backward kernels as host memory.
    """
    for v in values:
        if isinstance(v, np.ndarray):
            break
    else:
        return values  # the common case, Tensors (and None): nothing to bring over
    like = values[0] if isinstance(values[0], Tensor) else None
    return tuple(
        _tensor_arg(v, op, name, like=like) if isinstance(v, np.ndarray) else v
        for name, v in zip(names, values)
    )


def _no_out(op: str, out: Any) -> None:
    if out is not None:
        raise TypeError(f"{op}: out= is not supported with Tensor arguments")


class Op(Function):
    """A Function whose forward runs on the active backend (checked against the tensors')."""

    on_active_backend = True  # Function.apply checks it (NOTE [ The lean apply ])

    @classmethod
    def wrong_backend(cls, be: ModuleType, active: ModuleType) -> None:
        _check_active(be, cls.__name__.lstrip("_").lower())

    def needs_any(self) -> bool:
        return any(self.needs_grad)


# ----------------------------------------------------------------------------- elementwise


class _FromInput(Op):
    """Activations whose backward reads the forward input ``x``."""

    op = ""

    def forward(self, x: Any, *params: Any) -> Any:
        self.x, self.params = x, params
        if params:  # gelu's approximate, leaky_relu's slope: checked by the array op
            return getattr(A, self.op)(x, *params)
        return A.unary(self.op, self.be, x)

    def backward(self, g: Any) -> tuple[Any, ...]:
        gi = new_array(self.be, self.x.shape, self.x.dtype)
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


class _FromOutput(Op):
    """Activations whose backward reads the forward output ``y`` (sigmoid, tanh)."""

    op = ""

    def forward(self, x: Any) -> Any:
        self.y = A.unary(self.op, self.be, x)
        return self.y

    def backward(self, g: Any) -> tuple[Any, ...]:
        gi = new_array(self.be, self.y.shape, self.y.dtype)
        if self.y.size:
            getattr(kernels(self.be), self.op + "_backward")(self.y, g, gi)
        return (gi,)


class _Sigmoid(_FromOutput):
    op = "sigmoid"


class _Tanh(_FromOutput):
    op = "tanh"


def gelu(x: Tensor, approximate: str, out: Any) -> Tensor:
    _no_out("gelu", out)
    return _Gelu.apply(x, approximate)


def relu(x: Tensor, out: Any) -> Tensor:
    if out is not None:
        _no_out("relu", out)
    return _Relu.apply_one(x)


def leaky_relu(x: Tensor, negative_slope: float, out: Any) -> Tensor:
    _no_out("leaky_relu", out)
    return _LeakyRelu.apply(x, negative_slope)


def silu(x: Tensor, out: Any) -> Tensor:
    _no_out("silu", out)
    return _Silu.apply_one(x)


def sigmoid(x: Tensor, out: Any) -> Tensor:
    _no_out("sigmoid", out)
    return _Sigmoid.apply_one(x)


def tanh(x: Tensor, out: Any) -> Tensor:
    _no_out("tanh", out)
    return _Tanh.apply_one(x)


class _AddRelu(Op):
    def forward(self, a: Any, b: Any) -> Any:
        self.y = A.add_relu(a, b)
        self.shapes = (tuple(a.shape), tuple(b.shape))
        return self.y

    def backward(self, g: Any) -> tuple[Any, ...]:
        gi = new_array(self.be, self.y.shape, self.y.dtype)
        if self.y.size:
            kernels(self.be).add_relu_backward(self.y, g, gi)
        return tuple(sum_to_shape(self.m, gi, s) if n else None for s, n in zip(self.shapes, self.needs_grad))


class _MulRelu(Op):
    def forward(self, a: Any, b: Any) -> Any:
        out = A.mul_relu(a, b)  # validates, and broadcasts a copy for its own kernel
        self.shapes = (tuple(a.shape), tuple(b.shape))
        self.a = self.m.broadcast_to(a, tuple(out.shape))
        self.b = self.m.broadcast_to(b, tuple(out.shape))
        return out

    def backward(self, g: Any) -> tuple[Any, ...]:
        be, shape, dtype = self.be, tuple(self.a.shape), self.a.dtype
        ga = new_array(be, shape, dtype) if self.needs_grad[0] else None
        gb = new_array(be, shape, dtype) if self.needs_grad[1] else None
        if math.prod(shape):
            kernels(be).mul_relu_backward(self.a, self.b, g, ga, gb)
        return (
            None if ga is None else sum_to_shape(self.m, ga, self.shapes[0]),
            None if gb is None else sum_to_shape(self.m, gb, self.shapes[1]),
        )


def add_relu(a: Any, b: Any, out: Any) -> Tensor:
    a, b = autocast_args("widest", *constants("add_relu", ("a", "b"), a, b))
    _no_out("add_relu", out)
    return _AddRelu.apply(a, b)


def mul_relu(a: Any, b: Any, out: Any) -> Tensor:
    a, b = autocast_args("widest", *constants("mul_relu", ("a", "b"), a, b))
    _no_out("mul_relu", out)
    return _MulRelu.apply(a, b)


class _Affine(Op):
    def forward(self, x: Any, scale: Any, bias: Any) -> Any:
        out = A.affine(x, scale, bias)
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
        gx = new_array(be, x.shape, x.dtype) if self.needs_grad[0] else None
        gs = new_array(be, (features,), x.dtype) if self.needs_grad[1] else None
        gb = new_array(be, (features,), x.dtype) if self.needs_grad[2] else None
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


def affine(x: Any, scale: Any, bias: Any, out: Any) -> Tensor:
    x, scale, bias = autocast_args("widest", *constants("affine", ("x", "scale", "bias"), x, scale, bias))
    _no_out("affine", out)
    return _Affine.apply(x, scale, bias)


# ----------------------------------------------------------------------------- linear

_SPLIT_ACTIVATION = frozenset(("gelu", "gelu_tanh", "silu"))


class _Linear(Op):
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
    saved = ("x", "w", "pre")  # NOTE [ Released nodes ]

    def forward(self, x: Any, w: Any, b: Any, activation: str | None) -> Any:
        self.x, self.w, self.activation, self.has_bias = x, w, activation, b is not None
        if activation in _SPLIT_ACTIVATION and self.needs_any():
            out, self.pre = A.linear_keep_pre(x, w, b, activation)
            return out
        out = A.linear_arrays(self.be, x, w, b, activation)
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
        gx = new_array(be, x.shape, x.dtype) if self.needs_grad[0] else None
        gw = new_array(be, w.shape, w.dtype) if self.needs_grad[1] else None
        gb = new_array(be, (out_features,), w.dtype) if self.has_bias and self.needs_grad[2] else None
        pre = self.pre
        if x.ndim == 2:  # the kernel's (rows, features) already
            x2, g2, gx2 = x, g, gx
        else:
            x2, g2 = x.reshape(rows, in_features), g.reshape(rows, out_features)
            pre = None if pre is None else pre.reshape(rows, out_features)
            gx2 = None if gx is None else gx.reshape(rows, in_features)
        # grad_pre None: the kernel takes scratch where it needs it (none on numba's float16 path)
        kernels(be).linear_act_backward(x2, w, pre, g2, self.activation, None, gx2, gw, gb)
        return gx, gw, gb, None


def linear(x: Any, weight: Any, bias: Any, activation: str | None, out: Any) -> Tensor:
    x, weight, bias = autocast_args("lower", *constants("linear", ("x", "weight", "bias"), x, weight, bias))
    _no_out("linear", out)
    A.check_activation(activation)
    return _Linear.apply(x, weight, bias, activation)


# ----------------------------------------------------------------------------- row reductions


class _SoftmaxLike(Op):
    op = ""

    def forward(self, x: Any, dim: int) -> Any:
        self.y = getattr(A, self.op)(x, dim)
        self.view = A.softmax_view(tuple(x.shape), dim)
        return self.y

    def backward(self, g: Any) -> tuple[Any, ...]:
        gi = new_array(self.be, self.y.shape, self.y.dtype)
        if self.y.size:
            getattr(kernels(self.be), self.op + "_backward")(
                self.y.reshape(self.view), g.reshape(self.view), gi.reshape(self.view)
            )
        return gi, None


class _Softmax(_SoftmaxLike):
    op = "softmax"


class _LogSoftmax(_SoftmaxLike):
    op = "log_softmax"


def softmax(x: Tensor, dim: int, out: Any) -> Tensor:
    _no_out("softmax", out)
    (x,) = autocast_args("float32", x)
    return _Softmax.apply(x, dim)


def log_softmax(x: Tensor, dim: int, out: Any) -> Tensor:
    _no_out("log_softmax", out)
    (x,) = autocast_args("float32", x)
    return _LogSoftmax.apply(x, dim)


class _LayerNorm(Op):
    def forward(self, x: Any, weight: Any, bias: Any, norm_shape: tuple[int, ...], eps: float) -> Any:
        features = math.prod(norm_shape)
        rows = x.size // features if features else 0
        self.x2 = x.reshape(rows, features)
        self.w = None if weight is None else weight.reshape(features)
        self.has_bias = bias is not None
        self.param_shape = norm_shape
        out = new_array(self.be, x.shape, x.dtype)
        self.mean, self.rstd = A.layer_norm_rows(self.be, x, weight, bias, norm_shape, eps, out)
        return out

    def backward(self, g: Any) -> tuple[Any, ...]:
        be, x2 = self.be, self.x2
        rows, features = x2.shape
        gx = new_array(be, x2.shape, x2.dtype) if self.needs_grad[0] else None
        gw = new_array(be, (features,), x2.dtype) if self.w is not None and self.needs_grad[1] else None
        gb = new_array(be, (features,), x2.dtype) if self.has_bias and self.needs_grad[2] else None
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


def layer_norm(x: Any, normalized_shape: Any, weight: Any, bias: Any, eps: float, out: Any) -> Tensor:
    x, weight, bias = autocast_args(
        "float32", *constants("layer_norm", ("x", "weight", "bias"), x, weight, bias)
    )
    _no_out("layer_norm", out)
    norm_shape, eps = A.layer_norm_args(normalized_shape, eps)
    x = _tensor_arg(x, "layer_norm", "x")
    A.check_layer_norm_input(x.shape, norm_shape)
    params = []
    for argname, value in (("weight", weight), ("bias", bias)):
        if value is not None:
            value = _tensor_arg(value, "layer_norm", argname, like=x)
            A.check_layer_norm_param(argname, value.shape, norm_shape)
        params.append(value)
    return _LayerNorm.apply(x, params[0], params[1], norm_shape, eps)


class _RmsNorm(Op):
    def forward(self, x: Any, weight: Any, norm_shape: tuple[int, ...], eps: float) -> Any:
        features = math.prod(norm_shape)
        rows = x.size // features if features else 0
        self.x2 = x.reshape(rows, features)
        self.w = None if weight is None else weight.reshape(features)
        self.param_shape = norm_shape
        out = new_array(self.be, x.shape, x.dtype)
        self.rstd = A.rms_norm_rows(self.be, x, weight, norm_shape, eps, out)
        return out

    def backward(self, g: Any) -> tuple[Any, ...]:
        be, x2 = self.be, self.x2
        rows, features = x2.shape
        gx = new_array(be, x2.shape, x2.dtype) if self.needs_grad[0] else None
        gw = new_array(be, (features,), x2.dtype) if self.w is not None and self.needs_grad[1] else None
        if rows and features:
            kernels(be).rms_norm_backward(x2, self.w, self.rstd, g.reshape(rows, features), gx, gw)
        else:
            gw = None if gw is None else self.m.full((features,), 0.0, x2.dtype)
        return (
            None if gx is None else gx.reshape(g.shape),
            None if gw is None else gw.reshape(self.param_shape),
            None,
            None,
        )


def rms_norm(input: Any, normalized_shape: Any, weight: Any, eps: float | None, out: Any) -> Tensor:
    x, weight = autocast_args("float32", *constants("rms_norm", ("input", "weight"), input, weight))
    _no_out("rms_norm", out)
    norm_shape, eps = A.rms_norm_args(normalized_shape, eps)
    x = _tensor_arg(x, "rms_norm", "input")
    A.check_layer_norm_input(x.shape, norm_shape, "rms_norm", "input")
    if weight is not None:
        weight = _tensor_arg(weight, "rms_norm", "weight", like=x)
        A.check_layer_norm_param("weight", weight.shape, norm_shape, "rms_norm")
    return _RmsNorm.apply(x, weight, norm_shape, A.rms_norm_eps(eps, x.dtype))


# ----------------------------------------------------------------------------- embedding


class _Embedding(Op):
    def forward(self, weight: Any, indices: Any, shape: tuple[int, ...], padding_idx: int) -> Any:
        self.indices, self.padding_idx = indices, padding_idx
        self.wshape, self.wdtype = tuple(weight.shape), weight.dtype
        return A.embedding_forward(self.be, indices, weight).reshape(shape + (weight.shape[1],))

    def backward(self, g: Any) -> tuple[Any, ...]:
        gw = new_array(self.be, self.wshape, self.wdtype)
        if gw.size:  # NOTE: with no indices the kernel still writes gw: all zeros
            kernels(self.be).embedding_backward(
                self.indices, g.reshape(self.indices.size, self.wshape[1]), gw, self.padding_idx
            )
        return gw, None, None, None


def _embedding_indices(input: Any, num_embeddings: int, be: ModuleType) -> tuple[Any, tuple[int, ...]]:
    """embedding's ``input`` (a Tensor, or what the array path takes), checked, on ``be``."""
    if isinstance(input, Tensor):
        if input.requires_grad:
            raise TypeError("embedding: input (the indices) cannot require grad")
        if backend(input) is not be:
            raise TypeError(f"embedding: input lives on backend {input.backend!r}, weight on {be.NAME!r}")
        input = data(input)
    indices, shape, _ = A.embedding_indices(input, num_embeddings, be)
    return indices, shape


def embedding(
    input: Any,
    weight: Any,
    padding_idx: int | None,
    max_norm: float | None,
    norm_type: float,
    scale_grad_by_freq: bool,
    sparse: bool,
) -> Any:
    """A lookup of rows of ``weight``; see ``taifuse.functional.embedding``.

    NumPy weight with a Tensor input gives a NumPy result, as a NumPy weight always does."""
    A.check_embedding_options(max_norm, norm_type, scale_grad_by_freq, sparse)
    host = not isinstance(weight, Tensor)
    w = _tensor_arg(weight, "embedding", "weight")
    A.check_embedding_weight(w.shape)
    pad = A.embedding_padding_idx(padding_idx, w.shape[0])
    indices, shape = _embedding_indices(input, w.shape[0], backend(w))
    out = _Embedding.apply(w, indices, shape, pad)
    return out.numpy() if host else out


# ----------------------------------------------------------------------------- dropout


class _Dropout(Op):
    def forward(self, x: Any, p: float) -> Any:
        self.p, self.seed = p, _random.next_seed()
        out = new_array(self.be, x.shape, x.dtype)
        if x.size:
            self.be.dropout(x, out, p, self.seed)
        return out

    def backward(self, g: Any) -> tuple[Any, ...]:
        gi = new_array(self.be, g.shape, g.dtype)
        if g.size:
            kernels(self.be).dropout_backward(g, gi, self.p, self.seed)
        return gi, None


def dropout(x: Any, p: float, training: bool, out: Any) -> Tensor:
    _no_out("dropout", out)
    p = A.dropout_p(p)
    x = _tensor_arg(x, "dropout", "x")
    if not training or p == 0.0:
        return x
    return _Dropout.apply(x, p)


# ----------------------------------------------------------------------------- attention


def _contiguous(m: Any, a: Any) -> Any:
    """``a``, or a contiguous copy of a strided host view of it (NOTE [ Views ])."""
    return m.contiguous(a) if isinstance(a, np.ndarray) and not a.flags.c_contiguous else a


def _attention_views(be: ModuleType, arrays: tuple, batch: tuple) -> bool:
    """Whether ``be``'s attention kernels take these arrays as they are: (B, H, n, d) host views
    of any row strides, as c_attn's split gives them (NOTE [ Numba attention views ] in
    backends/numba/attention.py), with no broadcast between them."""
    if not getattr(be, "ATTENTION_VIEWS", False) or len(batch) != 2:
        return False
    for a in arrays:
        if tuple(a.shape[:-2]) != batch or (a.shape[-1] > 1 and a.strides[-1] != a.itemsize):
            return False
    return True


class _Attention(Op):
    """``scaled_dot_product_attention``: keeps the inputs, the output and one log-sum-exp per
    query row; the backward kernel recomputes the probabilities from them.

    With ``views`` (a backend whose kernels take (B, H, n, d) views, ``ATTENTION_VIEWS``, and 4-D
    inputs of one batch shape: ``_attention_views``) the inputs and the output's gradient go to
    the kernels as they are, strided or not, and the output and the gradients are made in (B, n,
    H, d) layout: the output is returned so (the caller transposes it back as a view), the
    gradients as (B, H, n, d) views of it. So ``CausalSelfAttention``'s split of c_attn's output,
    its heads' merge and their backwards copy nothing (NOTE [ Numba attention views ]), as with
    PyTorch's CPU flash attention, whose output has these strides. Elsewhere views are copied,
    as for every other op."""

    owns_grads = True  # gq, gk and gv are new arrays (or sums of them), one per input
    strided = True  # views are copied here where the kernels need it (_attention_views)

    def forward(
        self,
        q: Any,
        k: Any,
        v: Any,
        mask: Any,
        batch: tuple,
        causal: bool,
        scale: float,
        p: float,
        views: bool,
    ) -> Any:
        be = self.be
        self.shapes = (tuple(q.shape), tuple(k.shape), tuple(v.shape))
        self.batch, self.views = batch, views
        if views:
            self.q, self.k, self.v = q, k, v
        else:
            q, k, v = (_contiguous(self.m, a) for a in (q, k, v))
            self.q, self.k, self.v = (A.attention_broadcast(be, a, batch) for a in (q, k, v))
        self.mask, self.causal, self.scale, self.p = mask, causal, scale, p
        self.out, self.lse, self.seed = A.attention_forward(
            be, self.q, self.k, self.v, mask, causal, scale, p, heads_last=views
        )
        return self.out if views else self.out.reshape(batch + (q.shape[-2], v.shape[-1]))

    def backward(self, g: Any) -> tuple[Any, ...]:
        be, q, k, v = self.be, self.q, self.k, self.v
        if self.views:  # g is (B, L, H, Ev), as the output
            if not _attention_views(be, (g.transpose(0, 2, 1, 3),), self.batch):
                g = _contiguous(self.m, g)
            g = g.transpose(0, 2, 1, 3)
            grads = [
                new_array(be, (a.shape[0], a.shape[2], a.shape[1], a.shape[3]), a.dtype).transpose(0, 2, 1, 3)
                if need
                else None
                for a, need in zip((q, k, v), self.needs_grad)
            ]
        else:
            g = _contiguous(self.m, g).reshape(self.out.shape)
            grads = [
                new_array(be, a.shape, a.dtype) if need else None
                for a, need in zip((q, k, v), self.needs_grad)
            ]
        if q.shape[-2] * k.shape[-2] * v.shape[-1] * math.prod(q.shape[:-2]):
            kernels(be).attention_backward(
                q,
                k,
                v,
                self.mask,
                self.causal,
                self.scale,
                self.p,
                self.seed,
                self.out,
                self.lse,
                g,
                *grads,
            )
        else:  # an empty product: every gradient is an empty or zero sum
            grads = [None if gr is None else self.m.full(tuple(gr.shape), 0.0, gr.dtype) for gr in grads]
        result = []
        for gr, shape in zip(grads, self.shapes):
            if gr is not None:
                gr = sum_to_shape(self.m, gr.reshape(self.batch + tuple(gr.shape[-2:])), shape)
            result.append(gr)
        return (*result, None, None, None, None, None, None)


def scaled_dot_product_attention(
    query: Any, key: Any, value: Any, attn_mask: Any, dropout_p: float, is_causal: bool, scale: float | None
) -> Tensor:
    """Attention on Tensors; see ``taifuse.functional.scaled_dot_product_attention``. The mask
    (a NumPy array or a Tensor) is a constant: it gets no gradient."""
    op = "scaled_dot_product_attention"
    q = _tensor_arg(query, op, "query")
    k, v = _tensor_arg(key, op, "key"), _tensor_arg(value, op, "value")
    if (
        isinstance(attn_mask, np.ndarray)
        and attn_mask.dtype.kind == "f"
        and _autocast_state.is_autocast_enabled()
    ):
        attn_mask = _tensor_arg(attn_mask, op, "attn_mask")  # a float mask is cast with the rest
    q, k, v, attn_mask = autocast_args("lower", q, k, v, attn_mask)
    k = _tensor_arg(k, op, "key", like=q, like_name="query")
    v = _tensor_arg(v, op, "value", like=q, like_name="query")
    batch, L, S, E, _ = A.attention_shapes(q.shape, k.shape, v.shape)
    p, causal, scale = A.attention_options(dropout_p, is_causal, scale, attn_mask is not None, E)
    if isinstance(attn_mask, Tensor):
        attn_mask = data(attn_mask)
    mask = A.attention_mask(backend(q), attn_mask, q.dtype, batch, L, S)
    views = _attention_views(backend(q), (data(q), data(k), data(v)), batch)
    out = _Attention.apply(q, k, v, mask, batch, causal, scale, p, views)
    return out.transpose(1, 2) if views else out  # (B, L, H, Ev) made: a view as (B, H, L, Ev)


# ----------------------------------------------------------------------------- losses


class _MseLoss(Op):
    def forward(self, x: Any, t: Any, reduction: str) -> Any:
        self.x, self.t, self.reduction = x, t, reduction
        out = A.mse_loss_forward(self.be, x, t, reduction)
        return out if reduction == "none" else out.reshape(())

    def backward(self, g: Any) -> tuple[Any, ...]:
        gi = new_array(self.be, self.x.shape, self.x.dtype)
        if self.x.size:
            g = g if self.reduction == "none" else g.reshape(1)
            kernels(self.be).mse_loss_backward(self.x, self.t, g, gi, self.reduction)
        gt = self.m.neg(gi) if self.needs_grad[1] else None
        return (gi if self.needs_grad[0] else None), gt, None


def mse_loss(input: Any, target: Any, reduction: str) -> Tensor:
    """Mean squared error; see ``taifuse.functional.mse_loss``."""
    reduction = A.check_reduction(reduction, "mse_loss")
    x, t = autocast_args("float32", _tensor_arg(input, "mse_loss", "input"), target)
    t = _tensor_arg(t, "mse_loss", "target", like=x)
    if x.shape != t.shape:
        raise ValueError(f"mse_loss: input {x.shape} and target {t.shape} should have the same shape")
    return _MseLoss.apply(x, t, reduction)


class _CrossEntropy(Op):
    def forward(self, logits: Any, target: Any, reduction: str) -> Any:
        self.vector = logits.ndim == 1
        rows, classes = (1, logits.shape[0]) if self.vector else logits.shape
        self.logits = logits.reshape(rows, classes)
        self.target = target.reshape(rows)
        self.reduction = reduction
        out, self.lse = A.cross_entropy_forward(self.be, self.logits, self.target, reduction)
        return out.reshape(()) if reduction != "none" or self.vector else out

    def backward(self, g: Any) -> tuple[Any, ...]:
        gi = new_array(self.be, self.logits.shape, self.logits.dtype)
        if self.logits.shape[0]:
            g = g.reshape(self.logits.shape[0]) if self.reduction == "none" else g.reshape(1)
            kernels(self.be).cross_entropy_backward(self.logits, self.target, self.lse, g, gi, self.reduction)
        return (gi.reshape(self.logits.shape[1]) if self.vector else gi), None, None


def _class_indices(target: Any, rows: int | None, classes: int, be: ModuleType) -> Any:
    if isinstance(target, Tensor):
        if backend(target) is not be:
            raise TypeError(
                f"cross_entropy: target lives on backend {target.backend!r}, logits on {be.NAME!r}"
            )
        if not isinstance(data(target), np.ndarray):
            # A device-resident target is used as is: a host range check would copy it back every
            # step (NOTE [ Class indices on the device ] in backends/taichi/backward.py).
            A.check_class_indices(target.dtype, target.shape, rows)
            return data(target)
        host = data(target)  # the array itself, not Tensor.numpy(): no value leaves a compiled step
    else:
        host = np.asarray(target)
    return A.class_indices(host, rows, classes, be)


def cross_entropy(logits: Any, target: Any, reduction: str) -> Any:
    """Cross entropy from logits and class indices; see ``taifuse.functional.cross_entropy``.

    NumPy logits with a Tensor target give a NumPy loss, as NumPy logits always do."""
    reduction = A.check_reduction(reduction, "cross_entropy")
    host = not isinstance(logits, Tensor)
    (x,) = autocast_args("float32", _tensor_arg(logits, "cross_entropy", "logits"))
    if x.ndim not in (1, 2):
        raise ValueError(f"cross_entropy: logits should be (N, C) or (C,), got shape {x.shape}")
    rows = None if x.ndim == 1 else x.shape[0]
    t = _class_indices(target, rows, x.shape[-1], backend(x))
    out = _CrossEntropy.apply(x, t, reduction)
    return out.numpy() if host else out
