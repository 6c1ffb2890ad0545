"""The Taichi backend: taifuse's kernels on Taichi's Metal arch (and Vulkan, CUDA or CPU).

This module is the backend's table (``taifuse.backends.KERNEL_NAMES``, ``BACKWARD_KERNEL_NAMES``,
``OPTIM_KERNEL_NAMES``, the array API and the pool's ``ALLOCATOR``); the code lives in the
modules below it, which import in one direction only::

    _runtime      Taichi's init, DeviceArray, the array API, the pool's allocator, transfer counters
                  (imports nothing here)
    _math         @ti.func scalar math shared by every kernel factory
    forward       forward kernels and their wrappers
    tensor_math   TaichiMath, the Tensor arithmetic table (and the reductions, matmul)
    backward      backward and loss kernels (uses forward and tensor_math)
    optim         fused optimizer kernels

Data lives on the device in :class:`DeviceArray`; host<->device copies are counted
(:func:`transfer_stats`). On Linux the same kernels run on ``ti.vulkan`` (lavapipe), which shares
Metal's SPIR-V codegen; ``python -m taifuse.backends.metal_check`` compiles every kernel with
only Metal's capabilities. Taichi is imported and initialised in :func:`init`, never at import
time (NOTE [ Re-initialising Taichi ] in ``_runtime.py`` says what a re-initialisation does).
"""

from taifuse.backends.taichi._runtime import (
    ALLOCATOR,
    INDEX_DTYPE,
    NAME,
    DeviceArray,
    check_dtype,
    describe,
    empty,
    from_numpy,
    init,
    is_array,
    reset_transfer_stats,
    sync,
    to_numpy,
    transfer_stats,
)
from taifuse.backends.taichi.attention import attention, attention_backward
from taifuse.backends.taichi.backward import (
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
from taifuse.backends.taichi.conv import (
    adaptive_avg_pool2d,
    adaptive_avg_pool2d_backward,
    avg_pool2d,
    avg_pool2d_backward,
    conv2d,
    conv2d_backward,
    max_pool2d,
    max_pool2d_backward,
)
from taifuse.backends.taichi.forward import (
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
from taifuse.backends.taichi.optim import adam_step, all_finite, lion_step, sgd_step, unscale_check
from taifuse.backends.taichi.tensor_math import TENSOR_MATH

__all__ = [
    "ALLOCATOR",
    "INDEX_DTYPE",
    "NAME",
    "TENSOR_MATH",
    "DeviceArray",
    "adam_step",
    "adaptive_avg_pool2d",
    "adaptive_avg_pool2d_backward",
    "add_relu",
    "add_relu_backward",
    "affine",
    "affine_backward",
    "all_finite",
    "all_kernels",
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
    "reset_transfer_stats",
    "rms_norm",
    "rms_norm_backward",
    "sgd_step",
    "sigmoid",
    "sigmoid_backward",
    "silu",
    "silu_backward",
    "softmax",
    "softmax_backward",
    "sync",
    "tanh",
    "tanh_backward",
    "to_numpy",
    "transfer_stats",
    "unscale_check",
]


def all_kernels() -> list[tuple[str, object]]:
    """Every (name, ti.kernel) pair the backend may launch, in every dtype specialisation (for
    ``metal_check``); Taichi must be running."""
    from taifuse.backends.taichi import _runtime, backward, forward, optim, tensor_math
    from taifuse.backends.taichi.attention import all_kernels as attention_kernels
    from taifuse.backends.taichi.conv import all_kernels as conv_kernels

    return (
        _runtime.all_kernels()
        + forward.all_kernels()
        + tensor_math.all_kernels()
        + backward.all_kernels()
        + optim.all_kernels()
        + attention_kernels()
        + conv_kernels()
    )
