"""Neural-network ops on NumPy arrays (and the active backend's arrays), PyTorch-style.

Every op validates its arguments (a ``TypeError``/``ValueError`` that names the argument, raised
before anything is written), moves NumPy inputs to the active backend once, allocates the result,
runs one kernel and hands the result back as the type it was given: NumPy in, NumPy out; a backend
array (``taifuse.backends.taichi.DeviceArray``) in, a backend array out.

``out=`` takes a C-contiguous, writable array of the result's shape and dtype. It may be the input
itself for an in-place update (``F.relu(x, out=x)``: ``x`` of every op but ``linear``, ``a`` and
``b`` of ``add_relu`` and ``mul_relu``); sharing memory with an input in any other way, such as
``linear``'s bias or a shifted view of ``x``, is a ``ValueError`` naming that input
(NOTE [ out= overlap ] in ``taifuse/_array_ops.py``).

Example::

    >>> import numpy as np
    >>> import taifuse.functional as F
    >>> F.relu(np.array([-1.0, 2.0], dtype=np.float32))
    array([0., 2.], dtype=float32)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from taifuse import _array_ops, _autograd_ops, _batch_norm_ops, _conv_bn_ops, _conv_ops
from taifuse.backends import _spec
from taifuse.tensor import Tensor, tensors_in

__all__ = [
    "adaptive_avg_pool2d",
    "add_relu",
    "affine",
    "avg_pool2d",
    "batch_norm",
    "conv1d",
    "conv2d",
    "conv2d_batch_norm",
    "cross_entropy",
    "dropout",
    "embedding",
    "gelu",
    "layer_norm",
    "leaky_relu",
    "linear",
    "log_softmax",
    "max_pool2d",
    "mse_loss",
    "mul_relu",
    "relu",
    "rms_norm",
    "scaled_dot_product_attention",
    "sigmoid",
    "silu",
    "softmax",
    "tanh",
]

# linear's activations (the spec's tuple itself; nn.Linear checks its argument against it).
ACTIVATIONS = _spec.ACTIVATIONS

# Each op sends Tensor arguments (any of its array arguments a Tensor) to its differentiable
# version in taifuse._autograd_ops, and anything else to the array path, taifuse._array_ops.


# ----------------------------------------------------------------------------- elementwise


def gelu(x: Any, approximate: str = "none", *, out: Any = None) -> Any:
    """Gaussian error linear unit, as ``torch.nn.functional.gelu``.

    ``approximate='none'``: x * Phi(x) = 0.5 * x * (1 + erf(x / sqrt(2))).
    ``approximate='tanh'``: 0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x**3))).

    Example::

        >>> import numpy as np, taifuse.functional as F
        >>> F.gelu(np.array([0.0, 1.0], dtype=np.float32)).round(4)
        array([0.    , 0.8413], dtype=float32)
    """
    if isinstance(x, Tensor):
        return _autograd_ops.gelu(x, approximate, out)
    return _array_ops.gelu(x, approximate, out)


def relu(x: Any, *, out: Any = None) -> Any:
    """max(x, 0) elementwise."""
    if isinstance(x, Tensor):
        return _autograd_ops.relu(x, out)
    return _array_ops.relu(x, out)


def leaky_relu(x: Any, negative_slope: float = 0.01, *, out: Any = None) -> Any:
    """x if x > 0 else negative_slope * x."""
    if isinstance(x, Tensor):
        return _autograd_ops.leaky_relu(x, negative_slope, out)
    return _array_ops.leaky_relu(x, negative_slope, out)


def silu(x: Any, *, out: Any = None) -> Any:
    """x * sigmoid(x) (also called swish)."""
    if isinstance(x, Tensor):
        return _autograd_ops.silu(x, out)
    return _array_ops.silu(x, out)


def sigmoid(x: Any, *, out: Any = None) -> Any:
    """1 / (1 + exp(-x)), without overflow for large |x|."""
    if isinstance(x, Tensor):
        return _autograd_ops.sigmoid(x, out)
    return _array_ops.sigmoid(x, out)


def tanh(x: Any, *, out: Any = None) -> Any:
    """Hyperbolic tangent elementwise."""
    if isinstance(x, Tensor):
        return _autograd_ops.tanh(x, out)
    return _array_ops.tanh(x, out)


def add_relu(a: Any, b: Any, *, out: Any = None) -> Any:
    """relu(a + b) in one pass (a and b broadcast as in NumPy)."""
    if tensors_in((a, b)):
        return _autograd_ops.add_relu(a, b, out)
    return _array_ops.add_relu(a, b, out)


def mul_relu(a: Any, b: Any, *, out: Any = None) -> Any:
    """relu(a * b) in one pass (a and b broadcast as in NumPy)."""
    if tensors_in((a, b)):
        return _autograd_ops.mul_relu(a, b, out)
    return _array_ops.mul_relu(a, b, out)


def affine(x: Any, scale: Any, bias: Any, *, out: Any = None) -> Any:
    """x * scale + bias with per-feature ``scale`` and ``bias`` over the last axis.

    ``scale`` and ``bias`` are arrays of shape ``(C,)`` with ``C = x.shape[-1]``, or Python numbers.

    Example::

        >>> import numpy as np, taifuse.functional as F
        >>> F.affine(np.ones((2, 3), np.float32), np.array([1, 2, 3], np.float32), 0.5)
        array([[1.5, 2.5, 3.5],
               [1.5, 2.5, 3.5]], dtype=float32)
    """
    if tensors_in((x, scale, bias)):
        return _autograd_ops.affine(x, scale, bias, out)
    return _array_ops.affine(x, scale, bias, out)


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
    if tensors_in((x, weight, bias)):
        return _autograd_ops.linear(x, weight, bias, activation, out)
    return _array_ops.linear(x, weight, bias, activation, out)


# ----------------------------------------------------------------------------- convolution and pooling
# The geometry rules, array path and autograd Functions: taifuse/_conv_ops.py; the kernels'
# arguments: NOTE [ Convolution kernel arguments ] in backends/reference/conv.py.


def conv2d(
    input: Any,
    weight: Any,
    bias: Any = None,
    stride: int | tuple[int, int] = 1,
    padding: int | tuple[int, int] | str = 0,
    dilation: int | tuple[int, int] = 1,
    groups: int = 1,
    activation: str | None = None,
) -> Any:
    """2-D convolution (cross-correlation) over NCHW input, as ``torch.nn.functional.conv2d``, with
    ``F.linear``'s fused bias and activation epilogue.

    out[n, o, y, x] = activation(b[o] + sum_{c, i, j} weight[o, c, i, j] *
    input[n, g * C/groups + c, y * stride - pad + i * dilation, x * stride - pad + j * dilation])
    for ``input (N, C, H, W)`` (4-D only: add the batch dimension of one image with ``x[None]``),
    ``weight (out_channels, C / groups, kH, kW)``, ``bias (out_channels,)`` or None, and ``g`` the
    group of output channel ``o``. ``padding``: an int, a pair, ``'valid'`` (none) or ``'same'``
    (stride 1; an odd total puts the extra row and column at the end, as PyTorch). ``groups``
    splits the channels (``groups == C`` is a depthwise convolution). ``activation``: None,
    'relu', 'gelu', 'gelu_tanh' or 'silu', applied in the same pass that adds the bias. Under
    autocast the input, weight and bias are cast to the lower precision, as PyTorch's CUDA autocast
    casts ``conv2d``.

    Example::

        >>> import numpy as np, taifuse.functional as F
        >>> x = np.arange(9, dtype=np.float32).reshape(1, 1, 3, 3)
        >>> F.conv2d(x, np.ones((1, 1, 2, 2), np.float32))
        array([[[[ 8., 12.],
                 [20., 24.]]]], dtype=float32)
    """
    if tensors_in((input, weight, bias)):
        return _conv_ops.conv2d_tensor(input, weight, bias, stride, padding, dilation, groups, activation)
    return _conv_ops.conv2d(input, weight, bias, stride, padding, dilation, groups, activation)


def conv2d_batch_norm(
    input: Any,
    weight: Any,
    bias: Any = None,
    running_mean: Any = None,
    running_var: Any = None,
    bn_weight: Any = None,
    bn_bias: Any = None,
    stride: int | tuple[int, int] = 1,
    padding: int | tuple[int, int] | str = 0,
    dilation: int | tuple[int, int] = 1,
    groups: int = 1,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
    activation: str | None = None,
) -> Any:
    """The Conv2d -> BatchNorm -> ReLU block as one op (a taifuse extension; PyTorch composes it):
    ``batch_norm(conv2d(input, weight, bias, stride, padding, dilation, groups), running_mean,
    running_var, bn_weight, bn_bias, training, momentum, eps, activation=activation)``.

    The arguments are :func:`conv2d`'s and :func:`batch_norm`'s (batch norm's ``weight`` and
    ``bias`` are ``bn_weight`` and ``bn_bias``); ``activation`` None or ``'relu'``. In training the
    block reads and writes the activation fewer times than the three ops (the convolution
    accumulates its output's statistics as it stores it; one pass normalizes, applies the affine
    map and the ReLU; the backward forms the convolution's gradient in the pass that computes
    batch norm's: docs/cnn.md), and the running statistics are updated in place. The gradient of
    the convolution's ``bias`` is exactly 0 in training (batch norm subtracts the batch mean), so
    a block usually has none (``nn.Conv2d(..., bias=False)``). In evaluation it runs the
    convolution, then one normalize-ReLU pass; ``nn.utils.fuse_conv_bn_eval`` folds it into one
    convolution. ``nn.ConvBnReLU2d`` is the module.

    Example::

        >>> import numpy as np, taifuse.functional as F
        >>> x = np.arange(18, dtype=np.float32).reshape(2, 1, 3, 3)
        >>> rm, rv = np.zeros(1, np.float32), np.ones(1, np.float32)
        >>> y = F.conv2d_batch_norm(x, np.ones((1, 1, 2, 2), np.float32), None, rm, rv, training=True,
        ...                         activation="relu")
        >>> y.shape, float(y.min()), rm  # the running mean moved by 0.1 of the batch mean, 34
        ((2, 1, 2, 2), 0.0, array([3.4], dtype=float32))
    """
    args = (input, weight, bias, running_mean, running_var, bn_weight, bn_bias, stride, padding, dilation,
            groups, training, momentum, eps, activation)  # fmt: skip
    if tensors_in((input, weight, bias, running_mean, running_var, bn_weight, bn_bias)):
        return _conv_bn_ops.conv2d_batch_norm_tensor(*args)
    return _conv_bn_ops.conv2d_batch_norm(*args)


def conv1d(
    input: Any,
    weight: Any,
    bias: Any = None,
    stride: int | tuple[int] = 1,
    padding: int | tuple[int] | str = 0,
    dilation: int | tuple[int] = 1,
    groups: int = 1,
    activation: str | None = None,
) -> Any:
    """1-D convolution over ``input (N, C, L)`` with ``weight (out_channels, C / groups, k)``, as
    ``torch.nn.functional.conv1d``: :func:`conv2d` on a height of 1, with the same arguments.

    Example::

        >>> import numpy as np, taifuse.functional as F
        >>> F.conv1d(np.arange(4, dtype=np.float32).reshape(1, 1, 4), np.ones((1, 1, 2), np.float32))
        array([[[1., 3., 5.]]], dtype=float32)
    """

    def as_2d(a: Any, argname: str) -> Any:
        if getattr(a, "ndim", None) != 3:
            shape = getattr(a, "shape", None)
            raise ValueError(
                f"conv1d: {argname} should be 3-D, got shape {None if shape is None else tuple(shape)}"
            )
        return a.reshape(tuple(a.shape[:2]) + (1, a.shape[2]))

    def pair(v: Any, name: str, fill: int) -> Any:
        if isinstance(v, str):
            return v
        items = v if isinstance(v, (tuple, list)) else (v,)
        if len(items) != 1:
            raise TypeError(f"conv1d: {name} should be an int or a tuple of one int, got {v!r}")
        return (fill, items[0])

    x4, w4 = as_2d(input, "input"), as_2d(weight, "weight")
    y = conv2d(x4, w4, bias, pair(stride, "stride", 1), pair(padding, "padding", 0),
               pair(dilation, "dilation", 1), groups, activation)  # fmt: skip
    return y.reshape((y.shape[0], y.shape[1], y.shape[3]))


def max_pool2d(
    input: Any,
    kernel_size: int | tuple[int, int],
    stride: int | tuple[int, int] | None = None,
    padding: int | tuple[int, int] = 0,
    dilation: int | tuple[int, int] = 1,
    ceil_mode: bool = False,
    return_indices: bool = False,
) -> Any:
    """2-D max pooling over ``(N, C, H, W)`` or ``(C, H, W)``, as ``torch.nn.functional.max_pool2d``.

    out[n, c, y, x] = the maximum of input[n, c] over the window of ``kernel_size`` taps spaced
    ``dilation`` apart, starting at (y * stride - padding, x * stride - padding); padded taps are
    ignored (``padding`` at most half the kernel). ``stride`` defaults to ``kernel_size``;
    ``ceil_mode`` keeps a last partial window that starts inside the input. With
    ``return_indices`` also the flat index ``h * W + w`` of each maximum (int64; int32 on taichi).
    The first maximum of a window wins, and a NaN wins over any number, as in PyTorch.

    Example::

        >>> import numpy as np, taifuse.functional as F
        >>> F.max_pool2d(np.arange(16, dtype=np.float32).reshape(1, 1, 4, 4), 2)
        array([[[[ 5.,  7.],
                 [13., 15.]]]], dtype=float32)
    """
    if isinstance(input, Tensor):
        return _conv_ops.max_pool2d_tensor(
            input, kernel_size, stride, padding, dilation, ceil_mode, return_indices
        )
    return _conv_ops.max_pool2d(input, kernel_size, stride, padding, dilation, ceil_mode, return_indices)


def avg_pool2d(
    input: Any,
    kernel_size: int | tuple[int, int],
    stride: int | tuple[int, int] | None = None,
    padding: int | tuple[int, int] = 0,
    ceil_mode: bool = False,
    count_include_pad: bool = True,
    divisor_override: int | None = None,
) -> Any:
    """2-D average pooling, as ``torch.nn.functional.avg_pool2d``: the sum over each window divided
    by its size, counting the zero padding (``count_include_pad``, as PyTorch clips the window to
    the padded input) or not, or by ``divisor_override``.

    Example::

        >>> import numpy as np, taifuse.functional as F
        >>> F.avg_pool2d(np.arange(16, dtype=np.float32).reshape(1, 1, 4, 4), 2)
        array([[[[ 2.5,  4.5],
                 [10.5, 12.5]]]], dtype=float32)
    """
    if isinstance(input, Tensor):
        return _conv_ops.avg_pool2d_tensor(
            input, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override
        )
    return _conv_ops.avg_pool2d(
        input, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override
    )


def adaptive_avg_pool2d(input: Any, output_size: int | tuple[int | None, int | None]) -> Any:
    """Average pooling to a fixed ``output_size``, as ``torch.nn.functional.adaptive_avg_pool2d``:
    output row ``y`` averages input rows ``floor(y * H / OH)`` to ``ceil((y + 1) * H / OH) - 1``
    (columns alike); a None size keeps the input's.

    Example::

        >>> import numpy as np, taifuse.functional as F
        >>> F.adaptive_avg_pool2d(np.arange(16, dtype=np.float32).reshape(1, 1, 4, 4), 1)
        array([[[[7.5]]]], dtype=float32)
    """
    if isinstance(input, Tensor):
        return _conv_ops.adaptive_avg_pool2d_tensor(input, output_size)
    return _conv_ops.adaptive_avg_pool2d(input, output_size)


# ----------------------------------------------------------------------------- row reductions


def softmax(x: Any, dim: int = -1, *, out: Any = None) -> Any:
    """exp(x) / sum(exp(x)) along ``dim``, computed stably (max subtracted first).

    Example::

        >>> import numpy as np, taifuse.functional as F
        >>> F.softmax(np.zeros((1, 4), np.float32))
        array([[0.25, 0.25, 0.25, 0.25]], dtype=float32)
    """
    if isinstance(x, Tensor):
        return _autograd_ops.softmax(x, dim, out)
    return _array_ops.softmax(x, dim, out)


def log_softmax(x: Any, dim: int = -1, *, out: Any = None) -> Any:
    """x - logsumexp(x) along ``dim``, computed stably."""
    if isinstance(x, Tensor):
        return _autograd_ops.log_softmax(x, dim, out)
    return _array_ops.log_softmax(x, dim, out)


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
    """Batch normalization over the channel dimension of ``input (N, C, *)``, as ``torch.nn.functional.batch_norm``.

    y = act((x - mean[c]) / sqrt(var[c] + eps) * weight[c] + bias[c]). In training (``training=True``)
    mean and var are the batch's, over every axis but 1 (the biased variance, computed in one pass),
    and ``running_mean``/``running_var`` (if given) are updated in place:
    ``running = (1 - momentum) * running + momentum * batch``, with the unbiased variance for
    ``running_var``. In evaluation the running statistics are used. ``activation=None|'relu'``
    fuses a ReLU into the normalize pass (and its mask into the backward). float16 input may come
    with float32 parameters and running statistics (PyTorch's mixed batch norm; under autocast
    batch norm is not cast, as in PyTorch: docs/batch_norm.md).

    Example::

        >>> import numpy as np
        >>> import taifuse.functional as F
        >>> x = np.array([[1.0, 10.0], [3.0, 30.0]], np.float32)
        >>> rm, rv = np.zeros(2, np.float32), np.ones(2, np.float32)
        >>> F.batch_norm(x, rm, rv, training=True, eps=0.0)
        array([[-1., -1.],
               [ 1.,  1.]], dtype=float32)
        >>> rm, rv  # 0.9 * running + 0.1 * batch (unbiased variances 2 and 200)
        (array([0.2, 2. ], dtype=float32), array([ 1.1, 20.9], dtype=float32))
    """
    if tensors_in((input, running_mean, running_var, weight, bias)):
        return _batch_norm_ops.batch_norm_tensors(
            input, running_mean, running_var, weight, bias, training, momentum, eps, activation
        )
    return _batch_norm_ops.batch_norm(
        input, running_mean, running_var, weight, bias, training, momentum, eps, activation
    )


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
    if tensors_in((x, weight, bias)):
        return _autograd_ops.layer_norm(x, normalized_shape, weight, bias, eps, out)
    return _array_ops.layer_norm(x, normalized_shape, weight, bias, eps, out)


def rms_norm(
    input: Any,
    normalized_shape: int | Sequence[int],
    weight: Any = None,
    eps: float | None = None,
    *,
    out: Any = None,
) -> Any:
    """Root-mean-square normalization over the trailing ``normalized_shape`` dimensions, as
    ``torch.nn.functional.rms_norm``.

    y = x / sqrt(mean(x^2) + eps) * weight, the mean over the last ``len(normalized_shape)`` axes
    (no centring and no bias, unlike ``layer_norm``). ``eps=None`` is the machine epsilon of the
    compute dtype (``np.finfo(np.float32).eps`` for float16 and float32 input, as PyTorch). One fused
    pass per row forward, which keeps one ``rstd`` per row for the one fused backward.

    Example::

        >>> import numpy as np
        >>> import taifuse.functional as F
        >>> F.rms_norm(np.array([[2.0, -2.0], [0.5, 0.5]], np.float32), 2, eps=0.0)  # rms 2, 0.5
        array([[ 1., -1.],
               [ 1.,  1.]], dtype=float32)
    """
    if tensors_in((input, weight)):
        return _autograd_ops.rms_norm(input, normalized_shape, weight, eps, out)
    return _array_ops.rms_norm(input, normalized_shape, weight, eps, out)


# ----------------------------------------------------------------------------- embedding


def embedding(
    input: Any,
    weight: Any,
    padding_idx: int | None = None,
    max_norm: float | None = None,
    norm_type: float = 2.0,
    scale_grad_by_freq: bool = False,
    sparse: bool = False,
) -> Any:
    """Rows of ``weight`` looked up by integer indices, as ``torch.nn.functional.embedding``.

    out[..., :] = weight[input[...], :] for ``weight (num_embeddings, embedding_dim)`` and integer
    ``input`` of any shape; the result has shape ``(*input.shape, embedding_dim)``. The backward
    adds each output row's gradient into the weight row it came from (repeated indices accumulate);
    the row ``padding_idx`` (negative counts from the end) gets no gradient. An index outside
    ``[0, num_embeddings)`` is an ``IndexError`` and a non-integer ``input`` a ``TypeError``, raised
    before anything is written (indices already on a device backend are not range-checked: NOTE
    [ Class indices on the device ]). ``input`` takes no gradient. ``max_norm``, ``norm_type``,
    ``scale_grad_by_freq`` and ``sparse`` are PyTorch's and only their defaults are supported.

    Example::

        >>> import numpy as np
        >>> import taifuse.functional as F
        >>> weight = np.arange(6, dtype=np.float32).reshape(3, 2)
        >>> F.embedding(np.array([[2, 0], [2, 2]]), weight)
        array([[[4., 5.],
                [0., 1.]],
        <BLANKLINE>
               [[4., 5.],
                [4., 5.]]], dtype=float32)
    """
    if tensors_in((input, weight)):
        return _autograd_ops.embedding(
            input, weight, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse
        )
    _array_ops.check_embedding_options(max_norm, norm_type, scale_grad_by_freq, sparse)
    return _array_ops.embedding(input, weight, padding_idx)


# ----------------------------------------------------------------------------- dropout


def dropout(x: Any, p: float = 0.5, training: bool = True, *, out: Any = None) -> Any:
    """Zero each element with probability ``p`` and scale the rest by ``1 / (1 - p)``.

    The mask comes from a counter-based hash of the element index and a seed drawn from
    taifuse's generator (``taifuse.manual_seed``), so it is reproducible and identical on every
    backend. With ``training=False`` (or ``p == 0``) ``x`` is returned unchanged, as in PyTorch.
    """
    if isinstance(x, Tensor):
        return _autograd_ops.dropout(x, p, training, out)
    return _array_ops.dropout(x, p, training, out)


# ----------------------------------------------------------------------------- attention


def scaled_dot_product_attention(
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
) -> Any:
    """Attention, as ``torch.nn.functional.scaled_dot_product_attention``, in one fused kernel.

    out = dropout(softmax(query @ key.T * scale + mask), dropout_p) @ value for ``query (..., L,
    E)``, ``key (..., S, E)``, ``value (..., S, Ev)``; the leading dims broadcast (unequal ones
    are materialised). ``scale`` defaults to ``1 / sqrt(E)``. ``attn_mask`` is boolean (True =
    attend) or additive in the query's dtype, broadcastable to ``(..., L, S)``; ``is_causal``
    masks key j for query i when j > i (top-left aligned, as PyTorch, also when L != S) and may
    not be combined with a mask. A query row that sees no key gives 0, as PyTorch's CPU kernels
    do. Dropout acts on the probabilities with the counter-hash mask of ``F.dropout`` (the same on
    every backend). The fused kernels never store the (L, S) scores: the backward recomputes
    them from the output and one log-sum-exp per query row. The mask gets no gradient.

    Example::

        >>> import numpy as np, taifuse.functional as F
        >>> q = k = np.eye(2, dtype=np.float32)[None]
        >>> v = np.array([[[1.0, 0.0], [0.0, 1.0]]], dtype=np.float32)
        >>> F.scaled_dot_product_attention(q, k, v, is_causal=True).round(4)
        array([[[1.    , 0.    ],
                [0.3302, 0.6698]]], dtype=float32)
    """
    if tensors_in((query, key, value)):
        return _autograd_ops.scaled_dot_product_attention(
            query, key, value, attn_mask, dropout_p, is_causal, scale
        )
    return _array_ops.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale)


# ----------------------------------------------------------------------------- losses


def mse_loss(input: Any, target: Any, reduction: str = "mean") -> Any:
    """Mean squared error, as ``torch.nn.functional.mse_loss``.

    loss = (input - target)^2 elementwise, then its mean (``'mean'``), sum (``'sum'``) or nothing
    (``'none'``). ``input`` and ``target`` have the same shape. NumPy in, NumPy out (a 0-d array
    when reduced); Tensors in, a differentiable Tensor out. For example, input ``[1, 3]`` against
    target ``[0, 0]`` gives 5.0.
    """
    if tensors_in((input, target)):
        return _autograd_ops.mse_loss(input, target, reduction)
    return _array_ops.mse_loss(input, target, reduction)


def cross_entropy(logits: Any, target: Any, reduction: str = "mean") -> Any:
    """Cross entropy of ``logits`` against class indices, as ``torch.nn.functional.cross_entropy``.

    loss[n] = logsumexp(logits[n]) - logits[n, target[n]] for ``logits (N, C)`` and integer
    ``target (N,)`` in ``[0, C)`` (or ``logits (C,)`` with a 0-d target), then its mean, sum or
    nothing (``reduction``). The backward is the fused softmax(logits) - onehot(target). For
    example, all-zero logits over 4 classes give log(4) ~ 1.3863 for any target.
    """
    if tensors_in((logits, target)):
        return _autograd_ops.cross_entropy(logits, target, reduction)
    return _array_ops.cross_entropy(logits, target, reduction)
