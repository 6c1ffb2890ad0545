"""``taifuse bench --torch-device``: device synchronisation in the timers, the device-resident cases
(taifuse.bench.suites.resident) checked against PyTorch on every backend, the argument checks and the
device in the environment block (issue 31)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

import taifuse.bench
from taifuse.bench import device, harness, report, timing, worker
from taifuse.bench.case import Variant

HAS_TORCH = importlib.util.find_spec("torch") is not None
needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="needs torch (pip install 'taifuse[compare]')")


class _Log:
    """A timed callable whose ``sync`` records when it ran relative to the calls."""

    def __init__(self) -> None:
        self.events: list[str] = []

    def __call__(self):
        self.events.append("call")
        return 1

    def sync(self) -> None:
        self.events.append("sync")


def test_timers_wait_for_the_device_before_starting_and_before_stopping():
    log = _Log()
    timing.time_loops(log, 3)
    assert log.events == ["sync", "call", "call", "call", "sync"]
    log.events.clear()
    ns, result = timing.first_call(log)
    assert log.events == ["sync", "call", "sync"] and result == 1 and ns > 0
    log.events.clear()
    calls = timing.warm_up(log)
    # one sync before the first call, then one after every call (each warm-up call is timed alone)
    assert log.events == ["sync"] + ["call", "sync"] * calls


def test_host_callables_are_timed_without_a_sync():
    calls = []
    assert timing.time_loops(lambda: calls.append(1), 4) > 0
    assert calls == [1, 1, 1, 1]


def test_a_variants_sync_code_is_attached_to_its_call_and_shown_in_the_report_code():
    v = Variant("x", "y = a + 1", result="y", prepare="count = []", sync="count.append(1)")
    call = v.build({"a": 1})
    assert call() == 2
    call.sync()
    call.sync()
    assert call.__globals__["count"] == [1, 1]
    assert "# before the clock starts and before it stops:\ncount.append(1)" in v.full_code()
    assert not hasattr(Variant("h", "y = a", result="y").build({"a": 0}), "sync")


def test_torch_sync_statement_per_device_kind():
    assert device.torch_sync("cuda") == "torch.cuda.synchronize()"
    assert device.torch_sync("cuda:1") == "torch.cuda.synchronize()"
    assert device.torch_sync("mps") == "torch.mps.synchronize()"
    assert device.torch_sync("cpu") == ""


def test_torch_device_needs_compare_torch(tmp_path):
    with pytest.raises(taifuse.bench.BenchArgumentError, match="--torch-device needs --compare-torch"):
        taifuse.bench.run(["elementwise"], torch_device="cpu", out=tmp_path / "o", progress=False)
    assert not (tmp_path / "o").exists()


@needs_torch
def test_bad_torch_devices_are_refused_before_measuring(tmp_path):
    import torch

    with pytest.raises(taifuse.bench.BenchArgumentError, match="--torch-device 'gpu0'"):
        taifuse.bench.run(["elementwise"], compare_torch=True, torch_device="gpu0", progress=False)
    if not torch.cuda.is_available():
        with pytest.raises(
            taifuse.bench.BenchArgumentError, match="--torch-device cuda: PyTorch sees no CUDA"
        ):
            taifuse.bench.run(["elementwise"], compare_torch=True, torch_device="cuda", progress=False)
    assert device.torch_device() is None  # the variable is restored after a refused run


def test_resident_mode_builds_the_four_suites_device_cases_and_refuses_others(monkeypatch):
    from taifuse.bench.suites import load_cases, resident

    monkeypatch.setenv(device.TORCH_DEVICE_ENV, "cpu")
    cases = load_cases([], compare_torch=True)
    assert {c.suite for c in cases} == set(resident.SUITES)
    assert all(c.extra.get("device") and c.name.endswith("on the device") for c in cases)
    with pytest.raises(ValueError, match=r"--torch-device: suite\(s\) \['memory'\] have no device-resident"):
        load_cases(["memory"], compare_torch=True)
    monkeypatch.delenv(device.TORCH_DEVICE_ENV)
    assert not any(c.extra.get("device") for c in load_cases(["elementwise"], compare_torch=True))


def _small_cases():
    from taifuse.bench.suites import resident

    return (
        resident.elementwise_cases(True, n=3000, rows=40, cols=96)
        + resident.linear_cases(True, (48, 40, 24))
        + resident.optim_cases(True, (2, (24, 16)))
        + resident.transformer_cases(True, (1, 2, 24, 8))
    )


@needs_torch
def test_device_cases_agree_with_pytorch_on_every_backend(backend, monkeypatch):
    """Every device-resident case, at small sizes: the taifuse candidate (on the backend's device,
    float16 included) against PyTorch's variants, each within the case's tolerance, then timed."""
    import torch

    if backend.name == "numpy":
        pytest.skip("the device cases time taifuse's kernels (the reference backend has the same API)")
    dev = "cuda" if backend.arch == "cuda" and torch.cuda.is_available() else "cpu"
    monkeypatch.setenv(device.TORCH_DEVICE_ENV, dev)
    backend.activate()
    for case in _small_cases():
        # PyTorch on the CPU is an isolated baseline (checked here, timed alone); on CUDA it is timed here.
        check_only = harness.isolated_labels(case)
        assert bool(check_only) == (dev == "cpu")
        result = worker.measure_case(case, harness.comparisons(case, True), 2, 50_000, check_only=check_only)
        assert result["failed"] == [], (case.name, result["checks"])
        peers = [b.label for b in case.baselines if b.same_result]
        assert set(result["checks"]) == set(peers) and peers, case.name
        for label, check in result["checks"].items():
            assert check["ok"], (case.name, label, check)
        assert all(len(s["a"]) == 2 for s in result["samples"].values())


def test_device_rows_have_no_cpu_roofline_and_their_level_is_the_device():
    from taifuse.bench.suites import resident

    case = resident.elementwise_cases(False, n=2048, rows=8, cols=16)[0]
    runs = [
        {
            "first_call_ns": {"taifuse": 1e6},
            "checks": {},
            "failed": [],
            "loops": {"taifuse": 10},
            "samples": {"taifuse|taifuse": {"a": [1e5] * 4, "b": [1.01e5] * 4}},
        }
    ] * 2
    rows = harness.case_rows(case, runs, {"copy": {"L1": 1.0, "DRAM": 1.0}, "gemm": 1.0}, 0.05, control=True)
    assert {r["cache_level"] for r in rows} == {harness.DEVICE_LEVEL}
    assert all(r.get("roofline") is None for r in rows)


def test_environment_names_the_torch_device():
    info = {
        "device": "cuda",
        "torch": "2.11.0+cu130",
        "name": "NVIDIA H100 80GB HBM3",
        "capability": "9.0",
        "multiprocessors": 132,
        "memory_gib": 79.2,
        "cuda": "13.0",
        "driver": "580.159.04",
    }
    line = device.line(info)
    assert line == (
        "torch on cuda: NVIDIA H100 80GB HBM3 (sm_90, 132 SMs, 79.2 GiB), driver 580.159.04, CUDA 13.0, "
        "torch 2.11.0+cu130"
    )
    rows = dict(report._device_rows({"torch_device": info}))
    assert rows == {"device": line}
    assert report._device_rows({"torch_device": None}) == []
    assert device.describe(None) is None


@needs_torch
def test_describe_cpu():
    info = device.describe("cpu")
    assert info["device"] == "cpu" and info["name"] == "PyTorch CPU" and info["torch"]
    assert device.line(info).startswith("torch on cpu, torch ")


def test_backend_helpers_round_trip_on_the_active_backend(backend):
    backend.activate()
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    d = device.to_backend(a)
    e = device.empty_like(d)
    device.synchronize()
    assert tuple(e.shape) == (3, 4) and np.dtype(e.dtype) == np.float32
    np.testing.assert_array_equal(np.asarray(d if isinstance(d, np.ndarray) else d.numpy()), a)


def test_workers_run_on_the_taichi_arch_of_the_parent():
    # Regression: Taichi names its CPU arch "x64", and the workers were started with
    # TAIFUSE_TAICHI_ARCH=x64, which taifuse refuses: every taichi-cpu bench row failed.
    env = taifuse.bench.worker_environment(
        "taichi", {"arch": "x64", "requested_arch": "cpu"}, {"PATH": "/bin"}
    )
    assert env == {"PATH": "/bin", "TAIFUSE_BACKEND": "taichi", "TAIFUSE_TAICHI_ARCH": "cpu"}
    assert taifuse.bench.worker_environment("taichi", {"arch": "cuda"}, {})["TAIFUSE_TAICHI_ARCH"] == "cuda"
    assert "TAIFUSE_TAICHI_ARCH" not in taifuse.bench.worker_environment("numba", {}, {})
