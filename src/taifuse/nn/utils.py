"""Module utilities, as ``torch.nn.utils``: :func:`fuse_conv_bn_eval` folds an evaluation-mode
batch norm into the convolution before it, so the block runs as one convolution kernel.

Example::

    >>> import numpy as np, taifuse, taifuse.nn as nn
    >>> taifuse.set_backend("numpy")
    >>> taifuse.manual_seed(0)
    >>> conv, bn = nn.Conv2d(2, 3, 3, padding=1).eval(), nn.BatchNorm2d(3).eval()
    >>> fused = nn.utils.fuse_conv_bn_eval(conv, bn)
    >>> x = taifuse.tensor(np.ones((1, 2, 4, 4), np.float32))
    >>> bool(np.allclose(fused(x).numpy(), bn(conv(x)).numpy(), atol=1e-5))
    True
"""

from __future__ import annotations

import numpy as np

from taifuse.nn.batchnorm import BatchNorm1d, BatchNorm2d
from taifuse.nn.conv import Conv2d
from taifuse.nn.module import Module, Parameter

__all__ = ["fuse_conv_bn_eval", "fuse_conv_bn_weights"]


def fuse_conv_bn_weights(
    conv_w: np.ndarray,
    conv_b: np.ndarray | None,
    bn_rm: np.ndarray,
    bn_rv: np.ndarray,
    bn_eps: float,
    bn_w: np.ndarray | None,
    bn_b: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray]:
    """The folded weight and bias as arrays, ``torch.nn.utils.fusion.fuse_conv_bn_weights``'s math
    (without ``transpose``): with ``s = bn_w / sqrt(bn_rv + bn_eps)`` per output channel,
    ``w' = conv_w * s`` and ``b' = (conv_b - bn_rm) * s + bn_b``; a missing ``conv_b`` or ``bn_b``
    is zeros and a missing ``bn_w`` ones. Computed in float64 and rounded once to the weight's
    dtype (the bias to ``conv_b``'s, or the weight's when there is none), as torch keeps the dtypes.
    """
    w_dtype = np.asarray(conv_w).dtype
    b_dtype = w_dtype if conv_b is None else np.asarray(conv_b).dtype
    rm = np.asarray(bn_rm, np.float64)
    scale = 1.0 / np.sqrt(np.asarray(bn_rv, np.float64) + float(bn_eps))
    if bn_w is not None:
        scale = scale * np.asarray(bn_w, np.float64)
    bias = -rm if conv_b is None else np.asarray(conv_b, np.float64) - rm
    bias = bias * scale
    if bn_b is not None:
        bias = bias + np.asarray(bn_b, np.float64)
    weight = np.asarray(conv_w, np.float64) * scale.reshape((-1,) + (1,) * (np.ndim(conv_w) - 1))
    return weight.astype(w_dtype), bias.astype(b_dtype)


def fuse_conv_bn_eval(conv: Conv2d, bn: BatchNorm1d | BatchNorm2d) -> Conv2d:
    """A new ``Conv2d`` whose weight and bias fold ``bn``'s evaluation-mode affine map into ``conv``,
    as ``torch.nn.utils.fuse_conv_bn_eval`` (without ``transpose``: taifuse has no transposed
    convolution).

    The result computes ``bn(conv(x))`` of the evaluation mode in one convolution: with
    ``s = bn.weight / sqrt(bn.running_var + bn.eps)``, its weight is ``conv.weight * s`` (per output
    channel) and its bias ``(conv.bias - bn.running_mean) * s + bn.bias``. ``conv`` and ``bn`` are
    not changed; the new module has ``conv``'s hyperparameters, a bias even when ``conv`` had none
    (with ``requires_grad=False`` then, as torch's), and is in evaluation mode. A batch norm with
    taifuse's fused ``activation='relu'`` gives a convolution with the same fused activation, so
    the whole Conv-BN-ReLU block is one kernel.

    Raises:
        ValueError: either module is in training mode (PyTorch asserts "Fusion only for eval!"),
            ``bn`` has no running statistics, its ``num_features`` is not ``conv.out_channels``, or
            ``conv`` already applies an activation (the batch norm would follow it, so nothing folds).
        TypeError: ``conv`` is not a ``Conv2d`` or ``bn`` not a ``BatchNorm1d``/``BatchNorm2d``.
    """
    if not isinstance(conv, Conv2d):
        raise TypeError(f"fuse_conv_bn_eval: conv should be a taifuse.nn.Conv2d, got {type(conv).__name__}")
    if not isinstance(bn, (BatchNorm1d, BatchNorm2d)):
        raise TypeError(
            f"fuse_conv_bn_eval: bn should be a taifuse.nn.BatchNorm1d or BatchNorm2d, got {type(bn).__name__}"
        )
    if conv.training or bn.training:
        which = " and ".join(n for n, m in (("conv", conv), ("bn", bn)) if m.training)
        raise ValueError(
            f"fuse_conv_bn_eval: fusion only for eval: {which} in training mode (call .eval() first; "
            "a training-mode batch norm normalizes by the batch's statistics, which cannot be folded)"
        )
    if bn.running_mean is None or bn.running_var is None:
        raise ValueError("fuse_conv_bn_eval: bn has no running statistics (track_running_stats=False)")
    if bn.num_features != conv.out_channels:
        raise ValueError(
            f"fuse_conv_bn_eval: bn.num_features ({bn.num_features}) should equal conv.out_channels "
            f"({conv.out_channels})"
        )
    if conv.activation is not None:
        raise ValueError(
            f"fuse_conv_bn_eval: conv applies activation={conv.activation!r} before the batch norm, "
            "which cannot be folded; fuse a conv without an activation"
        )
    weight, bias = fuse_conv_bn_weights(
        conv.weight.numpy(),
        None if conv.bias is None else conv.bias.numpy(),
        bn.running_mean.numpy(),
        bn.running_var.numpy(),
        bn.eps,
        None if bn.weight is None else bn.weight.numpy(),
        None if bn.bias is None else bn.bias.numpy(),
    )
    # A new module with conv's hyperparameters, without Conv2d.__init__'s draw from the generator.
    fused = Conv2d.__new__(Conv2d)
    Module.__init__(fused)
    for name, value in vars(conv).items():
        if name not in ("_parameters", "_modules", "_buffers", "_non_persistent_buffers"):
            object.__setattr__(fused, name, value)
    fused.activation = bn.activation
    fused.weight = Parameter(weight, requires_grad=conv.weight.requires_grad)
    fused.bias = Parameter(bias, requires_grad=conv.bias is not None and conv.bias.requires_grad)
    return fused
