"""``taifuse.bench``: benchmark tables whose every number is measured, with its interval and method.

From Python::

    import taifuse.bench
    result = taifuse.bench.run(["elementwise"], quick=True, out="bench-out")
    print(result["rows"][0]["verdict"])

From the shell: ``taifuse bench [--suite NAME ...] [--quick] [--out DIR] [--baseline FILE]
[--compare-torch]``. Modules: :mod:`~taifuse.bench.stats` (intervals, verdicts),
:mod:`~taifuse.bench.timing` and :mod:`~taifuse.bench.harness` (fresh processes, ABBA pairs),
:mod:`~taifuse.bench.roofline`, :mod:`~taifuse.bench.env`, :mod:`~taifuse.bench.report`,
:mod:`~taifuse.bench.baseline`, and the suites in :mod:`taifuse.bench.suites`.
"""

from __future__ import annotations

import datetime
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from taifuse.bench.case import Case, Variant
from taifuse.bench.harness import FULL, GOALS, QUICK, Plan

__all__ = ["FULL", "GOALS", "QUICK", "BenchArgumentError", "Case", "Plan", "Variant", "check_out", "run", "select_cases"]


class BenchArgumentError(ValueError):
    """A bad ``out`` or ``baseline`` for :func:`run`, found before anything is measured."""


def check_out(out: str | os.PathLike) -> None:
    """Raise :class:`BenchArgumentError` unless ``out`` is a writable directory or can be created as one.

    Nothing is created: a run that fails later leaves no empty directory behind.
    """
    path = Path(out)
    if path.exists():
        if not path.is_dir():
            raise BenchArgumentError(f"--out {path}: exists and is not a directory")
        if not os.access(path, os.W_OK | os.X_OK):
            raise BenchArgumentError(f"--out {path}: directory is not writable")
        return
    ancestor = path.absolute().parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise BenchArgumentError(f"--out {path}: cannot be created, {ancestor} is not a directory")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise BenchArgumentError(f"--out {path}: cannot be created, {ancestor} is not writable")


def _active_backend() -> tuple[str, dict]:
    from taifuse import backends

    return backends.get_backend(), backends.active().describe()


def _progress(total: int, enabled: bool):
    if enabled:
        try:
            from tqdm import tqdm

            return tqdm(total=total, unit="process", desc="taifuse bench", file=sys.stderr, leave=False)
        except ImportError:
            pass
    return None


def select_cases(cases: Sequence[Case], patterns: Sequence[str]) -> list[Case]:
    """The cases whose id matches one of ``patterns`` (``fnmatch``: ``*``, ``?``, ``[seq]``;
    case-sensitive), in their order. Raises :class:`BenchArgumentError` naming a pattern that
    matches none of them, with the ids there are."""
    import fnmatch

    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(c.id, pattern) for c in cases):
            ids = ", ".join(c.id for c in cases)
            raise BenchArgumentError(f"--case {pattern!r} matches no case of the suites chosen (their ids: {ids})")
    return [c for c in cases if any(fnmatch.fnmatchcase(c.id, p) for p in patterns)]


