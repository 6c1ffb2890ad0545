"""What every backend agrees on: the one table of kernels, the array API and the elementwise op codes.

``KERNELS`` is the one place a kernel's name is written (docs/architecture.md, "Adding an op"):
each backend's table and ``__all__`` (:func:`kernel_table`), the dispatch's ``KERNEL_NAMES``,
``BACKWARD_KERNEL_NAMES`` and ``OPTIM_KERNEL_NAMES``, the profiler's op set
(``_array_ops.PROFILED_OPS``) and the kernel-table tests are derived from it.

This module imports nothing of taifuse: the dispatch (``backends/__init__.py``), every backend
package and the layers above read it. :func:`kernel_table` imports a backend's own modules by
name, for that backend's ``__init__``. Signatures of the kernels are in the reference backend
(``backends/reference``), which is the specification.
"""

from __future__ import annotations

import enum
import importlib
from typing import Any, NamedTuple

# Every backend, by the name the dispatch selects it by.
BACKENDS = ("numpy", "numba", "taichi")


class Kernel(NamedTuple):
    """One kernel of the backends' tables and what the layers that use it need to know."""

    name: str
    # Which list holds it: "forward" (KERNEL_NAMES), "backward" (BACKWARD_KERNEL_NAMES: a backward
    # per differentiable op, and the losses with theirs) or "optim" (OPTIM_KERNEL_NAMES).
    table: str
    # The module of each backend package that defines it: backends/<backend>/<module>.py.
    module: str
    # The array-path function (taifuse.functional's op of that name) that launches it, which the
    # profiler records (NOTE [ Profiler hooks ] in taifuse/_profile_hook.py); None for the kernels
    # only an autograd backward or an optimizer calls, or another kernel's op launches.
    array_op: str | None
    # The backends whose table has it.
    backends: tuple[str, ...] = BACKENDS
    # The module of taifuse that defines ``array_op``: ``_array_ops``, or an op family's module
    # above it (``_conv_ops``), which wraps its own ops with ``_array_ops.profile_ops`` (it cannot
    # be wrapped from ``_array_ops``, which it imports).
    array_module: str = "_array_ops"


def _forward(name: str, module: str = "forward", array_op: str | None = None) -> Kernel:
    return Kernel(name, "forward", module, array_op or name)


def _backward(name: str, module: str = "backward", array_op: str | None = None) -> Kernel:
    return Kernel(name, "backward", module, array_op)


def _optim(name: str) -> Kernel:
    return Kernel(name, "optim", "optim", None)


KERNELS: tuple[Kernel, ...] = (
    # Forward kernels, each launched by the _array_ops function of its own name unless one is given.
    _forward("gelu"),
    _forward("relu"),
    _forward("leaky_relu"),
    _forward("silu"),
    _forward("sigmoid"),
    _forward("tanh"),
    _forward("add_relu"),
    _forward("mul_relu"),
    _forward("affine"),
    _forward("linear_act", array_op="linear"),
    _forward("softmax"),
    _forward("log_softmax"),
    _forward("layer_norm"),
    _forward("dropout"),
    _forward("attention", "attention", array_op="scaled_dot_product_attention"),
    _forward("rms_norm"),
    _forward("embedding"),
    # Batch norm's kernels, launched by _batch_norm_ops.batch_norm (the op is named on one row).
    Kernel("batch_norm_stats", "forward", "batch_norm", "batch_norm", array_module="_batch_norm_ops"),
    Kernel("batch_norm_update", "forward", "batch_norm", None),
    Kernel("batch_norm_elemt", "forward", "batch_norm", None),
    # Convolution and pooling, launched by _conv_ops' array path.
    Kernel("conv2d", "forward", "conv", "conv2d", array_module="_conv_ops"),
    Kernel("max_pool2d", "forward", "conv", "max_pool2d", array_module="_conv_ops"),
    Kernel("avg_pool2d", "forward", "conv", "avg_pool2d", array_module="_conv_ops"),
    Kernel("adaptive_avg_pool2d", "forward", "conv", "adaptive_avg_pool2d", array_module="_conv_ops"),
    # The training-mode Conv2d -> BatchNorm -> ReLU block (_conv_bn_ops): the convolution with the
    # batch statistics of its output, then batch_norm_update and batch_norm_elemt.
    Kernel("conv2d_stats", "forward", "conv", "conv2d_batch_norm", array_module="_conv_bn_ops"),
    # The autograd layer's kernels: a backward per differentiable op, and the losses with theirs.
    _backward("gelu_backward"),
    _backward("relu_backward"),
    _backward("leaky_relu_backward"),
    _backward("silu_backward"),
    _backward("sigmoid_backward"),
    _backward("tanh_backward"),
    _backward("add_relu_backward"),
    _backward("mul_relu_backward"),
    _backward("affine_backward"),
    _backward("linear_act_backward"),
    _backward("softmax_backward"),
    _backward("log_softmax_backward"),
    _backward("layer_norm_backward"),
    _backward("dropout_backward"),
    _backward("attention_backward", "attention"),
    _backward("mse_loss", array_op="mse_loss"),
    _backward("mse_loss_backward"),
    _backward("cross_entropy", array_op="cross_entropy"),
    _backward("cross_entropy_backward"),
    _backward("rms_norm_backward"),
    _backward("embedding_backward"),
    _backward("batch_norm_backward", "batch_norm"),
    _backward("conv2d_backward", "conv"),
    _backward("max_pool2d_backward", "conv"),
    _backward("avg_pool2d_backward", "conv"),
    _backward("adaptive_avg_pool2d_backward", "conv"),
    _backward("conv2d_batch_norm_backward", "conv"),
    # Fused optimizer update kernels (taifuse.optim).
    _optim("sgd_step"),
    _optim("adam_step"),
    _optim("lion_step"),
    _optim("all_finite"),
    _optim("unscale_check"),
)

# The names of each list (the dispatch re-exports them).
KERNEL_NAMES = tuple(k.name for k in KERNELS if k.table == "forward")
BACKWARD_KERNEL_NAMES = tuple(k.name for k in KERNELS if k.table == "backward")
OPTIM_KERNEL_NAMES = tuple(k.name for k in KERNELS if k.table == "optim")
# Array helpers every backend exports.
ARRAY_API = ("NAME", "init", "describe", "check_dtype", "is_array", "from_numpy", "to_numpy", "empty")


def kernel_names(backend: str) -> tuple[str, ...]:
    """The kernels ``backend``'s table holds, in ``KERNELS``' order."""
    return tuple(k.name for k in KERNELS if backend in k.backends)


def kernel_table(backend: str, package: str) -> dict[str, Any]:
    """``backend``'s kernels by name, each from its module of ``package`` (the backend's package).

    Each backend's ``__init__`` builds its table and ``__all__`` with this, so a kernel that
    ``KERNELS`` lists and its module lacks is an ``ImportError`` naming both when the backend is
    imported, never a name silently absent from the table.
    """
    table = {}
    for kernel in KERNELS:
        if backend not in kernel.backends:
            continue
        module = importlib.import_module(f"{package}.{kernel.module}")
        fn = getattr(module, kernel.name, None)
        if fn is None:
            raise ImportError(
                f"the {backend} backend has no kernel {kernel.name!r}: backends/_spec.py lists it "
                f"in {kernel.module!r}, and {module.__name__} does not define it"
            )
        table[kernel.name] = fn
    return table


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
