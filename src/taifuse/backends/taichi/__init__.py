"""The Taichi backend: taifuse's kernels on Taichi's Metal arch (and Vulkan, CUDA or CPU).

This module is the backend's table (the kernels ``backends/_spec.py`` lists, each from the module
it names, the array API and the pool's ``ALLOCATOR``); the code lives in the modules below it,
which import in one direction only::

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

from taifuse.backends import _spec
from taifuse.backends.taichi._runtime import (
    ALLOCATOR,
    INDEX_DTYPE,
    NAME,
    DeviceArray,
    check_dtype,
    copy_from_host,
    copy_to_host,
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
from taifuse.backends.taichi.tensor_math import TENSOR_MATH

# The kernels: every name backends/_spec.py lists, from the module it names.
_KERNELS = _spec.kernel_table(NAME, __name__)
globals().update(_KERNELS)

__all__ = [
    "ALLOCATOR",
    "INDEX_DTYPE",
    "NAME",
    "TENSOR_MATH",
    "DeviceArray",
    "all_kernels",
    "check_dtype",
    "copy_from_host",
    "copy_to_host",
    "describe",
    "empty",
    "from_numpy",
    "init",
    "is_array",
    "reset_transfer_stats",
    "sync",
    "to_numpy",
    "transfer_stats",
] + list(_KERNELS)


def all_kernels() -> list[tuple[str, object]]:
    """Every (name, ti.kernel) pair the backend may launch, in every dtype specialisation (for
    ``metal_check``): those of the runtime, the Tensor math and every module ``backends/_spec.py``
    names for a kernel; Taichi must be running."""
    import importlib

    kernel_modules = dict.fromkeys(k.module for k in _spec.KERNELS if NAME in k.backends)
    pairs = []
    for module in ("_runtime", "tensor_math", *kernel_modules):
        pairs += importlib.import_module(f"{__name__}.{module}").all_kernels()
    return pairs
