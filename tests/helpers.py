"""Shared test machinery: the backends under test, the float64 reference of every op, one tolerance
table and :func:`check_op`, the one helper every op test goes through (in the spirit of tinygrad's
``helper_test_op``).

``check_op(spec, "gelu", x, approximate="tanh")`` runs ``taifuse.functional.gelu`` on the backend
``spec`` describes and compares the result with the float64 reference: the kernels of
``taifuse.backends.reference`` run on float64 copies of the same inputs (shaped here, independently
of ``functional.py``). The comparison is

    |got - ref| <= tol.floor + tol.atol * scale + tol.rtol * |ref|

where ``tol = TOLERANCES[dtype]`` and ``scale`` is the magnitude of the quantities the op computes
with (see :func:`reference`): for ``x * g(x)`` the rounding error of a correct float32 kernel grows
with ``|x|`` even where the result is tiny, and a dot product's error grows with ``|x| @ |w|.T``.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import platform
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from hypothesis import strategies as st

# Reasons a test skips a sample that taifuse refuses (after checking the refusal) or cannot spell,
# by design, on a backend that did run, or a case a test leaves out on a backend that runs its
# other cases (a subset kept for the suite's time): conftest's required-backend guard lets these
# skips stand.
REFUSED_BY_DESIGN = "refused by design: "
CANNOT_EXPRESS = "taifuse cannot express it: "
SUBSET = "a subset on this backend: "
DESIGN_SKIPS = (REFUSED_BY_DESIGN, CANNOT_EXPRESS, SUBSET)

import taifuse
import taifuse.functional as F
from taifuse import backends
from taifuse.backends import reference as R

F16, F32, F64 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)
DTYPES = (F16, F32, F64)


@dataclass(frozen=True)
class Tol:
    rtol: float  # times |ref|
    atol: float  # times the op's scale (see the module docstring)
    floor: float  # absolute, for results at the bottom of the dtype's range


# NOTE [ Tolerance table ]
# One entry per dtype; every backend and every op is held to it. How the numbers were chosen:
# * float16 is storage only: a kernel computes in float32 and rounds once into float16, while the
#   reference is exact, so a correct kernel is within 1 ulp of float16 (2**-10 ~ 9.8e-4 relative;
#   half an ulp for the rounding plus float32 noise that can tip a value past a rounding midpoint).
#   atol covers the float32 arithmetic underneath (the float32 entry's atol, rounded up), and the floor is
#   one float16 subnormal step (5.96e-8), the spacing of the smallest results.
# * float32: rtol 4e-6 is ~32 ulp (2**-23 ~ 1.19e-7): a handful of roundings in a short formula
#   plus the error of a vectorisable exp/tanh/erf approximation, measured below 1e-6 absolute
#   (docs/backends.md, "Numba"). atol 1e-6 (~8 ulp) per unit of scale covers x * g(x) where g carries the
#   approximation error, and a float32 sum or dot product whose error grows with the magnitudes
#   summed. The floor, 1e-37 (~8.5x float32's smallest normal), lets a result near the bottom of
#   the range come out as 0: a GPU (or fastmath, or an exp built from exponent bits) flushes
#   subnormal intermediates such as exp(x - max) before softmax's division.
# * float64 runs exact libm math (CONTRACT: "exact libm math for f64"), so only summation order
#   differs from the reference: rtol 1e-12 and atol 1e-13 per unit of scale leave ~500 ulp for that.
# Measured headroom (numba and taichi-cpu, 50k-element inputs at scales 1e-3..1e3): the worst error is
# 0.5 of the bound in float16 (the half-ulp rounding), and in float32 0.04 for elementwise ops and
# 0.25 for softmax and linear, so the table is not what a correct kernel leans on.
# Ops with a documented fast approximation may get their own entry in OP_TOLERANCES, with a why.
TOLERANCES: dict[np.dtype, Tol] = {
    F16: Tol(rtol=1e-3, atol=2e-6, floor=float(np.finfo(np.float16).smallest_subnormal)),
    F32: Tol(rtol=4e-6, atol=1e-6, floor=1e-37),
    F64: Tol(rtol=1e-12, atol=1e-13, floor=float(np.finfo(np.float64).tiny)),
}
OP_TOLERANCES: dict[tuple[str, np.dtype], Tol] = {}


def tolerance(op: str, dtype: np.dtype) -> Tol:
    return OP_TOLERANCES.get((op, np.dtype(dtype)), TOLERANCES[np.dtype(dtype)])


# ----------------------------------------------------------------------------- backends under test

METAL_HOST = sys.platform == "darwin" and platform.machine() in ("arm64", "aarch64")
# On Apple silicon the GPU param is the real Metal; elsewhere Vulkan (lavapipe on CI) is its proxy.
GPU_PARAM = "taichi-metal" if METAL_HOST else "taichi-vulkan"
# CUDA is the one real GPU the project can reach (the device machine of benchmarks/gpu/run.sh): it
# shares Taichi's front end and ndarray runtime with Metal. Skipped at once where no NVIDIA driver is.
CUDA_PARAM = "taichi-cuda"
BACKEND_PARAMS = ("numpy", "numba", "taichi-cpu", GPU_PARAM, CUDA_PARAM)


def current_taichi_arch() -> str | None:
    """The arch Taichi actually runs on ('cpu', 'vulkan', 'metal', ...), or None before it started."""
    ti = sys.modules.get("taichi")
    if ti is None:
        return None
    arch = ti.lang.impl.current_cfg().arch
    return "cpu" if arch in (ti.x64, ti.arm64) else arch.name


@dataclass(frozen=True)
class BackendSpec:
    """One backend under test: a fixture param such as ``'taichi-vulkan'``."""

    param: str

    @property
    def name(self) -> str:
        return self.param.split("-")[0]

    @property
    def arch(self) -> str | None:
        return self.param.split("-")[1] if "-" in self.param else None

    @property
    def may_be_absent(self) -> bool:
        """Only a GPU runtime may be missing on a machine that has the backend's package installed."""
        return self.arch in ("vulkan", "metal", "cuda") or importlib.util.find_spec(self.name) is None

    @property
    def supports_f64(self) -> bool:
        return self.name != "taichi"

    def module(self):
        return backends.get_module(self.name)

    def is_active(self) -> bool:
        if backends._active_name != self.name:
            return False
        return self.arch is None or current_taichi_arch() == self.arch

    def activate(self) -> None:
        """Make this backend active again, whatever a test did since (switched backends, re-ran ti.init).

        Always through ``set_backend``: backend ``init`` is idempotent and cheap when nothing
        changed, and only it can tell that Taichi was re-initialised behind the dispatcher's back.
        """
        taifuse.set_backend(self.name, arch=self.arch)
        assert self.is_active(), f"{self.param} did not start"


