"""The NumPy reference backend: the living specification of every kernel.

Its table is this package: the forward kernels (``forward.py``), the backward and loss kernels
(``backward.py``) and the fused optimizer kernels (``optim.py``), each written for clarity in
float64, never for speed. Every other backend is tested against it. The conventions every
backend's kernels follow are in ``forward.py``'s docstring.
"""

from __future__ import annotations

import numpy as np

from taifuse.backends._host import ALLOCATOR, check_dtype, empty, from_numpy, is_array, to_numpy
from taifuse.backends._spec import ACTIVATIONS
from taifuse.backends.reference.attention import attention, attention_backward
from taifuse.backends.reference.backward import (
    LOSS_REDUCTIONS,
    add_relu_backward,
    affine_backward,
    cross_entropy,
    cross_entropy_backward,
    dropout_backward,
    embedding_backward,
    gelu_backward,
    layer_norm_backward,
    leaky_relu_backward,
    linear_act_backward,
    log_softmax_backward,
    mse_loss,
    mse_loss_backward,
    mul_relu_backward,
    relu_backward,
    rms_norm_backward,
    sigmoid_backward,
    silu_backward,
    softmax_backward,
    tanh_backward,
)
from taifuse.backends.reference.conv import (
    adaptive_avg_pool2d,
    adaptive_avg_pool2d_backward,
    avg_pool2d,
    avg_pool2d_backward,
    conv2d,
    conv2d_backward,
    max_pool2d,
    max_pool2d_backward,
)
from taifuse.backends.reference.forward import (
    add_relu,
    affine,
    dropout,
    dropout_key,
    dropout_scale,
    dropout_threshold,
    embedding,
    gelu,
    hash32,
    layer_norm,
    leaky_relu,
    linear_act,
    log_softmax,
    mul_relu,
    relu,
    rms_norm,
    sigmoid,
    silu,
    softmax,
    tanh,
)
from taifuse.backends.reference.optim import adam_step, all_finite, lion_step, sgd_step, unscale_check

NAME = "numpy"


def init() -> None:
    """Nothing to start: NumPy is always there."""


def describe() -> dict:
    return {"backend": NAME, "numpy": np.__version__}


__all__ = [
    "ACTIVATIONS",
    "ALLOCATOR",
    "LOSS_REDUCTIONS",
    "NAME",
    "adam_step",
    "adaptive_avg_pool2d",
    "adaptive_avg_pool2d_backward",
    "add_relu",
    "add_relu_backward",
    "affine",
    "affine_backward",
    "all_finite",
    "attention",
    "attention_backward",
    "avg_pool2d",
    "avg_pool2d_backward",
    "check_dtype",
    "conv2d",
    "conv2d_backward",
    "cross_entropy",
    "cross_entropy_backward",
    "describe",
    "dropout",
    "dropout_backward",
    "dropout_key",
    "dropout_scale",
    "dropout_threshold",
    "embedding",
    "embedding_backward",
    "empty",
    "from_numpy",
    "gelu",
    "gelu_backward",
    "hash32",
    "init",
    "is_array",
    "layer_norm",
    "layer_norm_backward",
    "leaky_relu",
    "leaky_relu_backward",
    "linear_act",
    "linear_act_backward",
    "lion_step",
    "log_softmax",
    "log_softmax_backward",
    "max_pool2d",
    "max_pool2d_backward",
    "mse_loss",
    "mse_loss_backward",
    "mul_relu",
    "mul_relu_backward",
    "relu",
    "relu_backward",
    "rms_norm",
    "rms_norm_backward",
    "sgd_step",
    "sigmoid",
    "sigmoid_backward",
    "silu",
    "silu_backward",
    "softmax",
    "softmax_backward",
    "tanh",
    "tanh_backward",
    "to_numpy",
    "unscale_check",
]
