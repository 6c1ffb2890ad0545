"""Compile every kernel of the taichi backend as Metal would, on a machine without Metal.

Metal shares Taichi's SPIR-V codegen with Vulkan, but lavapipe (a CPU Vulkan) accepts things Metal
does not: float64, and more than 31 buffer bindings per kernel. This check runs on ``ti.vulkan``
and builds a ``ti.aot.Module`` whose device capabilities are only Metal's, so codegen fails for a
kernel exactly where it would fail on Metal. It then checks the saved module:

* every kernel compiled (a failure names the kernel and Taichi's error),
* the module requires no capability outside Metal's set,
* no task binds more buffers than Metal's argument table holds (31),
* with ``--msl``, SPIRV-Cross translates every task's SPIR-V to Metal Shading Language 2.3.

Usage::

    python -m taifuse.backends.metal_check [--out DIR] [--msl] [--module mypkg.ops ...]

``--module`` checks a user's Taichi kernels (a custom op's, docs/custom_ops.md) instead of
taifuse's: the module's ``all_kernels()`` when it defines one (``(name, kernel)`` pairs, as the
backend's), else every ``@ti.kernel`` at its top level. Their ndarray arguments need a dtype and
ndim, as an AOT module's do.

Exit status 0 when every kernel passes, 1 when one fails, 2 when Vulkan is unavailable.
Taichi allows one AOT module per process, so tests run this in a subprocess. The hidden flags
``--selftest-f64`` and ``--selftest-bindings`` add a kernel that must fail, to prove the check can.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

# Taichi's names for the SPIR-V capabilities Metal devices report (docs/backends.md, "Taichi and Metal").
# Notably absent: spirv_has_float64, spirv_has_atomic_float*, spirv_has_physical_storage_buffer.
METAL_CAPS = (
    "spirv_has_int8",
    "spirv_has_int16",
    "spirv_has_float16",
    "spirv_has_int64",
    "spirv_has_subgroup_basic",
    "spirv_has_subgroup_vote",
    "spirv_has_subgroup_ballot",
    "spirv_has_subgroup_arithmetic",
)
# Metal's buffer argument table has 31 entries per compute function.
METAL_MAX_BUFFER_BINDINGS = 31
MSL_VERSION = "20300"


def _init_vulkan():
    os.environ.setdefault("ENABLE_TAICHI_HEADER_PRINT", "False")
    os.environ.setdefault("TI_SKIP_VERSION_CHECK", "ON")
    import taichi as ti

    # The offline cache stays off: a kernel cached by an ordinary (all-capabilities) Vulkan run
    # must not stand in for a compile under Metal's capabilities.
    ti.init(arch=ti.vulkan, enable_fallback=False, offline_cache=False, log_level=ti.ERROR)
    return ti


def _compile(ti, kernels: Iterable[tuple[str, object]], out_dir: Path) -> list[str]:
    """Add every kernel to one AOT module with Metal's caps and save it; return the failures."""
    problems = []
    module = ti.aot.Module(caps=list(METAL_CAPS))
    for name, kernel in kernels:
        try:
            module.add_kernel(kernel, name=name)
        except RuntimeError as exc:  # Taichi's codegen errors; report the kernel and go on
            problems.append(f"{name}: does not compile with Metal's capabilities: {exc}")
    module.save(str(out_dir))
    return problems


def _check_metadata(out_dir: Path) -> tuple[list[str], list[str]]:
    """Check required caps and per-task buffer bindings; return (problems, one summary line per kernel)."""
    meta = json.loads((out_dir / "metadata.json").read_text())
    problems, lines = [], []
    allowed = set(METAL_CAPS) | {"spirv_version"}
    for cap in meta.get("required_caps", []):
        if cap["key"] not in allowed and cap["value"]:
            problems.append(f"module requires capability {cap['key']}, which Metal lacks")
    for kernel in meta["kernels"]:
        widest = 0
        for task in kernel["tasks_attribs"]:
            n = len(task["buffer_binds"]) + len(task.get("texture_binds", []))
            widest = max(widest, n)
            if n > METAL_MAX_BUFFER_BINDINGS:
                problems.append(
                    f"{kernel['name']}: task {task['name']} binds {n} buffers, "
                    f"Metal allows {METAL_MAX_BUFFER_BINDINGS}"
                )
        lines.append(
            f"{kernel['name']}: {len(kernel['tasks_attribs'])} task(s), at most {widest} buffer binding(s)"
        )
    return problems, lines