_start_failures: dict[str, str] = {}


def cuda_absent() -> str | None:
    """Why the taichi-cuda param cannot run here, or None when an NVIDIA GPU and its driver are.

    Asked of the driver without starting Taichi: a failed ti.init(arch=cuda) would fall back to the
    CPU and re-initialise Taichi under the other backends' tests."""
    if importlib.util.find_spec("taichi") is None:
        return "the 'taichi' package is not installed"
    if backends.best_taichi_arch() != "cuda":
        return "no NVIDIA GPU with its driver (libcuda.so.1 and /dev/nvidia*) on this machine"
    return None


def start(spec: BackendSpec) -> str | None:
    """Start ``spec``'s backend; returns why it is unavailable, or None when it runs as asked."""
    if spec.param in _start_failures:
        return _start_failures[spec.param]
    reason = None
    if importlib.util.find_spec(spec.name) is None:
        reason = f"the {spec.name!r} package is not installed"
    elif importlib.util.find_spec(backends._MODULES[spec.name]) is None:
        reason = f"the module {backends._MODULES[spec.name]} does not exist"
    elif spec.arch == "cuda" and cuda_absent() is not None:
        reason = cuda_absent()
    else:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            taifuse.set_backend(spec.name, arch=spec.arch)
        if taifuse.get_backend() != spec.name:
            reason = "; ".join(str(w.message) for w in caught) or f"started {taifuse.get_backend()} instead"
        elif spec.arch is not None and current_taichi_arch() != spec.arch:
            # Taichi itself falls back to the CPU when an arch is missing (it logs, does not raise).
            reason = f"Taichi started on {current_taichi_arch()!r}, not {spec.arch!r} (is the runtime installed?)"
    if reason is not None:
        _start_failures[spec.param] = reason
    return reason


