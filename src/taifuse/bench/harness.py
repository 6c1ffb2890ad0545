"""Runs the measurements in fresh processes and turns their samples into report rows.

Per case, ``plan.processes`` workers run one after another (never side by side: on a small machine
two workers would time each other). Each worker checks outputs, times the first call, warms up,
calibrates and records ABBA pairs (:func:`taifuse.bench.worker.measure_case`); the roofline
(copy bandwidth of each cache level the rows use, GEMM rate) is measured by workers of its own in
the same run, and every row is judged against the ceiling of its own level (roofline.py). Rows are built here
with :mod:`taifuse.bench.stats`; see NOTE [ How a comparison is judged ] there.

NOTE [ Isolated baselines ]
Interleaving A and B in one process cancels drift, but it assumes that calling one does not slow
the other. That fails when the two keep different thread pools that spin after their work:
measured on 2 cores, the MLP training step ran at ~11.9 ms (taifuse) and ~11.6 ms (PyTorch) each
alone, but in one ABBA process PyTorch's step took ~23 ms, because NumPy's OpenBLAS workers,
still spinning after taifuse's products, took a core from PyTorch's OpenMP pool. The ratio (1.6x)
was real for that process and false for any user. A baseline marked ``isolated`` is therefore
checked in the case's main processes but timed in fresh processes of its own: for each process
index, one process times the candidate alone, one each isolated baseline, and one the candidate
again, in an order that reverses from one index to the next. The pairs of a ratio then come from
two processes of the same index, and the candidate's two processes give an A/A control of that
method, whose spread (cross-process noise, larger than within one process) sets the threshold of
those rows' verdicts.
"""

from __future__ import annotations

import dataclasses
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
from taifuse.bench.env import UNKNOWN_LEVEL, cpu_caches
from taifuse.bench.roofline import Ceilings
from taifuse.bench.row import NO_DATA, NOT_A_COMPARISON, Row, RowHeader


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
# The goal scripts in benchmarks/: fewer blocks than FULL, as they run a few cases only.
GOALS = Plan(processes=5, blocks=12, roofline_samples=10)


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
    """The (candidate, baseline) pairs timed in one process; the control case adds (candidate, candidate).

    Isolated baselines are not among them (NOTE [ Isolated baselines ]).
    """
    cand = case.candidate.label
    pairs = [(cand, b.label) for b in case.baselines if not b.isolated]
    return ([(cand, cand)] if control else []) + pairs


def isolated_labels(case: Case) -> list[str]:
    """The baselines timed in processes of their own."""
    return [b.label for b in case.baselines if b.isolated]


# The level of a device-resident row's working set (taifuse.bench.suites.resident): device memory.
DEVICE_LEVEL = "device"

# The second candidate process of an index, in a case with isolated baselines.
CANDIDATE_AGAIN = "candidate again"


def _solo_order(case: Case, index: int) -> list[str]:
    """The processes of one index: candidate, isolated baselines, candidate again; reversed on odd indices."""
    order = [case.candidate.label, *isolated_labels(case), CANDIDATE_AGAIN]
    return order if index % 2 == 0 else order[::-1]


def worker_count(case: Any, processes: int) -> int:
    """How many worker processes a case takes (for progress bars)."""
    if is_custom(case):
        return len(case.jobs(processes))
    isolated = isolated_labels(case)
    return processes * (1 + (len(isolated) + 2 if isolated else 0))


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
    levels = roofline.ceiling_sizes(bandwidth_levels(cases), quick=quick)
    for p in range(plan.processes):
        job = {"kind": "roofline", "levels": levels, "samples": plan.roofline_samples, "seed": p}
        raw["roofline"].append(spawn(job, env, plan.worker_timeout_s))
        on_step("roofline")
    control = _control_case(cases)
    for case in cases:
        common = {"case": case.id, "quick": quick, "compare_torch": compare_torch}
        if is_custom(case):
            jobs = [{"kind": "custom", **common, **extra} for extra in case.jobs(plan.processes)]
            raw["cases"][case.id] = _run_jobs(case.id, jobs, raw, env, plan, on_step)
            continue
        job = {
            "kind": "case",
            **common,
            "comparisons": comparisons(case, control=case is control),
            "check_only": isolated_labels(case),
            "blocks": plan.blocks,
            "min_sample_ns": plan.min_sample_ns,
        }
        raw["cases"][case.id] = _run_jobs(case.id, [job] * plan.processes, raw, env, plan, on_step)
        if isolated_labels(case) and case.id not in raw["errors"]:
            raw.setdefault("solo", {})[case.id] = _measure_solo(
                case, plan, quick, compare_torch, env, on_step
            )
    return raw


def _run_jobs(
    case_id: str, jobs: list[dict], raw: dict, env: dict[str, str] | None, plan: Plan, on_step: Callable
) -> list[dict]:
    """Each job in a fresh worker, one after another; a failure is recorded and ends the case's runs."""
    runs = []
    for job in jobs:
        try:
            runs.append(spawn(job, env, plan.worker_timeout_s))
        except WorkerError as exc:
            raw["errors"][case_id] = str(exc)
            on_step(case_id)
            break
        on_step(case_id)
    return runs