def _translate_msl(out_dir: Path) -> list[str]:
    """Translate every saved SPIR-V task to MSL with SPIRV-Cross; return the failures."""
    tool = shutil.which("spirv-cross")
    if tool is None:
        print("metal_check: spirv-cross not found; skipping the MSL translation", file=sys.stderr)
        return []
    problems = []
    spvs = sorted(out_dir.glob("*.spv"))
    for spv in spvs:
        result = subprocess.run(
            [
                tool,
                "--msl",
                "--msl-version",
                MSL_VERSION,
                str(spv),
                "--output",
                str(spv.with_suffix(".metal")),
            ],
            check=False,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if result.returncode != 0:
            problems.append(f"{spv.stem}: spirv-cross --msl failed: {result.stderr.strip()[:500]}")
    print(
        f"metal_check: translated {len(spvs) - len(problems)}/{len(spvs)} SPIR-V tasks to MSL {MSL_VERSION}"
    )
    return problems


def check(kernels: Sequence[tuple[str, object]], out_dir: Path, *, msl: bool = False) -> list[str]:
    """Run the whole check on ``kernels`` (``(name, ti.kernel)`` pairs); return the problems found.

    Taichi must already be initialised on ``ti.vulkan``, and no other AOT module may have been
    built in this process.
    """
    import taichi as ti

    out_dir.mkdir(parents=True, exist_ok=True)
    problems = _compile(ti, kernels, out_dir)
    meta_problems, lines = _check_metadata(out_dir)
    for line in lines:
        print(f"  {line}")
    problems += meta_problems
    if msl:
        problems += _translate_msl(out_dir)
    return problems


def _selftest_kernels(f64: bool, bindings: bool) -> list[tuple[str, object]]:
    from taifuse.backends import _metal_selftest

    pairs = []
    if f64:
        pairs.append(("selftest_f64", _metal_selftest.f64_kernel))
    if bindings:
        pairs.append(("selftest_bindings", _metal_selftest.wide_kernel))
    return pairs


def user_kernels(module_name: str) -> list[tuple[str, object]]:
    """The (name, kernel) pairs of a user's module: its ``all_kernels()``, else its top-level
    ``@ti.kernel`` functions; ``ValueError`` when it has none."""
    import importlib

    module = importlib.import_module(module_name)
    listed = getattr(module, "all_kernels", None)
    if callable(listed):
        pairs = list(listed())
    else:
        # Taichi marks the functions ti.kernel returns (its public API has no predicate for it).
        pairs = [(n, v) for n, v in vars(module).items() if getattr(v, "_is_wrapped_kernel", False)]
    if not pairs:
        raise ValueError(f"module {module_name!r} defines no Taichi kernel (@ti.kernel) and no all_kernels()")
    return [(f"{module_name.rpartition('.')[2]}_{n}", k) for n, k in pairs]


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m taifuse.backends.metal_check",
        description="Compile every taichi-backend kernel with only Metal's capabilities (on ti.vulkan).",
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="folder for the AOT module (default: a temp dir)"
    )
    parser.add_argument(
        "--msl", action="store_true", help="also translate the SPIR-V to MSL with spirv-cross"
    )
    parser.add_argument(
        "--module",
        action="append",
        default=None,
        metavar="MODULE",
        help="check the Taichi kernels of this importable module (repeatable) instead of taifuse's",
    )
    parser.add_argument("--selftest-f64", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--selftest-bindings", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    try:
        ti = _init_vulkan()
    except RuntimeError as exc:
        print(f"metal_check: Vulkan is unavailable ({type(exc).__name__}: {exc})", file=sys.stderr)
        return 2
    if args.module:
        try:
            kernels = [pair for name in args.module for pair in user_kernels(name)]
        except (ImportError, ValueError) as exc:
            print(f"metal_check: {exc}", file=sys.stderr)
            return 1
    else:
        from taifuse.backends.taichi import all_kernels

        kernels = all_kernels()
    kernels += _selftest_kernels(args.selftest_f64, args.selftest_bindings)
    out_dir = args.out if args.out is not None else Path(tempfile.mkdtemp(prefix="taifuse-metal-check-"))
    print(f"metal_check: taichi {'.'.join(map(str, ti.__version__))}, {len(kernels)} kernels -> {out_dir}")
    problems = check(kernels, out_dir, msl=args.msl)
    if problems:
        for problem in problems:
            print(f"FAIL {problem}")
        print(f"metal_check: {len(problems)} problem(s)")
        return 1
    print(f"metal_check: all {len(kernels)} kernels pass Metal's capability and binding limits")
    return 0


if __name__ == "__main__":
    sys.exit(main())