def run(
    suites: Sequence[str] | None = None,
    *,
    quick: bool = False,
    out: str | os.PathLike | None = None,
    baseline: str | os.PathLike | None = None,
    compare_torch: bool = False,
    torch_device: str | None = None,
    progress: bool = True,
    plan: Plan | None = None,
    command: str | None = None,
    cases: Sequence[Case] | None = None,
    case_patterns: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Measure the named suites (all when ``suites`` is empty) and return the result dict.

    Args:
        suites: suite names from :func:`taifuse.bench.suites.suite_names`.
        quick: fewer processes and samples (same sizes), for CI.
        out: directory for ``BENCHMARKS.md``, ``results.json`` (and PNGs); nothing is written if None.
        baseline: an earlier ``results.json`` (or its directory) to compare with
            (:mod:`~taifuse.bench.baseline`).
        compare_torch: add PyTorch baselines (needs torch).
        torch_device: PyTorch's device (``"cuda"``); the suites then build their device-resident
            cases (:mod:`taifuse.bench.device`; needs ``compare_torch``). The choice reaches the
            worker processes through ``TAIFUSE_BENCH_TORCH_DEVICE``, which is set in this process
            for the run and restored after it.
        progress: show a progress bar on stderr.
        plan: override the amount of measuring (processes, ABBA blocks); default QUICK or FULL.
        command: the command line recorded in the report.
        cases: run these cases instead of whole suites (a script may drop baselines it does not
            need with ``dataclasses.replace(case, baselines=...)``); ``suites`` is then ignored.
            Each must come from a registered suite: worker processes rebuild cases by id.
        case_patterns: keep only the cases whose id matches one of these shell-style patterns
            (:func:`select_cases`; ``taifuse bench --case``).

    Returns a dict with ``environment``, ``method``, ``plan``, ``rows`` and, with ``baseline``,
    ``baseline`` (whose ``status`` is ``"regression"``, ``"ok"`` or ``"not comparable"``).

    Raises :class:`BenchArgumentError` before measuring anything when ``out`` is not a directory
    that exists or can be created, ``baseline`` is missing, not JSON, or lacks what the
    comparison needs, or a pattern of ``case_patterns`` matches no case. The results are written to ``out`` before they are compared with
    ``baseline``, so a comparison that fails cannot lose a run.
    """
    from taifuse.bench import baseline as baseline_mod
    from taifuse.bench import env as env_mod
    from taifuse.bench import harness, report
    from taifuse.bench.suites import load_cases

    # NOTE: a bad --out or --baseline used to surface only after every case had been measured,
    # as a raw traceback that lost the run; both are checked before the first measurement.
    if out is not None:
        check_out(out)
    earlier = None
    if baseline is not None:
        try:
            earlier = baseline_mod.load(baseline)
        except baseline_mod.BaselineError as e:
            raise BenchArgumentError(f"--baseline {e}") from None
    if compare_torch:
        import importlib.util

        if importlib.util.find_spec("torch") is None:
            raise RuntimeError("--compare-torch needs PyTorch: pip install 'taifuse[compare]'")
    if torch_device is not None:
        from taifuse.bench import device as device_mod

        if not compare_torch:
            raise BenchArgumentError("--torch-device needs --compare-torch (it is where PyTorch's tensors live)")
        try:
            device_mod.check(torch_device)
        except ValueError as e:
            raise BenchArgumentError(str(e)) from None
        saved = os.environ.get(device_mod.TORCH_DEVICE_ENV)
        os.environ[device_mod.TORCH_DEVICE_ENV] = torch_device
        try:
            return run(
                suites, quick=quick, out=out, baseline=baseline, compare_torch=compare_torch,
                progress=progress, plan=plan, command=command, cases=cases, case_patterns=case_patterns,
            )
        finally:
            if saved is None:
                os.environ.pop(device_mod.TORCH_DEVICE_ENV, None)
            else:
                os.environ[device_mod.TORCH_DEVICE_ENV] = saved
    plan = plan or (QUICK if quick else FULL)
    cases = (
        list(cases)
        if cases is not None
        else load_cases(list(suites or []), quick=quick, compare_torch=compare_torch)
    )
    if case_patterns:
        cases = select_cases(cases, case_patterns)
    load_before = env_mod.load_average()
    backend, backend_info = _active_backend()
    worker_env = worker_environment(backend, backend_info)
    workers = sum(harness.worker_count(c, plan.processes) for c in cases)
    bar = _progress(plan.processes + workers, progress)

    def step(label: str) -> None:
        if bar is not None:
            bar.set_postfix_str(label[-40:])
            bar.update(1)

    try:
        raw = harness.measure(
            cases, plan, quick=quick, compare_torch=compare_torch, env=worker_env, on_step=step
        )
    finally:
        if bar is not None:
            bar.close()
    rows, method = harness.build_rows(cases, raw)
    threads: dict = {}
    for runs in raw["cases"].values():
        for r in runs:
            threads.update(r.get("threads", {}))
    for r in raw["roofline"]:
        threads.update({k: v for k, v in r.get("threads", {}).items() if k not in threads})
    result: dict[str, Any] = {
        "command": command or _python_call(suites, quick, out, baseline, compare_torch),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "plan": {
            "processes": plan.processes,
            "blocks": plan.blocks,
            "roofline_samples": plan.roofline_samples,
            "min_sample_ns": plan.min_sample_ns,
            "quick": quick,
        },
        "suites": list(dict.fromkeys(c.suite for c in cases)),
        "environment": {
            **env_mod.collect(backend, backend_info, threads, _mpi_library(raw)),
            "torch_device": _torch_device_info(),
            "load_average": {"before": load_before, "after": env_mod.load_average()},
        },
        "method": method,
        "errors": raw["errors"],
        "rows": rows,
    }
    files = report.write(result, Path(out)) if out is not None else None
    if earlier is not None:
        result["baseline"] = baseline_mod.compare(result, earlier)
        if out is not None:  # again, now with the comparison in both files
            files = report.write(result, Path(out))
    if files is not None:
        result["files"] = [str(p) for p in files]
    return result


# Taichi's names of its CPU arches, which TAIFUSE_TAICHI_ARCH spells "cpu".
_TAICHI_CPU_ARCHES = ("x64", "arm64")


def worker_environment(backend: str, backend_info: dict, environ: dict | None = None) -> dict[str, str]:
    """The environment of the worker processes: this one's, with the active backend and Taichi arch
    pinned so that every worker runs where this process does. Taichi reports the CPU arch as
    ``x64``/``arm64``, which ``TAIFUSE_TAICHI_ARCH`` calls ``cpu``."""
    env = dict(os.environ if environ is None else environ, TAIFUSE_BACKEND=backend)
    arch = backend_info.get("arch")
    if backend == "taichi" and arch:
        env["TAIFUSE_TAICHI_ARCH"] = "cpu" if str(arch) in _TAICHI_CPU_ARCHES else str(arch)
    return env


def _torch_device_info() -> dict | None:
    from taifuse.bench import device

    return device.describe(device.torch_device())


def _mpi_library(raw: dict) -> str | None:
    """The MPI library's version string a case's ranks reported (the distributed suite), if any."""
    for runs in raw["cases"].values():
        for r in runs:
            if isinstance(r.get("mpi"), dict) and r["mpi"].get("library"):
                return r["mpi"]["library"]
    return None


def _python_call(suites, quick, out, baseline, compare_torch) -> str:
    args = [repr(list(suites or []))] + [f"quick={quick}", f"out={str(out)!r}"]
    if baseline is not None:
        args.append(f"baseline={str(baseline)!r}")
    if compare_torch:
        args.append("compare_torch=True")
    from taifuse.bench import device

    if device.torch_device() is not None:
        args.append(f"torch_device={device.torch_device()!r}")
    return f"taifuse.bench.run({', '.join(args)})"