def _measure_solo(
    case: Case, plan: Plan, quick: bool, compare_torch: bool, env: dict[str, str] | None, on_step: Callable
) -> list[dict[str, dict]]:
    """Per process index, ``{label: result}`` of the solo processes (NOTE [ Isolated baselines ])."""
    indices = []
    for index in range(plan.processes):
        results = {}
        for label in _solo_order(case, index):
            job = {
                "kind": "solo",
                "case": case.id,
                "quick": quick,
                "compare_torch": compare_torch,
                "label": case.candidate.label if label == CANDIDATE_AGAIN else label,
                "blocks": plan.blocks,
                "min_sample_ns": plan.min_sample_ns,
            }
            try:
                results[label] = spawn(job, env, plan.worker_timeout_s)
            except WorkerError:
                results = None  # an incomplete index is dropped; the rows say how many remain
                break
            finally:
                on_step(case.id)
        if results is not None:
            indices.append(results)
    return indices


# ----------------------------------------------------------------------------- rows


def bandwidth_levels(cases: list[Any], caches: list[dict] | None = None) -> set[str]:
    """The ceiling levels of the memory-bound rows among ``cases``: the copy ceilings a run needs
    (NOTE [ One ceiling per cache level ] and NOTE [ Mixed levels ] in roofline.py)."""
    caches = cpu_caches() if caches is None else caches
    return {
        roofline.ceiling_level(roofline.row_level(c.bytes_moved, caches))
        for c in cases
        if not is_custom(c) and not c.flops and c.bytes_moved
    }


def _roofline_of(case: Case, t: stats.Estimate, ceilings: Ceilings, level: str) -> dict | None:
    if case.extra.get("device"):
        return None  # the run's ceilings are the CPU's (taifuse.bench.suites.resident)
    return roofline.judge(
        flops=case.flops,
        bytes_moved=case.bytes_moved,
        bytes_written=case.bytes_written,
        level=level,
        time_ns=(t.median, t.low, t.high),
        ceilings=ceilings,
    )


def _sides(case: Case, a: str, b: str) -> dict:
    """The candidate and baseline fields of a comparison row of ``a`` against ``b``."""
    base = case.variant(b)
    return {
        "candidate": {"label": a, "code": case.candidate.full_code()},
        "baseline": {
            "label": b,
            "code": base.full_code(),
            "same_result": base.same_result,
            "note": base.note,
            "peer": base.peer,
        },
    }


def case_rows(
    case: Case,
    runs: list[dict],
    ceilings: Ceilings | dict,
    limit: float,
    *,
    control: bool,
    error: str | None = None,
    caches: list[dict] | None = None,
    solo: list[dict[str, dict]] | None = None,
) -> list[dict]:
    """Rows of one case: first call of the candidate, the A/A control (if carried), one per baseline.

    ``ceilings``: the run's :class:`~taifuse.bench.roofline.Ceilings` (or the plain mapping
    ``Ceilings.coerce`` reads); each row is judged against the one of its own level.
    ``solo``: the isolated baselines' processes (NOTE [ Isolated baselines ]), which add their
    own A/A control row and one row per isolated baseline.
    """
    caches = cpu_caches() if caches is None else caches
    ceilings = Ceilings.coerce(ceilings)
    header = RowHeader.of(
        case,
        runs,
        bytes_moved=case.bytes_moved,
        # An allocation moves no data: no level (a 16 MiB scratch buffer is not "L1").
        cache=(
            DEVICE_LEVEL
            if case.extra.get("device")
            else roofline.row_level(case.bytes_moved, caches)
            if case.bytes_moved
            else NO_DATA
        ),
        tolerance={"rtol": case.rtol, "atol": case.atol},
    )
    cand = case.candidate
    rows: list[Row] = []
    if runs:
        first = stats.estimate([[r["first_call_ns"][cand.label]] for r in runs])
        rows.append(
            Row(
                id=f"{case.id}/first-call",
                kind="first_call",
                label=f"{case.name}: first call",
                unit="ms",
                verdict=NOT_A_COMPARISON,
                header=header,
                candidate={"label": cand.label, "code": cand.full_code()},
                note="one call in a fresh process: imports, JIT compile or cache load, first touch of buffers",
            ).estimated(first, scale=1e6)
        )
    for a, b in comparisons(case, control):
        is_control = a == b
        row = Row(
            id=f"{case.id}/{'control' if is_control else b}",
            kind="control" if is_control else "compare",
            label=f"{case.name}: {a} vs {a} (A/A control)" if is_control else f"{case.name}: {a} vs {b}",
            unit="x speedup",
            header=header,
            **_sides(case, a, b),
            extra={"check": next((r["checks"][b] for r in runs if b in r.get("checks", {})), None)},
        )
        if error is not None and not runs:
            rows.append(dataclasses.replace(row, verdict=f"failed: {error}"))
            continue
        if any(b in r["failed"] for r in runs):
            rows.append(dataclasses.replace(row, verdict=stats.FAILED))
            continue
        key = f"{a}|{b}"
        ta = [r["samples"][key]["a"] for r in runs]
        tb = [r["samples"][key]["b"] for r in runs]
        loops = {a: [r["loops"][a] for r in runs], b: [r["loops"][b] for r in runs]}
        limit_ = stats.MIN_EFFECT if is_control else limit
        row = _timed(row, case, ta, tb, case.variant(b).same_result, ceilings, limit_, loops)
        if error is not None:
            row.note = f"only {len(runs)} process(es) finished: {error}"
        rows.append(row)
    if solo:
        rows.extend(_isolated_rows(case, runs, solo, ceilings, limit, header))
    return [r.as_dict() for r in rows]


