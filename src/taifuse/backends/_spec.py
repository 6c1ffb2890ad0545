"""What every backend agrees on: the kernel tables' names and the elementwise op codes.

This module imports nothing of taifuse: the dispatch (``backends/__init__.py``), every backend
package and the layers above read it. Signatures of the kernels are in the reference backend
(``backends/reference``), which is the specification.
"""

from __future__ import annotations

import enum

# Kernels every backend exports (forward ops).
KERNEL_NAMES = (
    "gelu",
    "relu",
    "leaky_relu",
    "silu",
    "sigmoid",
    "tanh",
    "add_relu",
    "mul_relu",
    "affine",
    "linear_act",
    "softmax",
    "log_softmax",
    "layer_norm",
    "dropout",
    "attention",
    "rms_norm",
    "embedding",
    *("conv2d", "max_pool2d", "avg_pool2d", "adaptive_avg_pool2d"),
)
# Kernels of the autograd layer (tensor.py): a backward per differentiable op, and the losses with
# theirs.
BACKWARD_KERNEL_NAMES = (
    "gelu_backward",
    "relu_backward",
    "leaky_relu_backward",
    "silu_backward",
    "sigmoid_backward",
    "tanh_backward",
    "add_relu_backward",
    "mul_relu_backward",
    "affine_backward",
    "linear_act_backward",
    "softmax_backward",
    "log_softmax_backward",
    "layer_norm_backward",
    "dropout_backward",
    "attention_backward",
    "mse_loss",
    "mse_loss_backward",
    "cross_entropy",
    "cross_entropy_backward",
    "rms_norm_backward",
    "embedding_backward",
    *("conv2d_backward", "max_pool2d_backward", "avg_pool2d_backward", "adaptive_avg_pool2d_backward"),
)
# Fused optimizer update kernels (taifuse.optim).
OPTIM_KERNEL_NAMES = ("sgd_step", "adam_step", "lion_step", "all_finite", "unscale_check")
# Array helpers every backend exports.
ARRAY_API = ("NAME", "init", "describe", "check_dtype", "is_array", "from_numpy", "to_numpy", "empty")


class Activation(enum.IntEnum):
    """Elementwise op codes, one numbering for every backend's fused kernels.

    The forward span, the backward span and the linear epilogue of each backend switch on these
    values. ``SIGMOID`` and ``TANH`` backward kernels take the op's output ``y`` (their derivative
    is a function of it); every other backward takes the input.
    """

    IDENTITY = 0
    RELU = 1
    GELU = 2
    GELU_TANH = 3
    SILU = 4
    SIGMOID = 5
    TANH = 6
    LEAKY_RELU = 7


# The ``activation`` argument of ``F.linear`` / ``linear_act``, in order.
ACTIVATIONS = (None, "relu", "gelu", "gelu_tanh", "silu")
_BY_NAME = {
    None: Activation.IDENTITY,
    "relu": Activation.RELU,
    "gelu": Activation.GELU,
    "gelu_tanh": Activation.GELU_TANH,
    "silu": Activation.SILU,
}


def activation_code(activation: str | None) -> Activation:
    """The op code of a fused linear's ``activation`` argument; ``ValueError`` naming it otherwise."""
    try:
        return _BY_NAME[activation]
    except (KeyError, TypeError):
        raise ValueError(f"activation should be one of {ACTIVATIONS}, got {activation!r}") from None


def gelu_code(approximate: str) -> Activation:
    """The op code of ``gelu(approximate=...)``: exact (``'none'``) or the tanh form."""
    return Activation.GELU_TANH if approximate == "tanh" else Activation.GELU
