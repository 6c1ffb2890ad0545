"""Backend dispatch: picks the active kernel table and imports it lazily.

Every backend package (``reference``, ``numba``, ``taichi``) exports the same names with the same
signatures; :data:`KERNEL_NAMES` lists the kernels and :data:`ARRAY_API` the array helpers (the
table of kernels, from which each backend builds its own, and the op codes live in ``_spec.py``).
A test checks that the tables match.

Selection, in order of precedence: :func:`use_backend` in the current thread, then
:func:`set_backend` (for the whole process), then the environment variable ``TAIFUSE_BACKEND``
(``numpy``, ``numba``, ``taichi`` or ``auto``), then ``auto``: Taichi on Metal when this is a Mac
with Metal, else Numba, else NumPy. ``TAIFUSE_TAICHI_ARCH`` (``metal``, ``vulkan``, ``cuda``,
``cpu``) picks Taichi's arch; unset, Taichi starts on the best arch the machine has
(:func:`best_taichi_arch`). A backend that fails to start falls back to the next one in
``taichi -> numba -> numpy`` with one warning that says why.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import platform
import sys
import threading
import warnings
from collections.abc import Iterator
from types import ModuleType
from typing import Any

# The kernel tables' names live with the op codes in _spec.py (signatures: the reference backend).
from taifuse.backends._spec import ARRAY_API as ARRAY_API
from taifuse.backends._spec import BACKENDS as BACKENDS
from taifuse.backends._spec import BACKWARD_KERNEL_NAMES as BACKWARD_KERNEL_NAMES
from taifuse.backends._spec import KERNEL_NAMES as KERNEL_NAMES
from taifuse.backends._spec import OPTIM_KERNEL_NAMES as OPTIM_KERNEL_NAMES

TAICHI_ARCHES = ("metal", "vulkan", "cuda", "cpu")

_MODULES = {
    "numpy": "taifuse.backends.reference",
    "numba": "taifuse.backends.numba",
    "taichi": "taifuse.backends.taichi",
}
_REQUIRES = {"numpy": "numpy", "numba": "numba", "taichi": "taichi"}
_FALLBACK = {"taichi": "numba", "numba": "numpy"}


class BackendUnavailable(RuntimeError):
    """A backend's package is missing or its runtime failed to start."""


_lock = threading.RLock()
# The process's choice: set_backend's override, and the backend it resolved to (None: not yet).
_active: ModuleType | None = None
_active_name: str | None = None
_override: str | None = None
_override_arch: str | None = None


class _ThreadChoice(threading.local):
    """The current thread's innermost use_backend block: its request, and the backend it resolved to."""

    request: tuple[str | None, str | None] | None = None  # (name, arch); name None: auto
    module: ModuleType | None = None


_thread = _ThreadChoice()


def _installed(name: str) -> bool:
    return importlib.util.find_spec(_REQUIRES[name]) is not None


def available_backends() -> list[str]:
    """Names of the backends whose packages are installed (cheap: imports nothing heavy)."""
    return [name for name in BACKENDS if _installed(name)]


def versions() -> dict[str, str]:
    """The installed version of each backend's package (``numpy``, ``numba``, ``taichi``): read
    from the packages' metadata, so nothing is imported or started."""
    from importlib import metadata

    out = {}
    for name in available_backends():
        try:
            out[name] = metadata.version(_REQUIRES[name])
        except metadata.PackageNotFoundError:  # importable without metadata (a source checkout)
            out[name] = "version unknown"
    return out


def best_taichi_arch() -> str:
    """The arch the taichi backend starts on when none is asked for: ``'metal'`` on a Mac with
    Apple silicon, else ``'cuda'`` with an NVIDIA GPU, else ``'vulkan'`` with a Vulkan GPU, else
    ``'cpu'`` (a CPU Vulkan driver such as lavapipe does not count). Taichi is not started."""
    # By name, as every backend is reached: the dispatch imports no backend (docs/architecture.md).
    return importlib.import_module(f"{_MODULES['taichi']}._runtime").best_arch()


def _metal_possible() -> bool:
    return sys.platform == "darwin" and platform.machine() in ("arm64", "aarch64")


def _requested(override: str | None, override_arch: str | None) -> tuple[str, str | None]:
    """The backend and arch to start: an override (None for 'auto'), else the environment's."""
    name = override or os.environ.get("TAIFUSE_BACKEND", "auto").strip().lower() or "auto"
    arch = override_arch or os.environ.get("TAIFUSE_TAICHI_ARCH", "").strip().lower() or None
    if name not in BACKENDS + ("auto",):
        raise ValueError(f"TAIFUSE_BACKEND should be one of {BACKENDS + ('auto',)}, got {name!r}")
    if arch is not None and arch not in TAICHI_ARCHES:
        raise ValueError(f"TAIFUSE_TAICHI_ARCH should be one of {TAICHI_ARCHES}, got {arch!r}")
    return name, arch


def _start(name: str, arch: str | None) -> ModuleType:
    if not _installed(name):
        raise BackendUnavailable(f"the {_REQUIRES[name]!r} package is not installed")
    try:
        # Importing can fail too (a broken numba/llvmlite install, a taichi wheel without its
        # runtime): that is a fallback with a warning, exactly like a failed init().
        module = importlib.import_module(_MODULES[name])
        if name == "taichi":
            module.init(arch=arch)
        else:
            module.init()
    except Exception as exc:  # a runtime that fails to start is a fallback, not a crash
        raise BackendUnavailable(f"{type(exc).__name__}: {exc}") from exc
    return module