# ----------------------------------------------------------------------------- float64 reference


def _f64(a: Any) -> Any:
    return None if a is None else np.array(a, dtype=np.float64)  # a copy: the reference never aliases


def _unary(kernel: str, *extra: Any) -> Callable:
    def run(x, **_):
        x = _f64(x)
        out = np.empty_like(x)
        getattr(R, kernel)(x, out, *extra)
        return out, np.maximum(1.0, np.abs(x))

    return run


def _ref_gelu(x, approximate="none"):
    return _unary("gelu", approximate)(x)


def _ref_leaky_relu(x, negative_slope=0.01):
    slope = float(negative_slope)
    out, scale = _unary("leaky_relu", slope)(x)
    return out, scale * max(1.0, abs(slope))


def _ref_binary(op: str, a, b):
    a, b = np.broadcast_arrays(_f64(a), _f64(b))
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    out = np.empty_like(a)
    getattr(R, op)(a, b, out)
    scale = np.abs(a) + np.abs(b) if op == "add_relu" else np.abs(a * b)
    return out, np.maximum(1.0, scale)


_ref_add_relu = functools.partial(_ref_binary, "add_relu")
_ref_mul_relu = functools.partial(_ref_binary, "mul_relu")


def _ref_affine(x, scale, bias):
    # A Python number for scale or bias is taken in x's dtype, as functional.affine documents.
    scale, bias = (np.asarray(v, dtype=x.dtype) for v in (scale, bias))
    x = _f64(x)
    c = x.shape[-1]
    s = np.broadcast_to(_f64(scale), (c,)).copy()
    b = np.broadcast_to(_f64(bias), (c,)).copy()
    x2 = x.reshape(math.prod(x.shape[:-1]), c)
    out = np.empty_like(x2)
    if x2.size:
        R.affine(x2, s, b, out)
    mag = np.abs(x2 * s) + np.abs(b)
    return out.reshape(x.shape), np.maximum(1.0, mag).reshape(x.shape)


def _ref_linear(x, weight, bias=None, activation=None):
    x, w, b = _f64(x), _f64(weight), _f64(bias)
    m, k = w.shape
    x2 = x.reshape(math.prod(x.shape[:-1]), k)
    out = np.empty((x2.shape[0], m))
    if out.size:
        R.linear_act(x2, w, b, activation, out)
    mag = np.abs(x2) @ np.abs(w).T + (0.0 if b is None else np.abs(b))
    shape = x.shape[:-1] + (m,)
    return out.reshape(shape), np.maximum(1.0, mag).reshape(shape)


def _ref_softmax_like(op: str, x, dim=-1):
    x = _f64(x)
    shape = x.shape if x.ndim else (1,)
    d = dim % len(shape)
    view = (math.prod(shape[:d]), shape[d], math.prod(shape[d + 1 :]))
    x3 = x.reshape(view)
    out = np.empty_like(x3)
    if x3.size:
        getattr(R, op)(x3, out)
        spread = np.abs(x3 - x3.max(axis=1, keepdims=True))  # what exp() and the subtraction see
    else:
        spread = np.zeros_like(x3)
    if op == "softmax":
        # exp(x - max) is relatively accurate to eps * |x - max|: the error scales with the output.
        scale = np.abs(out) * (1.0 + spread)
    else:
        scale = 1.0 + spread + math.log(max(view[1], 1))
    return out.reshape(x.shape), scale.reshape(x.shape)


