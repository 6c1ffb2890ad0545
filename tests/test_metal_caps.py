"""Every taichi-backend kernel compiles with only Metal's capabilities, and the check can fail.

Taichi allows one AOT module per process, so the check runs ``python -m
taifuse.backends.metal_check`` in a subprocess (exit 2 = no Vulkan here: skip), once for all three
tests: every kernel plus the two deliberate failures.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("taichi")

# One worker under pytest-xdist runs the shared check (``--dist loadgroup``, pyproject.toml).
pytestmark = [pytest.mark.vulkan, pytest.mark.xdist_group("metal_check")]


SELFTESTS = ("selftest_f64", "selftest_bindings")


@pytest.fixture(scope="module")
def checked(tmp_path_factory):
    """One run of the check over every kernel plus the two that must fail (each whole run compiles
    all 200-odd kernels, ~40 s of CPU, so the three tests share it)."""
    out = tmp_path_factory.mktemp("metal_check")
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


def test_every_kernel_passes_metal_capabilities_and_binding_limit(checked):
    import importlib

    from taifuse.backends import _spec

    result, aot, flags = checked
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


def test_a_float64_kernel_fails_the_check_and_is_named(checked):
    result, _, _ = checked
    (line,) = [line for line in _failures(result) if line.startswith("FAIL selftest_f64")]
    assert "f64" in line.removeprefix("FAIL selftest_f64")


def test_a_kernel_with_too_many_buffers_fails_the_check(checked):
    result, _, _ = checked
    (line,) = [line for line in _failures(result) if line.startswith("FAIL selftest_bindings")]
    assert "Metal allows 31" in line
