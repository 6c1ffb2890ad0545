"""Elementwise suite: taifuse's kernels on the active backend against the strongest NumPy code
(in-place ufuncs into preallocated buffers, ``x*x*x`` rather than ``x**3``) and PyTorch CPU."""

from __future__ import annotations

import functools

import numpy as np

from taifuse.bench.case import Case, Variant
from taifuse.bench.env import largest_cache_bytes

SUITE = "elementwise"
N = 4 * 1024 * 1024  # 16 MiB per float32 array: past L2, and past L3 on most machines
ROWS, COLS = 4096, 1024  # the same element count as a 2-D activation map for affine
_TAIFUSE = ("numpy as np", "taifuse.functional as F")
_TORCH = ("numpy as np", "torch", "torch.nn.functional as TF")
_OUT = "out = np.empty_like(x)"
# NOTE [ Like outputs ]
# Where PyTorch writes into an ``out=`` buffer, that buffer is a NumPy allocation seen through
# ``torch.from_numpy``, as taifuse's ``out`` is, warmed by the same first call: the two sides then
# read the same input and write into the same kind of memory. ``torch.empty_like`` would differ in
# more than the kernel: NumPy advises transparent huge pages for large arrays (``madvise``; checked
# on the development VM, where 14 of a 16 MiB array's MiB came back as huge pages) and PyTorch's
# allocator does not, and the two start at different offsets in a page. At a working set the size
# of the last-level cache (the affine row: 32 MiB on a 32 MiB L3) how the output's pages map onto
# the cache sets can change how much of the next call still hits (not measured on that machine),
# and the row would then time the allocators as well as the kernels.
_TORCH_OUT = "ot = torch.from_numpy(np.empty_like({like}))"


# NumPy has no erf: Abramowitz & Stegun 7.1.26 (|error| <= 1.5e-7) evaluated in place is the
# strongest pure-NumPy exact-GELU we know of; np.vectorize(math.erf) would be a strawman.
def numpy_gelu_erf(x: str = "x") -> str:
    """In-place NumPy exact GELU of the array named ``x`` into ``out`` (scratch ``t``, ``u``)."""
    return f"""
np.multiply({x}, 0.7071067811865476, out=u)
np.abs(u, out=u)
np.multiply(u, 0.3275911, out=t)
t += 1.0
np.reciprocal(t, out=t)
np.multiply(t, 1.061405429, out=out)
out -= 1.453152027
out *= t
out += 1.421413741
out *= t
out -= 0.284496736
out *= t
out += 0.254829592
out *= t
np.square(u, out=u)
np.negative(u, out=u)
np.exp(u, out=u)
out *= u
np.subtract(2.0, out, out=out, where={x} >= 0)
out *= {x}
out *= 0.5
"""


def numpy_gelu_tanh(x: str = "x") -> str:
    """In-place NumPy tanh-GELU of the array named ``x`` into ``out`` (scratch ``t``)."""
    return f"""
np.multiply({x}, {x}, out=t)
t *= {x}
t *= 0.044715
t += {x}
t *= 0.7978845608028654
np.tanh(t, out=t)
t += 1.0
np.multiply({x}, t, out=out)
out *= 0.5
"""


_NUMPY_SILU = """
np.negative(x, out=t)
np.exp(t, out=t)
t += 1.0
np.divide(x, t, out=out)
"""


def copy_bound(where: str) -> Variant:
    """The roofline's copy kernel on the case's bytes (``roofline.ThreadedCopy``: every CPU, ordinary
    stores, NOTE [ Traffic model ] in taifuse._ceilings); ``where`` names the level."""
    return Variant(
        "copy bound",
        "copy()",
        prepare="out = np.empty_like(x)\ncopy = roofline.ThreadedCopy(x, out)",
        imports=("numpy as np", "taifuse.bench.roofline as roofline"),
        same_result=False,
        note=(
            "not the same function: the roofline's copy kernel (np.add(x, 0.0, out=out) split over every "
            f"CPU, one thread each) on the same bytes, the {where} ceiling at this size"
        ),
    )


def _unary_inputs(seed: int, n: int = N) -> dict:
    return {"x": np.random.default_rng(seed).standard_normal(n, dtype=np.float32)}


