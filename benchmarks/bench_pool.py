"""Issue 6's "what it must show" for the buffer pool, measured with the ``taifuse.bench`` harness.

* The 784-1024-1024-10 GELU MLP training step (batch 256, cross entropy, plain SGD on Tensors) with
  the pool on against the same step with it off: a time ratio with its 95% interval, the two sides
  interleaved (ABBA) in fresh processes.
* Allocations per step in the steady state (goal: none after the first step) and the pool's hit
  rate there (goal: at least 99%), counted by the pool itself while the same step runs.
* The cost of a 16 MiB scratch buffer from the pool against a fresh ``np.empty`` plus first touch
  and a fresh ``ti.ndarray`` (and, on the device, the Taichi pool against a fresh ``ti.ndarray``).

Goals follow the harness's verdicts ("met" only when the row says faster, or no measurable
difference where the goal is "no slower"; "undecided" for an unstable or inconclusive row);
nothing here forces a pass.

Run: ``python benchmarks/bench_pool.py [--quick] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import taifuse.bench
from taifuse.bench import report
from taifuse.bench.suites import load_cases
from taifuse.bench.suites import pool as pool_suite

STEP_CASE = "pool/mlp training step: pool on vs off"


def goals(result: dict, steady: dict) -> list[dict]:
    """The pool's goals from the rows of a run and the steady-state counts."""
    rows = {r["id"]: r for r in result["rows"]}
    out = []
    step = rows.get(f"{STEP_CASE}/pool off")
    if step is not None and step["value"] is not None:
        # speedup = time(off) / time(on): >= 1 means the pool costs nothing; the goal is "no slower"
        out.append(
            {
                "goal": "training step with the pool no slower than without (speedup >= 1)",
                "value": step["value"],
                "low": step["low"],
                "high": step["high"],
                "status": "met"
                if step["verdict"] in ("faster", "no measurable difference")
                else "not met"
                if step["verdict"] == "slower"
                else "undecided",
                "detail": f"verdict: {step['verdict']}",
            }
        )
    out.append(
        {
            "goal": "no new allocations after the first step",
            "value": steady["allocations_after_first_step"],
            "low": None,
            "high": None,
            "status": "met" if steady["allocations_after_first_step"] == 0 else "not met",
            "detail": f"per step: {[s['allocations'] for s in steady['per_step']]} on {steady['backend']}",
        }
    )
    out.append(
        {
            "goal": "hit rate >= 99% after the first step",
            "value": steady["hit_rate_after_first_step"],
            "low": None,
            "high": None,
            "status": "met" if steady["hit_rate_after_first_step"] >= 0.99 else "not met",
            "detail": f"reuses per step: {[s['reuses'] for s in steady['per_step']]}",
        }
    )
    for row in result["rows"]:
        if row["id"].startswith("pool/16 MiB") and row.get("kind") == "compare" and row["value"] is not None:
            out.append(
                {
                    "goal": f"{row['label']}: pool faster",
                    "value": row["value"],
                    "low": row["low"],
                    "high": row["high"],
                    "status": "met"
                    if row["verdict"] == "faster"
                    else "not met"
                    if row["verdict"] in ("slower", "no measurable difference")
                    else "undecided",
                    "detail": f"pool {row['candidate_ms']['median']:.4g} ms, "
                    f"{row['baseline']['label']} {row['baseline_ms']['median']:.4g} ms",
                }
            )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer processes and samples, ti.cpu only")
    parser.add_argument(
        "--out", help="also write BENCHMARKS.md, results.json and pool_steady_state.json here"
    )
    parser.add_argument("--steps", type=int, default=6, help="training steps for the allocation count")
    args = parser.parse_args(argv)

    steady = pool_suite.steady_state(args.steps)
    cases = load_cases(["pool"], quick=args.quick)
    plan = taifuse.bench.QUICK if args.quick else taifuse.bench.GOALS
    result = taifuse.bench.run(
        cases=cases,
        plan=plan,
        out=args.out,
        command="python benchmarks/bench_pool.py" + (" --quick" if args.quick else ""),
    )
    print(report.summary(result))
    print(f"\n{report.run_line(result)}\n")
    print(f"steady state ({steady['backend']}): {json.dumps(steady['per_step'])}")
    for g in goals(result, steady):
        print(report.goal_line(g))
    if args.out:
        Path(args.out, "pool_steady_state.json").write_text(json.dumps(steady, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