_ref_softmax = functools.partial(_ref_softmax_like, "softmax")
_ref_log_softmax = functools.partial(_ref_softmax_like, "log_softmax")


def _ref_layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    x, w, b = _f64(x), _f64(weight), _f64(bias)
    norm = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    d = math.prod(norm)
    x2 = x.reshape(x.size // d if d else 0, d)
    out = np.empty_like(x2)
    if x2.size:
        rows = x2.shape[0]
        R.layer_norm(
            x2, None if w is None else w.reshape(-1), None if b is None else b.reshape(-1), eps, out,
            np.empty(rows), np.empty(rows),
        )
        mu = x2.mean(axis=1, keepdims=True)
        rstd = 1.0 / np.sqrt(((x2 - mu) ** 2).mean(axis=1, keepdims=True) + eps)
        # A float32 row sum is off by ~eps * sqrt(D) * |x| (rounding errors of D terms add up in
        # quadrature), and (x - mean) * rstd carries it; weight and bias scale what follows.
        wabs = 1.0 if w is None else np.abs(w).reshape(1, -1)
        babs = 0.0 if b is None else np.abs(b).reshape(1, -1)
        mag = (np.abs(x2) + np.abs(mu)) * rstd * math.sqrt(d) * wabs + babs
    else:
        mag = np.zeros_like(x2)
    return out.reshape(x.shape), np.maximum(1.0, mag).reshape(x.shape)


def _ref_rms_norm(input, normalized_shape, weight=None, eps=None):
    x, w = _f64(input), _f64(weight)
    norm = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if eps is None:  # PyTorch's: the compute dtype's epsilon (float32 for float16 storage)
        eps = float(np.finfo(np.float64 if np.asarray(input).dtype == np.float64 else np.float32).eps)
    d = math.prod(norm)
    x2 = x.reshape(x.size // d if d else 0, d)
    out = np.empty_like(x2)
    if x2.size:
        R.rms_norm(x2, None if w is None else w.reshape(-1), eps, out, np.empty(x2.shape[0]))
        # A float32 sum of squares is off by ~eps * sqrt(D) relative (as layer_norm's row sums).
        rstd = 1.0 / np.sqrt((x2 * x2).mean(axis=1, keepdims=True) + eps)
        wabs = 1.0 if w is None else np.abs(w).reshape(1, -1)
        mag = np.abs(x2) * rstd * math.sqrt(d) * wabs
    else:
        mag = np.zeros_like(x2)
    return out.reshape(x.shape), np.maximum(1.0, mag).reshape(x.shape)


def _ref_embedding(input, weight, padding_idx=None):
    idx = np.asarray(input)
    w = _f64(weight)
    out = np.empty((idx.size, w.shape[1]))
    R.embedding(idx.reshape(-1), w, out)
    return out.reshape(idx.shape + (w.shape[1],)), np.ones(out.shape).reshape(idx.shape + (w.shape[1],))


def reference(op: str, *args: Any, **kwargs: Any) -> tuple[np.ndarray, np.ndarray]:
    """(float64 result, scale) of ``taifuse.functional.<op>(*args, **kwargs)`` per backends/reference.

    By the op's name: ``_ref_<op>`` above where the op takes more than its input (its arguments,
    a reshape, its own error scale), else the reference kernel of that name as an elementwise
    ``kernel(x, out)``.
    """
    by_name = globals().get(f"_ref_{op}")
    if by_name is not None:
        return by_name(*args, **kwargs)
    if op in backends.KERNEL_NAMES:
        return _unary(op)(*args, **kwargs)
    raise KeyError(f"no reference for {op!r}")


# ----------------------------------------------------------------------------- comparison


def assert_close(
    got: np.ndarray, ref: np.ndarray, scale: np.ndarray | float, tol: Tol, what: str, inputs: tuple = ()
) -> None:
    """Assert ``got`` matches ``ref`` per the module docstring's formula; non-finite values must match exactly."""
    got64 = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert got64.shape == ref.shape, f"{what}: shape {got64.shape}, expected {ref.shape}"
    if ref.size == 0:
        return
    nonfinite = ~np.isfinite(ref)
    # Where the exact result rounds to inf in the storage dtype, a correct kernel's does too.
    with np.errstate(over="ignore"):
        overflow = np.isinf(ref.astype(got.dtype)) & ~nonfinite
    special = nonfinite | overflow
    expected_special = np.where(overflow, np.copysign(np.inf, ref), ref)
    bad = special & ~((got64 == expected_special) | (np.isnan(got64) & np.isnan(expected_special)))
    err = np.where(special, 0.0, np.abs(got64 - np.where(special, 0.0, ref)))
    bound = tol.floor + tol.atol * np.broadcast_to(scale, ref.shape) + tol.rtol * np.abs(np.where(special, 0.0, ref))
    bad |= ~(err <= bound)  # NaN in got fails here
    if bad.any():
        idx = np.unravel_index(int(np.argmax(bad)), ref.shape)
        ratio = np.where(special, 0.0, err / bound)
        worst = np.unravel_index(int(np.nanargmax(ratio)), ref.shape)
        lines = [
            f"{what}: {int(bad.sum())} of {ref.size} elements out of tolerance {tol}",
            f"  first at {idx}: got {got64[idx]!r}, reference {ref[idx]!r}, bound {bound[idx]:.3g}",
            f"  worst err/bound {ratio[worst]:.3g} at {worst}: got {got64[worst]!r}, reference {ref[worst]!r}",
        ]
        for name, arr in inputs:
            if isinstance(arr, np.ndarray) and arr.shape == ref.shape:
                lines.append(f"  {name}[first] = {arr[idx]!r}, {name}[worst] = {arr[worst]!r}")
        raise AssertionError("\n".join(lines))


def max_error_ratio(got: np.ndarray, ref: np.ndarray, scale: Any, tol: Tol) -> float:
    """Largest err/bound over the finite elements (for measuring how much headroom a tolerance leaves)."""
    got64, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    ok = np.isfinite(ref) & np.isfinite(got64)
    if not ok.any():
        return 0.0
    bound = tol.floor + tol.atol * np.broadcast_to(scale, ref.shape) + tol.rtol * np.abs(ref)
    return float(np.max(np.abs(got64 - ref)[ok] / bound[ok]))


def check_op(spec: BackendSpec, op: str, *args: Any, **kwargs: Any) -> np.ndarray | None:
    """Run ``taifuse.functional.<op>`` on ``spec``'s backend and compare it with the float64 reference.

    Also checks: the result's type, shape and dtype; inputs are not modified; ``out=`` gives the
    same result in the caller's buffer. On a backend without float64 the op must raise a
    ``TypeError`` naming float64 instead. Returns the result (None when the op was refused).
    """
    spec.activate()
    dtype = args[0].dtype
    fn = getattr(F, op)
    if dtype == F64 and not spec.supports_f64:
        try:
            fn(*args, **kwargs)
        except TypeError as exc:
            assert "float64" in str(exc), f"{op}: the float64 TypeError should say float64, got {exc}"
            return None
        raise AssertionError(f"{op} on {spec.param} accepted float64; it should raise TypeError")

    before = [a.copy() if isinstance(a, np.ndarray) else a for a in args]
    # A float16 result that overflows is inf on purpose (the reference rounds to inf too).
    def quiet():
        return np.errstate(over="ignore")

    with quiet():
        got = fn(*args, **kwargs)
    for name_i, (a, b) in enumerate(zip(args, before)):
        if isinstance(a, np.ndarray):
            np.testing.assert_array_equal(a, b, err_msg=f"{op} modified its input #{name_i}", strict=True)
    assert isinstance(got, np.ndarray), f"{op}: NumPy in should give NumPy out, got {type(got).__name__}"
    assert got.dtype == dtype, f"{op}: result dtype {got.dtype}, expected {dtype}"

    with quiet():
        ref, scale = reference(op, *args, **kwargs)
    described = ", ".join(
        [f"{type(a).__name__}{getattr(a, 'shape', '')}" for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    )
    assert_close(got, ref, scale, tolerance(op, dtype), f"{op}({described}) on {spec.param} {dtype}",
                 inputs=(("x", args[0]),))

    out = np.full(got.shape, np.nan, dtype=dtype)
    with quiet():
        returned = fn(*args, **kwargs, out=out)
    assert returned is out, f"{op}: with out= the op should return out itself"
    np.testing.assert_array_equal(out, got, err_msg=f"{op}: out= gave a different result", strict=True)
    return got


# ----------------------------------------------------------------------------- hypothesis strategies

# Values a kernel must get right beyond the bulk: signed zeros, where tanh/sigmoid/erf saturate in
# float32 (|x| ~ 9-20), where float32 exp overflows (88.7), and magnitudes far past all of them.
SPECIAL_VALUES = (0.0, -0.0, 1.0, -1.0, 3.0, -3.0, 9.0, -9.0, 20.0, -20.0, 88.0, -88.0, 89.0, -89.0, 1e4, -1e4)
# Shapes past every small-size path, some odd-sized, one over 2**17 elements.
LARGE_SHAPES = ((131_073,), (257, 513), (3, 129, 67))


@st.composite
def shapes(draw, min_dims: int = 0, max_dims: int = 3, max_side: int = 9, large: bool = True) -> tuple[int, ...]:
    """Shapes with empty, one-element, odd and 3-D cases, and now and then a large one."""
    if large and draw(st.integers(0, 9)) == 0:
        candidates = [s for s in LARGE_SHAPES if min_dims <= len(s) <= max_dims]
        if candidates:
            return draw(st.sampled_from(candidates))
    return tuple(draw(st.lists(st.integers(0, max_side), min_size=min_dims, max_size=max_dims)))


@st.composite
def arrays(draw, shape: tuple[int, ...], dtype: np.dtype, scales=(1e-3, 1.0, 4.0, 30.0, 1e3),
           specials: tuple[float, ...] = SPECIAL_VALUES) -> np.ndarray:
    """An array of ``dtype``: normal noise at a drawn scale, with drawn special values planted in it.

    Values come from a NumPy generator seeded by hypothesis (drawing every element through
    hypothesis is too slow for the large shapes); the scale and the planted values are what
    hypothesis explores and shrinks.
    """
    seed = draw(st.integers(0, 2**32 - 1))
    scale = draw(st.sampled_from(scales))
    planted = draw(st.lists(st.sampled_from(specials), max_size=6)) if specials else []
    rng = np.random.default_rng(seed)
    x = np.asarray(rng.standard_normal(shape) * scale)  # 0-d stays an array
    flat = x.reshape(-1)
    if flat.size and planted:
        flat[rng.integers(0, flat.size, len(planted))] = planted
    return x.astype(dtype)


def load_gpt_example() -> Any:
    """examples/gpt.py as the module "gpt", the name examples/train_gpt.py imports it by (its
    dataclass needs its module in sys.modules); an import of the same file by that name first is
    reused."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "gpt.py"
    loaded = sys.modules.get("gpt")
    if loaded is not None and Path(getattr(loaded, "__file__", "")).resolve() == path:
        return loaded
    spec = importlib.util.spec_from_file_location("gpt", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpt"] = module
    spec.loader.exec_module(module)
    return module
