"""One fresh benchmark process: ``python -m taifuse.bench.worker JOB.json RESULT.json``.

The parent (:mod:`taifuse.bench.harness`) starts several of these per case, one after another, so
each set of samples comes from a process with its own imports, JIT state and memory layout.
Results go to a file, not stdout, because some libraries print banners on import.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any

from taifuse.bench import roofline, timing
from taifuse.bench.case import Case, check_outputs, to_host
from taifuse.bench.env import thread_settings


def _backend() -> dict:
    if "taifuse.functional" not in sys.modules:
        return {}
    from taifuse import backends

    return {"backend": backends.get_backend(), "backend_info": backends.active().describe()}


def measure_case(
    case: Case,
    comparisons: list[tuple[str, str]],
    blocks: int,
    min_sample_ns: int = timing.MIN_SAMPLE_NS,
    check_only: Sequence[str] = (),
) -> dict[str, Any]:
    """Correctness check, first call, warm-up, calibration and ABBA pairs for one case, in this process.

    Args:
        case: the case; its candidate is the reference output of the correctness check.
        comparisons: ``(a_label, b_label)`` pairs to time; ``(c, c)`` is an A/A control.
        blocks: ABBA blocks per comparison (one sample pair each).
        min_sample_ns: each timed sample runs at least this long (loops calibrated per variant;
            at least ``case.min_loops`` calls).
        check_only: variants that are checked here but timed in processes of their own
            (isolated baselines, see :func:`measure_solo`).

    A variant whose output fails ``allclose`` against the candidate is never timed: its
    comparisons come back with ``"failed"`` and the check that failed.
    """
    inputs = case.setup(case.seed)
    labels = list(dict.fromkeys([label for pair in comparisons for label in pair] + list(check_only)))
    candidate = case.candidate.label
    if candidate not in labels:
        labels.insert(0, candidate)
    calls = {label: case.variant(label).build(inputs) for label in labels}

    first_call_ns, outputs = {}, {}
    for label in labels:
        first_call_ns[label], outputs[label] = timing.first_call(calls[label])
        outputs[label] = to_host(outputs[label])
    checks = {}
    for label in labels:
        if label != candidate and case.variant(label).same_result:
            checks[label] = check_outputs(outputs[candidate], outputs[label], case.rtol, case.atol)
    del outputs
    failed = {label for label, check in checks.items() if not check["ok"]}

    timed = [label for label in labels if label not in failed and label not in check_only]
    warmup_calls = {label: timing.warm_up(calls[label]) for label in timed}
    loops = {label: timing.calibrate(calls[label], min_sample_ns, case.min_loops) for label in timed}
    live = [(a, b) for a, b in comparisons if a not in failed and b not in failed]
    samples: dict[str, dict[str, list[float]]] = {f"{a}|{b}": {"a": [], "b": []} for a, b in live}
    for _ in range(blocks):
        # Round-robin over comparisons so a slow drift spreads over all of them alike.
        for a, b in live:
            ta, tb = timing.abba_block(calls[a], loops[a], calls[b], loops[b])
            samples[f"{a}|{b}"]["a"].append(ta)
            samples[f"{a}|{b}"]["b"].append(tb)
    return {
        "first_call_ns": first_call_ns,
        "checks": checks,
        "failed": sorted(failed),
        "warmup_calls": warmup_calls,
        "loops": loops,
        "samples": samples,
        "threads": thread_settings(),
        **_backend(),
    }


def measure_solo(
    case: Case, label: str, blocks: int, min_sample_ns: int = timing.MIN_SAMPLE_NS
) -> dict[str, Any]:
    """First call, warm-up, calibration and ``blocks`` samples of one variant, alone in this process.

    Each sample is the mean of two calibrated loops, as one side of an ABBA block is. The
    outputs are checked in the case's main processes (``measure_case(check_only=...)``).
    """
    call = case.variant(label).build(case.setup(case.seed))
    first_ns, _ = timing.first_call(call)
    warmup_calls = timing.warm_up(call)
    loops = timing.calibrate(call, min_sample_ns, case.min_loops)
    samples = [(timing.time_loops(call, loops) + timing.time_loops(call, loops)) / 2.0 for _ in range(blocks)]
    return {
        "label": label,
        "first_call_ns": first_ns,
        "warmup_calls": warmup_calls,
        "loops": loops,
        "samples": samples,
        "threads": thread_settings(),
        **_backend(),
    }


def run_job(job: dict) -> dict:
    """Run one job description (``kind`` = ``"case"`` or ``"roofline"``) and return its result."""
    if job["kind"] == "roofline":
        result = roofline.measure(job["levels"], job["samples"], seed=job.get("seed", 0))
        result["threads"] = thread_settings()
        return result
    if job["kind"] == "case":
        from taifuse.bench.suites import find_case

        case = find_case(job["case"], quick=job["quick"], compare_torch=job["compare_torch"])
        pairs = [tuple(pair) for pair in job["comparisons"]]
        return measure_case(
            case,
            pairs,
            job["blocks"],
            job.get("min_sample_ns", timing.MIN_SAMPLE_NS),
            check_only=job.get("check_only", ()),
        )
    if job["kind"] == "solo":  # an isolated variant: harness NOTE [ Isolated baselines ]
        from taifuse.bench.suites import find_case

        case = find_case(job["case"], quick=job["quick"], compare_torch=job["compare_torch"])
        return measure_solo(case, job["label"], job["blocks"], job.get("min_sample_ns", timing.MIN_SAMPLE_NS))
    if job["kind"] == "custom":  # see harness.is_custom
        from taifuse.bench.suites import find_case

        case = find_case(job["case"], quick=job["quick"], compare_torch=job["compare_torch"])
        # A case whose work runs in processes of its own (the distributed suite's ranks) reports
        # their threads and backend: those win over this launcher's.
        return {"threads": thread_settings(), **_backend(), **case.run_job(job)}
    raise ValueError(f"unknown job kind {job['kind']!r}")


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m taifuse.bench.worker JOB.json RESULT.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        job = json.load(f)
    result = run_job(job)
    with open(argv[1], "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