def _resolve(override: str | None, override_arch: str | None) -> ModuleType:
    """Start the requested backend, or the first that starts after it (one warning each)."""
    name, arch = _requested(override, override_arch)
    if name == "auto":
        if _metal_possible() and _installed("taichi") and arch in (None, "metal"):
            name, arch = "taichi", "metal"
        elif _installed("numba"):
            name = "numba"
        else:
            name = "numpy"
    if name == "taichi" and arch is None and _installed("taichi"):
        arch = best_taichi_arch()
    while True:
        try:
            module = _start(name, arch)
            break
        except BackendUnavailable as exc:
            nxt = _FALLBACK.get(name)
            if nxt is None:
                raise
            label = f"taichi (arch={arch})" if name == "taichi" else name
            warnings.warn(
                f"taifuse: backend {label} could not start ({exc}); falling back to {nxt}",
                RuntimeWarning,
                stacklevel=4,
            )
            name = nxt
    return module


def active() -> ModuleType:
    """The active backend module in this thread (resolved and started on first use)."""
    if _thread.request is not None:
        module = _thread.module
        if module is None:
            with _lock:  # NOTE: starting a backend (ti.init) is process-wide; one at a time
                module = _thread.module = _resolve(*_thread.request)
        return module
    module = _active  # every op asks: the started backend without a second call
    return module if module is not None else _process_active()


def _process_active() -> ModuleType:
    global _active, _active_name
    module = _active
    if module is not None:
        return module
    with _lock:
        if _active is None:
            module = _resolve(_override, _override_arch)
            _active, _active_name = module, module.NAME
        return _active


def get_backend() -> str:
    """Name of the active backend in this thread: ``'numpy'``, ``'numba'`` or ``'taichi'``."""
    return active().NAME


def _check_choice(name: Any, arch: str | None) -> str:
    """Validate a set_backend / use_backend choice; the name in lower case."""
    if not isinstance(name, str) or name.lower() not in BACKENDS + ("auto",):
        raise ValueError(f"backend name should be one of {BACKENDS + ('auto',)}, got {name!r}")
    name = name.lower()
    if arch is not None:
        if name != "taichi":
            raise ValueError(
                f"arch is only meaningful for the taichi backend, got arch={arch!r} with {name!r}"
            )
        if arch not in TAICHI_ARCHES:
            raise ValueError(f"arch should be one of {TAICHI_ARCHES}, got {arch!r}")
    return name


def set_backend(name: str, *, arch: str | None = None) -> None:
    """Select the backend for the ops that follow, in every thread of the process.

    Args:
        name: ``'numpy'``, ``'numba'``, ``'taichi'`` or ``'auto'``.
        arch: Taichi arch (``'metal'``, ``'vulkan'``, ``'cuda'``, ``'cpu'``); only with ``'taichi'``.

    A backend that fails to start falls back to the next one with a warning, as the automatic
    choice does. A thread inside a :func:`use_backend` block keeps that block's backend until
    it leaves the block. Example::

        >>> import taifuse
        >>> taifuse.set_backend("numpy")
        >>> taifuse.get_backend()
        'numpy'
    """
    global _override, _override_arch, _active, _active_name
    name = _check_choice(name, arch)
    with _lock:
        _override = None if name == "auto" else name
        _override_arch = arch
        _active, _active_name = None, None
        _process_active()


@contextlib.contextmanager
def use_backend(name: str, *, arch: str | None = None) -> Iterator[None]:
    """Context manager: run the block on backend ``name`` in this thread, then restore its choice.

    Like ``torch.no_grad``, the choice is the current thread's: other threads keep theirs (their
    own blocks, else :func:`set_backend`'s choice) while this one is inside the block. Blocks nest.
    ``'auto'`` is the environment's choice (``TAIFUSE_BACKEND``), or the automatic one.

    NOTE: Taichi has one runtime per process. A block on another Taichi arch than the one running
    re-initialises it for every thread, which invalidates the Taichi arrays made before; on leaving
    the block the previous arch is started again at next use. Threads that work on Taichi at the
    same time should use the same arch.

    Example::

        >>> import taifuse
        >>> taifuse.set_backend("numpy")
        >>> with taifuse.use_backend("numpy"):
        ...     taifuse.get_backend()
        'numpy'
    """
    global _active, _active_name
    name = _check_choice(name, arch)
    saved = (_thread.request, _thread.module)
    _thread.request, _thread.module = (None if name == "auto" else name, arch), None
    started = None
    try:
        started = active()  # now, so that a fallback warns at the `with`, as set_backend does
        yield
    finally:
        _thread.request, _thread.module = saved
        if started is not None and started.NAME == "taichi":
            # The block may have re-initialised Taichi on its arch: an outer block's choice and
            # the process's re-run their init() (idempotent) at next use, rather than keep a
            # handle to a runtime on another arch.
            if _thread.module is not None and _thread.module.NAME == "taichi":
                _thread.module = None
            with _lock:
                _active, _active_name = None, None


@contextlib.contextmanager
def preserved_choice() -> Iterator[None]:
    """Context manager: on exit, the process's backend choice is what it was on entry.

    For tests, doctests and benchmarks that call :func:`set_backend`: the choice made before the
    block is put back and re-resolved (and its backend re-initialised) at next use, so a block
    that switched Taichi's arch leaves nothing behind.
    """
    global _override, _override_arch, _active, _active_name
    with _lock:
        saved = (_override, _override_arch)
    try:
        yield
    finally:
        with _lock:
            _override, _override_arch = saved
            _active, _active_name = None, None


def get_module(name: str) -> ModuleType:
    """Import (without selecting) a backend module by name, for tests and benchmarks."""
    if name not in BACKENDS:
        raise ValueError(f"backend name should be one of {BACKENDS}, got {name!r}")
    return importlib.import_module(_MODULES[name])
