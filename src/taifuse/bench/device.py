"""Benchmarks with their data on a device: ``taifuse bench --compare-torch --torch-device cuda``.

``--torch-device DEVICE`` puts PyTorch's tensors on ``DEVICE`` (``cpu``, ``cuda``, ``cuda:1``,
``mps``) and turns the ``elementwise``, ``linear``, ``optim`` and ``transformer`` suites to their
device-resident cases (:mod:`taifuse.bench.suites.resident`): every input is moved to the active
taifuse backend (a Taichi ``DeviceArray`` on a GPU arch) and to PyTorch's device once, before
timing, so a timed call launches kernels on data that is already there, and each timer waits for the
device's work (NOTE [ Timing device work ] in :mod:`taifuse.bench.timing`). The device is named in
the environment block (:func:`describe`): the GPU, its driver and the CUDA version.

The choice travels to the worker processes in the environment variable :data:`TORCH_DEVICE_ENV`
(the cases are rebuilt there by id, so both sides must build the same list).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Any

import numpy as np

TORCH_DEVICE_ENV = "TAIFUSE_BENCH_TORCH_DEVICE"

# The taifuse side's device synchronisation, as a variant's ``sync`` code (with this module imported
# as ``device``): the active backend's ``sync`` (``ti.sync()`` on Taichi), nothing on CPU backends.
TAIFUSE_SYNC = "device.synchronize()"


def torch_device() -> str | None:
    """PyTorch's device for this run, or None when ``--torch-device`` was not given (host cases)."""
    value = os.environ.get(TORCH_DEVICE_ENV, "").strip()
    return value or None


def resident() -> bool:
    """Whether the suites build their device-resident cases in this process."""
    return torch_device() is not None


def torch_sync(device: str) -> str:
    """The statement that waits for PyTorch's work on ``device`` (empty where calls are synchronous)."""
    kind = device.split(":")[0]
    if kind == "cuda":
        return "torch.cuda.synchronize()"
    if kind == "mps":
        return "torch.mps.synchronize()"
    return ""


def synchronize() -> None:
    """Wait for the active taifuse backend's launched kernels (a no-op on the CPU backends)."""
    from taifuse import backends

    sync = getattr(backends.active(), "sync", None)
    if sync is not None:
        sync()


def to_backend(a: np.ndarray) -> Any:
    """``a`` on the active taifuse backend: a ``DeviceArray`` on Taichi, the array itself on the CPU."""
    from taifuse import backends

    return backends.active().from_numpy(np.ascontiguousarray(a))


def empty_like(a: Any) -> Any:
    """A new array of ``a``'s shape and dtype on the active taifuse backend."""
    from taifuse import backends

    return backends.active().empty(tuple(a.shape), np.dtype(a.dtype))


def check(device: str) -> None:
    """Raise ``ValueError`` naming ``--torch-device`` unless PyTorch is installed and ``device`` is usable."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        raise ValueError(f"--torch-device {device}: needs PyTorch (pip install 'taifuse[compare]')")
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        raise ValueError(f"--torch-device {device!r}: not a PyTorch device ({e})") from None
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"--torch-device {device}: PyTorch sees no CUDA device (torch {torch.__version__})"
            )
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise ValueError(
                f"--torch-device {device}: PyTorch sees {torch.cuda.device_count()} CUDA device(s)"
            )
    elif parsed.type == "mps":
        if not torch.backends.mps.is_available():
            raise ValueError(f"--torch-device {device}: PyTorch's MPS backend is not available")
    elif parsed.type != "cpu":
        raise ValueError(f"--torch-device {device}: only cpu, cuda and mps are supported")


def nvidia_smi() -> dict | None:
    """The first GPU as ``nvidia-smi`` reports it (name, driver, memory), or None without one."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    fields = ("name", "driver_version", "memory.total", "clocks.max.sm", "clocks.max.memory")
    try:
        done = subprocess.run(
            [exe, f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return None
    values = [v.strip() for v in lines[0].split(",")]
    info = dict(zip(("name", "driver", "memory_mib", "max_sm_clock_mhz", "max_memory_clock_mhz"), values))
    info["count"] = len(lines)
    return info


def describe(device: str | None) -> dict | None:
    """PyTorch's device for the environment block: its name, and for CUDA the GPU, driver and versions."""
    if device is None:
        return None
    info: dict[str, Any] = {"device": device}
    try:
        import torch
    except ImportError:
        return info
    parsed = torch.device(device)
    info["torch"] = torch.__version__
    if parsed.type == "cuda" and torch.cuda.is_available():
        index = parsed.index or 0
        props = torch.cuda.get_device_properties(index)
        info.update(
            name=props.name,
            capability=f"{props.major}.{props.minor}",
            multiprocessors=props.multi_processor_count,
            memory_gib=round(props.total_memory / 2**30, 1),
            cuda=torch.version.cuda,
            cudnn=torch.backends.cudnn.version(),
            tf32_matmul=torch.backends.cuda.matmul.allow_tf32,
        )
        smi = nvidia_smi()
        if smi is not None:
            info["driver"] = smi.get("driver")
            info["nvidia_smi"] = smi
    elif parsed.type == "cpu":
        info["name"] = "PyTorch CPU"
    return info


def line(info: dict | None) -> str | None:
    """One line naming the device for the report's environment line, or None."""
    if not info:
        return None
    if "capability" in info:
        return (
            f"torch on {info['device']}: {info.get('name')} (sm_{info['capability'].replace('.', '')}, "
            f"{info.get('multiprocessors')} SMs, {info.get('memory_gib')} GiB), driver {info.get('driver', '?')}, "
            f"CUDA {info.get('cuda')}, torch {info.get('torch')}"
        )
    return f"torch on {info['device']}, torch {info.get('torch', '?')}"
