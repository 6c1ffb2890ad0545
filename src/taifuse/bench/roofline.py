"""The machine's ceilings, measured in the same run as the rows they judge: copy bandwidth and GEMM rate.

Copy: ``np.copyto`` between two float32 arrays well past the last-level cache, split into one
contiguous chunk per CPU and run on that many threads (``np.copyto`` releases the GIL), so the
ceiling is what the whole machine can copy, as the multi-threaded kernels it judges use every core;
bytes moved = read + write. GEMM: ``np.matmul(x, w.T, out=out)`` in float32 at 4096x1024x768 (2*M*N*K flops), the
product the fused-linear suite is built on.
"""

from __future__ import annotations

import itertools
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from taifuse.bench import timing
from taifuse.bench.env import largest_cache_bytes

GEMM_SHAPE = (4096, 1024, 768)  # (rows of x, inner, rows of w)
COPY_CODE = "np.copyto(dst[chunk], src[chunk]) for one contiguous chunk per CPU, on os.cpu_count() threads"
GEMM_CODE = "np.matmul(x, w.T, out=out)"
_MIB = 1024 * 1024


def copy_array_bytes(quick: bool = False) -> int:
    """Bytes of each copy array: 4x the largest cache (2x in quick mode), at least 256 (128) MiB."""
    factor, floor = (2, 128 * _MIB) if quick else (4, 256 * _MIB)
    largest = largest_cache_bytes()
    return max(factor * largest, floor) if largest else 2 * floor


def _samples(fn, samples: int) -> list[float]:
    timing.warm_up(fn)  # the first copy also faults in the destination's pages
    return [timing.time_loops(fn, 1) for _ in range(samples)]


def _time_copy(copy_bytes: int, samples: int, seed: int) -> list[float]:
    src = np.random.default_rng(seed).standard_normal(copy_bytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    workers = os.cpu_count() or 1
    bounds = np.linspace(0, src.size, workers + 1).astype(np.int64)
    chunks = [(dst[lo:hi], src[lo:hi]) for lo, hi in itertools.pairwise(bounds)]
    with ThreadPoolExecutor(max_workers=workers) as pool:

        def copy() -> None:
            for future in [pool.submit(np.copyto, d, s) for d, s in chunks]:
                future.result()

        return _samples(copy, samples)


def _time_gemm(samples: int, seed: int) -> list[float]:
    m, k, n = GEMM_SHAPE
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k), dtype=np.float32)
    w = rng.standard_normal((n, k), dtype=np.float32)
    out = np.empty((m, n), dtype=np.float32)
    return _samples(lambda: np.matmul(x, w.T, out=out), samples)


def measure(copy_bytes: int, samples: int, seed: int = 0) -> dict:
    """Time ``samples`` copies and ``samples`` GEMMs in this process; nanoseconds per call."""
    copy_ns = _time_copy(copy_bytes, samples, seed)
    gemm_ns = _time_gemm(samples, seed + 1)
    m, k, n = GEMM_SHAPE
    return {
        "copy": {"ns": copy_ns, "array_bytes": copy_bytes, "bytes_moved": 2 * copy_bytes, "code": COPY_CODE},
        "gemm": {"ns": gemm_ns, "shape": GEMM_SHAPE, "flops": 2 * m * k * n, "code": GEMM_CODE},
    }
