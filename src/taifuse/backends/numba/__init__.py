"""The Numba CPU backend: JIT-compiled, multithreaded kernels on NumPy arrays.

Its kernel table is this package: the forward kernels (``forward.py``), the backward and loss
kernels (``backward.py``) and the fused optimizer kernels (``optim.py``), all built on ``_jit.py``
(jit options, intrinsics, scalar math, the serial-or-parallel choice), which imports nothing else
of the package. Signatures and semantics are the reference backend's (``backends/reference``).

Importing it imports Numba, so it is imported only when the backend is chosen
(``taifuse.backends`` does that lazily; ``import taifuse`` never imports Numba). Kernels compile
on first use per dtype and are cached on disk (``cache=True``).
"""

from __future__ import annotations

import numba
import numpy as np

from taifuse.backends._host import ALLOCATOR, check_dtype, empty, from_numpy, is_array, to_numpy
from taifuse.backends.numba._jit import (
    _parallel_min_elements,
    _threading_layer,
)
from taifuse.backends.numba.attention import attention, attention_backward
from taifuse.backends.numba.backward import (
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
from taifuse.backends.numba.conv import (
    adaptive_avg_pool2d,
    adaptive_avg_pool2d_backward,
    avg_pool2d,
    avg_pool2d_backward,
    conv2d,
    conv2d_backward,
    max_pool2d,
    max_pool2d_backward,
)
from taifuse.backends.numba.forward import (
    add_relu,
    affine,
    dropout,
    embedding,
    gelu,
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
from taifuse.backends.numba.optim import adam_step, all_finite, lion_step, sgd_step, unscale_check

NAME = "numba"


def init() -> None:
    """Start Numba's threads (NOTE [ OpenMP spin between BLAS calls ] in ``_jit.py``: before any
    parallel kernel runs); kernels compile on first use."""
    _threading_layer()


def describe() -> dict:
    """Numba version, threading layer and thread count."""
    return {
        "backend": NAME,
        "numba": numba.__version__,
        "numpy": np.__version__,
        "threading_layer": _threading_layer(),
        "threads": numba.get_num_threads(),
        "parallel_min_elements": _parallel_min_elements(),
    }


__all__ = [
    "ALLOCATOR",
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
    "embedding",
    "embedding_backward",
    "empty",
    "from_numpy",
    "gelu",
    "gelu_backward",
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
