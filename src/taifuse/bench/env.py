"""The environment a benchmark ran in, and a fingerprint that says whether two runs are comparable."""

from __future__ import annotations

import ctypes
import hashlib
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

_CACHE_DIR = Path("/sys/devices/system/cpu/cpu0/cache")
_THREAD_VARS = (
    "OMP_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "MKL_NUM_THREADS",
    "NUMBA_NUM_THREADS",
    "NUMBA_THREADING_LAYER",
    "TAIFUSE_BACKEND",
    "TAIFUSE_TAICHI_ARCH",
)
# What must match for two runs' numbers to be compared (--baseline).
FINGERPRINT_KEYS = (
    "cpu_model",
    "logical_cpus",
    "cpus_usable",
    "caches",
    "memory_gib",
    "system",
    "machine",
    "python",
    "numpy",
    "blas",
    "numba",
    "taichi",
    "torch",
    "backend",
    "thread_counts",
)


def _parse_size(text: str) -> int:
    text = text.strip().upper()
    for suffix, factor in (("K", 1024), ("M", 1024**2), ("G", 1024**3)):
        if text.endswith(suffix):
            return int(float(text[:-1]) * factor)
    return int(text)


def cpu_caches() -> list[dict]:
    """Data/unified caches of CPU 0 from sysfs (empty where sysfs does not say): level, type, bytes."""
    caches = []
    if not _CACHE_DIR.is_dir():
        return caches
    for index in sorted(_CACHE_DIR.glob("index*")):
        try:
            kind = (index / "type").read_text().strip()
            if kind == "Instruction":
                continue
            caches.append(
                {
                    "level": int((index / "level").read_text()),
                    "type": kind,
                    "bytes": _parse_size((index / "size").read_text()),
                    "shared_cpu_list": (index / "shared_cpu_list").read_text().strip(),
                }
            )
        except (OSError, ValueError):
            continue
    return caches


def largest_cache_bytes(caches: list[dict] | None = None) -> int | None:
    caches = cpu_caches() if caches is None else caches
    return max((c["bytes"] for c in caches), default=None)


def cache_level(working_set_bytes: int, caches: list[dict] | None = None) -> str:
    """Where a working set of this many bytes lives: ``"L1"``, ``"L2"``, ``"L3"`` or ``"DRAM"``.

    Judged against the nominal sizes (a shared L3 on a busy or virtual machine holds less).
    """
    caches = cpu_caches() if caches is None else caches
    if not caches:
        return "unknown (no cache sizes)"
    for cache in sorted(caches, key=lambda c: c["level"]):
        if working_set_bytes <= cache["bytes"]:
            return f"L{cache['level']}"
    return "DRAM"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def blas_threads() -> int | None:
    """Threads of the OpenBLAS that NumPy loaded, asked through its C API (None if not found)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    paths = {line.split()[-1] for line in maps.splitlines() if "openblas" in line.lower() and ".so" in line}
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for symbol in (
            "scipy_openblas_get_num_threads64_",
            "openblas_get_num_threads64_",
            "openblas_get_num_threads",
        ):
            fn = getattr(lib, symbol, None)
            if fn is not None:
                fn.restype = ctypes.c_int
                return int(fn())
    return None


def thread_settings() -> dict:
    """Thread counts of the libraries this process has imported (nothing is imported here)."""
    threads: dict = {"blas": blas_threads()}
    numba = sys.modules.get("numba")
    if numba is not None:
        threads["numba"] = numba.get_num_threads()
        try:
            threads["numba_layer"] = numba.threading_layer()
        except ValueError:  # no parallel region has run yet
            threads["numba_layer"] = f"not started (configured: {numba.config.THREADING_LAYER})"
    torch = sys.modules.get("torch")
    if torch is not None:
        threads["torch"] = torch.get_num_threads()
        threads["torch_interop"] = torch.get_num_interop_threads()
    return threads


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages: other work on the machine skews every timing."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def _git(*args: str) -> str | None:
    root = Path(__file__).resolve().parents[3]
    try:
        done = subprocess.run(
            ["git", "-C", str(root), *args], check=False, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _blas_info() -> dict:
    import numpy as np

    try:
        config = np.show_config(mode="dicts")
    except TypeError:  # NumPy < 1.25 only prints
        return {"name": "unknown (numpy.show_config has no mode='dicts')"}
    deps = config.get("Build Dependencies", {})
    return {
        "blas": deps.get("blas", {}),
        "lapack": deps.get("lapack", {}),
        "simd": config.get("SIMD Extensions", {}),
    }


def collect(
    backend: str | None = None, backend_info: dict | None = None, worker_threads: dict | None = None
) -> dict:
    """The environment block: hardware, OS, Python, libraries and their threads, git state, timer.

    ``backend``/``backend_info`` come from the active taifuse backend; ``worker_threads`` are the
    thread counts a benchmark worker process saw (the parent may not import numba or torch).
    """
    import numpy as np

    from taifuse.bench.timing import timer_resolution_ns

    caches = cpu_caches()
    threads = worker_threads or thread_settings()
    memory = _memory_bytes()
    blas = _blas_info()
    blas_name = blas.get("blas", {}).get("name", "unknown")
    blas_version = blas.get("blas", {}).get("version", "")
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no")
    env = {
        "cpu_model": _cpu_model(),
        "logical_cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "caches": [{k: c[k] for k in ("level", "type", "bytes")} for c in caches],
        "memory_bytes": memory,
        "memory_gib": round(memory / 1024**3) if memory else None,
        "system": platform.system(),
        "machine": platform.machine(),
        "os": platform.platform(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "numpy": np.__version__,
        "blas": f"{blas_name} {blas_version}".strip(),
        "numpy_config": blas,
        "numba": _version("numba"),
        "taichi": _version("taichi"),
        "torch": _version("torch"),
        "taifuse": _version("taifuse"),
        "backend": backend,
        "backend_info": backend_info or {},
        "taichi_arch": (backend_info or {}).get("arch")
        or f"taichi not active (TAIFUSE_TAICHI_ARCH={os.environ.get('TAIFUSE_TAICHI_ARCH', 'unset')})",
        "threads": threads,
        "thread_counts": {k: threads.get(k) for k in ("blas", "numba")},
        "thread_env": {k: os.environ[k] for k in _THREAD_VARS if k in os.environ},
        "git_commit": commit,
        "git_dirty": None if status is None else bool(status),
        "timer": timer_resolution_ns(),
    }
    env["fingerprint"] = fingerprint(env)
    return env


def fingerprint(env: dict) -> str:
    """A short hash of the keys in :data:`FINGERPRINT_KEYS` (hardware, software, backend, threads)."""
    data = json.dumps({k: env.get(k) for k in FINGERPRINT_KEYS}, sort_keys=True, default=str)
    return hashlib.sha256(data.encode()).hexdigest()[:16]


def fingerprint_differences(old: dict, new: dict) -> list[str]:
    """The fingerprint keys on which two environment blocks differ, as ``"key: old -> new"``."""
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in FINGERPRINT_KEYS if old.get(k) != new.get(k)]
