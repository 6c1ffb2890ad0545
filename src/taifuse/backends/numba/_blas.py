"""CBLAS ``?gemm`` from the OpenBLAS that NumPy loaded, for the products NumPy's matmul cannot
express (NOTE [ Implicit GEMM on the host ] in conv.py): an accumulating product (``beta = 1``) into
a strided output, with operands whose rows are further apart than their length.

``gemm(dtype)`` is a callable ``f(m, n, k, a, lda, b, ldb, beta, c, ldc)`` for row-major
``c[:m, :n] = a[:m, :k] @ b[:k, :n] + beta * c[:m, :n]`` on raw addresses (``alpha`` 1, no
transposes), or None where no OpenBLAS with CBLAS is loaded (another BLAS: MKL, Accelerate; callers
fall back to NumPy). It runs on the calling thread, with the GIL released (ctypes), on as many BLAS
threads as the caller allows (``_blas_single_threaded`` in attention.py).

The library is NumPy's, found among the ones ``threadpoolctl`` lists: no new dependency. More than
one OpenBLAS may be loaded (SciPy's wheels ship their own, 32-bit integers, with threads of its
own), and NumPy's comes first, by its path under NumPy's install: the other one's threads are not
held to one by ``_blas_single_threaded`` when it was loaded after that context's first use, and its
calls from the workers then ran on both cores' spinning threads, 20-30 times slower. Its symbols are
``cblas_sgemm`` or, as NumPy 2's wheels ship OpenBLAS, prefixed and suffixed
(``scipy_cblas_sgemm64_``); its integers are 64-bit when ``openblas_get_config()`` says
``USE64BITINT``. A product of small known operands checks the binding once before it is used.

``address(dtype)`` is the same function's raw address and whether its integers are 64-bit, for
jitted code that calls it itself (``call_gemm``: NOTE [ BLAS from Numba threads ] in conv.py),
with no Python, ctypes or GIL between the calls; None where ``gemm`` is None.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

_ROW_MAJOR, _NO_TRANS = 101, 111
_PREFIXES = ("scipy_", "")
_SUFFIXES = ("64_", "")
_lock = threading.Lock()
_found: dict | None = None  # dtype -> call, ("address", dtype) -> (address, ilp64), "library": its path


def _bind(dll, prefix: str, suffix: str) -> dict | None:
    try:
        config = getattr(dll, f"{prefix}openblas_get_config{suffix}")
        kernels = {t: getattr(dll, f"{prefix}cblas_{t}gemm{suffix}") for t in "sd"}
    except AttributeError:
        return None
    config.restype, config.argtypes = ctypes.c_char_p, []
    integer = ctypes.c_int64 if b"USE64BITINT" in (config() or b"") else ctypes.c_int32
    out = {}
    for t, scalar, dtype in (("s", ctypes.c_float, np.float32), ("d", ctypes.c_double, np.float64)):
        f = kernels[t]
        f.restype = None
        f.argtypes = [integer] * 6 + [scalar, ctypes.c_void_p, integer, ctypes.c_void_p, integer, scalar]
        f.argtypes += [ctypes.c_void_p, integer]

        def call(m, n, k, a, lda, b, ldb, beta, c, ldc, f=f):
            f(_ROW_MAJOR, _NO_TRANS, _NO_TRANS, m, n, k, 1.0, a, lda, b, ldb, beta, c, ldc)

        if not _checks(call, dtype):
            return None
        out[np.dtype(dtype)] = call
        out["address", np.dtype(dtype)] = (ctypes.cast(f, ctypes.c_void_p).value, integer is ctypes.c_int64)
    return out


def _checks(call, dtype) -> bool:
    # A 2 x 3 @ 3 x 2 product into a strided output, accumulated: the argument types are right.
    a = np.arange(1, 7, dtype=dtype).reshape(2, 3)
    b = np.arange(1, 13, dtype=dtype).reshape(3, 4)[:, 1:3]  # rows 4 apart
    c = np.ones((2, 5), dtype)
    call(2, 2, 3, a.ctypes.data, 3, b.ctypes.data, 4, 1.0, c.ctypes.data, 5)
    want = np.ones((2, 5), dtype)
    want[:, :2] += a @ b
    return bool(np.array_equal(c, want))


def _numpy_first(path: str) -> int:
    # 0 for a library inside NumPy's install (numpy/, numpy.libs/ beside it), 1 for any other.
    site = os.path.dirname(os.path.dirname(os.path.realpath(np.__file__)))
    inside = (os.path.join(site, "numpy") + os.sep, os.path.join(site, "numpy.libs") + os.sep)
    return 0 if os.path.realpath(path).startswith(inside) else 1


def _find() -> dict:
    from threadpoolctl import threadpool_info

    libs = [lib for lib in threadpool_info() if lib.get("internal_api") == "openblas"]
    for lib in sorted(libs, key=lambda lib: _numpy_first(lib["filepath"])):
        try:
            dll = ctypes.CDLL(lib["filepath"])
        except OSError:
            continue
        for prefix in _PREFIXES:
            for suffix in _SUFFIXES:
                bound = _bind(dll, prefix, suffix)
                if bound:
                    return dict(bound, library=lib["filepath"])
    return {}


def gemm(dtype) -> Callable | None:
    """The row-major ``?gemm`` for float32 or float64 (module docstring), or None."""
    global _found
    if _found is None:
        with _lock:
            if _found is None:
                _found = _find()
    return _found.get(np.dtype(dtype))


def address(dtype) -> tuple[int, bool] | None:
    """``(address, ilp64)`` of the CBLAS ``?gemm`` that ``gemm(dtype)`` calls, or None."""
    gemm(dtype)
    return _found.get(("address", np.dtype(dtype)))


# NOTE [ OpenBLAS spin after a product ]
# After a product, OpenBLAS's worker threads spin before they sleep: THREAD_TIMEOUT, 2**28 time-stamp
# cycles by default (about 0.1 s at 2.6 GHz), read when the threads start. Measured on the 2-core AMD
# EPYC VM: a 512 x 512 product and then 0.2 s asleep cost the process 0.108 s of CPU (0.003 s with
# the timeout at its shortest). In a training step a product comes every few milliseconds, so the
# worker never sleeps: one core spins for the whole step, and everything else that wants that core
# waits for it: attention's two worker threads (which hold BLAS to one thread per call, NOTE [ Numba
# attention threads ], so the spinning worker has nothing to do), Numba's OpenMP worker, and the
# calling thread itself when the scheduler puts them on the same core. The timeout is an environment
# variable OpenBLAS reads once, when it loads, which is before taifuse can set it; but the library
# exports ``openblas_read_env`` (read the variables again) and ``blas_thread_shutdown_`` /
# ``blas_thread_init`` (stop the workers and start them again, as OpenBLAS itself does around a
# fork), and the new workers take the new timeout. ``shorten_spin`` does that once, when the numba
# backend starts, with ``OPENBLAS_THREAD_TIMEOUT`` set only for the moment of the reading, so that
# nothing else (processes started later) inherits it; a timeout the user set
# (``OPENBLAS_THREAD_TIMEOUT`` or ``GOTO_THREAD_TIMEOUT``) is left alone, as is an OpenBLAS without
# these symbols. The value is log2 of the cycles (OpenBLAS clamps it to 4..30): 2**18 is ~0.1 ms, which
# still covers the gap between the two products of a linear's backward. Measured (quiet, 2-core AMD
# EPYC, each tree in its own process, taken in turn; medians of 8-12 steps per process):
#   * the 4-layer GPT step of the ``step`` suite, 5 pairs: 345 330 345 377 351 ms against the default's
#     345 382 393 367 369 (median of the pairs' ratios 0.951x), with 600 ms of CPU a step against 730;
#   * the example GPT step, 4 pairs: 52 57 65 68 ms against 53 63 64 80 (within this VM's spread),
#     89-111 ms of CPU against 106-161;
#   * two linears (2048 x 512 by 512 x 512) with a gelu, forward and backward, 4 pairs: 36-45 ms both;
#   * 2**16 and 2**20 on the 4-layer step: no difference from 2**18 that the spread could show.
SPIN_LOG2 = "18"


def shorten_spin() -> bool:
    """Restart NumPy's OpenBLAS workers with a short spin (NOTE [ OpenBLAS spin after a product ]);
    whether it did. Call it where no other thread runs a BLAS call (the backend's start): it is
    skipped off the main thread, where another thread may be inside a product."""
    if "OPENBLAS_THREAD_TIMEOUT" in os.environ or "GOTO_THREAD_TIMEOUT" in os.environ:
        return False
    if threading.current_thread() is not threading.main_thread():
        return False
    dll = _library()
    if dll is None:
        return False
    try:
        read_env, shutdown, start = dll.openblas_read_env, dll.blas_thread_shutdown_, dll.blas_thread_init
    except AttributeError:
        return False
    with _lock:
        os.environ["OPENBLAS_THREAD_TIMEOUT"] = SPIN_LOG2  # NOTE: os.environ sets the C environment too
        try:
            read_env()
        finally:
            del os.environ["OPENBLAS_THREAD_TIMEOUT"]
        shutdown()
        start()
    return True


def spin_log2() -> int | None:
    """The log2 of the cycles NumPy's OpenBLAS workers spin after a product, as it read it from the
    environment (0: its default, 2**28), or None where that is not known."""
    dll = _library()
    try:
        return None if dll is None else int(dll.openblas_thread_timeout())
    except AttributeError:
        return None


def _library() -> ctypes.CDLL | None:
    """The OpenBLAS that ``gemm`` binds, or None where there is none."""
    gemm(np.float32)
    path = _found.get("library")
    return None if path is None else ctypes.CDLL(path)


# CBLAS's enumerations (C ints whatever the library's integer width).
NO_TRANS, TRANS = _NO_TRANS, 112


@intrinsic
def _cblas_gemm(typingctx, fn, order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):
    # A call of the C function at address ``fn`` with these arguments' types (a, b, c: addresses).
    sig = types.void(fn, order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)

    def codegen(context, builder, signature, args):
        ptr = ir.IntType(8).as_pointer()
        values, kinds = [], []
        for i, (t, v) in enumerate(zip(signature.args[1:], args[1:])):
            if i in (7, 9, 12):
                values.append(builder.inttoptr(v, ptr))
                kinds.append(ptr)
            else:
                values.append(v)
                kinds.append(context.get_value_type(t))
        f = builder.inttoptr(args[0], ir.FunctionType(ir.VoidType(), kinds).as_pointer())
        builder.call(f, values)
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True, nogil=True, inline="always")
def call_gemm(fn, ilp64, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):
    """Row-major ``c = alpha * op(a) @ op(b) + beta * c`` through ``address``'s function from
    jitted code (``ta``, ``tb``: ``NO_TRANS`` or ``TRANS``; ``alpha``, ``beta`` in its dtype; ``a``,
    ``b``, ``c`` addresses), on the calling thread."""
    i32 = np.int32
    if ilp64:
        i = np.int64
        _cblas_gemm(
            fn, i32(101), i32(ta), i32(tb), i(m), i(n), i(k), alpha, a, i(lda), b, i(ldb), beta, c, i(ldc)
        )  # fmt: skip
    else:
        _cblas_gemm(
            fn, i32(101), i32(ta), i32(tb), i32(m), i32(n), i32(k), alpha, a, i32(lda), b, i32(ldb), beta, c, i32(ldc)
        )  # fmt: skip


@intrinsic
def take(typingctx, counter):
    """``counter[0]`` before adding one to it, atomically: the next work item of a parallel loop
    whose threads each take the next as they finish one (an int64 array)."""
    sig = types.int64(counter)

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        return builder.atomic_rmw("add", data, ir.Constant(ir.IntType(64), 1), "monotonic")

    return sig, codegen
