"""Every taichi-backend kernel compiles with only Metal's capabilities, and the check can fail.

Taichi allows one AOT module per process, so each check runs ``python -m
taifuse.backends.metal_check`` in a subprocess (exit 2 = no Vulkan here: skip).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("taichi")

pytestmark = pytest.mark.vulkan


def _run_check(tmp_path, *flags: str) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, "-m", "taifuse.backends.metal_check", "--out", str(tmp_path / "aot"), *flags],
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if result.returncode == 2:
        pytest.skip(f"Vulkan is unavailable: {result.stderr.strip()[-300:]}")
    return result


def test_every_kernel_passes_metal_capabilities_and_binding_limit(tmp_path):
    from taifuse.backends.taichi import backward, conv, forward, tensor_math

    flags = ("--msl",) if shutil.which("spirv-cross") else ()
    result = _run_check(tmp_path, *flags)
    assert result.returncode == 0, result.stdout + result.stderr
    meta = json.loads((tmp_path / "aot" / "metadata.json").read_text())
    compiled = {kernel["name"] for kernel in meta["kernels"]}
    expected = {name for module in (forward, tensor_math, backward, conv) for name, _ in module.all_kernels()}
    assert expected <= compiled  # the optimizer kernels are checked too (tests/test_optim.py owns them)
    assert {
        "bw_softmax_backward_rows_float32",
        "bw_cross_entropy_rows_float16",
        "tm_matmul_float16",
    } <= compiled
    assert {f"{op}_float16" for op in ("linear_act", "layer_norm", "dropout")} <= compiled
    if flags:
        spvs = list((tmp_path / "aot").glob("*.spv"))
        assert spvs and len(list((tmp_path / "aot").glob("*.metal"))) == len(spvs)


def test_a_float64_kernel_fails_the_check_and_is_named(tmp_path):
    result = _run_check(tmp_path, "--selftest-f64")
    assert result.returncode == 1
    assert "FAIL selftest_f64" in result.stdout and "f64" in result.stdout
    assert "1 problem(s)" in result.stdout  # only the deliberate kernel fails


def test_a_kernel_with_too_many_buffers_fails_the_check(tmp_path):
    result = _run_check(tmp_path, "--selftest-bindings")
    assert result.returncode == 1
    assert "FAIL selftest_bindings" in result.stdout and "Metal allows 31" in result.stdout