def _timed(
    row: Row,
    case: Case,
    ta: list[list[float]],
    tb: list[list[float]],
    same_result: bool,
    ceilings: Ceilings,
    limit: float,
    loops: dict[str, list[int]],
) -> Row:
    """``row`` with the measured fields of a comparison, from per-process samples of A and B."""
    est = stats.speedup(ta, tb)
    cand_t, base_t = stats.estimate(ta), stats.estimate(tb)
    level = row.header.cache_level if row.header else UNKNOWN_LEVEL
    extra = {
        **row.extra,
        "candidate_ms": {"median": cand_t.median / 1e6, "low": cand_t.low / 1e6, "high": cand_t.high / 1e6},
        "baseline_ms": {"median": base_t.median / 1e6, "low": base_t.low / 1e6, "high": base_t.high / 1e6},
        "baseline_roofline": _roofline_of(case, base_t, ceilings, level) if same_result else None,
        "loops": loops,
        "samples": {"ratios": [list(np.asarray(y) / np.asarray(x)) for x, y in zip(ta, tb)]},
        "threshold": limit,  # the smallest difference this row's verdict would call one
    }
    return dataclasses.replace(
        row.estimated(est),
        roofline=_roofline_of(case, cand_t, ceilings, level),
        verdict=stats.verdict(est, limit),
        extra=extra,
    )


def _isolated_rows(
    case: Case,
    runs: list[dict],
    solo: list[dict[str, dict]],
    ceilings: Ceilings,
    limit: float,
    header: RowHeader,
) -> list[Row]:
    """The isolated A/A control and one row per isolated baseline (NOTE [ Isolated baselines ])."""
    cand = case.candidate
    method = "isolated processes: each side timed alone in fresh processes, alternating (NOTE [ Isolated baselines ])"

    def samples(label: str) -> list[list[float]]:
        return [index[label]["samples"] for index in solo]

    def loops(label: str) -> list[int]:
        return [index[label]["loops"] for index in solo]

    control = Row(
        id=f"{case.id}/control-isolated",
        kind="control",
        label=f"{case.name}: {cand.label} vs {cand.label} (A/A control, isolated processes)",
        unit="x speedup",
        header=header,
        candidate={"label": cand.label, "code": cand.full_code()},
        baseline={
            "label": cand.label,
            "code": cand.full_code(),
            "same_result": True,
            "note": method,
            "peer": False,
        },
        note=method,
        extra={"check": None},
    )
    rows = [
        _timed(
            control,
            case,
            samples(cand.label),
            samples(CANDIDATE_AGAIN),
            True,
            ceilings,
            stats.MIN_EFFECT,
            {cand.label: loops(cand.label)},
        )
    ]
    # Cross-process noise is larger than within one process: these rows' own control sets their bar.
    isolated_limit = max(limit, stats.threshold(stats.speedup(samples(cand.label), samples(CANDIDATE_AGAIN))))
    for label in isolated_labels(case):
        row = Row(
            id=f"{case.id}/{label}",
            kind="compare",
            label=f"{case.name}: {cand.label} vs {label} (isolated processes)",
            unit="x speedup",
            header=header,
            **_sides(case, cand.label, label),
            note=method,
            extra={"check": next((r["checks"][label] for r in runs if label in r.get("checks", {})), None)},
        )
        if any(label in r["failed"] for r in runs):
            rows.append(dataclasses.replace(row, verdict=stats.FAILED))
            continue
        rows.append(
            _timed(
                row,
                case,
                samples(cand.label),
                samples(label),
                case.variant(label).same_result,
                ceilings,
                isolated_limit,
                {cand.label: loops(cand.label), label: loops(label)},
            )
        )
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
    rows = roofline.rows(raw["roofline"])
    ceilings = Ceilings.from_rows(rows)
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
                solo=raw.get("solo", {}).get(case.id),
            )
        )
    method = {
        "threshold": limit,
        "min_effect": stats.MIN_EFFECT,
        "control_spread": stats.control_spread(control_est) if control_est else None,
        "unstable_dispersion": stats.UNSTABLE_DISPERSION,
        "confidence": stats.CONFIDENCE,
        "resamples": stats.RESAMPLES,
        "ceilings": ceilings.as_dict(),
    }
    return rows, method
