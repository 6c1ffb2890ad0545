"""Runs the measurements in fresh processes and turns their samples into report rows.

Per case, ``plan.processes`` workers run one after another (never side by side: on a small machine
two workers would time each other). Each worker checks outputs, times the first call, warms up,
calibrates and records ABBA pairs (:func:`taifuse.bench.worker.measure_case`); the roofline
(copy bandwidth, GEMM rate) is measured by workers of its own in the same run. Rows are built here
with :mod:`taifuse.bench.stats`; see NOTE [ How a comparison is judged ] there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from taifuse.bench import roofline, stats, timing
from taifuse.bench.case import Case
from taifuse.bench.env import cache_level, cpu_caches

NOT_A_COMPARISON = "not a comparison"


@dataclass(frozen=True)
class Plan:
    """How much to measure: fresh processes per case, ABBA blocks per process, roofline samples."""

    processes: int
    blocks: int
    roofline_samples: int
    min_sample_ns: int = timing.MIN_SAMPLE_NS
    worker_timeout_s: float = 300.0


QUICK = Plan(processes=3, blocks=8, roofline_samples=6)
FULL = Plan(processes=5, blocks=25, roofline_samples=20)


class WorkerError(RuntimeError):
    """A benchmark worker process failed; the message carries the end of its stderr."""


def spawn(job: dict, env: dict[str, str] | None = None, timeout_s: float = 300.0) -> dict:
    """Run one job in a fresh ``python -m taifuse.bench.worker`` process and return its result."""
    with tempfile.TemporaryDirectory(prefix="taifuse-bench-") as tmp:
        job_path, result_path = os.path.join(tmp, "job.json"), os.path.join(tmp, "result.json")
        with open(job_path, "w") as f:
            json.dump(job, f)
        try:
            done = subprocess.run(
                [sys.executable, "-m", "taifuse.bench.worker", job_path, result_path],
                env=env,
                check=False,
                capture_output=True,
                text=True,
                timeout=timeout_s,
            )
        except subprocess.TimeoutExpired as exc:
            raise WorkerError(
                f"worker for {job.get('case', job['kind'])} ran past {timeout_s:.0f} s"
            ) from exc
        if done.returncode != 0 or not os.path.exists(result_path):
            tail = "\n".join(done.stderr.strip().splitlines()[-8:])
            raise WorkerError(f"worker for {job.get('case', job['kind'])} exited {done.returncode}: {tail}")
        with open(result_path) as f:
            return json.load(f)


def comparisons(case: Case, control: bool) -> list[tuple[str, str]]:
    """The (candidate, baseline) pairs timed for a case; the control case adds (candidate, candidate)."""
    cand = case.candidate.label
    pairs = [(cand, b.label) for b in case.baselines]
    return ([(cand, cand)] if control else []) + pairs


def measure(
    cases: list[Case],
    plan: Plan,
    *,
    quick: bool,
    compare_torch: bool,
    env: dict[str, str] | None = None,
    on_step: Callable[[str], None] = lambda label: None,
) -> dict[str, Any]:
    """Run every worker of the roofline and of each case; raw results keyed by case id.

    The first case carries the run's A/A control. ``on_step`` is called after each worker.
    """
    raw: dict[str, Any] = {"roofline": [], "cases": {}, "errors": {}}
    copy_bytes = roofline.copy_array_bytes(quick)
    for p in range(plan.processes):
        job = {"kind": "roofline", "copy_bytes": copy_bytes, "samples": plan.roofline_samples, "seed": p}
        raw["roofline"].append(spawn(job, env, plan.worker_timeout_s))
        on_step("roofline")
    control = _control_case(cases)
    for case in cases:
        if is_custom(case):
            runs = []
            for extra in case.jobs(plan.processes):
                job = {
                    "kind": "custom",
                    "case": case.id,
                    "quick": quick,
                    "compare_torch": compare_torch,
                    **extra,
                }
                try:
                    runs.append(spawn(job, env, plan.worker_timeout_s))
                except WorkerError as exc:
                    raw["errors"][case.id] = str(exc)
                    on_step(case.id)
                    break
                on_step(case.id)
            raw["cases"][case.id] = runs
            continue
        job = {
            "kind": "case",
            "case": case.id,
            "quick": quick,
            "compare_torch": compare_torch,
            "comparisons": comparisons(case, control=case is control),
            "blocks": plan.blocks,
            "min_sample_ns": plan.min_sample_ns,
        }
        runs = []
        for _ in range(plan.processes):
            try:
                runs.append(spawn(job, env, plan.worker_timeout_s))
            except WorkerError as exc:
                raw["errors"][case.id] = str(exc)
                on_step(case.id)
                break
            on_step(case.id)
        raw["cases"][case.id] = runs
    return raw


# ----------------------------------------------------------------------------- rows


def _rate_row(
    row_id: str,
    label: str,
    groups_ns: list[list[float]],
    amount: float,
    unit: str,
    scale: float,
    code: str,
    size: str,
    level: str,
) -> dict:
    t = stats.estimate(groups_ns)
    return {
        "id": row_id,
        "kind": "roofline",
        "label": label,
        "unit": unit,
        "value": amount / t.median / scale,
        "low": amount / t.high / scale,
        "high": amount / t.low / scale,
        "n_processes": t.n_processes,
        "n_samples": t.n_samples,
        "dispersion": t.dispersion,
        "time_ms": t.median / 1e6,
        "size": size,
        "bytes_moved": None,
        "cache_level": level,
        "roofline": None,
        "code": code,
        "dtype": "float32",
        "verdict": stats.UNSTABLE if t.dispersion > stats.UNSTABLE_DISPERSION else NOT_A_COMPARISON,
    }


def roofline_rows(results: list[dict]) -> list[dict]:
    """Copy bandwidth (GB/s, 1e9 bytes) and GEMM rate (GFLOP/s) rows, with bootstrap intervals."""
    if not results:
        return []
    copy, gemm = results[0]["copy"], results[0]["gemm"]
    m, k, n = gemm["shape"]
    return [
        _rate_row(
            "roofline/copy",
            "copy bandwidth",
            [r["copy"]["ns"] for r in results],
            copy["bytes_moved"],
            "GB/s",
            1.0,
            copy["code"],
            f"2 x {copy['array_bytes'] / 2**20:.0f} MiB float32",
            cache_level(copy["array_bytes"] * 2),
        ),
        _rate_row(
            "roofline/gemm",
            "GEMM rate",
            [r["gemm"]["ns"] for r in results],
            gemm["flops"],
            "GFLOP/s",
            1.0,
            gemm["code"],
            f"x ({m}, {k}) @ w ({n}, {k}).T",
            cache_level(4 * (m * k + n * k + m * n)),
        ),
    ]


def _ceilings(rows: list[dict]) -> dict[str, float]:
    by_id = {r["id"]: r for r in rows}
    return {
        "copy_gbps": by_id["roofline/copy"]["value"] if "roofline/copy" in by_id else float("nan"),
        "gemm_gflops": by_id["roofline/gemm"]["value"] if "roofline/gemm" in by_id else float("nan"),
    }


def _roofline_of(case: Case, time_ns: float, ceilings: dict[str, float]) -> dict:
    if case.flops:
        achieved = case.flops / time_ns  # flops per ns == GFLOP/s
        return {
            "achieved": achieved,
            "unit": "GFLOP/s",
            "fraction": achieved / ceilings["gemm_gflops"],
            "of": "GEMM rate",
        }
    achieved = case.bytes_moved / time_ns  # bytes per ns == GB/s
    return {
        "achieved": achieved,
        "unit": "GB/s",
        "fraction": achieved / ceilings["copy_gbps"],
        "of": "copy bandwidth",
    }


def _common(case: Case, runs: list[dict], caches: list[dict]) -> dict:
    threads: dict = {}
    for run in runs:
        threads.update(run.get("threads", {}))
    return {
        "suite": case.suite,
        "case": case.name,
        "dtype": case.dtype,
        "shape": case.shape,
        "seed": case.seed,
        "setup_code": case.setup_code,
        "size": case.shape,
        "bytes_moved": case.bytes_moved,
        "cache_level": cache_level(case.bytes_moved, caches),
        "threads": threads,
        "backend": runs[0].get("backend") if runs else None,
        "tolerance": {"rtol": case.rtol, "atol": case.atol},
    }


def case_rows(
    case: Case,
    runs: list[dict],
    ceilings: dict[str, float],
    limit: float,
    *,
    control: bool,
    error: str | None = None,
    caches: list[dict] | None = None,
) -> list[dict]:
    """Rows of one case: first call of the candidate, the A/A control (if carried), one per baseline."""
    caches = cpu_caches() if caches is None else caches
    common = _common(case, runs, caches)
    cand = case.candidate
    rows: list[dict] = []
    if runs:
        first = stats.estimate([[r["first_call_ns"][cand.label]] for r in runs])
        rows.append(
            {
                **common,
                "id": f"{case.id}/first-call",
                "kind": "first_call",
                "label": f"{case.name}: first call",
                "unit": "ms",
                "value": first.median / 1e6,
                "low": first.low / 1e6,
                "high": first.high / 1e6,
                "n_processes": first.n_processes,
                "n_samples": first.n_samples,
                "dispersion": first.dispersion,
                "candidate": {"label": cand.label, "code": cand.full_code()},
                "baseline": None,
                "roofline": None,
                "verdict": NOT_A_COMPARISON,
                "note": "one call in a fresh process: imports, JIT compile or cache load, "
                "first touch of buffers",
            }
        )
    pairs = comparisons(case, control)
    for a, b in pairs:
        base = case.variant(b)
        is_control = a == b
        row = {
            **common,
            "id": f"{case.id}/{'control' if is_control else b}",
            "kind": "control" if is_control else "compare",
            "label": f"{case.name}: {a} vs {a} (A/A control)" if is_control else f"{case.name}: {a} vs {b}",
            "unit": "x speedup",
            "candidate": {"label": a, "code": cand.full_code()},
            "baseline": {
                "label": b,
                "code": base.full_code(),
                "same_result": base.same_result,
                "note": base.note,
            },
            "check": None,
            "roofline": None,
            "value": None,
            "low": None,
            "high": None,
            "n_processes": 0,
            "n_samples": 0,
            "dispersion": None,
        }
        checks = [r["checks"].get(b) for r in runs if b in r.get("checks", {})]
        if checks:
            row["check"] = checks[0]
        if error is not None and not runs:
            row["verdict"] = f"failed: {error}"
            rows.append(row)
            continue
        if any(b in r["failed"] for r in runs):
            row["verdict"] = stats.FAILED
            rows.append(row)
            continue
        key = f"{a}|{b}"
        ta = [r["samples"][key]["a"] for r in runs]
        tb = [r["samples"][key]["b"] for r in runs]
        est = stats.speedup(ta, tb)
        cand_t, base_t = stats.estimate(ta), stats.estimate(tb)
        row.update(
            {
                "value": est.median,
                "low": est.low,
                "high": est.high,
                "n_processes": est.n_processes,
                "n_samples": est.n_samples,
                "dispersion": est.dispersion,
                "candidate_ms": {
                    "median": cand_t.median / 1e6,
                    "low": cand_t.low / 1e6,
                    "high": cand_t.high / 1e6,
                },
                "baseline_ms": {
                    "median": base_t.median / 1e6,
                    "low": base_t.low / 1e6,
                    "high": base_t.high / 1e6,
                },
                "roofline": _roofline_of(case, cand_t.median, ceilings),
                "baseline_roofline": _roofline_of(case, base_t.median, ceilings)
                if base.same_result
                else None,
                "loops": {a: [r["loops"][a] for r in runs], b: [r["loops"][b] for r in runs]},
                "samples": {"ratios": [list(np.asarray(y) / np.asarray(x)) for x, y in zip(ta, tb)]},
                "verdict": stats.verdict(est, stats.MIN_EFFECT if is_control else limit),
            }
        )
        if error is not None:
            row["note"] = f"only {len(runs)} process(es) finished: {error}"
        rows.append(row)
    return rows


def is_custom(case: Any) -> bool:
    """A case that measures something other than time (memory rows, say) declares its own worker
    jobs (``jobs(processes) -> [dict]``), runs them (``run_job(job) -> dict``, in the worker) and
    builds its rows (``rows(results, error) -> [dict]``); the harness only spawns the processes."""
    return hasattr(case, "jobs") and hasattr(case, "rows")


def _control_case(cases: list[Case]) -> Case | None:
    """The case that carries the run's A/A control: the first timed one."""
    return next((c for c in cases if not is_custom(c)), None)