def dram_elements() -> int:
    """float32 elements per array for a working set (input + output) of 4x the largest cache."""
    largest = largest_cache_bytes() or 64 * 2**20
    return max(N, (4 * largest // 8) // 2**20 * 2**20)


def _binary_inputs(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"a": rng.standard_normal(N, dtype=np.float32), "b": rng.standard_normal(N, dtype=np.float32)}


def _affine_inputs(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "x": rng.standard_normal((ROWS, COLS), dtype=np.float32),
        "scale": rng.standard_normal(COLS, dtype=np.float32),
        "bias": rng.standard_normal(COLS, dtype=np.float32),
    }


_UNARY_SETUP = f"x = np.random.default_rng(seed).standard_normal({N}, dtype=np.float32)"
_BINARY_SETUP = (
    f"rng = np.random.default_rng(seed); a, b = (rng.standard_normal({N}, dtype=np.float32) for _ in 'ab')"
)
_AFFINE_SETUP = (
    f"rng = np.random.default_rng(seed); x = rng.standard_normal(({ROWS}, {COLS}), dtype=np.float32); "
    f"scale, bias = (rng.standard_normal({COLS}, dtype=np.float32) for _ in 'sb')"
)


def _torch(code: str, prepare: str = "xt = torch.from_numpy(x)", result: str = "y") -> Variant:
    return Variant(
        "torch",
        code,
        result=result,
        prepare=prepare,
        imports=_TORCH,
        note="PyTorch CPU on zero-copy views of the same NumPy inputs",
        isolated=True,  # its OpenMP runtime is not Numba's: NOTE [ Isolated baselines ] in bench.harness
    )


def _unary_case(
    name: str,
    taifuse_code: str,
    numpy_code: str,
    torch_code: str,
    scratch: str,
    quick: bool,
    compare_torch: bool,
    extra_baselines: tuple[Variant, ...] = (),
) -> Case:
    baselines = [
        Variant(
            "numpy",
            numpy_code,
            prepare=f"{_OUT}\n{scratch}",
            note="in-place NumPy ufuncs into preallocated buffers",
        )
    ]
    if compare_torch:
        # the out= overloads of torch's own kernels (torch._C._nn), so PyTorch writes into a warm
        # NumPy allocation as taifuse's out= does, instead of allocating 16 MiB a call
        baselines.append(
            _torch(torch_code, prepare="xt = torch.from_numpy(x)\n" + _TORCH_OUT.format(like="x"), result="ot")
        )
    baselines.extend(extra_baselines)
    return Case(
        suite=SUITE,
        name=name,
        setup=_unary_inputs,
        setup_code=_UNARY_SETUP,
        candidate=Variant("taifuse", taifuse_code, prepare=_OUT, imports=_TAIFUSE),
        baselines=tuple(baselines),
        dtype="float32",
        shape=f"({N},)",
        bytes_moved=2 * 4 * N,
        bytes_written=4 * N,
        rtol=1e-5,
        atol=1e-5,
    )


def cases(quick: bool = False, compare_torch: bool = False) -> list[Case]:
    """The elementwise cases (the same list in quick mode: each is cheap, and quick only cuts samples)."""
    bound = copy_bound("in-cache")
    out = [
        _unary_case(
            "gelu(approximate='tanh')",
            "F.gelu(x, approximate='tanh', out=out)",
            numpy_gelu_tanh(),
            "torch._C._nn.gelu(xt, approximate='tanh', out=ot)",
            "t = np.empty_like(x)",
            quick,
            compare_torch,
            (bound,),
        ),
        _unary_case(
            "gelu(approximate='none')",
            "F.gelu(x, approximate='none', out=out)",
            numpy_gelu_erf(),
            "torch._C._nn.gelu(xt, out=ot)",
            "t = np.empty_like(x)\nu = np.empty_like(x)",
            quick,
            compare_torch,
        ),
        _unary_case(
            "silu",
            "F.silu(x, out=out)",
            _NUMPY_SILU,
            "torch._C._nn.silu(xt, out=ot)",
            "t = np.empty_like(x)",
            quick,
            compare_torch,
        ),
    ]
    add_baselines = [
        Variant(
            "numpy", "np.add(a, b, out=out)\nnp.maximum(out, 0.0, out=out)", prepare="out = np.empty_like(a)"
        )
    ]
    if compare_torch:
        add_baselines.append(
            _torch(
                "torch.add(at, bt, out=ot)\not.relu_()",
                result="ot",
                prepare="at, bt = torch.from_numpy(a), torch.from_numpy(b)\n" + _TORCH_OUT.format(like="a"),
            )
        )
    out.append(
        Case(
            suite=SUITE,
            name="add_relu",
            setup=_binary_inputs,
            setup_code=_BINARY_SETUP,
            candidate=Variant(
                "taifuse", "F.add_relu(a, b, out=out)", prepare="out = np.empty_like(a)", imports=_TAIFUSE
            ),
            baselines=tuple(add_baselines),
            dtype="float32",
            shape=f"({N},) + ({N},)",
            bytes_moved=3 * 4 * N,
            bytes_written=4 * N,
            rtol=1e-6,
            atol=1e-6,
        )
    )
    affine_baselines = [Variant("numpy", "np.multiply(x, scale, out=out)\nout += bias", prepare=_OUT)]
    if compare_torch:
        affine_baselines.append(
            _torch(
                "torch.addcmul(bt, xt, st, out=ot)",
                result="ot",
                prepare="xt, st, bt = (torch.from_numpy(v) for v in (x, scale, bias))\n"
                + _TORCH_OUT.format(like="x"),
            )
        )
    out.append(
        Case(
            suite=SUITE,
            name="affine",
            setup=_affine_inputs,
            setup_code=_AFFINE_SETUP,
            candidate=Variant("taifuse", "F.affine(x, scale, bias, out=out)", prepare=_OUT, imports=_TAIFUSE),
            baselines=tuple(affine_baselines),
            dtype="float32",
            shape=f"({ROWS}, {COLS}) * ({COLS},) + ({COLS},)",
            bytes_moved=2 * 4 * ROWS * COLS + 2 * 4 * COLS,
            bytes_written=4 * ROWS * COLS,
            rtol=1e-5,
            atol=1e-5,
        )
    )
    out.append(_past_last_cache_case())
    out.extend(_half_storage_case(*op) for op in _HALF_STORAGE_OPS)
    return out


def _past_last_cache_case() -> Case:
    # On machines whose last-level cache holds the 4M-element arrays, this row shows the DRAM case.
    n = dram_elements()
    return Case(
        suite=SUITE,
        name=f"gelu(approximate='tanh'), {n // 2**20}M elements",
        setup=functools.partial(_unary_inputs, n=n),
        setup_code=f"x = np.random.default_rng(seed).standard_normal({n}, dtype=np.float32)",
        candidate=Variant(
            "taifuse", "F.gelu(x, approximate='tanh', out=out)", prepare=_OUT, imports=_TAIFUSE
        ),
        baselines=(copy_bound("DRAM"),),
        dtype="float32",
        shape=f"({n},)",
        bytes_moved=2 * 4 * n,
        bytes_written=4 * n,
    )


# float16 storage against float32 storage of the same op at a DRAM size (issue 17's goal: at least
# 1.6x): the op's name, its call on `x` (and `y`), and whether it reads a second array. relu is
# memory-bound in both dtypes; exact gelu's float32 arithmetic costs about as much as moving its
# float32 bytes on a 2-core machine, so halving the bytes gains less there (docs/amp.md).
_HALF_STORAGE_OPS = (
    ("relu", "F.relu(x, out=out)", False),
    ("gelu(approximate='none')", "F.gelu(x, out=out)", False),
)
# The float32 side's output, rounded to float16 for the correctness check only: ``to_host`` calls
# ``.numpy()`` on the first call's result, outside the timing, so the timed calls round nothing.
_ROUNDED_FOR_CHECK = "rounded = types.SimpleNamespace(numpy=lambda: out.astype(np.float16))"


def _half_storage_inputs(seed: int, n: int, binary: bool) -> dict:
    rng = np.random.default_rng(seed)
    inputs = {"x": rng.standard_normal(n, dtype=np.float32).astype(np.float16)}
    if binary:
        inputs["y"] = rng.standard_normal(n, dtype=np.float32).astype(np.float16)
    return inputs


def _half_storage_case(name: str, call: str, binary: bool) -> Case:
    """``name`` on float16 arrays (taifuse) against the same call on float32 copies of them."""
    n = max(dram_elements(), 16 * 2**20)  # at least 64 MiB of float32 input
    arrays = ("x", "y") if binary else ("x",)
    widen = "\n".join(f"{a} = {a}.astype(np.float32)" for a in arrays)
    draw = "; ".join(f"{a} = rng.standard_normal({n}, dtype=np.float32).astype(np.float16)" for a in arrays)
    return Case(
        suite=SUITE,
        name=f"{name}, float16 storage against float32, {n // 2**20}M elements",
        setup=functools.partial(_half_storage_inputs, n=n, binary=binary),
        setup_code=f"rng = np.random.default_rng(seed); {draw}",
        candidate=Variant("taifuse float16", call, prepare=_OUT, imports=_TAIFUSE),
        baselines=(
            Variant(
                "taifuse float32",
                call,
                result="rounded",
                prepare=f"{widen}\n{_OUT}\n{_ROUNDED_FOR_CHECK}",
                imports=(*_TAIFUSE, "types"),
                note="the same taifuse op on float32 copies of the inputs: twice the bytes moved",
            ),
        ),
        dtype="float16",
        shape=f"({n},)" + (f" + ({n},)" if binary else ""),
        bytes_moved=(len(arrays) + 1) * 2 * n,
        bytes_written=2 * n,
        rtol=2.0**-10,  # one float16 rounding of either side's float32 result
        atol=2.0**-24,
    )
