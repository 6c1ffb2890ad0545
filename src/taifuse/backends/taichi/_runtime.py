"""The bottom of the taichi backend: the runtime, :class:`DeviceArray`, the array API and the
pool's :data:`ALLOCATOR` of device memory.

Data lives on the device in :class:`DeviceArray` (a flat ``ti.Ndarray`` with a logical shape).
Host<->device copies happen only in :func:`from_numpy`, :func:`to_numpy` and
:meth:`DeviceArray.numpy` (and the optimizer's 4-byte finiteness flag), and each one is counted
through :func:`_count_transfer` (:func:`transfer_stats`), so a test can prove that a training
step copies nothing but its loss back.

Metal has no float64: :func:`check_dtype` refuses it with a ``TypeError`` instead of casting.
Taichi is imported and initialised in :func:`init`, never at import time. This module imports
nothing of ``taifuse.backends.taichi``: every other module of the package imports it.

# NOTE [ Re-initialising Taichi ]
# ``ti.init`` tears down the previous runtime and every ndarray it owned. A DeviceArray created
# before an arch switch is therefore invalid afterwards: using it raises ``RuntimeError`` (it
# records the runtime generation it was born in). Its storage also skips Taichi's
# ``delete_ndarray`` on garbage collection, because the dead C++ ndarray's address may by then
# belong to an ndarray of the new runtime, which the delete would free.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import glob
import io
import math
import os
import platform
import sys
import threading
from collections import deque
from typing import Any

import numpy as np

NAME = "taichi"

_ARCH_NAMES = ("metal", "vulkan", "cuda", "cpu")
# The float storage dtypes; every kernel set is built once for each (float16 is storage only).
FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float16))
# Integer data (class indices) is stored as int32: NOTE [ Class indices on the device ] in backward.py.
INDEX_DTYPE = np.dtype(np.int32)
# NumPy dtype -> the name of its Taichi type (resolved by _ti_dtype once Taichi is imported).
# bfloat16 optimizer state is stored as its uint16 bit patterns: NOTE [ bfloat16 optimizer state ]
# in reference/optim.py. Only the optimizer makes such arrays; kernels other than its own refuse them.
BITS_DTYPE = np.dtype(np.uint16)
_TI_DTYPES = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16", INDEX_DTYPE: "i32", BITS_DTYPE: "u16"}
# Kernels index with 32-bit ints (64-bit indices are slow or missing on some GPUs).
_MAX_ELEMENTS = 2**31 - 1

# Mutated in place, never rebound: the package's modules import this very dict.
_state: dict[str, Any] = {
    "ti": None,  # the taichi module, once imported
    "requested": None,  # arch name the caller asked for
    "actual": None,  # arch name Taichi runs on
    "program": None,  # Taichi's Program object we initialised (detects foreign ti.init calls)
    "generation": 0,  # bumped on every (re-)initialisation; see NOTE [ Re-initialising Taichi ]
    "cuda_context": None,  # on arch cuda: Taichi's CUDA context (NOTE [ CUDA contexts and threads ])
    "init_thread": None,  # the thread that ran ti.init
}
# Written only by _count_transfer.
_transfers = {"host_to_device": 0, "device_to_host": 0, "bytes_host_to_device": 0, "bytes_device_to_host": 0}
_dummies: dict[np.dtype, Any] = {}  # 1-element stand-ins for absent optional arrays (bias=None)
_storage_class: type | None = None


# ----------------------------------------------------------------------------- runtime


def _import_taichi():
    if _state["ti"] is None:
        # Quiet and offline by default; an explicit user setting wins.
        os.environ.setdefault("ENABLE_TAICHI_HEADER_PRINT", "False")
        os.environ.setdefault("TI_SKIP_VERSION_CHECK", "ON")
        import taichi

        _state["ti"] = taichi
    return _state["ti"]


def _current_program():
    from taichi.lang import impl

    return impl.get_runtime().prog


@functools.cache
def best_arch() -> str:
    """The arch Taichi starts on when none is asked for: the best this machine has.

    ``'metal'`` on a Mac with Apple silicon, else ``'cuda'`` where an NVIDIA GPU and its driver
    are, else ``'vulkan'`` where a Vulkan driver reports a GPU, else ``'cpu'``. A Vulkan driver
    that runs on the CPU (lavapipe, SwiftShader) does not count: it emulates a GPU on the same
    cores, and the matrix products a model spends its time in ran several times slower on lavapipe
    than on ``ti.cpu`` (a linear layer, interleaved in one process on a loaded 2-core machine).
    Asks the drivers through ctypes, never Taichi: nothing starts, and CUDA is not initialised
    (a fork after it stays safe). Cached for the process.
    """
    if sys.platform == "darwin" and platform.machine() in ("arm64", "aarch64"):
        return "metal"
    if _cuda_present():
        return "cuda"
    if any(kind in _VULKAN_GPU_TYPES for kind in _vulkan_device_types()):
        return "vulkan"
    return "cpu"


def _cuda_present() -> bool:
    """An NVIDIA GPU with its driver library, found without cuInit (which a later fork would break)."""
    library = "nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"
    try:
        ctypes.CDLL(library)
    except OSError:
        return False
    if sys.platform.startswith("linux"):
        return bool(glob.glob("/proc/driver/nvidia/gpus/*") or glob.glob("/dev/nvidia[0-9]*"))
    return True


# VkPhysicalDeviceType: integrated, discrete and virtual GPUs (0 is "other", 4 the CPU).
_VULKAN_GPU_TYPES = (1, 2, 3)


class _VkInstanceCreateInfo(ctypes.Structure):
    _fields_ = [
        ("sType", ctypes.c_int32),
        ("pNext", ctypes.c_void_p),
        ("flags", ctypes.c_uint32),
        ("pApplicationInfo", ctypes.c_void_p),
        ("enabledLayerCount", ctypes.c_uint32),
        ("ppEnabledLayerNames", ctypes.c_void_p),
        ("enabledExtensionCount", ctypes.c_uint32),
        ("ppEnabledExtensionNames", ctypes.c_void_p),
    ]


def _vulkan_device_types() -> list[int]:
    """The VkPhysicalDeviceType of each device the Vulkan loader lists; [] without a loader or driver."""
    names = {"win32": "vulkan-1.dll", "darwin": "libvulkan.1.dylib"}
    try:
        vk = ctypes.CDLL(names.get(sys.platform, "libvulkan.so.1"))
    except OSError:
        return []
    vk.vkCreateInstance.restype = vk.vkEnumeratePhysicalDevices.restype = ctypes.c_int32
    vk.vkCreateInstance.argtypes = [ctypes.c_void_p] * 3
    vk.vkEnumeratePhysicalDevices.argtypes = [ctypes.c_void_p] * 3
    vk.vkGetPhysicalDeviceProperties.argtypes = [ctypes.c_void_p] * 2
    vk.vkDestroyInstance.argtypes = [ctypes.c_void_p] * 2
    create = _VkInstanceCreateInfo(sType=1)  # VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO
    instance = ctypes.c_void_p()
    if vk.vkCreateInstance(ctypes.byref(create), None, ctypes.byref(instance)) != 0:
        return []
    try:
        count = ctypes.c_uint32()
        if vk.vkEnumeratePhysicalDevices(instance, ctypes.byref(count), None) != 0:
            return []
        devices = (ctypes.c_void_p * count.value)()
        listed = vk.vkEnumeratePhysicalDevices(instance, ctypes.byref(count), devices)
        if listed not in (0, 5):  # VK_SUCCESS, VK_INCOMPLETE (the count is then what was written)
            return []
        kinds = []
        for device in devices[: count.value]:
            # VkPhysicalDeviceProperties (824 bytes): apiVersion, driverVersion, vendorID, deviceID,
            # then deviceType, a uint32 at byte 16.
            properties = ctypes.create_string_buffer(1024)
            vk.vkGetPhysicalDeviceProperties(device, properties)
            kinds.append(int.from_bytes(properties.raw[16:20], sys.byteorder))
        return kinds
    finally:
        vk.vkDestroyInstance(instance, None)


def init(arch: str | None = None) -> None:
    """Start Taichi on ``arch`` (``'metal'``, ``'vulkan'``, ``'cuda'`` or ``'cpu'``; None: :func:`best_arch`).

    Idempotent for the same arch. A different arch re-initialises Taichi, which invalidates every
    DeviceArray created before (see NOTE [ Re-initialising Taichi ]). Raises ``RuntimeError``
    when Taichi cannot run on ``arch`` (it would otherwise fall back to the CPU silently), so the
    dispatcher's fallback warning says why.
    """
    arch = best_arch() if arch is None else arch
    if arch not in _ARCH_NAMES:
        raise ValueError(f"taichi arch should be one of {_ARCH_NAMES}, got {arch!r}")
    ti = _import_taichi()
    if (
        _state["requested"] == arch
        and _state["program"] is not None
        and _current_program() is _state["program"]
    ):
        return
    # Any ti.init call tears the old runtime down, even one that then fails: invalidate first.
    _state["generation"] += 1
    _state.update(requested=None, actual=None, program=None, cuda_context=None, init_thread=None)
    _dummies.clear()
    with contextlib.redirect_stdout(io.StringIO()):  # ti.init prints "[Taichi] Starting on arch=..."
        ti.init(
            arch=getattr(ti, arch),
            enable_fallback=False,  # raise instead of silently running on the CPU
            offline_cache=True,
            log_level=ti.WARN,
            # LLVM's fast math reassociates (x - max) - log(sum) into x - (max + log(sum)), which
            # rounds at |max|'s scale (log_softmax off by 1e-4 at max = 1000). ti.cpu is a test
            # proxy, so it trades speed for that. lavapipe did not reassociate (tested); Metal is untested.
            fast_math=arch != "cpu",
        )
    from taichi.lang import impl

    actual = str(impl.current_cfg().arch).split(".")[-1]
    expected = ("x64", "arm64") if arch == "cpu" else (arch,)
    if actual not in expected:
        raise RuntimeError(f"Taichi started on arch {actual!r} instead of the requested {arch!r}")
    _state.update(requested=arch, actual=actual, program=_current_program(), init_thread=threading.get_ident())
    if arch == "cuda":
        _record_cuda_context()


# NOTE [ CUDA contexts and threads ]
# Taichi's CUDA backend makes its context current on the thread that ran ti.init, and allocates
# (cuMemAllocAsync), copies and frees on whatever thread calls it without making the context current
# there. Found on the GPU machine (issue 31): a DataLoader worker thread that moved a batch to the
# device failed with CUDA_ERROR_INVALID_CONTEXT, and a garbage collection that ran in
# pytest-xdist's receiver thread freed a DeviceArray there and aborted the process. So on CUDA,
# init() records the context (cuCtxGetCurrent, through the driver library as best_arch probes it),
# and the entry points that allocate, copy or free push it for the call when they run on another
# thread (cuCtxPushCurrent / cuCtxPopCurrent). The thread that ran ti.init pays one comparison.


def _record_cuda_context() -> None:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return
    ctx = ctypes.c_void_p()
    if lib.cuCtxGetCurrent(ctypes.byref(ctx)) == 0 and ctx.value:
        _state["cuda_context"] = (lib, ctx)


@contextlib.contextmanager
def _pushed_cuda_context(lib, ctx):
    lib.cuCtxPushCurrent_v2(ctx)
    try:
        yield
    finally:
        lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))


_NO_CONTEXT = contextlib.nullcontext()  # reusable: it holds no state


def thread_context():
    """A context manager that makes Taichi's CUDA context current for a call made on a thread other
    than the one that ran ti.init (NOTE [ CUDA contexts and threads ]); a no-op elsewhere."""
    cuda = _state["cuda_context"]
    if cuda is None or threading.get_ident() == _state["init_thread"]:
        return _NO_CONTEXT  # every allocation and free passes here: no new object
    return _pushed_cuda_context(*cuda)


def _require_init() -> None:
    if _state["program"] is None:
        raise RuntimeError("the taichi backend is not initialised; call init(arch=...) first")


def _on_gpu() -> bool:
    # Threadgroup memory exists on the GPU archs only: ti.cpu runs the kernels without it.
    return _state["requested"] != "cpu"


def _launch_grid(work: int, grids: tuple[int, ...]) -> int | None:
    """The constant launch size for ``work`` blocks or threads on a GPU arch: the smallest of ``grids``
    that holds it, or None for a runtime range (work larger than every grid, or the CPU arch, which has
    no idle blocks to save). NOTE [ The dispatch size of a runtime range ] in forward.py."""
    if not _on_gpu():
        return None
    return next((g for g in grids if work <= g), None)


def _half_arithmetic() -> bool:
    """Whether float16 data may be computed in float16 (NOTE [ float16 arithmetic in the elementwise
    kernels ]): on Metal and Vulkan. Not on CUDA: Taichi's CUDA code generator marks every function
    unsafe-fp-math (taichi/runtime/cuda/jit_cuda.cpp), and on the H100 float16 arithmetic then
    flushed float16 subnormals to zero (relu(4.1e-5) gave 0; tanh(-4.5e-6) gave +4.5e-6), where
    the float32 path converts them exactly. The ops are memory-bound: computing in float32 costs
    nothing measurable there."""
    return _state["requested"] in ("metal", "vulkan")


def describe() -> dict:
    """Versions and arches: what was asked for and what Taichi actually runs on."""
    info: dict[str, Any] = {"backend": NAME, "requested_arch": _state["requested"], "arch": _state["actual"]}
    if _state["ti"] is not None:
        info["taichi"] = ".".join(str(v) for v in _state["ti"].__version__)
    return info


def sync() -> None:
    """Wait for every launched kernel to finish (needed before timing device work)."""
    _require_init()
    _state["ti"].sync()


# ----------------------------------------------------------------------------- transfers


def _count_transfer(direction: str, nbytes: int) -> None:
    """Count one host<->device copy; ``direction`` is ``'host_to_device'`` or ``'device_to_host'``."""
    _transfers[direction] += 1
    _transfers[f"bytes_{direction}"] += int(nbytes)


def transfer_stats() -> dict[str, int]:
    """Host<->device copies since the last :func:`reset_transfer_stats`: counts and bytes."""
    return dict(_transfers)


def reset_transfer_stats() -> None:
    """Zero the counters of :func:`transfer_stats`."""
    for key in _transfers:
        _transfers[key] = 0


# ----------------------------------------------------------------------------- DeviceArray


def _ti_dtype(dtype: np.dtype):
    """The Taichi type of a supported NumPy dtype (Taichi must be imported)."""
    return getattr(_state["ti"], _TI_DTYPES[np.dtype(dtype)])


def _make_storage(ti_dtype, n: int):
    """A flat ti.Ndarray that knows the runtime generation it belongs to."""
    global _storage_class
    if _storage_class is None:
        import sys as _sys

        from taichi.lang._ndarray import ScalarNdarray

        class _Storage(ScalarNdarray):
            # Held by the class: module globals may already be None when the interpreter exits.
            _runtime_state = _state

            def __del__(self):
                # See NOTE [ Re-initialising Taichi ]: never delete through a newer runtime.
                # At interpreter exit Taichi's own globals may be gone already; the process is
                # releasing everything anyway.
                if _sys.is_finalizing():
                    return
                if getattr(self, "_generation", None) == self._runtime_state["generation"]:
                    with thread_context():  # a collection may run on any thread
                        super().__del__()

        _storage_class = _Storage
    with thread_context():
        storage = _storage_class(ti_dtype, (n,))
    storage._generation = _state["generation"]
    return storage


class DeviceArray:
    """An array on the Taichi device: a flat 1-D ``ti.Ndarray`` viewed with a logical shape.

    ``reshape`` returns a view that shares the storage. Copies to the host happen only through
    :meth:`numpy` (or :func:`to_numpy`) and are counted in :func:`transfer_stats`.

    Example::

        >>> import numpy as np
        >>> from taifuse.backends import taichi
        >>> taichi.init("cpu")
        >>> a = taichi.from_numpy(np.arange(6, dtype=np.float32))
        >>> a.reshape((2, 3)).numpy()
        array([[0., 1., 2.],
               [3., 4., 5.]], dtype=float32)
    """

    __slots__ = ("_generation", "_storage", "dtype", "shape")

    def __init__(self, storage: Any, shape: tuple[int, ...], dtype: np.dtype, generation: int) -> None:
        self._storage = storage  # None for size-0 arrays: Taichi cannot allocate them
        self._generation = generation
        self.shape = tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype)

    @property
    def storage(self) -> Any:
        """The flat Taichi ndarray this array views from its start (None when it is empty): two
        arrays share memory exactly when they share it (reshape is the only view)."""
        return self._storage

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def _ndarray(self):
        """The live flat ti.Ndarray (raises if Taichi was re-initialised since)."""
        if self._generation != _state["generation"]:
            raise RuntimeError(
                "this DeviceArray belongs to a Taichi runtime that was re-initialised (arch switch); "
                "it is no longer valid: create it again from NumPy"
            )
        return self._storage

    def reshape(self, *shape: Any) -> DeviceArray:
        """A view with a new shape and the same storage (no copy); one dimension may be -1."""
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        shape = tuple(int(s) for s in shape)
        if shape.count(-1) > 1:
            raise ValueError(f"reshape: only one dimension can be -1, got {shape}")
        if -1 in shape:
            known = math.prod(s for s in shape if s != -1)
            if known == 0 or self.size % known:
                raise ValueError(f"reshape: cannot reshape an array of size {self.size} into {shape}")
            shape = tuple(self.size // known if s == -1 else s for s in shape)
        if any(s < 0 for s in shape) or math.prod(shape) != self.size:
            raise ValueError(f"reshape: cannot reshape an array of size {self.size} into {shape}")
        self._ndarray()
        return DeviceArray(self._storage, shape, self.dtype, self._generation)

    def numpy(self) -> np.ndarray:
        """Copy to a new host ``numpy.ndarray`` (one counted device-to-host transfer)."""
        storage = self._ndarray()
        _count_transfer("device_to_host", self.nbytes)
        if storage is None:
            return np.empty(self.shape, dtype=self.dtype)
        with thread_context():
            return storage.to_numpy().reshape(self.shape)

    def __array__(self, dtype=None, copy=None):
        # NOTE: lets np.asarray(device_array) work; it is a counted transfer like .numpy().
        a = self.numpy()
        return a if dtype is None else a.astype(dtype, copy=False)

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d DeviceArray")
        return self.shape[0]

    def __repr__(self) -> str:
        arch = _state["actual"] if self._generation == _state["generation"] else "invalid"
        return f"DeviceArray(shape={self.shape}, dtype={self.dtype}, arch={arch})"


# ----------------------------------------------------------------------------- array API


def check_dtype(dtype: np.dtype, argname: str) -> None:
    """Accept float32 and float16; refuse float64 (Metal has none) and everything else."""
    dtype = np.dtype(dtype)
    if dtype in FLOAT_DTYPES:
        return
    if dtype == np.float64:
        raise TypeError(
            f"{argname} has dtype float64, which the taichi backend does not support (Metal has no "
            "float64); convert it to float32, or use the numpy or numba backend"
        )
    raise TypeError(f"{argname} should be float16 or float32 on the taichi backend, got {dtype}")


def is_array(obj: object) -> bool:
    return isinstance(obj, DeviceArray)


def empty(shape: tuple[int, ...], dtype: np.dtype) -> DeviceArray:
    """Allocate a new, unpooled DeviceArray; size 0 allocates nothing.

    Its contents are undefined: Taichi zero-fills a new ndarray, but on Vulkan in 4-byte units
    only, so the last element of a float16 or uint16 array of odd length may hold a freed array's
    bits. Zero what must start at zero (``taifuse.pool.zeros``).

    What the pool's :data:`ALLOCATOR` calls on a miss; results and scratch come from
    ``taifuse.pool`` instead.
    """
    _require_init()
    dtype = np.dtype(dtype)
    if dtype not in (INDEX_DTYPE, BITS_DTYPE):
        check_dtype(dtype, "empty: dtype")
    shape = tuple(int(s) for s in shape)
    if any(s < 0 for s in shape):
        raise ValueError(f"empty: shape should be non-negative, got {shape}")
    size = math.prod(shape)
    if size > _MAX_ELEMENTS:
        raise ValueError(f"the taichi backend indexes with 32-bit ints: {size} elements is too many")
    storage = _make_storage(_ti_dtype(dtype), size) if size else None
    return DeviceArray(storage, shape, dtype, _state["generation"])


def from_numpy(a: np.ndarray) -> DeviceArray:
    """Copy a host array to the device (one counted host-to-device transfer)."""
    a = _device_host_array(a)
    return _copy_in(empty(a.shape, a.dtype), a)


def from_numpy_pooled(a: np.ndarray) -> DeviceArray:
    """:func:`from_numpy` into a buffer from the device pool, which takes it back when the array
    is dropped (the data loader's batches: the same shapes every step, so nothing is allocated
    after the first few)."""
    from taifuse import pool

    a = _device_host_array(a)
    return _copy_in(pool.empty(ALLOCATOR, a.shape, a.dtype), a)


def _device_host_array(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype == BITS_DTYPE:
        pass  # bit patterns, kept as they are
    elif a.dtype.kind in "biu":
        if a.size and (a.min() < np.iinfo(INDEX_DTYPE).min or a.max() > np.iinfo(INDEX_DTYPE).max):
            raise ValueError("from_numpy: integer data outside int32, the taichi backend's integer type")
        a = a.astype(INDEX_DTYPE)
    else:
        check_dtype(a.dtype, "from_numpy: array")
    return a


def _copy_in(out: DeviceArray, a: np.ndarray) -> DeviceArray:
    _count_transfer("host_to_device", a.nbytes)
    if out.size:
        with thread_context():
            out._ndarray().from_numpy(np.ascontiguousarray(a).reshape(-1))
    return out


def to_numpy(a: DeviceArray) -> np.ndarray:
    """Copy a DeviceArray to a new host array (one counted device-to-host transfer)."""
    return a.numpy()


# ----------------------------------------------------------------------------- kernel arguments


def _nd(arr: DeviceArray):
    return arr._ndarray()


def _optional(arr: DeviceArray | None, dtype: np.dtype):
    """The ndarray for an optional argument, or a 1-element stand-in (never read) when absent."""
    if arr is not None:
        return _nd(arr)
    dtype = np.dtype(dtype)
    if dtype not in _dummies:
        # Not from the pool: one element per dtype, never written, kept as long as the runtime.
        _dummies[dtype] = _make_storage(_ti_dtype(dtype), 1)
    return _dummies[dtype]


# ----------------------------------------------------------------------------- the pool's allocator

_device_lease_class: type | None = None


def _device_lease(block: Any, returns: deque) -> Any:
    """A per-lease ``ti.Ndarray`` over ``block``'s device allocation (NOTE [ Buffer ownership ] in
    taifuse/pool.py): reshaped DeviceArrays share their ``_storage``, so this object is what every
    view of the lease keeps alive."""
    global _device_lease_class
    if _device_lease_class is None:
        import sys as _sys

        from taichi.lang._ndarray import ScalarNdarray

        class _DeviceLease(ScalarNdarray):
            # Built without __init__ (no allocation of its own); it borrows the pooled storage's
            # attributes, including the C++ handle ``arr``, so kernels see the same memory.
            # Held by the class: at interpreter exit this module's globals may be None already.
            _is_finalizing = staticmethod(_sys.is_finalizing)

            def __del__(self) -> None:
                if self._is_finalizing():
                    return
                self._returns.append(self._block)

        _device_lease_class = _DeviceLease
    lease = _device_lease_class.__new__(_device_lease_class)
    lease.__dict__.update(block.storage.__dict__)
    lease._block = block
    lease._returns = returns
    return lease


@functools.cache
def _fill_kernel(dtype: np.dtype):
    """A kernel ``fill(x, n, value)`` that sets the ``n`` elements of a flat ``dtype`` ndarray to
    ``value`` (a float32 for the float dtypes, an int32 for the integer ones) cast to ``dtype``.

    The pool's fill (its ``zero=True`` and its poison): Taichi's ``Ndarray.fill`` runs its own
    kernel on the GPU archs, which stores an int32 constant into uint16 (or a float32 into float16)
    with a "may lose precision" warning for every new value.
    """
    ti = _import_taichi()
    dtype = np.dtype(dtype)
    T = _ti_dtype(dtype)

    def fill(x, n, value):
        for i in range(n):
            x[i] = ti.cast(value, T)

    # NOTE: this module has ``from __future__ import annotations`` (its annotations are strings),
    # and Taichi reads a kernel's parameter types from its annotations as objects: set them here.
    fill.__annotations__ = {
        "x": ti.types.ndarray(dtype=T, ndim=1),
        "n": ti.i32,
        "value": ti.f32 if dtype.kind == "f" else ti.i32,
    }
    return ti.kernel(fill)


@functools.cache
def _copy_kernel(dtype: np.dtype):
    """A kernel ``copy(src, dst, n)`` that copies ``n`` elements between flat ``dtype`` arrays, one
    of them a host NumPy array (Taichi passes it as an external array): the device-to-host copy into
    a buffer the caller owns, which ``to_numpy`` (a new array per call) is not."""
    ti = _import_taichi()
    T = _ti_dtype(np.dtype(dtype))

    def copy(src, dst, n):
        for i in range(n):
            dst[i] = src[i]

    copy.__annotations__ = {
        "src": ti.types.ndarray(dtype=T, ndim=1),
        "dst": ti.types.ndarray(dtype=T, ndim=1),
        "n": ti.i32,
    }
    return ti.kernel(copy)


def copy_to_host(a: DeviceArray, out: np.ndarray) -> None:
    """Copy DeviceArray ``a`` into the existing C-contiguous host array ``out`` (same size and
    dtype): one counted device-to-host transfer and no new host buffer (taifuse.distributed stages
    device arrays through pooled host buffers this way)."""
    if out.size != a.size or out.dtype != a.dtype or not out.flags.c_contiguous:
        raise ValueError(f"copy_to_host: out should be a C-contiguous {a.dtype} array of {a.size} elements")
    storage = a._ndarray()
    _count_transfer("device_to_host", a.nbytes)
    if a.size:
        _copy_kernel(a.dtype)(storage, out.reshape(-1), a.size)
        sync()


def copy_from_host(a: DeviceArray, src: np.ndarray) -> None:
    """Overwrite DeviceArray ``a`` with host array ``src`` (same size and dtype), in place."""
    if src.size != a.size or src.dtype != a.dtype:
        raise ValueError(f"copy_from_host: src should be a {a.dtype} array of {a.size} elements")
    storage = a._ndarray()
    _count_transfer("host_to_device", a.nbytes)
    if a.size:
        storage.from_numpy(np.ascontiguousarray(src).reshape(-1))


def all_kernels() -> list[tuple[str, object]]:
    """The fill kernels, per dtype the pool may hand out, and the host copies of the float dtypes
    (taifuse.distributed's staging), for ``metal_check``."""
    fills = [(f"fill_{dtype.name}", _fill_kernel(dtype)) for dtype in _TI_DTYPES]
    return fills + [(f"copy_to_host_{dtype.name}", _copy_kernel(dtype)) for dtype in FLOAT_DTYPES]


class TaichiAllocator:
    """Device memory of the running Taichi runtime for ``taifuse.pool``: blocks are flat
    ``ti.Ndarray`` storages, leases DeviceArrays over a per-lease ndarray sharing the block's memory."""

    ON_HOST = False  # exact element counts: a ti.Ndarray's length is visible to kernels and copies

    def key(self) -> tuple:
        # A re-initialised runtime is another memory space: the old pool's blocks died with the old
        # runtime (NOTE [ Re-initialising Taichi ]).
        return (NAME, _state["actual"], _state["generation"])

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> DeviceArray:
        return empty(shape, dtype)

    def new_block(self, count: int, dtype: np.dtype) -> tuple[Any, int]:
        return empty((count,), dtype)._storage, 0

    def lease(self, block: Any, returns: deque, shape: tuple[int, ...], dtype: np.dtype) -> DeviceArray:
        return DeviceArray(_device_lease(block, returns), shape, dtype, block.storage._generation)

    def fill(self, array: DeviceArray, value: float) -> None:
        if array.size:
            _fill_kernel(array.dtype)(array._ndarray(), array.size, value)


ALLOCATOR = TaichiAllocator()
