"""Every taichi-backend kernel compiles with only Metal's capabilities, and the check can fail.

Taichi allows one AOT module per process, so the check runs ``python -m
taifuse.backends.metal_check`` in a subprocess (exit 2 = no Vulkan here: skip), once for all three
checks: every kernel plus the two deliberate failures.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("taichi")

pytestmark = pytest.mark.vulkan


SELFTESTS = ("selftest_f64", "selftest_bindings")


def _checked(out):
    """One run of the check over every kernel plus the two that must fail (each whole run compiles
    all 200-odd kernels, ~40 s of CPU, so one test makes all three checks: under pytest-xdist a
    shared module fixture runs once per worker)."""
    flags = ("--msl",) if shutil.which("spirv-cross") else ()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "taifuse.backends.metal_check",
            "--out",
            str(out / "aot"),
            "--selftest-f64",
            "--selftest-bindings",
            *flags,
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if result.returncode == 2:
        pytest.skip(f"Vulkan is unavailable: {result.stderr.strip()[-300:]}")
    return result, out / "aot", flags


def _failures(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in result.stdout.splitlines() if line.startswith("FAIL ")]


def test_every_kernel_passes_metal_capabilities_and_the_check_can_fail(tmp_path):
    result, aot, flags = _checked(tmp_path)
    _every_kernel_passes(result, aot, flags)
    _a_float64_kernel_fails_and_is_named(result)
    _a_kernel_with_too_many_buffers_fails(result)


def _every_kernel_passes(result, aot, flags) -> None:
    import importlib

    from taifuse.backends import _spec

    # The modules the spec names for a Taichi kernel, and the Tensor math: a new kernel module is
    # checked with no edit here.
    modules = ["tensor_math", *dict.fromkeys(k.module for k in _spec.KERNELS if "taichi" in k.backends)]

    # Only the two deliberate kernels fail, so without them the check passes.
    assert result.returncode == 1, result.stdout + result.stderr
    failed = [line.split()[1].rstrip(":") for line in _failures(result)]
    assert sorted(failed) == sorted(SELFTESTS), result.stdout
    assert f"metal_check: {len(SELFTESTS)} problem(s)" in result.stdout
    meta = json.loads((aot / "metadata.json").read_text())
    compiled = {kernel["name"] for kernel in meta["kernels"]}
    expected = {
        name
        for module in modules
        for name, _ in importlib.import_module(f"taifuse.backends.taichi.{module}").all_kernels()
    }
    assert {"attention", "batch_norm", "forward", "backward", "optim"} <= set(modules)
    assert expected <= compiled  # the optimizer kernels are checked too (tests/test_optim.py owns them)
    assert {
        "bw_softmax_backward_rows_float32",
        "bw_cross_entropy_rows_float16",
        "tm_matmul_float16",
    } <= compiled
    assert {f"{op}_float16" for op in ("linear_act", "layer_norm", "dropout")} <= compiled
    if flags:
        spvs = list(aot.glob("*.spv"))
        assert spvs and len(list(aot.glob("*.metal"))) == len(spvs)


def _a_float64_kernel_fails_and_is_named(result) -> None:
    (line,) = [line for line in _failures(result) if line.startswith("FAIL selftest_f64")]
    assert "f64" in line.removeprefix("FAIL selftest_f64")


def _a_kernel_with_too_many_buffers_fails(result) -> None:
    (line,) = [line for line in _failures(result) if line.startswith("FAIL selftest_bindings")]
    assert "Metal allows 31" in line