def build_rows(cases: list[Case], raw: dict[str, Any]) -> tuple[list[dict], dict]:
    """All rows of a run (roofline first, then each case) and the threshold the verdicts used."""
    caches = cpu_caches()
    rows = roofline_rows(raw["roofline"])
    ceilings = _ceilings(rows)
    control_est = None
    control = _control_case(cases)
    if control is not None and raw["cases"].get(control.id):
        runs = raw["cases"][control.id]
        cand = control.candidate.label
        key = f"{cand}|{cand}"
        if all(key in r["samples"] for r in runs):
            control_est = stats.speedup(
                [r["samples"][key]["a"] for r in runs], [r["samples"][key]["b"] for r in runs]
            )
    limit = stats.threshold(control_est)
    for case in cases:
        if is_custom(case):
            rows.extend(case.rows(raw["cases"].get(case.id, []), raw["errors"].get(case.id)))
            continue
        rows.extend(
            case_rows(
                case,
                raw["cases"].get(case.id, []),
                ceilings,
                limit,
                control=case is control,
                error=raw["errors"].get(case.id),
                caches=caches,
            )
        )
    method = {
        "threshold": limit,
        "min_effect": stats.MIN_EFFECT,
        "control_spread": stats.control_spread(control_est) if control_est else None,
        "unstable_dispersion": stats.UNSTABLE_DISPERSION,
        "confidence": stats.CONFIDENCE,
        "resamples": stats.RESAMPLES,
        "ceilings": ceilings,
    }
    return rows, method
