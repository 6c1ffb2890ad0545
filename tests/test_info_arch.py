"""``taifuse info`` and the taichi backend's arch when none is asked for (issue 25 section 6)."""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import types
from importlib import metadata

import pytest

from taifuse import backends
from taifuse.backends.taichi import _runtime


def _run(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter with the TAIFUSE_* variables cleared, then ``env`` applied."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("TAIFUSE_")} | env
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=full,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


@pytest.fixture
def machine(monkeypatch):
    """A pretend machine for best_arch: set ``platform``, ``machine``, ``cuda`` and ``vulkan``."""
    state = {"platform": "linux", "machine": "x86_64", "cuda": False, "vulkan": []}
    # The module's own view of sys and platform; the real ones stay as they are for everything else.
    monkeypatch.setattr(_runtime, "sys", types.SimpleNamespace(platform="linux"))
    monkeypatch.setattr(_runtime, "platform", types.SimpleNamespace(machine=lambda: state["machine"]))
    monkeypatch.setattr(_runtime, "_cuda_present", lambda: state["cuda"])
    monkeypatch.setattr(_runtime, "_vulkan_device_types", lambda: state["vulkan"])
    _runtime.best_arch.cache_clear()
    yield state
    _runtime.best_arch.cache_clear()


def _best(state: dict, **changes) -> str:
    state.update(changes)
    _runtime.sys.platform = state["platform"]
    _runtime.best_arch.cache_clear()
    return _runtime.best_arch()


def test_best_arch_prefers_metal_then_cuda_then_a_vulkan_gpu_then_cpu(machine):
    assert _best(machine, platform="darwin", machine="arm64", cuda=True, vulkan=[2]) == "metal"
    assert _best(machine, platform="darwin", machine="x86_64", cuda=False, vulkan=[]) == "cpu"  # Intel Mac
    assert _best(machine, platform="linux", cuda=True, vulkan=[2]) == "cuda"
    assert _best(machine, cuda=False, vulkan=[2]) == "vulkan"  # a discrete GPU
    assert _best(machine, vulkan=[1]) == "vulkan"  # an integrated one
    assert _best(machine, vulkan=[4]) == "cpu"  # lavapipe only: a CPU Vulkan does not count
    assert _best(machine, vulkan=[4, 1]) == "vulkan"
    assert _best(machine, vulkan=[]) == "cpu"  # no Vulkan loader or driver


def test_vulkan_probe_sees_lavapipe_as_a_cpu_device():
    if not glob.glob("/usr/share/vulkan/icd.d/lvp_icd*"):
        pytest.skip("lavapipe is not installed")
    assert 4 in _runtime._vulkan_device_types()  # VK_PHYSICAL_DEVICE_TYPE_CPU


def test_taichi_without_an_arch_starts_on_the_best_arch_here():
    # Reported: TAIFUSE_BACKEND=taichi with no arch asked for Metal on Linux, failed, and fell back
    # to numba with a warning.
    if importlib.util.find_spec("taichi") is None:
        pytest.skip("taichi is not installed")
    code = """
        import json, warnings
        warnings.simplefilter("always")
        with warnings.catch_warnings(record=True) as caught:
            import taifuse
            from taifuse import backends
            name = taifuse.get_backend()
        info = backends.active().describe()
        mine = [str(w.message) for w in caught if "taifuse" in str(w.message)]
        print(json.dumps({"name": name, "requested": info.get("requested_arch"), "warnings": mine}))
    """
    result = json.loads(_run(code, {"TAIFUSE_BACKEND": "taichi"}).stdout.strip().splitlines()[-1])
    assert result["warnings"] == [] and result["name"] == "taichi"
    assert result["requested"] == backends.best_taichi_arch()


def test_info_prints_every_installed_backends_version_without_starting_taichi():
    # Reported: with another backend active, `taifuse info` printed no Taichi version.
    code = """
        import sys
        from taifuse.cli import main
        main(["info"])
        print("taichi imported:", "taichi" in sys.modules)
    """
    out = _run(code, {"TAIFUSE_BACKEND": "numpy"}).stdout
    (installed,) = [line for line in out.splitlines() if line.startswith("backends installed:")]
    for name in backends.available_backends():
        assert f"{name} {metadata.version(name)}" in installed, installed
    assert "taichi imported: False" in out
    if "taichi" in backends.available_backends():
        assert f"TAIFUSE_TAICHI_ARCH=(unset: the best arch here, {backends.best_taichi_arch()})" in out
