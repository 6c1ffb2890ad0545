"""Backend dispatch: picks the active kernel table and imports it lazily.

Every backend module (``reference``, ``numba_cpu``, ``taichi_gpu``) exports the same names with the
same signatures; :data:`KERNEL_NAMES` lists the kernels and :data:`ARRAY_API` the array helpers.
A test checks that the tables match.

Selection, in order of precedence: :func:`set_backend` / :func:`use_backend`, then the environment
variable ``TAIFUSE_BACKEND`` (``numpy``, ``numba``, ``taichi`` or ``auto``), then ``auto``:
Taichi on Metal when this is a Mac with Metal, else Numba, else NumPy. ``TAIFUSE_TAICHI_ARCH``
(``metal``, ``vulkan``, ``cuda``, ``cpu``) picks Taichi's arch. A backend that fails to start falls
back to the next one in ``taichi -> numba -> numpy`` with one warning that says why.
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

BACKENDS = ("numpy", "numba", "taichi")
TAICHI_ARCHES = ("metal", "vulkan", "cuda", "cpu")

_MODULES = {
    "numpy": "taifuse.backends.reference",
    "numba": "taifuse.backends.numba_cpu",
    "taichi": "taifuse.backends.taichi_gpu",
}
_REQUIRES = {"numpy": "numpy", "numba": "numba", "taichi": "taichi"}
_FALLBACK = {"taichi": "numba", "numba": "numpy"}

# Kernels every backend exports (forward ops). Signatures are documented in reference.py,
# which is the specification.
KERNEL_NAMES = (
    "gelu",
    "relu",
    "leaky_relu",
    "silu",
    "sigmoid",
    "tanh",
    "add_relu",
    "mul_relu",
    "affine",
    "linear_act",
    "softmax",
    "log_softmax",
    "layer_norm",
    "dropout",
)
# Kernels of the autograd layer (tensor.py): a backward per differentiable op, and the losses with
# theirs. Signatures in reference.py's "Backward and loss kernels" section.
BACKWARD_KERNEL_NAMES = (
    "gelu_backward",
    "relu_backward",
    "leaky_relu_backward",
    "silu_backward",
    "sigmoid_backward",
    "tanh_backward",
    "add_relu_backward",
    "mul_relu_backward",
    "affine_backward",
    "linear_act_backward",
    "softmax_backward",
    "log_softmax_backward",
    "layer_norm_backward",
    "dropout_backward",
    "mse_loss",
    "mse_loss_backward",
    "cross_entropy",
    "cross_entropy_backward",
)
# Fused optimizer update kernels (taifuse.optim). Signatures in _optim_reference.py, which
# reference.py re-exports.
OPTIM_KERNEL_NAMES = ("sgd_step", "adam_step", "lion_step", "all_finite")
# Array helpers every backend exports.
ARRAY_API = ("NAME", "init", "describe", "check_dtype", "is_array", "from_numpy", "to_numpy", "empty")


class BackendUnavailable(RuntimeError):
    """A backend's package is missing or its runtime failed to start."""


_lock = threading.RLock()
_active: ModuleType | None = None
_active_name: str | None = None
_override: str | None = None  # set by set_backend / use_backend
_override_arch: str | None = None


def _installed(name: str) -> bool:
    return importlib.util.find_spec(_REQUIRES[name]) is not None


def available_backends() -> list[str]:
    """Names of the backends whose packages are installed (cheap: imports nothing heavy)."""
    return [name for name in BACKENDS if _installed(name)]


def _metal_possible() -> bool:
    return sys.platform == "darwin" and platform.machine() in ("arm64", "aarch64")


def _requested() -> tuple[str, str | None]:
    name = _override or os.environ.get("TAIFUSE_BACKEND", "auto").strip().lower() or "auto"
    arch = _override_arch or os.environ.get("TAIFUSE_TAICHI_ARCH", "").strip().lower() or None
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
            module.init(arch=arch or "metal")
        else:
            module.init()
    except Exception as exc:  # a runtime that fails to start is a fallback, not a crash
        raise BackendUnavailable(f"{type(exc).__name__}: {exc}") from exc
    return module


def _resolve() -> ModuleType:
    global _active, _active_name
    name, arch = _requested()
    if name == "auto":
        if _metal_possible() and _installed("taichi") and arch in (None, "metal"):
            name, arch = "taichi", "metal"
        elif _installed("numba"):
            name = "numba"
        else:
            name = "numpy"
    while True:
        try:
            module = _start(name, arch)
            break
        except BackendUnavailable as exc:
            nxt = _FALLBACK.get(name)
            if nxt is None:
                raise
            label = f"taichi (arch={arch or 'metal'})" if name == "taichi" else name
            warnings.warn(
                f"taifuse: backend {label} could not start ({exc}); falling back to {nxt}",
                RuntimeWarning,
                stacklevel=4,
            )
            name = nxt
    _active, _active_name = module, name
    return module


def active() -> ModuleType:
    """The active backend module (resolved and started on first use)."""
    module = _active
    if module is not None:
        return module
    with _lock:
        if _active is None:
            return _resolve()
        return _active


def get_backend() -> str:
    """Name of the active backend: ``'numpy'``, ``'numba'`` or ``'taichi'``."""
    active()
    assert _active_name is not None
    return _active_name


def set_backend(name: str, *, arch: str | None = None) -> None:
    """Select the backend for the ops that follow.

    Args:
        name: ``'numpy'``, ``'numba'``, ``'taichi'`` or ``'auto'``.
        arch: Taichi arch (``'metal'``, ``'vulkan'``, ``'cuda'``, ``'cpu'``); only with ``'taichi'``.

    A backend that fails to start falls back to the next one with a warning, as the automatic
    choice does. Example::

        >>> import taifuse
        >>> taifuse.set_backend("numpy")
        >>> taifuse.get_backend()
        'numpy'
    """
    global _override, _override_arch, _active, _active_name
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
    with _lock:
        _override = None if name == "auto" else name
        _override_arch = arch
        _active, _active_name = None, None
        active()


@contextlib.contextmanager
def use_backend(name: str, *, arch: str | None = None) -> Iterator[None]:
    """Context manager: run the block on backend ``name``, then restore the previous choice."""
    global _override, _override_arch, _active, _active_name
    with _lock:
        saved = (_override, _override_arch)
    set_backend(name, arch=arch)
    try:
        yield
    finally:
        with _lock:
            # Re-resolve lazily: backend init() is idempotent, and a Taichi arch switch inside
            # the block must be undone by re-initialising, not by keeping a stale module handle.
            _override, _override_arch = saved
            _active, _active_name = None, None


def get_module(name: str) -> ModuleType:
    """Import (without selecting) a backend module by name, for tests and benchmarks."""
    if name not in BACKENDS:
        raise ValueError(f"backend name should be one of {BACKENDS}, got {name!r}")
    return importlib.import_module(_MODULES[name])
